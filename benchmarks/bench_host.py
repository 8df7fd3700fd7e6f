"""The host side alone: frames/s from ingest through scheduling to publish, per CPU-second, and where it goes.

The engine runs in-process with the null pool (`models.noop`, `per_frame_s: 0`: no model, no pixels read) on
synthetic sources; a subscriber (engine.publish.client.Subscriber) drains every result in its own process (its
msgpack/ZeroMQ work is not the engine's, as in a deployment) and checks that each stream's seqs increase. Over
a timed window after a warm-up: frames/s offered, ingested, published, dropped by reason (the pool's ledger),
the engine process's CPU seconds per second (user+sys), the same per thread group (psutil's per-thread times by
thread name: ingest, core, workers, output, publisher, native), frames published per CPU-second ("per core":
load distorts it less than frames/s), the null pool's mean batch, and the machine's load beside each number.

Scenarios, each in its own subprocess with a time box; all of them run, then all again (`--repeats`):
  raw      the synthetic source alone (render), + the ring's copy into one slot, + the copy with 8 streams'
           working set: the engine's overhead per frame is its CPU per frame minus the last
  live     8 and 48 streams of 1280x720 @ 60 and of 320x240 @ 60; budget 5 s and the ladder off, so the
           null pool never drops for deadline: what is measured is the host
  offline  4 endless synthetic streams in offline mode (no pacing, back-pressure): frames/s at full speed
The JSON is rewritten after every scenario (a hang loses only the scenario it hit).

`--profile`: py-spy on 48 x 320x240, 8 and 48 x 1280x720 (all @ 60), twice each: `gil` (the GIL holder's lines,
in us per frame) and `idle` (every thread's wall time, waits included: where the core waits); in
`bench_host_profile.json`.

    python benchmarks/bench_host.py            # ~3 min on 2 cores; benchmarks/results/bench_host.json
    python benchmarks/bench_host.py --quick    # ~50 s, one run each, short windows
    python benchmarks/bench_host.py --profile  # needs py-spy (pip install py-spy)
Another checkout: run this file with that checkout first on PYTHONPATH (the JSON says which `engine` ran).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("engine") is None:  # not on PYTHONPATH: this file's own checkout
    sys.path.insert(0, str(ROOT))

SIZES = {"720p": (1280, 720), "240p": (320, 240)}
RAW_VARIANTS = (("render", 1, False), ("render_copy", 1, True), ("render_copy_x8", 8, True))
PROFILED = [("live", 48, "240p"), ("live", 8, "720p"), ("live", 48, "720p")]
SPY_MODES = {"gil": ["--gil"], "idle": ["--idle"]}
GROUPS = (("source-", "ingest"), ("engine-core", "core"), ("worker-", "workers"), ("output-", "output"),
          ("publisher", "publisher"), ("MainThread", "main"))


def thread_group(name: Optional[str]) -> str:
    """The engine's threads by role, from the names it gives them; unnamed ones are native (ZeroMQ's I/O)."""
    return "native" if name is None else next((g for prefix, g in GROUPS if name.startswith(prefix)), "other")


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- the subscriber (its own process) ---------------------------------------------------------------
class _Tally:
    """What the subscriber received: counts, latencies since the last report, seqs that did not increase."""

    def __init__(self) -> None:
        self.received, self.disorder, self.lat, self.last = 0, 0, [], {}

    def add(self, msg: dict) -> None:
        self.received += 1
        self.lat.append(msg["latency_ms"])
        self.disorder += msg["seq"] <= self.last.get(msg["stream"], -1)
        self.last[msg["stream"]] = msg["seq"]

    def report(self) -> str:
        lat, self.lat = sorted(self.lat), []
        pct = {q: lat[min(len(lat) - 1, int(len(lat) * q / 100))] if lat else math.nan for q in (50, 99)}
        t = os.times()
        return json.dumps({"received": self.received, "disorder": self.disorder, "p50_ms": pct[50],
                           "p99_ms": pct[99], "cpu_s": t.user + t.system})


def subscriber_main(endpoint: str) -> None:
    """Drain every `noop.` result; each line on stdin is answered with a report ("stop" ends it)."""
    from engine.publish.client import Subscriber
    sub, tally = Subscriber(endpoint, ["noop."]), _Tally()
    print("ready", flush=True)
    while True:
        msg, n = sub.recv(0.005), 0  # wait briefly for traffic, then drain it (bounded: stdin is read too)
        while msg is not None:
            tally.add(msg)
            n += 1
            msg = sub.recv(0) if n < 2000 else None
        if select.select([sys.stdin], [], [], 0)[0]:
            cmd = sys.stdin.readline().strip()
            print(tally.report(), flush=True)
            if cmd != "mark":
                return sub.close()


class SubscriberProcess:
    def __init__(self, endpoint: str):
        self.proc = subprocess.Popen([sys.executable, __file__, "--subscriber", endpoint], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"subscriber for {endpoint} did not start (exit {self.proc.poll()})")

    def mark(self, cmd: str = "mark") -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> dict:
        out = self.mark("stop")
        self.proc.wait(10)
        return out


# -- one engine scenario (child process) ------------------------------------------------------------
def engine_tree(sc: dict, endpoint: str) -> dict:
    w, h = SIZES[sc["size"]]
    mode = "live" if sc["kind"] == "live" else "offline"
    streams = [{"id": f"s{i}", "url": f"synthetic://shapes?size={w}x{h}&fps={sc['fps']}&seed={i}", "mode": mode}
               for i in range(sc["streams"])]
    return {"streams": streams, "max_streams": max(64, sc["streams"]),
            "models": {"noop": {"per_frame_s": 0, "max_batch": sc["max_batch"], "workers": 1}},
            # 5 s: a frame the host delivers up to a second late (the pacer's catch-up bound) still meets it
            "budget": {"latency_ms": 5000}, "qos": {"ladder": False}, "shutdown_timeout_s": 3,
            "publish": {"endpoint": endpoint, "hwm": 100000, "min_subscribers": 1, "wait_subscribers_s": 20},
            "metrics": {"enabled": False}, "control": {"enabled": False}}


def sample(eng, sub: SubscriberProcess) -> dict:
    """Every counter at one moment: the ledger, CPU (process, per thread group, machine), the subscriber."""
    import psutil
    acct, t0 = eng.pools["noop"].acct, time.monotonic()
    snaps = [acct.snapshot(s) for s in acct.streams()]  # under 48 busy streams this alone can take ~1 s
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups: Counter = Counter()
    for th in psutil.Process().threads():
        groups[thread_group(names.get(th.id))] += th.user_time + th.system_time
    sizes = [m.batch_sizes for m in eng.pools["noop"].slots.models]  # NoopRunner's record of its batches
    t, cpu = os.times(), psutil.cpu_times()
    return {"t": time.monotonic(), "sample_s": time.monotonic() - t0, "cpu_s": t.user + t.system, "groups": groups,
            "ingested": sum(s.ingested for s in snaps), "published": sum(s.published for s in snaps),
            "dropped": sum((Counter(s.dropped) for s in snaps), Counter()),
            "failed": sum((Counter(s.failed) for s in snaps), Counter()),
            "batches": sum(len(b) for b in sizes), "batched": sum(sum(b) for b in sizes),
            "machine_busy_s": sum(cpu) - cpu.idle - cpu.iowait, "load1": os.getloadavg()[0], "sub": sub.mark()}


def window_stats(a: dict, b: dict, sc: dict) -> dict:
    dt, cpu = b["t"] - a["t"], b["cpu_s"] - a["cpu_s"]
    ing, pub = b["ingested"] - a["ingested"], b["published"] - a["published"]
    sub_cpu = b["sub"]["cpu_s"] - a["sub"]["cpu_s"]
    busy = (b["machine_busy_s"] - a["machine_busy_s"]) / dt
    per_frame = {g: round((b["groups"][g] - a["groups"][g]) / ing * 1e6, 1) if ing else None
                 for g in sorted(b["groups"])}
    return {
        "window_s": round(dt, 2), "sample_s": round(b["sample_s"], 2),
        "offered_fps": sc["streams"] * sc["fps"] if sc["kind"] == "live" else None,
        "ingested_fps": ing / dt, "published_fps": pub / dt,
        "received_fps": (b["sub"]["received"] - a["sub"]["received"]) / dt,
        "dropped_fps": {k: v / dt for k, v in (b["dropped"] - a["dropped"]).items()},
        "failed": dict(b["failed"] - a["failed"]), "batches_per_s": (b["batches"] - a["batches"]) / dt,
        "mean_batch": (b["batched"] - a["batched"]) / max(1, b["batches"] - a["batches"]),
        "cpu_cores": cpu / dt, "published_per_cpu_s": pub / cpu if cpu else None,
        "cpu_us_per_ingested": cpu / ing * 1e6 if ing else None,
        "thread_cpu_cores": {g: round((b["groups"][g] - a["groups"][g]) / dt, 3) for g in sorted(b["groups"])},
        "thread_cpu_us_per_ingested": per_frame,
        "latency_p50_ms": b["sub"]["p50_ms"], "latency_p99_ms": b["sub"]["p99_ms"],
        "subscriber_cpu_cores": sub_cpu / dt, "load1": [round(a["load1"], 2), round(b["load1"], 2)],
        "machine_busy_cores": round(busy, 2), "others_busy_cores": round(busy - (cpu + sub_cpu) / dt, 2)}


def free_endpoint() -> str:
    # not engine.testing.net's: this file also measures older checkouts (the "before" side), which lack it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_engine(sc: dict) -> dict:
    from engine.config import build_config
    from engine.core.engine import Engine
    ep = free_endpoint()
    cfg, _ = build_config(engine_tree(sc, ep), cuda_available=False)
    sub, eng = SubscriberProcess(ep), Engine(cfg)
    t0 = time.monotonic()
    try:
        eng.start()
        t_started = time.monotonic()
        time.sleep(sc["warmup_s"])
        a = sample(eng, sub)
        if sc.get("signal"):
            print("WARM", flush=True)  # the parent attaches the profiler now
        time.sleep(sc["window_s"])
        b = sample(eng, sub)
    finally:
        t_stop = time.monotonic()
        eng.stop(drain=False)
        final = sub.stop()
    out = {**window_stats(a, b, sc), "start_s": round(t_started - t0, 2), "stop_s": round(time.monotonic() - t_stop, 2),
           "audit": eng.audit(),  # a leaked or double-counted frame shows here
           "order_errors": final["disorder"]}
    # the subscriber's count is its own (not the ledger's): what was counted published arrived, in order
    out["verified"] = (not out["audit"] and not out["order_errors"]
                       and out["received_fps"] >= 0.8 * out["published_fps"] - 5)
    return out


def raw_rate(size: str, sources: int, copy: bool, window_s: float) -> dict:
    """`sources` synthetic sources through `frames()` (what ingest threads iterate) in turn, on one thread;
    with `copy`, each frame then copied into the next of 16 torch-allocated slots of its source, as the ring
    does (x8: the working set of 8 streams, whose backgrounds and slots do not fit the caches, so a copy costs
    more than into one hot slot; 48 streams' would take seconds to set up)."""
    import numpy as np
    import torch
    from streams.synthetic import SyntheticSource
    w, h = SIZES[size]
    its = [SyntheticSource(f"raw{i}", f"synthetic://shapes?size={w}x{h}&fps=60&seed={i}").frames()
           for i in range(sources)]
    slots = [[torch.empty((h, w, 3), dtype=torch.uint8).numpy() for _ in range(16 if copy else 0)] for _ in its]
    def one_round(k: int) -> None:
        for i, it in enumerate(its):
            f = next(it)
            if copy:
                np.copyto(slots[i][k % 16], f.rgb)
    for k in range(16):  # every background rendered, every slot's pages touched, before the clock starts
        one_round(k)
    n, t0, c0 = 0, time.monotonic(), os.times()
    while time.monotonic() - t0 < window_s:
        one_round(n)
        n += 1
    dt, c1 = time.monotonic() - t0, os.times()
    cpu, frames = c1.user + c1.system - c0.user - c0.system, n * sources
    return {"fps": frames / dt, "frames_per_cpu_s": frames / cpu if cpu else None,
            "cpu_us_per_frame": cpu / frames * 1e6}


def run_raw(sc: dict) -> dict:
    """The source alone, single-threaded (CPU-s per frame is its cost)."""
    out: dict[str, Any] = {label: raw_rate(sc["size"], n, copy, sc["window_s"]) for label, n, copy in RAW_VARIANTS}
    out["copy_us_per_frame"] = out["render_copy"]["cpu_us_per_frame"] - out["render"]["cpu_us_per_frame"]
    return {**out, "load1": [round(os.getloadavg()[0], 2)]}


# -- the parent: scenarios in subprocesses -----------------------------------------------------------
def scenarios(args) -> list[dict]:
    base = {"warmup_s": args.warmup, "window_s": args.window, "max_batch": args.max_batch, "fps": 60}
    out = [{**base, "kind": "raw", "streams": 1, "size": s, "warmup_s": 0, "window_s": args.window / 3} for s in SIZES]
    out += [{**base, "kind": "live", "streams": n, "size": s} for s in SIZES for n in (8, 48)]
    out += [{**base, "kind": "offline", "streams": 4, "size": s} for s in SIZES]
    return [sc for sc in out if not args.only or args.only in name_of(sc)]


def name_of(sc: dict) -> str:
    if sc["kind"] == "raw":
        return f"raw {sc['size']}"
    return f"{sc['kind']} {sc['streams']}x{sc['size']}" + (f"@{sc['fps']}" if sc["kind"] == "live" else "")


def result_of(stdout: str) -> Optional[dict]:
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("RESULT ")), None)
    return json.loads(line[len("RESULT "):]) if line else None


