"""The pure parts of benchmarks/bench_peers.py: cases and systems, the interleaved schedule, what a window's two
marks and CPU samples come to, the medians over repeats and the vidar/Inference ratios. No process is started
here (tests/test_bench_peers.py feeds it canned numbers); the samplers at the end read the machine.
"""

from __future__ import annotations

import re
import statistics
import subprocess
from dataclasses import dataclass
from typing import Any, Optional

from peers.curve import COLLAPSE_TOLERANCE, falls_at


@dataclass(frozen=True)
class Case:
    """N mounts of one clip: `prefix` names the server's mounts (/<prefix>_<i>)."""
    streams: int
    width: int
    height: int
    fps: int

    @property
    def prefix(self) -> str:
        return f"s{self.height}p{self.fps}"

    @property
    def offered_fps(self) -> int:
        return self.streams * self.fps


CASES = {"16x240p60": Case(16, 320, 240, 60), "48x240p60": Case(48, 320, 240, 60), "8x720p30": Case(8, 1280, 720, 30)}
# beside CASES, any <N>x<res><fps> of these sizes is a case (8x240p60 ... 64x240p60: issue 42's no-collapse
# curve); keyed by height, one size each, so a case's mounts (Case.prefix) are never shared by two sizes
RESOLUTIONS = {"180p": (320, 180), "240p": (320, 240), "360p": (640, 360), "720p": (1280, 720), "1080p": (1920, 1080)}
CASE_NAME = re.compile(r"(\d+)x(\d+p)(\d+)")
MAX_STREAMS, MAX_FPS = 256, 240  # beyond what one machine serves and reads; a typo (480x240p60) is caught
SYSTEMS = {  # name -> the column's label
    "vidar": "vidar defaults",
    "vidar_b500": "vidar budget 500 ms",
    "inference_default": "Inference defaults",
    "inference_tuned": "Inference max-throughput (tuned)",
    "ultralytics": "Ultralytics LoadStreams",
}
# the ratios vidar / Inference: each vidar setting against the Inference setting of the same intent
PAIRS = (("vidar", "inference_default"), ("vidar_b500", "inference_tuned"))


def case(name: str) -> Case:
    """A case by its name: one of CASES or any `<N>x<res><fps>` of RESOLUTIONS (ValueError otherwise)."""
    if name in CASES:
        return CASES[name]
    m = CASE_NAME.fullmatch(name)
    if not m or m.group(2) not in RESOLUTIONS:
        raise ValueError(f"not a case: {name!r}")
    n, fps = int(m.group(1)), int(m.group(3))
    if not (1 <= n <= MAX_STREAMS and 1 <= fps <= MAX_FPS):
        raise ValueError(f"{name!r}: 1 to {MAX_STREAMS} streams at 1 to {MAX_FPS} fps")
    return Case(n, *RESOLUTIONS[m.group(2)], fps)


def case_name(c: Case) -> str:
    """The canonical name of a case (`08x240p60` -> `8x240p60`)."""
    res = next(r for r, size in RESOLUTIONS.items() if size == (c.width, c.height))
    return f"{c.streams}x{res}{c.fps}"


def parse_cases(text: str) -> list[str]:
    """'16x240p60,64x240p60' -> the canonical names, each one of CASES or any <N>x<res><fps> of RESOLUTIONS
    ('all': CASES, in their order)."""
    if text.strip() == "all":
        return list(CASES)
    names, unknown = [], []
    for raw in (s.strip() for s in text.split(",") if s.strip()):
        try:
            names.append(case_name(case(raw)))
        except ValueError:
            unknown.append(raw)
    if unknown or not names:
        raise ValueError(f"--cases: unknown {unknown or text!r}; choose from {', '.join(CASES)} (or all), or any "
                         f"<N>x<res><fps> of {', '.join(RESOLUTIONS)}, 1 to {MAX_STREAMS} streams, e.g. 64x240p60")
    return list(dict.fromkeys(names))


