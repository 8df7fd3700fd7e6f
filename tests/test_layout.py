"""The layering the Layout section of docs/concepts.md states (the import table once in the README), read from it
and checked against every import
in engine/ and streams/ (read with `ast`, function-level imports included):

  * a package imports only the packages its README row names, and what those may import (transitively);
  * no import circle between modules;
  * no private name (`_x`) imported from another package;
  * the engine never imports engine.testing; benchmarks and examples never import tests; a test module
    never imports another test module (shared helpers live in tests/support/);
  * every package says what it is for in its `__init__` docstring.

The checker is tested on a small made-up tree too, so a rule that could never fire would show.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- imports -->"


def read_rules(readme: str) -> dict[str, set[str]]:
    """{package: what it may import directly}, from the README's block between two `<!-- imports -->` marks."""
    parts = readme.split(MARK)
    if len(parts) != 3:
        raise AssertionError(f"the README needs exactly one block between two {MARK!r} lines")
    rules: dict[str, set[str]] = {}
    for line in parts[1].splitlines():
        m = re.match(r"^([\w.]+)\s+(?:->|→)\s*(.*)$", line.strip())
        if m:
            rules[m.group(1)] = {d.strip() for d in m.group(2).replace("(nothing)", "").split(",") if d.strip()}
    return rules