def run_child(sc: dict, timeout_s: float) -> dict:
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(sc)], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    res = result_of(p.stdout)
    if p.returncode != 0 or res is None:
        return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-1500:]}
    return {**res, "child_wall_s": round(time.monotonic() - t0, 1)}


def engine_info() -> dict:
    import engine
    import torch
    here = Path(engine.__file__).resolve().parents[1]
    git = ["git", "-C", str(here)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "engine", "streams"], capture_output=True, text=True).stdout
    return {"engine_file": engine.__file__, "commit": commit or None, "engine_or_streams_modified": bool(dirty.strip()),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.platform(),
            "cpus": os.cpu_count()}


def main_bench(args) -> None:
    record = {"date": now_utc(), **engine_info(), "args": vars(args), "rows": [], "complete": False}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(HEADER)
    raw: dict[str, dict] = {}
    for rep in range(args.repeats):  # all scenarios, then all again: the runs of one see different moments
        for sc in scenarios(args):
            res = run_child(sc, sc["warmup_s"] + sc["window_s"] + args.box)
            if sc["kind"] == "raw" and "error" not in res:
                raw[sc["size"]] = res
            elif res.get("cpu_us_per_ingested") and sc["size"] in raw:
                # what the engine spends per frame beyond the source and its copy alone (this pass's raw row)
                ref = raw[sc["size"]]["render_copy_x8"]["cpu_us_per_frame"]
                res["overhead_us_per_frame"] = res["cpu_us_per_ingested"] - ref
                res["source_share_of_cpu"] = ref / res["cpu_us_per_ingested"]
            record["rows"].append({"scenario": name_of(sc), "run": rep + 1, "spec": sc, **res})
            print_row(record["rows"][-1])
            out.write_text(json.dumps(record, indent=2, default=str))
    record["complete"] = True
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"\nengine: {record['engine_file']} (commit {record['commit']}); {record['cpus']} CPUs\n{HEADER}")
    order = {name: i for i, name in enumerate(dict.fromkeys(r["scenario"] for r in record["rows"]))}
    for r in sorted(record["rows"], key=lambda r: (order[r["scenario"]], r["run"])):
        print_row(r)
    print(f"\nwrote {out}")


