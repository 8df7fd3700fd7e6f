"""The documentation site (docs/, mkdocs.yml) cannot rot unseen.

- The site builds with `mkdocs build --strict`: a broken link or anchor, a missing image, a page the nav
  leaves out or a nav entry without its page fails; the Benchmarks page really includes RESULTS.md.
- The configuration reference is what scripts/gen_config_docs.py writes from engine/config.py now, and
  every config key has a description.
- Every ```yaml block in docs/ loads with vidar's own loader (`build_config`), completed with one stream
  when it is a fragment; a block after `<!-- config-check: keys ... -->` (placeholders in its values) has
  its keys checked against the config models instead.
- Every `vidar` and `make` command in a ```sh block exists: the Makefile has the target, and `vidar`'s
  own argument parser accepts the subcommands (`vidar cluster upp` is refused).
- The Grafana dashboard loads and names only metrics a running engine exports.
- The benchmark plots are made from the checked-in JSON.

The docs extra (`pip install -e .[docs]`) is installed by `make test`; without it these tests fail, naming it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from engine.config import EngineConfig, build_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DASHBOARD = DOCS / "grafana" / "vidar-dashboard.json"
KEYS_ONLY = re.compile(r"^<!-- config-check: keys\b")


def _script(name: str):
    """A module of scripts/ (not a package: they are run as files by make docs), loaded once."""
    key = f"vidar_scripts_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[key]


def _mkdocs() -> Path:
    exe = Path(sys.executable).parent / "mkdocs"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: the docs extra is not installed (pip install -e '.[docs]'; make test "
                    "installs it)", pytrace=False)
    return exe


def fenced_blocks(lang: str) -> list[tuple[str, int, str, str]]:
    """(page, line, the line before the fence, body) of every ```lang block in docs/ (generated pages too)."""
    out = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == f"```{lang}":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                before = lines[i - 1].strip() if i else ""
                out.append((str(page.relative_to(ROOT)), i + 1, before, "\n".join(lines[i + 1:end])))
                i = end
            i += 1
    return out


# -- the site -----------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # material's banner about its successor, not our problem
    # not --quiet: it hides the warnings from the counter --strict reads, and a broken link then passed
    run = subprocess.run([str(_mkdocs()), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(site)], capture_output=True, text=True, timeout=110, cwd=ROOT, env=env)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    # the snippet really pulled RESULTS.md in (a wrong line range would leave the page with its plots only)
    bench = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "Classification throughput" in bench and "Soak" in bench
    assert (site / "reference" / "config" / "index.html").is_file()


# -- the configuration reference ----------------------------------------------------------------------
def test_every_config_key_has_a_description():
    missing = _script("gen_config_docs").missing_descriptions()
    assert not missing, f"config keys without a docstring in engine/config.py: {missing}"


def test_the_config_reference_is_generated_from_the_config_now():
    gen = _script("gen_config_docs")
    assert gen.OUT.read_text(encoding="utf-8") == gen.render(), \
        "docs/reference/config.md differs from engine/config.py: run `python scripts/gen_config_docs.py` (make docs)"


def test_the_reference_shows_types_defaults_bounds_and_choices():
    text = _script("gen_config_docs").render()
    assert '| `budget.latency_ms` | float \\| "auto" | `"auto"` |  | ' in text  # chosen at start: the row says how
    assert "| `budget.max_batch_wait_ms` | float | `4.0` | >= 0 |" in text
    assert '| `streams[].mode` | "live" \\| "offline" | `"live"` |' in text
    assert "| `models.sam2.image_size` | int | `1024` | >= 128, <= 2048, multiple of 32 |" in text
    assert "## `cluster.publish`" in text


# -- config snippets ----------------------------------------------------------------------------------
def _unknown_keys(tree, model: type[BaseModel], path: str = "") -> list[str]:
    """Keys of a YAML tree that are not fields of the model at their place (values are not checked)."""
    if not isinstance(tree, dict):
        return [f"{path or '(top)'}: expected a mapping"]
    bad = []
    for key, value in tree.items():
        field = model.model_fields.get(key)
        if field is None:
            bad.append(f"{path}{key}")
            continue
        sub = _model_in(field.annotation)
        if sub is not None and value is not None:
            items = value if isinstance(value, list) else [value]
            for item in items:
                bad += _unknown_keys(item, sub, f"{path}{key}.")
    return bad


def _model_in(ann) -> type[BaseModel] | None:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


YAML_BLOCKS = fenced_blocks("yaml")


def test_the_docs_have_config_snippets():
    assert len(YAML_BLOCKS) >= 6, YAML_BLOCKS  # the parametrized test below would pass on none


@pytest.mark.parametrize("page,line,before,body", YAML_BLOCKS, ids=[f"{p}:{n}" for p, n, _, _ in YAML_BLOCKS])
def test_every_config_snippet_loads_with_vidars_loader(page, line, before, body):
    tree = yaml.safe_load(body)
    assert isinstance(tree, dict), f"{page}:{line}: a config snippet is a mapping"
    if KEYS_ONLY.match(before):
        assert not _unknown_keys(tree, EngineConfig), f"{page}:{line}: unknown keys {_unknown_keys(tree, EngineConfig)}"
        return
    if "streams" not in tree:  # a fragment (one section): completed with the one stream its examples name
        tree = {"streams": [{"id": "cam1", "url": "synthetic://shapes"}], **tree}
    build_config(tree, source=f"{page}:{line}", cuda_available=True)  # raises ConfigError naming the key