def allowed(rules: dict[str, set[str]], pkg: str) -> set[str]:
    """What `pkg` may import: its row, and what those may import, transitively (a row's entry may name a
    module, e.g. engine.frames.ref, narrower than its package)."""
    seen: set[str] = set()
    todo = list(rules[pkg])
    while todo:
        dep = todo.pop()
        if dep in seen:
            continue
        seen.add(dep)
        todo += rules.get(dep, ())
    return seen


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import of a project module in `path`."""
    name = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([mod] if mod else []))
            names = [a.name for a in node.names]
            subs = [n for n in names if (root / Path(*mod.split("."), n)).with_suffix(".py").exists()
                    or (root / Path(*mod.split("."), n, "__init__.py")).exists()]
            for n in subs:  # `from engine.frames import ring`: the module engine.frames.ring
                out.append((f"{mod}.{n}", [], node.lineno))
            out.append((mod, [n for n in names if n not in subs], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
    return [(m, ns, line) for m, ns, line in out if m.split(".")[0] in ("engine", "streams", "tests")]


def package_of(rules: dict[str, set[str]], module: str) -> str | None:
    """The longest rule key that `module` is or lies under (the row `engine` is the package's own
    __init__ only: a new subpackage needs a row of its own)."""
    keys = [k for k in rules if module == k or (module.startswith(k + ".") and k != "engine")]
    return max(keys, key=len) if keys else None


def covers(dep: str, module: str) -> bool:
    return module == dep or module.startswith(dep + ".")


def violations(root: Path, rules: dict[str, set[str]], packages: tuple[str, ...] = ("engine", "streams")) -> list[str]:
    files = [p for top in packages for p in sorted((root / top).rglob("*.py"))]
    graph: dict[str, set[str]] = {}
    found = []
    for path in files:
        me = module_name(root, path)
        mine = package_of(rules, me)
        if mine is None:
            found.append(f"{me}: its package has no row in the README's import table")
            continue
        may = allowed(rules, mine)
        graph.setdefault(me, set())
        for mod, names, line in imports(root, path):
            theirs = package_of(rules, mod)
            where = f"{path.relative_to(root)}:{line}"
            if theirs is None:
                found.append(f"{where}: imports {mod}, which has no row in the README's import table")
                continue
            if theirs != mine and not any(covers(d, mod) for d in may):
                found.append(f"{where}: {mine} may not import {mod} (allowed: {', '.join(sorted(may)) or 'nothing'})")
            if theirs != mine:
                private = [n for n in names if n.startswith("_")]
                if private:
                    found.append(f"{where}: imports private {', '.join(private)} from {mod} (another package)")
            if mod != me:
                graph[me].add(mod)
    found += [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# -- the real tree ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rules() -> dict[str, set[str]]:
    return read_rules((ROOT / "docs" / "concepts.md").read_text())


def test_every_import_keeps_to_the_readme_table(rules):
    assert violations(ROOT, rules) == []


def test_the_table_names_every_package_and_no_package_twice(rules):
    pkgs = {module_name(ROOT, p.parent / "__init__.py") for top in ("engine", "streams")
            for p in (ROOT / top).rglob("__init__.py")}
    pkgs.discard("engine")
    missing = sorted(p for p in pkgs if package_of(rules, p) is None)
    assert missing == [], f"packages without a row in the README's import table: {missing}"


def test_every_package_says_what_it_is_for():
    for init in [*(ROOT / "engine").rglob("__init__.py"), ROOT / "streams" / "__init__.py"]:
        if "static" in init.parts:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 8, f"{init.relative_to(ROOT)}: say in its docstring what the package is for"


def test_the_engine_never_imports_its_testing_helpers():
    for path in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "streams").rglob("*.py")]:
        if "testing" in path.relative_to(ROOT).parts:
            continue
        bad = [m for m, _, _ in imports(ROOT, path) if covers("engine.testing", m) or covers("tests", m)]
        assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"


def test_benchmarks_examples_and_tests_do_not_import_tests():
    for top in ("benchmarks", "examples"):
        for path in (ROOT / top).rglob("*.py"):
            bad = [m for m, _, _ in imports(ROOT, path) if covers("tests", m)]
            assert bad == [], f"{path.relative_to(ROOT)} imports {bad}: shared helpers go in engine/testing/"
    for path in (ROOT / "tests").rglob("test_*.py"):
        bad = [m for m, _, _ in imports(ROOT, path) if m.rsplit(".", 1)[-1].startswith("test_")]
        assert bad == [], f"{path.relative_to(ROOT)} imports test modules {bad}: move the helper to tests/support/"


def test_tests_mirror_the_packages():
    """tests/<package>/ for each engine subpackage that has tests of its own (the README's sentence)."""
    for d in (ROOT / "tests").iterdir():
        if d.is_dir() and (d / "__init__.py").exists() and d.name != "support":
            assert (ROOT / "engine" / d.name).is_dir() or (ROOT / d.name).is_dir(), \
                f"tests/{d.name}/ mirrors no package (engine/{d.name} or {d.name}/)"


# -- the checker on a made-up tree: each rule can fire ---------------------------------------------------

TABLE = f"""{MARK}
engine          -> (nothing)
engine.errors   -> (nothing)
engine.low      -> engine.errors
engine.high     -> engine.low
{MARK}"""


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"engine/__init__.py": "", "engine/errors.py": "", "engine/low/__init__.py": "",
                      "engine/high/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "streams").mkdir(exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("files, expect", [
    ({"engine/low/a.py": "from engine.errors import X\n", "engine/high/b.py": "from engine.low.a import Y\n"}, None),
    ({"engine/low/a.py": "from engine.high.b import Y\n", "engine/high/b.py": ""}, "engine.low may not import engine.high.b"),
    ({"engine/low/a.py": "def f():\n    from engine.high import b\n", "engine/high/b.py": ""},
     "engine.low may not import engine.high.b"),
    ({"engine/high/b.py": "from engine.low.a import _private\n", "engine/low/a.py": ""}, "imports private _private"),
    ({"engine/low/a.py": "from engine.low import b\n", "engine/low/b.py": "from . import a\n"}, "import circle"),
    ({"engine/other/__init__.py": "", "engine/other/c.py": ""}, "no row in the README's import table"),
])
def test_the_checker_catches_each_kind_of_violation(tmp_path, files, expect):
    found = violations(_tree(tmp_path, files), read_rules(TABLE))
    if expect is None:
        assert found == []
    else:
        assert any(expect in f for f in found), found