def fmt(x: Any, spec: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


HEADER = (f"{'scenario':<18}{'#':>2}{'offer/s':>8}{'ingest/s':>9}{'publ/s':>8}{'cores':>6}{'publ/cpu-s':>11}"
          f"{'us/frame':>9}{'ovh':>6}{'batch':>6}{'p50ms':>7}{'load1':>6}{'others':>7}  dropped/s")


def print_row(r: dict) -> None:
    head = f"{r['scenario']:<18}{r['run']:>2}"
    if "error" in r:
        print(f"{head}  ERROR {r['error']}", flush=True)
    elif r["spec"]["kind"] == "raw":
        x, c1, c8 = (r[k] for k, _, _ in RAW_VARIANTS)
        print(f"{head}{'':>8}{x['fps']:>9.0f}{'':>8}{1.0:>6.2f}{x['frames_per_cpu_s']:>11.0f}"
              f"{x['cpu_us_per_frame']:>9.0f}"
              f"   render + copy: {c1['cpu_us_per_frame']:.0f} us/frame, x8 streams {c8['cpu_us_per_frame']:.0f}",
              flush=True)
    else:
        drops = " ".join(f"{k}={v:.3g}" for k, v in sorted(r["dropped_fps"].items())) or "0"
        drops += "" if r["verified"] else "  NOT VERIFIED (audit, order or received: see the JSON)"
        print(f"{head}{fmt(r['offered_fps']):>8}{r['ingested_fps']:>9.0f}{r['published_fps']:>8.0f}"
              f"{r['cpu_cores']:>6.2f}"
              f"{fmt(r['published_per_cpu_s']):>11}{fmt(r['cpu_us_per_ingested']):>9}"
              f"{fmt(r.get('overhead_us_per_frame')):>6}{r['mean_batch']:>6.1f}{fmt(r['latency_p50_ms'], '.1f'):>7}"
              f"{r['load1'][0]:>6.2f}{r['others_busy_cores']:>7.2f}  {drops}", flush=True)


# -- profile: py-spy on a running scenario --------------------------------------------------------
def profile_one(sc: dict, spy: str, rate: int, mode: str) -> dict:
    """Start the scenario, attach py-spy once it is warm, sample for the window. `gil`: only the thread
    holding the GIL (one at a time: the process's serial Python work, in us per ingested frame). `idle`:
    every thread, waiting ones too (where each spends its wall time, as a share of it: a thread that waits
    for a lock shows there). py-spy's default (active threads) is not used: on an oversubscribed machine it
    counts runnable threads waiting for a core or the GIL as busy."""
    p = subprocess.Popen([sys.executable, __file__, "--child", json.dumps({**sc, "signal": True})],
                         stdout=subprocess.PIPE, text=True)
    for line in p.stdout:  # until the warm-up has ended
        if line.strip() == "WARM":
            break
    raw = Path(f"/tmp/bench_host_spy_{os.getpid()}_{sc['streams']}x{sc['size']}_{mode}.txt")
    spy_s = max(1, int(sc["window_s"]) - 1)  # ends before the window does: the shutdown is not sampled
    spy_run = subprocess.run([spy, "record", "--pid", str(p.pid), "--duration", str(spy_s), "--rate",
                              str(rate), "--format", "raw", "--threads", "--full-filenames", "--nonblocking", "-o",
                              str(raw), *SPY_MODES[mode]], capture_output=True, text=True)
    try:
        rest, _ = p.communicate(timeout=sc["window_s"] + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        rest = ""
    res = result_of(rest)
    if res is None or not raw.exists():
        return {"scenario": name_of(sc), "mode": mode, "error": f"exit {p.returncode}; py-spy: {spy_run.stderr[-300:]}"}
    return {"scenario": name_of(sc), "mode": mode, "rate_hz": rate, "window": res, "collapsed_stacks": str(raw),
            **summarize_profile(raw.read_text(), mode, rate, spy_s, res["ingested_fps"] * spy_s)}


def short(frame: str) -> str:
    """'func (/path/to/engine/frames/ring.py:178)' -> 'func (engine/frames/ring.py:178)'."""
    for marker in ("/engine/", "/streams/", "/site-packages/", "/lib/python3"):
        i = frame.find(marker)
        if i >= 0:
            return frame[:frame.rfind("(", 0, i) + 1] + frame[i + 1:]
    return frame


def where(frames: list[str]) -> str:
    """The top of a stack; a line in the standard library's threading or queue gets its caller beside it
    (`Condition.wait` says nothing; `Condition.wait <- EngineCore._run (engine/core/loop.py:86)` does)."""
    if not frames:
        return "(no Python frame)"
    caller = next((f for f in reversed(frames) if "/threading.py:" not in f and "/queue.py:" not in f), None)
    top = short(frames[-1])
    return top if caller in (None, frames[-1]) else f"{top} <- {short(caller)}"


def summarize_profile(text: str, mode: str, rate: int, seconds: int, frames: float) -> dict:
    """Self samples (the line at the top of the stack) and inclusive ones (a function anywhere on it), by
    thread group. gil: us per ingested frame; idle: share of the group's samples."""
    self_s, incl, group_s = Counter(), Counter(), Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        parts = stack.split(";")
        g, n = thread_group(parts[0].partition(": ")[2] or None), int(count)  # 'thread (TID): NAME'
        group_s[g] += n
        self_s[(g, where(parts[1:]))] += n
        for fr in {short(p) for p in parts[1:] if "threading.py" not in p}:
            incl[(g, fr)] += n
    unit = "us_per_frame" if mode == "gil" else "share"

    def scale(g: str, n: int) -> float:  # gil: a sample stands for 1/rate s; idle: of the group's samples
        return round(n / rate / max(frames, 1.0) * 1e6, 2) if mode == "gil" else round(n / group_s[g], 3)

    out = {"frames": round(frames), "unit": unit,
           "by_group": {g: scale(g, n) if mode == "gil" else n for g, n in group_s.most_common()},  # idle: samples
           "top_self": [{"group": g, "where": fr, unit: scale(g, n)} for (g, fr), n in self_s.most_common(40)],
           "top_inclusive": [{"group": g, "where": fr, unit: scale(g, n)} for (g, fr), n in incl.most_common(60)]}
    if mode == "gil":
        out["gil_held_share"] = round(sum(group_s.values()) / (rate * seconds), 3)
    return out


def main_profile(args) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("bench_host --profile needs py-spy: pip install py-spy")
    base = {"warmup_s": args.warmup, "window_s": max(args.window, 10.0), "max_batch": args.max_batch, "fps": 60}
    record = {"date": now_utc(), **engine_info(), "profiles": []}
    out = Path(args.out).with_name(Path(args.out).stem + "_profile.json")
    for (kind, n, size), mode in [(p, m) for p in PROFILED for m in SPY_MODES]:
        prof = profile_one({**base, "kind": kind, "streams": n, "size": size}, spy, args.rate, mode)
        record["profiles"].append(prof)
        out.write_text(json.dumps(record, indent=2, default=str))
        print(f"\n== {prof['scenario']} ({mode}, GIL held {prof.get('gil_held_share', '-')}): "
              f"{prof.get('error') or prof['by_group']}")
        shown: Counter = Counter()
        for item in prof.get("top_self", []):  # gil: the top 15 lines; idle: the top 4 of each group but ingest
            if (mode == "gil" and sum(shown.values()) < 15) or (mode == "idle" and item["group"] != "ingest"
                                                                 and shown[item["group"]] < 4):
                shown[item["group"]] += 1
                print(f"  {item[prof['unit']]:>8}  {item['group']:<9} {item['where']}")
    print(f"\nwrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one run each, short windows (~50 s)")
    ap.add_argument("--profile", action="store_true", help="py-spy profiles instead of the timing matrix")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the scenarios (default 2; --quick 1)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds before the window (default 2; --quick 1)")
    ap.add_argument("--window", type=float, default=5.0, help="timed window, s (default 5; --quick 1.5; --profile 10)")
    ap.add_argument("--max-batch", type=int, default=8, help="the null pool's max_batch (default 8, as gpu_check)")
    ap.add_argument("--rate", type=int, default=250, help="--profile: samples per second (default 250)")
    ap.add_argument("--box", type=float, default=60.0, help="seconds a scenario may take beyond warm-up + window")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_host.json"))
    ap.add_argument("--only", default="", help="run only the scenarios whose name contains this, e.g. 'live 48x'")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--subscriber", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.subscriber:
        return subscriber_main(args.subscriber)
    if args.child:
        sc = json.loads(args.child)
        return print("RESULT " + json.dumps(run_raw(sc) if sc["kind"] == "raw" else run_engine(sc), default=str),
                     flush=True)
    if args.quick:
        args.repeats, args.warmup, args.window = 1, 1.0, 1.5
    (main_profile if args.profile else main_bench)(args)


if __name__ == "__main__":
    main()