# -- commands -----------------------------------------------------------------------------------------
def _commands() -> list[tuple[str, int, list[str]]]:
    out = []
    for page, line, _, body in fenced_blocks("sh"):
        for k, text in enumerate(body.splitlines()):
            words = shlex.split(text, comments=True)
            if words and words[0] in ("vidar", "make"):
                out.append((page, line + 1 + k, words))
    return out


COMMANDS = _commands()


def test_the_quickstart_has_its_commands():
    quick = [w for p, _, w in COMMANDS if p == "docs/quickstart.md"]
    assert ["make", "run"] in quick and ["make", "test"] in quick and any(w[:2] == ["vidar", "run"] for w in quick)


@pytest.mark.parametrize("page,line,words", COMMANDS, ids=[f"{p}:{n}" for p, n, _ in COMMANDS])
def test_every_documented_command_exists(page, line, words, capsys):
    if words[0] == "make":
        makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
        targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", makefile, re.M))
        missing = [t for t in words[1:] if "=" not in t and not t.startswith("-") and t not in targets]
        assert not missing, f"{page}:{line}: make {missing}: no such target in the Makefile"
        return
    from engine.cli import main
    # --help at the end: argparse walks the subcommands given (refusing an unknown one with exit 2) and
    # prints the last one's help with exit 0, without running anything
    with pytest.raises(SystemExit) as exit_:
        main(words[1:] + ["--help"])
    err = capsys.readouterr().err
    assert exit_.value.code == 0, f"{page}:{line}: `{' '.join(words)}` is not a vidar command: {err}"


# -- the Grafana dashboard ----------------------------------------------------------------------------
METRIC = re.compile(r"\b((?:vidar|process)_[a-z0-9_]+)\b")


def _dashboard_exprs(dash: dict) -> list[str]:
    exprs = []
    for panel in dash["panels"]:
        assert panel.get("title") and panel.get("type") and panel.get("gridPos"), panel.get("title")
        assert panel.get("targets"), f"panel {panel['title']!r} has no targets"
        for target in panel["targets"]:
            assert isinstance(target.get("expr"), str) and target["expr"].strip(), panel["title"]
            assert METRIC.search(target["expr"]), f"panel {panel['title']!r}: {target['expr']!r} names no metric"
            exprs.append(target["expr"])
    for var in dash.get("templating", {}).get("list", []):
        exprs.append(var["query"]["query"] if isinstance(var.get("query"), dict) else var.get("query", ""))
    return exprs


def test_the_dashboard_has_grafanas_shape():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    names = {m for e in _dashboard_exprs(dash) for m in METRIC.findall(e)}
    # what the Metrics page promises the dashboard shows
    for needed in ("vidar_frames_published_total", "vidar_frames_dropped_total", "vidar_frames_in_flight",
                   "vidar_stage_seconds_bucket", "vidar_qos_level", "vidar_publish_missed_total",
                   "vidar_publish_slow_subscribers"):
        assert needed in names, f"the dashboard has no panel on {needed}"


def _exported(text: str) -> set[str]:
    """Metric names a scrape shows: the families (HELP/TYPE lines, also for families with no series yet)
    and every sample's name."""
    names = set()
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _known(name: str, exported: set[str]) -> bool:
    if name in exported:
        return True
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in exported:
            return True
    return False


@pytest.mark.timeout(120)
def test_the_dashboard_names_only_metrics_a_running_engine_exports(endpoint):
    from engine.core.engine import Engine
    from engine.models.noop import NoopRunner
    from engine.testing.wait import wait_for
    from tests.support.engines import engine_config
    from tests.support.net import free_port

    port = free_port()
    cfg = engine_config([{"id": "d1", "url": "synthetic://shapes?size=96x64&fps=30&frames=10", "mode": "offline"}],
                        endpoint, metrics={"enabled": True, "port": port})
    eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=0.001)})
    eng.start()
    try:
        assert wait_for(eng.finished, 60)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        eng.stop()
    exported = _exported(text)
    used = {m for e in _dashboard_exprs(json.loads(DASHBOARD.read_text(encoding="utf-8"))) for m in METRIC.findall(e)}
    unknown = sorted(m for m in used if not _known(m, exported))
    assert not unknown, f"the dashboard names metrics the engine does not export: {unknown}"


# -- the benchmark plots ------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_the_benchmark_plots_are_made_from_the_checked_in_results(tmp_path):
    plots = _script("plot_benchmarks")
    assert plots.main(["--out", str(tmp_path)]) == 0
    for name in ("goodput_vs_streams.png", "latency_vs_budget.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        assert (DOCS / "img" / name).is_file(), f"docs/img/{name} is not checked in: run make docs"


def test_plots_without_results_are_an_error_not_an_empty_image(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bench_host.json").write_text("{not json")
    assert _script("plot_benchmarks").main(["--results", str(tmp_path / "results"), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "bench_host.json: not readable JSON" in err and "no bench_host*.json" in err
    assert not (tmp_path / "goodput_vs_streams.png").exists()


# -- the README: short, and every link of it resolves ----------------------------------------------------
def test_the_readme_is_short_and_its_links_resolve():
    """Issue 34: the README is a page (at most ~150 lines) whose links lead somewhere: every relative link
    names a file of the repository, and a `#anchor` into a docs page names one of its headings."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "the README links to nothing"
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link!r}: {path} does not exist"
        if anchor:
            headings = [re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
                        for h in re.findall(r"^#+\s+(.*)$", target.read_text(), re.M)]
            assert anchor in headings, f"README links to {link!r}: no heading {anchor!r} in {path}"