def parse_choice(text: str, allowed: dict[str, Any], what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], every name one of `allowed` ('all': every one, in their order)."""
    names = list(allowed) if text.strip() == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"--{what}: unknown {unknown or text!r}; choose from {', '.join(allowed)} (or all)")
    return list(dict.fromkeys(names))


def schedule(cases: list[str], systems: list[str], repeats: int) -> list[tuple[int, str, str]]:
    """(repeat, case, system) in run order: every system of a case back to back, so a case's cells share the
    machine's state of the moment; the systems' order reversed every other repeat, so no system always runs
    first (or right after the heaviest)."""
    out = []
    for rep in range(1, repeats + 1):
        order = systems if rep % 2 else systems[::-1]
        out += [(rep, case, system) for case in cases for system in order]
    return out


def parse_ss(text: str, port: int) -> dict[str, int]:
    """`ss -tnH state established` lines (Recv-Q Send-Q local peer): the bytes the readers have not read yet
    (Recv-Q of connections to the server's port) and those the server could not send yet (its Send-Q)."""
    client_recvq = server_sendq = conns = 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        recvq, sendq, local, peer = int(parts[0]), int(parts[1]), parts[2], parts[3]
        if peer.endswith(f":{port}"):
            client_recvq, conns = client_recvq + recvq, conns + 1
        elif local.endswith(f":{port}"):
            server_sendq += sendq
    return {"client_recvq_bytes": client_recvq, "server_sendq_bytes": server_sendq, "conns": conns}


METRIC = re.compile(r"^(vidar_frames_(?:ingested|published|dropped|failed)_total|vidar_qos_level)"
                    r"(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(body: str) -> dict[str, float]:
    """vidar's Prometheus text summed over streams, dropped frames by reason ('..._dropped_total:deadline');
    the ladder's rung: the highest of any pool."""
    out: dict[str, float] = {}
    for line in body.splitlines():
        m = METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        reason = re.search(r'reason="([^"]+)"', labels)
        key = f"{name}:{reason.group(1)}" if reason else name
        out[key] = max(out.get(key, 0.0), value) if name == "vidar_qos_level" else out.get(key, 0.0) + value
    return out


def cpu_used(a: dict[int, float], b: dict[int, float]) -> tuple[float, list[int]]:
    """CPU seconds a process tree used between two samples ({pid: user+system s}): a process started in
    between counts from 0; one that ended in between is lost and listed."""
    return sum(s - a.get(pid, 0.0) for pid, s in b.items()), sorted(pid for pid in a if pid not in b)


def per_second(m1: dict, m2: dict, key: str, dt: float) -> list[float]:
    """Per stream, the advance of a counter between two marks ({stream: n}) per second."""
    return [(m2[key].get(s, 0) - m1[key].get(s, 0)) / dt for s in m2[key]]


def summarize_window(case: Case, m1: dict, m2: dict, s1: dict, s2: dict, clip_bytes_per_s: float) -> dict:
    """One run's window from its two marks (the sink's reports) and two samples (CPU, backlog, metrics).

    A sample: {"t", "tree" {pid: cpu s}, "sub" {pid: cpu s} (vidar's subscriber), "server", "busy_s" (the
    machine's busy CPU s), "backlog" (parse_ss), "metrics" (vidar only)}.
    """
    dt, cpu_dt = m2["t"] - m1["t"], s2["t"] - s1["t"]
    per = per_second(m1, m2, "count", dt)
    delivered = sum(per)
    tree, exited = cpu_used(s1["tree"], s2["tree"])
    sub, _ = cpu_used(s1.get("sub", {}), s2.get("sub", {}))
    server, _ = cpu_used(s1["server"], s2["server"])
    cores, sub_cores = tree / cpu_dt, sub / cpu_dt
    out: dict[str, Any] = {
        "window_s": round(dt, 2), "offered_fps": case.offered_fps, "delivered_fps": round(delivered, 1),
        "fraction_of_offered": round(delivered / case.offered_fps, 3),
        "per_stream_fps_min_med_max": [round(min(per), 1), round(statistics.median(per), 1), round(max(per), 1)]
        if per else None,
        "lat_p50_ms": m2.get("lat_p50_ms"), "lat_p99_ms": m2.get("lat_p99_ms"),
        "age_p50_ms": m2.get("age_p50_ms"), "age_p99_ms": m2.get("age_p99_ms"),
        "cpu_cores": round(cores, 3), "subscriber_cpu_cores": round(sub_cores, 3) if s2.get("sub") else None,
        # per delivered frame, the subscriber included: the peers count in their own process, vidar's user
        # needs a subscriber to receive anything
        "cpu_ms_per_frame": round((tree + sub) / cpu_dt / delivered * 1e3, 3) if delivered else None,
        "rtsp_server_cpu_cores": round(server / cpu_dt, 3),
        "other_load_cores": round((s2["busy_s"] - s1["busy_s"] - tree - sub - server) / cpu_dt, 3),
        "not_newer_in_window": m2.get("not_newer", 0) - m1.get("not_newer", 0),
        "tree_processes_exited": exited,
    }
    # intake: frames the system took off the network, delivered or not, where it numbers them all
    # (vidar's seq, inference's frame_id); ultralytics numbers nothing
    if m2.get("last_id"):
        out["intake_fps"] = round(sum(per_second(m1, m2, "last_id", dt)), 1)
    out.update(backlog(case, s1["backlog"], s2["backlog"], cpu_dt, clip_bytes_per_s))
    if s1.get("metrics") and s2.get("metrics"):
        out["vidar_counters_fps"] = {k: round((v - s1["metrics"].get(k, 0.0)) / cpu_dt, 1)
                                     for k, v in s2["metrics"].items() if k != "vidar_qos_level"}
        out["vidar_qos_level_end"] = s2["metrics"].get("vidar_qos_level")
    return out


def backlog(case: Case, b1: dict, b2: dict, dt: float, clip_bytes_per_s: float) -> dict:
    """Lag behind the live edge from the TCP backlog: the bytes waiting in a stream's connection (its reader's
    Recv-Q plus the server's Send-Q), over the clip's byte rate, are the seconds of video the reader has not
    taken yet (RTP/interleave headers, ~1-2 %, make it a slight overestimate). At the window's start and
    end, mean per stream, and how fast it grew."""
    def lag_s(b: dict) -> float:
        return (b["client_recvq_bytes"] + b["server_sendq_bytes"]) / case.streams / clip_bytes_per_s

    start, end = lag_s(b1), lag_s(b2)
    waiting = [b["client_recvq_bytes"] + b["server_sendq_bytes"] for b in (b1, b2)]
    return {"backlog_mb": [round(w / 1e6, 2) for w in waiting],
            "lag_s": [round(start, 2), round(end, 2)], "lag_end_s": round(end, 2),
            "lag_growth_s_per_min": round((end - start) / dt * 60, 2),
            "backlog_growth_mb_per_min": round((waiting[1] - waiting[0]) / dt * 60 / 1e6, 2),
            "connections": b2["conns"]}


def median_of(runs: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


CELL_KEYS = ("delivered_fps", "fraction_of_offered", "lat_p50_ms", "lat_p99_ms", "age_p50_ms", "age_p99_ms",
             "cpu_cores", "subscriber_cpu_cores", "cpu_ms_per_frame", "intake_fps", "lag_end_s", "lag_growth_s_per_min",
             "backlog_growth_mb_per_min", "other_load_cores")


def cells(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """{case: {system: medians over its verified runs}} (a run that failed verification is left out of the
    medians and counted)."""
    out: dict[str, dict[str, dict]] = {}
    for run in runs:
        out.setdefault(run["case"], {}).setdefault(run["system"], {"runs": [], "unverified": 0})
        cell = out[run["case"]][run["system"]]
        if run.get("verified") and run.get("summary"):
            cell["runs"].append(run["summary"])
        else:
            cell["unverified"] += 1
    for by_system in out.values():
        for cell in by_system.values():
            summaries = cell.pop("runs")
            cell.update({k: median_of(summaries, k) for k in CELL_KEYS}, n=len(summaries))
    return out


def curve(table: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """The no-collapse check (issue 42: 8 -> 16 -> 32 -> 48 -> 64 cameras): for each frame size and rate run at
    two or more stream counts, per system, delivered fps by stream count and the counts at which it falls below
    the best of the smaller ones by more than COLLAPSE_TOLERANCE. {"240p60": {system: {...}}}."""
    families: dict[str, dict[int, str]] = {}
    for name in table:
        c = case(name)
        families.setdefault(name.split("x", 1)[1], {})[c.streams] = name
    out: dict[str, dict[str, dict]] = {}
    for family, by_n in families.items():
        if len(by_n) < 2:
            continue
        for system in SYSTEMS:
            points = [(n, (table[by_n[n]].get(system) or {}).get("delivered_fps")) for n in sorted(by_n)]
            points = [(n, v) for n, v in points if v is not None]
            if len(points) < 2:
                continue
            falls = falls_at(points)
            out.setdefault(family, {})[system] = {"delivered_fps": {n: v for n, v in points}, "falls_at": falls,
                                                  "no_collapse": not falls}
    return out


def ratios(table: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """{case: {'vidar/inference_default': {metric: ratio}}}: delivered fps (above 1: vidar delivers more), CPU
    ms per frame and latency (above 1: vidar costs more, is slower)."""
    out: dict[str, dict[str, dict]] = {}
    for case, by_system in table.items():
        for mine, theirs in PAIRS:
            a, b = by_system.get(mine), by_system.get(theirs)
            if not a or not b:
                continue
            out.setdefault(case, {})[f"{mine}/{theirs}"] = {
                k: round(a[k] / b[k], 2) if a.get(k) and b.get(k) else None
                for k in ("delivered_fps", "cpu_ms_per_frame", "lat_p50_ms", "lat_p99_ms")}
    return out


def fmt(v: Optional[float], spec: str = ",.0f") -> str:
    return "n/m" if v is None else format(v, spec)


def format_table(table: dict[str, dict[str, dict]], ratio: dict[str, dict[str, dict]],
                 collapse: Optional[dict[str, dict[str, dict]]] = None) -> str:
    """The human table: one row per cell (medians), then the ratios and the no-collapse curve. `p50/p99 ms`:
    latency from the system's own capture stamp; `age p99`: vidar's frames' age by the camera's clock (the
    sink's estimate from pts, vidar_sink.py), which a backlog in the socket cannot hide; `cores`: the system's
    tree (+ vidar's subscriber); `ms/frame`: both, per delivered frame; `intake`: frames/s taken off the network;
    `lag s`: video seconds waiting in a stream's TCP connection at the window's end, `lag s/min` its growth;
    `other`: cores busy on the machine beyond the system, its subscriber and the server (above ~0.1: not a
    quiet machine)."""
    head = (f"{'case':<10} {'system':<33} {'n':>2} {'fps':>7} {'of offer':>8} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'age p99':>8} {'cores':>11} {'ms/frame':>8} {'intake':>7} {'lag s':>6} {'lag s/min':>9} {'other':>6}")
    lines = [head, "-" * len(head)]
    for case, by_system in table.items():
        for system in SYSTEMS:
            c = by_system.get(system)
            if c is None:
                continue
            cores = fmt(c["cpu_cores"], ".2f") + (f"+{c['subscriber_cpu_cores']:.2f}"
                                                  if c.get("subscriber_cpu_cores") is not None else "")
            bad = f"  ({c['unverified']} run(s) not verified)" if c["unverified"] else ""
            lines.append(f"{case:<10} {SYSTEMS[system]:<33} {c['n']:>2} {fmt(c['delivered_fps']):>7} "
                         f"{fmt(c['fraction_of_offered'], '.2f'):>8} {fmt(c['lat_p50_ms'], '.1f'):>7} "
                         f"{fmt(c['lat_p99_ms'], '.1f'):>7} {fmt(c.get('age_p99_ms'), '.1f'):>8} {cores:>11} "
                         f"{fmt(c['cpu_ms_per_frame'], '.2f'):>8} "
                         f"{fmt(c['intake_fps']):>7} {fmt(c['lag_end_s'], '.2f'):>6} "
                         f"{fmt(c['lag_growth_s_per_min'], '.1f'):>9} "
                         f"{fmt(c['other_load_cores'], '.2f'):>6}{bad}")
    lines.append("")
    lines.append("ratios vidar / Inference (fps > 1: vidar delivers more; ms/frame, latency > 1: vidar costs more)")
    for case, pairs in ratio.items():
        for pair, r in pairs.items():
            lines.append(f"{case:<10} {pair:<30} fps {fmt(r['delivered_fps'], '.2f')}  ms/frame "
                         f"{fmt(r['cpu_ms_per_frame'], '.2f')}  p50 {fmt(r['lat_p50_ms'], '.2f')}  "
                         f"p99 {fmt(r['lat_p99_ms'], '.2f')}")
    if collapse:
        lines += ["", f"no collapse as cameras are added (delivered fps by stream count; falls: below the best "
                      f"smaller count by more than {COLLAPSE_TOLERANCE:.0%})"]
    for family, by_system in (collapse or {}).items():
        for system, c in by_system.items():
            points = ", ".join(f"{n}: {v:,.0f}" for n, v in c["delivered_fps"].items())
            lines.append(f"{family:<10} {SYSTEMS[system]:<33} {points}  "
                         + ("MET" if c["no_collapse"] else f"falls at {c['falls_at']}"))
    return "\n".join(lines)


# -- samplers (they read the machine) ----------------------------------------------------------------
def tree_cpu(pid: int) -> dict[int, float]:
    """{pid: user+system CPU s} of `pid` and every process below it (empty when it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:  # ended between the listing and the read
            continue
        out[p.pid] = t.user + t.system
    return out


def machine_busy_s() -> float:
    import psutil

    c = psutil.cpu_times()
    return sum(c) - c.idle - c.iowait


def tcp_backlog(port: int) -> dict[str, int]:
    out = subprocess.run(["ss", "-tnH", "state", "established"], capture_output=True, text=True, timeout=10)
    return parse_ss(out.stdout, port)
