"""Plots for the Benchmarks page, made from the JSON the benchmarks wrote into benchmarks/results/.

    python scripts/plot_benchmarks.py                    # docs/img/goodput_vs_streams.png, latency_vs_budget.png
    python scripts/plot_benchmarks.py --results DIR --out DIR

- goodput_vs_streams.png, from bench_host*.json (benchmarks/bench_host.py): for each file and each group of
  live scenarios (frame size, rate, ingest mode when the file has one), results published per second and
  the share of the offered frames published, against the number of streams; the median of the file's runs.
- latency_vs_budget.png, from soak*.json (benchmarks/soak.py), the only results that record both a budget
  (config.engine.budget.latency_ms) and published latency percentiles: the newest run's p50 and p99 over
  time against its budget, and every run's median p50 and worst p99 as a share of its budget. (bench_host's
  runs record latency but run at a 5 s budget chosen never to bind, so they say nothing about the budget;
  bench_vit*.json and bench_sam2*.json record throughput and times per frame, not latency percentiles.)

A file whose shape is not recognised is skipped with a line saying which and why, never silently; no usable
file at all for a plot is an error (exit 1), so `make docs` cannot publish an empty plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on build machines
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# PNG metadata without the software version or a date: the same JSON makes the same image bytes
PNG_META = {"Software": None}


class NoData(Exception):
    """No results file had what a plot needs."""


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        print(f"plot_benchmarks: skipping {path.name}: not readable JSON ({err})", file=sys.stderr)
        return None


def host_series(results: Path) -> list[tuple[str, list[int], list[float], list[float]]]:
    """(label, streams, published/s, published share) per file and live scenario group, sorted by streams."""
    out = []
    for path in sorted(results.glob("bench_host*.json")):
        data = _load(path)
        rows = (data or {}).get("rows")
        if not isinstance(rows, list):
            print(f"plot_benchmarks: skipping {path.name}: no `rows` list", file=sys.stderr)
            continue
        groups: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
        for row in rows:
            spec = row.get("spec") or {}
            if spec.get("kind") != "live" or not row.get("published_fps") or not row.get("offered_fps"):
                continue  # raw and offline scenarios have no offered rate to hold published frames against
            ingest = f", ingest {spec['ingest']}" if spec.get("ingest") is not None else ""
            group = f"{spec['size']} @ {spec['fps']} fps{ingest}"
            groups[group][spec["streams"]].append((row["published_fps"], row["published_fps"] / row["offered_fps"]))
        if not groups:
            print(f"plot_benchmarks: skipping {path.name}: no live scenario with published and offered rates",
                  file=sys.stderr)
        when = (data.get("date") or "")[:10]
        for group, by_streams in sorted(groups.items()):
            streams = sorted(by_streams)
            fps = [statistics.median(p for p, _ in by_streams[n]) for n in streams]
            share = [statistics.median(s for _, s in by_streams[n]) for n in streams]
            out.append((f"{path.stem} {when}: {group}", streams, fps, share))
    return out


def soak_runs(results: Path) -> list[dict]:
    """Each soak run with a budget and per-sample latency: {name, date, budget_ms, t_min, p50, p99}."""
    runs = []
    for path in sorted(results.glob("soak*.json")):
        data = _load(path)
        if data is None:
            continue
        try:
            budget = float(data["config"]["engine"]["budget"]["latency_ms"])
            samples = data["samples"]
        except (KeyError, TypeError, ValueError):
            print(f"plot_benchmarks: skipping {path.name}: no budget or samples", file=sys.stderr)
            continue
        t, p50, p99 = [], [], []
        for s in samples:
            lat = [(v["p50_ms"], v["p99_ms"]) for v in (s.get("streams") or {}).values()
                   if v.get("p50_ms") is not None and v.get("p99_ms") is not None]
            if lat:  # the median stream's p50 and the worst stream's p99 at that sample
                t.append(s["t"] / 60)
                p50.append(statistics.median(a for a, _ in lat))
                p99.append(max(b for _, b in lat))
        if not t:
            print(f"plot_benchmarks: skipping {path.name}: no sample has latency percentiles", file=sys.stderr)
            continue
        runs.append({"name": path.stem, "date": data.get("date", ""), "budget_ms": budget, "t_min": t,
                     "p50": p50, "p99": p99})
    return runs


def plot_goodput(results: Path, out: Path) -> Path:
    series = host_series(results)
    if not series:
        raise NoData(f"no bench_host*.json in {results} has live scenarios")
    fig, (ax_fps, ax_share) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, streams, fps, share in series:
        line, = ax_fps.plot(streams, fps, marker="o", label=label)
        ax_share.plot(streams, share, marker="o", color=line.get_color(), label=label)
    ax_fps.set(xlabel="live streams", ylabel="results published / s", title="Published per second")
    ax_share.set(xlabel="live streams", ylabel="published / offered", ylim=(0, 1.05),
                 title="Goodput: share of offered frames published")
    ax_share.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in (ax_fps, ax_share):
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({n for _, streams, _, _ in series for n in streams}))
    ax_fps.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = out / "goodput_vs_streams.png"
    fig.savefig(path, dpi=110, metadata=PNG_META)
    plt.close(fig)
    return path


def plot_latency(results: Path, out: Path) -> Path:
    runs = soak_runs(results)
    if not runs:
        raise NoData(f"no soak*.json in {results} records a budget and latency percentiles")
    newest = max(runs, key=lambda r: r["date"])
    fig, (ax_t, ax_runs) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    ax_t.plot(newest["t_min"], newest["p50"], label="p50 (median stream)")
    ax_t.plot(newest["t_min"], newest["p99"], label="p99 (worst stream)")
    ax_t.axhline(newest["budget_ms"], color="red", ls="--", label=f"budget {newest['budget_ms']:g} ms")
    ax_t.set(xlabel="minutes", ylabel="published latency, ms", ylim=(0, newest["budget_ms"] * 1.15),
             title=f"{newest['name']} ({newest['date'][:10]})")
    ax_t.legend(fontsize=8)
    names = [r["name"].removeprefix("soak_") for r in runs]
    p50 = [statistics.median(r["p50"]) / r["budget_ms"] for r in runs]
    p99 = [max(r["p99"]) / r["budget_ms"] for r in runs]
    y = range(len(runs))
    ax_runs.barh([i + 0.2 for i in y], p99, height=0.4, label="worst p99")
    ax_runs.barh([i - 0.2 for i in y], p50, height=0.4, label="median p50")
    ax_runs.axvline(1.0, color="red", ls="--", label="budget")
    ax_runs.set_yticks(list(y), names, fontsize=7)
    ax_runs.set(xlabel="share of the budget", title="Every soak run")
    ax_runs.legend(fontsize=8)
    for ax in (ax_t, ax_runs):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "latency_vs_budget.png"
    fig.savefig(path, dpi=110, metadata=PNG_META)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plots for docs/benchmarks.md from benchmarks/results/*.json")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for plot in (plot_goodput, plot_latency):
            print(f"wrote {plot(args.results, args.out)}")
    except NoData as err:
        print(f"plot_benchmarks: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
