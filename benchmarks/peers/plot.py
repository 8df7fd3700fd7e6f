"""bench_peers.json's cells as one figure (`bench_peers.py --plot PATH`): per case, each system's share of the
offered frames delivered, its CPU ms per delivered frame, its latency p50 (bar) to p99 (whisker), and how fast
it falls behind the live edge (the growth of the video waiting in its TCP connections)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.measure import SYSTEMS


def plot_cells(record: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    cells = record["cells"]
    cases = list(cells)
    systems = [s for s in SYSTEMS if any(s in cells[c] for c in cases)]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.8))
    width = 0.8 / max(1, len(systems))
    panels = (("fraction_of_offered", "delivered / offered"), ("cpu_ms_per_frame", "CPU ms per delivered frame"),
              ("lat_p50_ms", "latency ms, p50 (bar) and p99 (whisker)"),
              ("lag_growth_s_per_min", "falls behind live: s per minute (TCP backlog)"))
    for ax, (key, title) in zip(axes, panels):
        for j, system in enumerate(systems):
            xs, ys, err = [], [], []
            for i, case in enumerate(cases):
                cell = cells[case].get(system) or {}
                if cell.get(key) is None:
                    continue
                xs.append(i + (j - (len(systems) - 1) / 2) * width)
                ys.append(cell[key])
                err.append(max(0.0, (cell.get("lat_p99_ms") or cell[key]) - cell[key]) if key == "lat_p50_ms" else 0)
            whisker = [[0.0] * len(err), err] if key == "lat_p50_ms" else None  # up to p99 only
            ax.bar(xs, ys, width, label=SYSTEMS[system], yerr=whisker, capsize=2)
        ax.set_xticks(range(len(cases)), cases)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[2].set_yscale("log")  # 5 ms beside 500 ms
    axes[0].legend(fontsize=7, loc="lower left")
    when = record["date"][:16].replace("T", " ")
    fig.suptitle(f"vidar beside Inference and Ultralytics, live RTSP, no model ({when} UTC, "
                 f"{record['cpus']} CPUs)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path
