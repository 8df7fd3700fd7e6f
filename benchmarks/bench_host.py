"""The host side alone: frames/s from ingest through scheduling to publish, CPU per frame by role, the core's GIL.

The engine runs in-process with the null pool (`models.noop`, `per_frame_s: 0`: no model, no pixels read) on
synthetic sources or real H.264 (`--source`); a subscriber (engine.publish.client.Subscriber) drains every result
in its own process (its msgpack/ZeroMQ work is not the engine's, as in a deployment) and checks that each
stream's seqs increase. Over a timed window after a warm-up: frames/s offered, ingested, published, dropped by
reason (the pool's ledger), CPU seconds per second of the whole engine (its process plus every ingest process it
started), frames published per CPU-second ("per core": load distorts it less than frames/s), the null pool's
mean batch, the machine's load.

CPU per published frame by role (issue 33 item 9), from psutil: in the engine process by thread name (ingest =
the `source-*` threads and FFmpeg's decoder threads, core = `engine-core`, workers, output, publisher, native =
other unnamed threads, i.e. ZeroMQ's I/O threads, ingest_io = the core's side of the ingest processes, main,
other); with ingest processes, `ingest` is the CPU of every process below the engine (psutil children,
recursive) summed, less the subscriber, multiprocessing's resource tracker and forkserver (`aux`). Each
process's share is in the JSON.

The crossing (issue 33's "ingest to the core's scheduler"): the scheduler's `add` is wrapped in the engine
process; each frame's `time.monotonic()` there minus its write stamp (`FrameMeta.t_written` where the tree has
one, set by the ingest process when the slot write ends; else `t_decoded`, the ring write, which is the same
moment with ingest threads). CLOCK_MONOTONIC is system-wide, so the two processes' stamps compare.

Modes (`--modes threads,processes`): each engine scenario runs with `ingest.processes: 0` (ingest threads in
the engine process) and with `--processes` (default `auto`), alternated (pass 1 threads first, pass 2
processes first), so before and after come from one run on one machine. A tree without the `ingest` config key
runs threads only and says it skipped the rest.

`--gil`: after the timing passes, one more run of each target scenario per mode with py-spy attached to the
engine (core) process for the window: `py-spy record --gil --format raw --threads --nonblocking` emits a
stack only for the thread holding the GIL at a sample (py-spy reads CPython 3.11's
`_PyRuntime.gilstate.tstate_current`, NULL while nobody holds it), so the GIL share is the samples written
/ the sampling intervals (rate x seconds, less py-spy's errors); checked against a thread that spins half
its time (0.46 measured against 0.49 of a core). Kept out of the timing rows: py-spy's own CPU (in each
record) competes for the same 2 cores, so those rows' throughput is lower.

Sources (`--source`):
  synthetic  (the default, what the bench_host rows in RESULTS.md measured) synthetic://shapes frames rendered by
             the ingest: no demux, decode or colour conversion, so the host is measured without what a camera
             costs (48 x 240p60 published 2,878 of 2,880 here, where real RTSP cameras got 0.4 of that: issue 42)
  h264       what a camera costs: one clip per frame size and rate, encoded at the start of the run with
             benchmarks/peers/clips.py (bench_peers.py's recipe: testsrc2 with noise, libx264 veryfast
             zerolatency, a keyframe every 60 frames, no B-frames; `--clip-s` seconds) into a temporary folder in
             memory (/dev/shm, a tmpfs: no disk read in the way; removed at the end); every stream is a
             `loop: true` file stream of it, so PyAV demuxes, decodes and converts every packet to RGB in the
             ingest: an ingest process with `ingest.processes`, as an RTSP stream (engine/core/stream_table.py
             `_in_process` sends every stream that decodes on the CPU there), live streams paced by the ingest's
             _Pacer from the frames' pts (capture time = when a frame was due). Not a camera in two ways: no
             socket or RTP depacketizing, and the decoder's threading is the file source's, which may differ
             from a live network stream's (streams/pyav.py: FileSource against NetworkSource). In the threads
             mode FFmpeg's decoder threads (they name themselves `av:<codec>:...`) count as ingest, not native.
             The JSON goes to bench_host_h264.json unless `--out` says otherwise.

Scenarios, each in its own subprocess with a time box; all of them run, then all again (`--repeats`):
  raw      the source alone (synthetic: render; h264: demux + decode + RGB conversion of the clip, looped), + the
           ring's copy into one slot, + the copy with 8 streams'
           working set: the engine's overhead per frame is its CPU per frame minus the last
  live     8 -> 16 -> 32 -> 48 -> 64 x 320x240 @ 60 (the no-collapse curve), 8 and 48 x 1280x720 @ 60,
           16 x 320x180 @ 250 (small frames at a high rate); budget 5 s and the ladder off, so the null pool
           never drops for deadline: what is measured is the host
  offline  4 endless streams (synthetic, or the clip looped) in offline mode (no pacing, back-pressure): frames/s
           at full speed
The JSON is rewritten after every scenario (a hang loses only the scenario it hit); its `comparison` holds the
per-scenario medians side by side, `targets` issue 33's targets per mode and `curve` the no-collapse check.

`--profile`: py-spy on 48 x 320x240, 8 and 48 x 1280x720 (all @ 60), twice each: `gil` (the GIL holder's lines,
in us per frame) and `idle` (every thread's wall time, waits included: where the core waits); in
`bench_host_profile.json`.

    python benchmarks/bench_host.py --modes threads,processes --gil   # ~10 min on 2 cores
    python benchmarks/bench_host.py --quick --modes threads            # ~1 min, one run each, short windows
    python benchmarks/bench_host.py --source h264 --modes processes    # real decode: what a camera costs
    python benchmarks/bench_host.py --profile  # needs py-spy (scripts/install-bench-deps.sh installs it)
Another checkout: run this file with that checkout first on PYTHONPATH (the JSON says which `engine` ran).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import resource
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("engine") is None:  # not on PYTHONPATH: this file's own checkout
    sys.path.insert(0, str(ROOT))

SIZES = {"720p": (1280, 720), "240p": (320, 240), "180p": (320, 180)}
SOURCES = ("synthetic", "h264")
CLIP_S = 10  # seconds of the h264 source's clip, looped: a reopen per pass is noise, and 720p60 encodes in ~15 s
RAW_VARIANTS = (("render", 1, False), ("render_copy", 1, True), ("render_copy_x8", 8, True))
PROFILED = [("live", 48, "240p"), ("live", 8, "720p"), ("live", 48, "720p")]
SPY_MODES = {"gil": ["--gil"], "idle": ["--idle"]}
MODES = ("threads", "processes")
CURVE = (8, 16, 32, 48, 64)  # streams of 240p60: published/s must not fall along it
SMALL = (16, "180p", 250)  # small frames at a high rate: 4,000/s offered, the issue's budget for this machine
GROUPS = (("source-", "ingest"), ("engine-core", "core"), ("worker-", "workers"), ("output-", "output"),
          ("publisher", "publisher"), ("ingest", "ingest_io"), ("MainThread", "main"))
ROLES = ("ingest", "ingest_io", "core", "workers", "output", "publisher", "native", "main", "other", "aux")
# Issue 33's targets on this machine: (what, row key, comparison, bound)
TARGETS = {
    "live 48x240p@60": [(">= 2,600 published/s of 2,880", "published_fps", ">=", 2600),
                        ("published/ingested >= 0.97", "published_over_ingested", ">=", 0.97),
                        ("crossing p99 <= 2 ms", "crossing_p99_ms", "<=", 2.0)],
    "live 48x720p@60": [("published/ingested >= 0.95", "published_over_ingested", ">=", 0.95),
                        # the same target read as the issue's "today" figures count (frames that got into the
                        # engine): ingested less those dropped at the source before any copy
                        ("published/admitted >= 0.95", "published_over_admitted", ">=", 0.95),
                        (">= 1,000 published/s", "published_fps", ">=", 1000)],
    f"live {SMALL[0]}x{SMALL[1]}@{SMALL[2]}": [("published/offered >= 0.9", "published_over_offered", ">=", 0.9)],
}


def thread_group(name: Optional[str]) -> str:
    """The engine's threads by role, from the names it gives them; unnamed ones are native (ZeroMQ's I/O)."""
    return "native" if name is None else next((g for prefix, g in GROUPS if name.startswith(prefix)), "other")


def native_group(comm: str) -> str:
    """A thread Python did not start, by the name the kernel holds for it: FFmpeg's decoder threads name
    themselves `av:<codec>:<kind><n>` (`av:h264:df0`): with ingest threads they decode a source thread's
    stream, so they are ingest; the rest (ZeroMQ's `ZMQbg/*`) native."""
    return "ingest" if comm.startswith("av:") else "native"


def thread_comm(tid: int) -> str:
    """This process's thread `tid`'s kernel name ('' once it is gone)."""
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def process_role(cmdline: str, parent_is_engine: bool) -> str:
    """A process below the engine: multiprocessing's helpers (`aux`: the resource tracker; the forkserver,
    which is the engine's child, whereas the ingest processes it forks carry its command line one level
    lower) or an ingest process."""
    if "resource_tracker" in cmdline or ("forkserver" in cmdline and parent_is_engine):
        return "aux"
    return "ingest"


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def ingest_key_supported() -> bool:
    """Whether this tree's config has issue 33's `ingest` section (`ingest.processes`)."""
    from engine.config import EngineConfig
    return "ingest" in EngineConfig.model_fields


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
        t = os.times()
        return json.dumps({"received": self.received, "disorder": self.disorder, "p50_ms": pct(lat, 50),
                           "p99_ms": pct(lat, 99), "cpu_s": t.user + t.system})


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q / 100))] if sorted_values else math.nan


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
    if sc.get("source", "synthetic") == "h264":  # every stream the same clip, looped (h264_clips made it)
        streams = [{"id": f"s{i}", "url": sc["clip"], "mode": mode, "loop": True} for i in range(sc["streams"])]
    else:
        streams = [{"id": f"s{i}", "url": f"synthetic://shapes?size={w}x{h}&fps={sc['fps']}&seed={i}", "mode": mode}
                   for i in range(sc["streams"])]
    tree = {"streams": streams, "max_streams": max(64, sc["streams"]),
            "models": {"noop": {"per_frame_s": 0, "max_batch": sc["max_batch"], "workers": 1}},
            # 5 s (default): a frame the host delivers up to a second late (the pacer's catch-up bound) still
            # meets it; --budget-ms sets a real one (frames past it are dropped, at the source where they can be)
            "budget": {"latency_ms": sc.get("budget_ms", 5000)}, "qos": {"ladder": False}, "shutdown_timeout_s": 3,
            "publish": {"endpoint": endpoint, "hwm": 100000, "min_subscribers": 1, "wait_subscribers_s": 20},
            "metrics": {"enabled": False}, "control": {"enabled": False}}
    if sc.get("ingest") is not None:  # absent on trees before issue 33 (threads are all they have)
        tree["ingest"] = {"processes": sc["ingest"]}
    return tree


class CrossingProbe:
    """The time from a frame's write (by an ingest thread or process) to the core's scheduler taking it:
    the pool scheduler's `add` is wrapped (two monotonic reads and appends per frame on the core thread,
    about a microsecond), recording only while `on`. The write stamp: `t_written` (FrameMeta's field or
    `extra` key, set by the ingest process when its slot copy ends) where the tree has one, else `t_decoded`
    (the ring write: the same moment with ingest threads; with processes, the core's commit of the
    descriptor, so the socket hop is left out: a lower bound). `since_capture` (live only) is from the
    capture stamp (a paced source's due time) instead: the same crossing plus the ingest's own wake-up
    lateness and copy, an upper bound in both modes. A write stamp of 0 (not set) is counted apart."""

    def __init__(self, pool, hub=None) -> None:
        """`hub`: the engine's IngestHub (processes mode): the crossing is also split at its commit (the hub's
        `_commit`, wrapped like `add`): `hop` = ingest write -> the core's I/O thread commits the descriptor,
        `in_core` = that commit -> the scheduler (the core's wake-up and step)."""
        self.on, self.values, self.since_capture, self.unstamped, self.stamp = False, [], [], 0, None
        self.hop, self.in_core, self._committed = [], [], {}
        add = pool.scheduler.add
        if hub is not None:  # processes: the crossing split at the core's I/O thread taking the descriptor
            commit = hub.leases._commit

            def probed_commit(lease, msg):
                if self.on and msg.t_written:
                    now = time.monotonic()
                    self.hop.append(now - msg.t_written)
                    if len(self._committed) < 100_000:  # bounded: a frame never scheduled leaves its entry
                        self._committed[(msg.stream, msg.seq)] = now
                return commit(lease, msg)
            hub.leases._commit = probed_commit

        def probed(fv, *args, **kwargs):
            if self.on:
                now, meta = time.monotonic(), fv.meta
                t_commit = self._committed.pop((meta.stream, meta.seq), None)
                if t_commit is not None:
                    self.in_core.append(now - t_commit)
                t_written = getattr(meta, "t_written", None) or meta.extra.get("t_written")
                if t_written is not None and not math.isfinite(t_written):  # written in the engine process
                    t_written = None
                stamp = t_written or meta.t_decoded
                self.stamp = self.stamp or ("t_written" if t_written else "t_decoded")
                if stamp:
                    self.values.append(now - stamp)
                else:
                    self.unstamped += 1
                if math.isfinite(meta.t_capture_mono) and meta.live:
                    self.since_capture.append(now - meta.t_capture_mono)
            return add(fv, *args, **kwargs)
        pool.scheduler.add = probed

    def stats(self) -> dict:
        v, c = sorted(self.values), sorted(self.since_capture)
        out = {f"crossing_p{q}_ms": round(pct(v, q) * 1e3, 3) for q in (50, 99)}
        out.update({f"capture_to_scheduler_p{q}_ms": round(pct(c, q) * 1e3, 3) for q in (50, 99)})
        # processes: the hop (ingest write -> the core's I/O thread) and in-core (its commit -> the scheduler)
        for name, vals in (("hop", sorted(self.hop)), ("in_core", sorted(self.in_core))):
            out.update({f"{name}_p{q}_ms": round(pct(vals, q) * 1e3, 3) for q in (50, 99)} if vals else {})
        return {**out, "crossing_max_ms": round(v[-1] * 1e3, 3) if v else math.nan, "crossing_frames": len(v),
                "crossing_unstamped": self.unstamped, "crossing_from": self.stamp}


def descendants(skip: set[int]) -> dict[int, dict]:
    """Every process below this one (ingest processes, multiprocessing's helpers) but `skip`: role, CPU s."""
    import psutil
    me, out = os.getpid(), {}
    for p in psutil.Process().children(recursive=True):
        if p.pid in skip:
            continue
        try:
            with p.oneshot():
                t, cmd, ppid = p.cpu_times(), " ".join(p.cmdline()), p.ppid()
        except psutil.Error:  # exited between the listing and the read: its CPU is lost (counted apart)
            continue
        out[p.pid] = {"role": process_role(cmd, ppid == me), "cpu_s": t.user + t.system, "cmd": cmd[:160]}
    return out


def sample(eng, sub: SubscriberProcess) -> dict:
    """Every counter at one moment: the ledger, CPU (process, per thread group, child processes, machine)."""
    import psutil
    acct, t0 = eng.pools["noop"].acct, time.monotonic()
    snaps = [acct.snapshot(s) for s in acct.streams()]  # under 48 busy streams this alone can take ~1 s
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups: Counter = Counter()
    for th in psutil.Process().threads():
        name = names.get(th.id)
        group = thread_group(name) if name is not None else native_group(thread_comm(th.id))
        groups[group] += th.user_time + th.system_time
    sizes = [m.batch_sizes for m in eng.pools["noop"].slots.models]  # NoopRunner's record of its batches
    t, cpu = os.times(), psutil.cpu_times()
    return {"t": time.monotonic(), "sample_s": time.monotonic() - t0, "cpu_s": t.user + t.system, "groups": groups,
            "procs": descendants({sub.proc.pid}),
            "ingested": sum(s.ingested for s in snaps), "published": sum(s.published for s in snaps),
            # frames dropped at the source before any copy (no credit, or past their deadline): ingested in the
            # ledger, never admitted into a slot (a tree without the counter: 0)
            "at_source": sum(getattr(r, "at_source", 0) for r in list(eng.pools["noop"].rings.values())),
            "dropped": sum((Counter(s.dropped) for s in snaps), Counter()),
            "failed": sum((Counter(s.failed) for s in snaps), Counter()),
            "batches": sum(len(b) for b in sizes), "batched": sum(sum(b) for b in sizes),
            "machine_busy_s": sum(cpu) - cpu.idle - cpu.iowait, "load1": os.getloadavg()[0], "sub": sub.mark()}


def process_cpu(a: dict, b: dict) -> tuple[Counter, list[dict]]:
    """CPU s in the window by process role: a process started in it counts from 0; one that ended in it
    is lost (listed with `exited`)."""
    by_role: Counter = Counter()
    listed = []
    for pid, p in b.items():
        used = p["cpu_s"] - a.get(pid, {}).get("cpu_s", 0.0)
        by_role[p["role"]] += used
        listed.append({"pid": pid, "role": p["role"], "cpu_s": round(used, 3), "cmd": p["cmd"]})
    listed += [{"pid": pid, "role": p["role"], "exited": True} for pid, p in a.items() if pid not in b]
    return by_role, listed


def window_stats(a: dict, b: dict, sc: dict) -> dict:
    dt, own_cpu = b["t"] - a["t"], b["cpu_s"] - a["cpu_s"]
    ing, pub = b["ingested"] - a["ingested"], b["published"] - a["published"]
    adm_less = b.get("at_source", 0) - a.get("at_source", 0)
    proc_cpu, procs = process_cpu(a["procs"], b["procs"])
    roles = {g: b["groups"][g] - a["groups"][g] for g in b["groups"]}  # not Counter +: it drops zeros
    for role, used in proc_cpu.items():
        roles[role] = roles.get(role, 0.0) + used
    cpu = own_cpu + sum(v for r, v in proc_cpu.items() if r == "ingest")  # the whole engine, aux helpers aside
    sub_cpu = b["sub"]["cpu_s"] - a["sub"]["cpu_s"]
    busy = (b["machine_busy_s"] - a["machine_busy_s"]) / dt
    per_frame = {g: round((b["groups"][g] - a["groups"][g]) / ing * 1e6, 1) if ing else None
                 for g in sorted(b["groups"])}
    offered = sc["streams"] * sc["fps"] if sc["kind"] == "live" else None
    return {
        "window_s": round(dt, 2), "sample_s": round(b["sample_s"], 2), "offered_fps": offered,
        "ingested_fps": ing / dt, "published_fps": pub / dt,
        "published_over_ingested": pub / ing if ing else None,
        "admitted_fps": (ing - adm_less) / dt,
        "published_over_admitted": pub / (ing - adm_less) if ing - adm_less > 0 else None,
        "published_over_offered": pub / dt / offered if offered else None,
        "received_fps": (b["sub"]["received"] - a["sub"]["received"]) / dt,
        "dropped_fps": {k: v / dt for k, v in (b["dropped"] - a["dropped"]).items()},
        "failed": dict(b["failed"] - a["failed"]), "batches_per_s": (b["batches"] - a["batches"]) / dt,
        "mean_batch": (b["batched"] - a["batched"]) / max(1, b["batches"] - a["batches"]),
        "cpu_cores": cpu / dt, "core_process_cores": own_cpu / dt, "published_per_cpu_s": pub / cpu if cpu else None,
        "cpu_us_per_ingested": cpu / ing * 1e6 if ing else None,
        "cpu_us_per_published": cpu / pub * 1e6 if pub else None,
        "thread_cpu_cores": {g: round((b["groups"][g] - a["groups"][g]) / dt, 3) for g in sorted(b["groups"])},
        "thread_cpu_us_per_ingested": per_frame,
        "role_cpu_cores": {r: round(roles[r] / dt, 3) for r in ROLES if r in roles},
        "role_cpu_us_per_published": {r: round(roles[r] / pub * 1e6, 1) if pub else None
                                      for r in ROLES if r in roles},
        "processes": procs,
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
        probe = CrossingProbe(eng.pools["noop"], getattr(eng, "ingest", None))
        t_started = time.monotonic()
        first_frames_s = wait_first_frames(eng, sc["streams"], sc.get("first_frames_timeout_s", 30.0))
        time.sleep(sc["warmup_s"])
        a = sample(eng, sub)
        # the crossing is recorded between the two samples, never during one: a sample's ledger snapshot holds the
        # ledger lock and the GIL for ~40 ms at 48 streams, and that stall is the benchmark's, not the engine's
        probe.on = True
        if sc.get("signal"):
            print("WARM", flush=True)  # the parent attaches the profiler now
        time.sleep(sc["window_s"])
        probe.on = False
        b = sample(eng, sub)
    finally:
        t_stop = time.monotonic()
        eng.stop(drain=False)
        final = sub.stop()
    out = {**window_stats(a, b, sc), **probe.stats(), "start_s": round(t_started - t0, 2),
           "first_frames_s": first_frames_s,
           "stop_s": round(time.monotonic() - t_stop, 2),
           "audit": eng.audit(),  # a leaked or double-counted frame shows here
           "order_errors": final["disorder"]}
    # the subscriber's count is its own (not the ledger's): what was counted published arrived, in order; and
    # every stream got frames in (a stream whose source failed to open publishes nothing, and 0 >= 0 holds)
    out["verified"] = (not out["audit"] and not out["order_errors"] and first_frames_s is not None
                       and out["received_fps"] >= 0.8 * out["published_fps"] - 5)
    return out


def wait_first_frames(eng, streams: int, timeout_s: float) -> Optional[float]:
    """Seconds until every stream has a frame in the ledger (None: not within `timeout_s`), so the warm-up
    starts when frames flow: ingest processes take a while to start (forkserver, `av` preloaded), threads
    do not, and a fixed warm-up would give the two modes different amounts of it."""
    acct, t0 = eng.pools["noop"].acct, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        names = acct.streams()
        if len(names) >= streams and all(acct.snapshot(s).ingested for s in names):
            return round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    return None


def looped_clip(stream_id: str, path: str) -> Iterator:
    """The clip's frames through the engine's file source (PyAV: demux, decode, RGB), from the start again at its
    end, as a `loop: true` stream reads it (the ingest reopens the file)."""
    from streams.pyav import FileSource
    while True:
        src = FileSource(stream_id, path)
        src.live = True  # as the engine sets it for a live stream (a file decodes alike either way)
        try:
            yield from src.frames()
        finally:
            src.close()


def raw_rate(size: str, sources: int, copy: bool, window_s: float, clip: Optional[str] = None) -> dict:
    """`sources` sources through `frames()` (what ingest threads iterate) in turn, on one thread (FFmpeg's own
    threads aside: their CPU is this process's, counted); synthetic ones, or with `clip` the file source on it
    (demux, decode, RGB conversion); with `copy`, each frame then copied into the next of 16 torch-allocated
    slots of its source, as the ring does (x8: the working set of 8 streams, whose backgrounds and slots do not
    fit the caches, so a copy costs more than into one hot slot; 48 streams' would take seconds to set up)."""
    import numpy as np
    import torch
    from streams.synthetic import SyntheticSource
    w, h = SIZES[size]
    its = [looped_clip(f"raw{i}", clip) if clip else
           SyntheticSource(f"raw{i}", f"synthetic://shapes?size={w}x{h}&fps=60&seed={i}").frames()
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
    out: dict[str, Any] = {label: raw_rate(sc["size"], n, copy, sc["window_s"], sc.get("clip"))
                           for label, n, copy in RAW_VARIANTS}
    out["copy_us_per_frame"] = out["render_copy"]["cpu_us_per_frame"] - out["render"]["cpu_us_per_frame"]
    return {**out, "load1": [round(os.getloadavg()[0], 2)]}


# -- the parent: scenarios in subprocesses -----------------------------------------------------------
def scenarios(args) -> tuple[list[dict], list[dict]]:
    """(raw scenarios, engine scenarios without a mode). --quick: the target scenarios and the curve's ends."""
    base = {"warmup_s": args.warmup, "window_s": args.window, "max_batch": args.max_batch, "fps": 60,
            "budget_ms": args.budget_ms, "source": args.source}
    curve = (CURVE[0], 48) if args.quick else CURVE
    live = [(n, "240p", 60) for n in curve] + [(8, "720p", 60)] * (not args.quick) + [(48, "720p", 60), SMALL]
    offline = ("240p",) if args.quick else ("720p", "240p")
    raw = [{**base, "kind": "raw", "streams": 1, "size": s, "warmup_s": 0, "window_s": args.window / 3}
           for s in (("240p",) if args.quick else ("720p", "240p"))]
    engine = [{**base, "kind": "live", "streams": n, "size": s, "fps": fps} for n, s, fps in live]
    engine += [{**base, "kind": "offline", "streams": 4, "size": s} for s in offline]
    keep = lambda sc: not args.only or args.only in name_of(sc)  # noqa: E731
    return [sc for sc in raw if keep(sc)], [sc for sc in engine if keep(sc)]


def name_of(sc: dict) -> str:
    if sc["kind"] == "raw":
        return f"raw {sc['size']}"
    return f"{sc['kind']} {sc['streams']}x{sc['size']}" + (f"@{sc['fps']}" if sc["kind"] == "live" else "")


def with_mode(sc: dict, mode: str, processes: Any, key: bool) -> dict:
    """The scenario in `mode`; `key`: the tree has `ingest.processes` (0 = ingest threads in the engine)."""
    return {**sc, "mode": mode, "ingest": (0 if mode == "threads" else processes) if key else None}


def result_of(stdout: str) -> Optional[dict]:
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("RESULT ")), None)
    return json.loads(line[len("RESULT "):]) if line else None


def run_child(sc: dict, timeout_s: float, spy: Optional[dict] = None) -> dict:
    """One scenario in a subprocess, killed past `timeout_s`. `spy` (path, rate, mode, exe): py-spy records
    the engine process once it is warm, for the window less a second (the shutdown is not sampled)."""
    t0, expired, spied = time.monotonic(), threading.Event(), None
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, __file__, "--child", json.dumps({**sc, "signal": bool(spy)})],
                             stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(timeout_s, lambda: (expired.set(), p.kill()))
        timer.start()
        try:
            lines = []
            for line in p.stdout:
                lines.append(line)
                if spy and line.strip() == "WARM":
                    spied = attach_spy(p.pid, max(1, int(sc["window_s"]) - 1), **spy)
            p.wait()
        finally:
            timer.cancel()
        err.seek(0)
        stderr = err.read()
    if expired.is_set():
        return {"error": f"timed out after {timeout_s:.0f} s"}
    res = result_of("".join(lines))
    if p.returncode != 0 or res is None:
        return {"error": f"exit {p.returncode}", "stderr_tail": stderr[-1500:]}
    return {**res, "child_wall_s": round(time.monotonic() - t0, 1), **({"spy": spied} if spy else {})}


def attach_spy(pid: int, seconds: int, *, path: str, rate: int, mode: str, exe: str) -> dict:
    """py-spy on `pid` for `seconds`; its CPU (this process's reaped children's, across its run) is kept:
    on 2 cores it competes with what it measures."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run([exe, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(rate),
                          "--format", "raw", "--threads", "--full-filenames", "--nonblocking", "-o", path,
                          *SPY_MODES[mode]], capture_output=True, text=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    errors = next((int(w.split()[-1]) for w in run.stdout.splitlines() if "Errors:" in w), 0)
    return {"path": path, "seconds": seconds, "rate_hz": rate, "mode": mode, "rc": run.returncode,
            "errors": errors, "cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 3),
            "behind": [ln.strip() for ln in run.stdout.splitlines() if "behind" in ln][-3:],
            "stderr_tail": run.stderr[-300:]}


def gil_share(text: str, rate: int, seconds: int, errors: int = 0) -> float:
    """Samples with a GIL holder / sampling intervals, from `py-spy record --gil --format raw` output."""
    held = sum(int(line.rpartition(" ")[2]) for line in text.splitlines() if line.rpartition(" ")[0])
    return held / max(1, rate * seconds - errors)


def gil_record(res: dict) -> dict:
    """A GIL run's summary: the share, GIL us per published frame by role, py-spy's own CPU."""
    spy = res.get("spy") or {}
    path = Path(spy.get("path", "/nonexistent"))
    if "error" in res or spy.get("rc") != 0 or not path.exists():
        return {"error": res.get("error") or f"py-spy exit {spy.get('rc')}: {spy.get('stderr_tail', '')}"}
    text, s = path.read_text(), spy["seconds"]
    prof = summarize_profile(text, "gil", spy["rate_hz"], s, res["published_fps"] * s)
    path.unlink()
    return {"gil_held_share": round(gil_share(text, spy["rate_hz"], s, spy["errors"]), 3),
            "gil_us_per_published": prof["by_group"], "top_self": prof["top_self"][:10],
            "spy_cpu_cores": round(spy["cpu_s"] / s, 3), "rate_hz": spy["rate_hz"], "seconds": s,
            "errors": spy["errors"], "behind": spy["behind"]}


def engine_info() -> dict:
    import engine
    import torch
    here = Path(engine.__file__).resolve().parents[1]
    git = ["git", "-C", str(here)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "engine", "streams"], capture_output=True, text=True).stdout
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return {"engine_file": engine.__file__, "commit": commit or None, "engine_or_streams_modified": bool(dirty.strip()),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.platform(),
            "cpus": os.cpu_count(), "cpu_model": cpu_model}


def spy_exe() -> Optional[str]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return exe if Path(exe).exists() else None


def main_bench(args) -> None:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: a comma-separated list of {MODES}, got {args.modes!r}")
    key = ingest_key_supported()
    record = {"date": now_utc(), **engine_info(), "args": vars(args), "modes": modes, "skipped_modes": {},
              "rows": [], "complete": False}
    if "processes" in modes and not key:
        record["skipped_modes"]["processes"] = "this tree's config has no `ingest` key (issue 33 not in it)"
        modes.remove("processes")
        print("processes mode: not in this tree (engine/config.py has no `ingest` key): skipped", flush=True)
    spy = spy_exe() if args.gil else None
    if args.gil and spy is None:
        raise SystemExit("bench_host --gil needs py-spy: bash scripts/install-bench-deps.sh (or pip install py-spy)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw_scs, engine_scs = scenarios(args)
    with h264_clips(raw_scs + engine_scs, args.clip_s) as source:  # made before any timing, removed after all
        record["source"] = source
        print(f"source: {describe_source(source)}", flush=True)
        print(HEADER)
        raw: dict[str, dict] = {}
        for rep in range(args.repeats):  # all scenarios, then all again: the runs of one see different moments
            for sc in raw_scs:
                res = run_child(sc, sc["window_s"] * len(RAW_VARIANTS) + args.box)
                raw[sc["size"]] = res if "error" not in res else raw.get(sc["size"], {})
                add_row(record, out, {"scenario": name_of(sc), "mode": "-", "run": rep + 1, "pass": "timing",
                                      "spec": sc, **res})
            for sc in engine_scs:
                for mode in (modes if rep % 2 == 0 else modes[::-1]):  # alternated: neither mode always goes first
                    msc = with_mode(sc, mode, args.processes, key)
                    res = run_child(msc, sc["warmup_s"] + sc["window_s"] + args.box)
                    add_overhead(res, raw.get(sc["size"]))
                    add_row(record, out, {"scenario": name_of(sc), "mode": mode, "run": rep + 1, "pass": "timing",
                                          "spec": msc, **res})
        if spy:
            gil_pass(args, record, out, engine_scs, modes, key, spy)
    summarize(record)
    record["complete"] = True
    out.write_text(json.dumps(record, indent=2, default=str))
    print_report(record)
    print(f"\nwrote {out}")


def clip_folder() -> Path:
    """A new temporary folder in memory where the machine has one (/dev/shm, a tmpfs): the clips are then read
    from RAM, as a camera's packets come from a socket, never from a disk that could be slow or busy."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="bench_host_clips_", dir=shm if shm.is_dir() and os.access(shm, os.W_OK)
                                 else None))


def filesystem_of(path: Path) -> Optional[str]:
    """The type of the filesystem `path` is on (tmpfs, ext4, ...), from /proc/mounts' longest matching mount."""
    best, kind, p = "", None, str(path)
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3 or len(parts[1]) <= len(best):
            continue
        if p == parts[1] or p.startswith(parts[1].rstrip("/") + "/"):
            best, kind = parts[1], parts[2]
    return kind


def clips_module():
    return peers_module("clips")


def peers_module(name: str):
    """benchmarks/peers/<name>.py, by its path: this file is also loaded by path (tests, other checkouts), so
    benchmarks/ need not be on sys.path."""
    key = f"bench_host_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / "peers" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # before it runs: its dataclass looks its own module up there
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def h264_clips(scs: list[dict], seconds: int) -> Iterator[dict]:
    """For the h264 source: one clip per (size, fps) the scenarios use, encoded into clip_folder() before any
    scenario runs (the encoder's CPU stays out of every window), each scenario's `clip` set to its path; the
    folder removed on the way out, whatever happened. Yields what the JSON records as `source`."""
    if not any(sc.get("source") == "h264" for sc in scs):
        yield {"kind": "synthetic"}
        return
    clips, folder = clips_module(), clip_folder()
    try:
        made: dict[str, dict] = {}
        for size, fps in dict.fromkeys((sc["size"], sc["fps"]) for sc in scs):
            t0 = time.monotonic()
            path = clips.make_clip(clips.ClipSpec(*SIZES[size], fps, seconds), folder)
            encode_s = round(time.monotonic() - t0, 1)
            made[f"{size}@{fps}"] = {**clips.describe(path), "path": str(path), "encode_s": encode_s}
        for sc in scs:
            sc["clip"] = made[f"{sc['size']}@{sc['fps']}"]["path"]
        yield {"kind": "h264", "dir": str(folder), "filesystem": filesystem_of(folder), "clip_s": seconds,
               "x264": clips.X264, "clips": made}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def describe_source(source: dict) -> str:
    """One line on what the streams were, printed above the rows and the report."""
    if source["kind"] != "h264":
        return f"{source['kind']} (rendered by the ingest: no demux, decode or colour conversion)"
    clips = ", ".join(f"{k} {c['frames']} frames {c['bytes_per_s'] * 8 / 1e3:.0f} kb/s (encoded in {c['encode_s']} s)"
                      for k, c in source["clips"].items())
    return (f"h264 clips looped through PyAV (demux, decode, RGB), in {source['dir']} ({source['filesystem']}): "
            f"{clips or 'none needed'}")


def gil_pass(args, record: dict, out: Path, engine_scs: list[dict], modes: list[str], key: bool, spy: str) -> None:
    """One more run of each target scenario per mode, py-spy --gil on the engine process for its window."""
    for sc in (s for s in engine_scs if name_of(s) in TARGETS):
        for mode in modes:
            msc = with_mode({**sc, "window_s": max(sc["window_s"], 3.0)}, mode, args.processes, key)
            path = f"/tmp/bench_host_gil_{os.getpid()}_{sc['streams']}x{sc['size']}_{mode}.txt"
            res = run_child(msc, msc["warmup_s"] + msc["window_s"] + args.box,
                            spy={"path": path, "rate": args.rate, "mode": "gil", "exe": spy})
            res["gil"] = gil_record(res)
            res.pop("spy", None)
            add_row(record, out, {"scenario": name_of(sc), "mode": mode, "run": 1, "pass": "gil", "spec": msc, **res})


def add_overhead(res: dict, raw: Optional[dict]) -> None:
    """What the engine spends per frame beyond the source and its copy alone (this pass's raw row)."""
    if res.get("cpu_us_per_ingested") and raw and "render_copy_x8" in raw:
        ref = raw["render_copy_x8"]["cpu_us_per_frame"]
        res["overhead_us_per_frame"] = res["cpu_us_per_ingested"] - ref
        res["source_share_of_cpu"] = ref / res["cpu_us_per_ingested"]


def add_row(record: dict, out: Path, row: dict) -> None:
    record["rows"].append(row)
    print_row(row)
    out.write_text(json.dumps(record, indent=2, default=str))


# -- before / after: medians, targets, the curve -----------------------------------------------------
def med(rows: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    return statistics.median(vals) if vals else None


def summarize(record: dict) -> None:
    """`comparison` (medians per scenario and mode, processes / threads), `targets`, `curve`."""
    timing = [r for r in record["rows"] if r["pass"] == "timing" and r["mode"] != "-" and "error" not in r]
    gil = {(r["scenario"], r["mode"]): r["gil"] for r in record["rows"] if r["pass"] == "gil" and "gil" in r}
    keys = ("published_fps", "ingested_fps", "published_over_ingested", "published_over_offered", "cpu_cores",
            "admitted_fps", "published_over_admitted",
            "cpu_us_per_published", "crossing_p50_ms", "crossing_p99_ms", "capture_to_scheduler_p99_ms",
            "hop_p99_ms", "in_core_p99_ms",
            "latency_p99_ms")
    comparison: dict[str, dict] = {}
    for name in dict.fromkeys(r["scenario"] for r in timing):
        entry: dict[str, Any] = {}
        for mode in dict.fromkeys(r["mode"] for r in timing if r["scenario"] == name):
            rows = [r for r in timing if r["scenario"] == name and r["mode"] == mode]
            roles = {role: med([r["role_cpu_us_per_published"] for r in rows], role)
                     for role in ROLES if any(role in r["role_cpu_us_per_published"] for r in rows)}
            g = gil.get((name, mode), {})
            entry[mode] = {"runs": len(rows), **{k: med(rows, k) for k in keys},
                           "published_fps_runs": [round(r["published_fps"]) for r in rows],
                           "role_cpu_us_per_published": roles, "gil_held_share": g.get("gil_held_share"),
                           "crossing_from": sorted({str(r.get("crossing_from")) for r in rows}),
                           "verified": all(r["verified"] for r in rows)}
        if "threads" in entry and "processes" in entry and entry["threads"]["published_fps"]:
            entry["published_ratio"] = entry["processes"]["published_fps"] / entry["threads"]["published_fps"]
        comparison[name] = entry
    record["comparison"] = comparison
    record["targets"] = targets(timing)
    record["curve"] = curve(comparison)


def targets(timing: list[dict]) -> list[dict]:
    """Each target per mode: met when every run meets it (the worst run is shown beside the median). The
    crossing in processes mode without an ingest-side write stamp (`crossing_from` t_decoded: the core's
    commit) is only a lower bound: met if the upper bound (capture -> scheduler) meets it, not met if the
    lower bound misses, undetermined (None) between."""
    out = []
    for name, checks in TARGETS.items():
        for mode in dict.fromkeys(r["mode"] for r in timing if r["scenario"] == name):
            rows = [r for r in timing if r["scenario"] == name and r["mode"] == mode]
            for what, key, op, bound in checks:
                met, worst = meets(rows, key, op, bound)
                entry = {"scenario": name, "mode": mode, "target": what, "key": key, "median": med(rows, key),
                         "worst": worst, "runs": len(rows), "met": met}
                if key == "crossing_p99_ms" and mode == "processes" and any(
                        r.get("crossing_from") != "t_written" for r in rows):
                    upper_met, upper = meets(rows, "capture_to_scheduler_p99_ms", op, bound)
                    entry.update(met=True if upper_met else (False if not met else None), bound="lower",
                                 upper_worst=upper)
                out.append(entry)
    return out


def meets(rows: list[dict], key: str, op: str, bound: float) -> tuple[bool, Optional[float]]:
    """(every row meets `key op bound`, the worst row's value)."""
    vals = [r.get(key) for r in rows]
    vals = [v if v is not None and not math.isnan(v) else None for v in vals]
    ok = [v is not None and (v >= bound if op == ">=" else v <= bound) for v in vals]
    worst = min(vals, key=lambda v: -math.inf if v is None else (v if op == ">=" else -v), default=None)
    return bool(ok) and all(ok), worst


def curve(comparison: dict) -> dict:
    """Published/s (median) per stream count of 240p60, per mode; `no_collapse`: no count publishes less than
    the best earlier one by more than peers/curve.py's COLLAPSE_TOLERANCE."""
    out = {}
    for mode in MODES:
        points = [(n, comparison.get(f"live {n}x240p@60", {}).get(mode, {}).get("published_fps")) for n in CURVE]
        points = [(n, v) for n, v in points if v is not None]
        if len(points) < 2:
            continue
        check = peers_module("curve")
        falls = check.falls_at(points)
        out[mode] = {"published_fps": {n: round(v) for n, v in points}, "falls_at": falls, "no_collapse": not falls,
                     "tolerance": check.COLLAPSE_TOLERANCE}
    return out


# -- printing ------------------------------------------------------------------------------------------
def fmt(x: Any, spec: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


HEADER = (f"{'scenario':<18}{'mode':<10}{'#':>2}{'offer/s':>8}{'ingest/s':>9}{'publ/s':>8}{'cores':>6}"
          f"{'publ/cpu-s':>11}{'us/frame':>9}{'ovh':>6}{'batch':>6}{'p50ms':>7}{'load1':>6}{'others':>7}  dropped/s")
ROLE_COLS = ("ingest", "ingest_io", "core", "workers", "output", "publisher", "native", "other")


def print_row(r: dict) -> None:
    head = f"{r['scenario']:<18}{r['mode']:<10}{r['run']:>2}"
    if "error" in r:
        print(f"{head}  ERROR {r['error']}", flush=True)
    elif r["spec"]["kind"] == "raw":
        x, c1, c8 = (r[k] for k, _, _ in RAW_VARIANTS)
        print(f"{head}{'':>8}{x['fps']:>9.0f}{'':>8}{1.0:>6.2f}{x['frames_per_cpu_s']:>11.0f}"
              f"{x['cpu_us_per_frame']:>9.0f}"
              f"   {'decode' if r['spec'].get('source') == 'h264' else 'render'} + copy: "
              f"{c1['cpu_us_per_frame']:.0f} us/frame, x8 streams {c8['cpu_us_per_frame']:.0f}",
              flush=True)
    else:
        drops = " ".join(f"{k}={v:.3g}" for k, v in sorted(r["dropped_fps"].items())) or "0"
        drops += "" if r["verified"] else "  NOT VERIFIED (audit, order or received: see the JSON)"
        gil = f"  GIL {r['gil'].get('gil_held_share', r['gil'].get('error'))}" if "gil" in r else ""
        print(f"{head}{fmt(r['offered_fps']):>8}{r['ingested_fps']:>9.0f}{r['published_fps']:>8.0f}"
              f"{r['cpu_cores']:>6.2f}"
              f"{fmt(r['published_per_cpu_s']):>11}{fmt(r['cpu_us_per_ingested']):>9}"
              f"{fmt(r.get('overhead_us_per_frame')):>6}{r['mean_batch']:>6.1f}{fmt(r['latency_p50_ms'], '.1f'):>7}"
              f"{r['load1'][0]:>6.2f}{r['others_busy_cores']:>7.2f}  {drops}{gil}", flush=True)


def print_report(record: dict) -> None:
    print(f"\nengine: {record['engine_file']} (commit {record['commit']}); {record['cpus']} CPUs "
          f"({record['cpu_model']}); skipped: {record['skipped_modes'] or 'nothing'}")
    print(f"source: {describe_source(record.get('source') or {'kind': 'synthetic'})}")
    print("\nmedians per scenario and mode; CPU us per published frame by role; x = crossing, ingest write -> "
          "scheduler (* the core's commit stamp: a lower bound), split (processes) into hop = write -> the core's "
          "commit and core = commit -> scheduler;\ncap = capture -> scheduler (an upper bound); "
          "GIL = the engine process's GIL-held share (--gil runs); P/T = published/s, processes / threads; "
          "pub/adm = published / admitted (ingested less the frames dropped at the source before any copy); "
          "pub/off = published / offered (live)")
    print(f"{'scenario':<18}{'mode':<10}{'n':>2}{'publ/s':>8}{'pub/off':>8}{'pub/ing':>8}{'pub/adm':>8}{'cpu us':>7}"
          + "".join(f"{c[:9]:>10}" for c in ROLE_COLS)
          + f"{'x p50ms':>8}{'x p99ms':>9}{'hop p99':>8}{'core p99':>9}{'cap p99':>8}{'GIL':>6}{'P/T':>6}")
    for name, entry in record["comparison"].items():
        for mode in MODES:
            e = entry.get(mode)
            if not e:
                continue
            roles = e["role_cpu_us_per_published"]
            ratio = fmt(entry.get("published_ratio"), ".2f") if mode == "processes" else ""
            star = "*" if mode == "processes" and e["crossing_from"] != ["t_written"] else " "
            print(f"{name:<18}{mode:<10}{e['runs']:>2}{fmt(e['published_fps']):>8}"
                  f"{fmt(e['published_over_offered'], '.3f'):>8}{fmt(e['published_over_ingested'], '.3f'):>8}"
                  f"{fmt(e.get('published_over_admitted'), '.3f'):>8}"
                  f"{fmt(e['cpu_us_per_published']):>7}"
                  + "".join(f"{fmt(roles.get(c)):>10}" for c in ROLE_COLS)
                  + f"{fmt(e['crossing_p50_ms'], '.2f'):>8}{fmt(e['crossing_p99_ms'], '.2f'):>8}{star}"
                  f"{fmt(e['hop_p99_ms'], '.2f'):>8}{fmt(e['in_core_p99_ms'], '.2f'):>9}"
                  f"{fmt(e['capture_to_scheduler_p99_ms'], '.2f'):>8}{fmt(e['gil_held_share'], '.2f'):>6}{ratio:>6}")
    src = (record.get("source") or {}).get("kind", "synthetic")
    print("\nissue 33's targets (met: every run)" + ("" if src == "synthetic" else
                                                     f"; set for the synthetic source, read here on {src}"))
    for t in record["targets"]:
        verdict = {True: "MET", False: "not met", None: "undetermined"}[t["met"]]
        bound = f"  (a lower bound; capture -> scheduler worst {fmt(t['upper_worst'], '.3g')})" if "bound" in t else ""
        print(f"  {t['scenario']:<18}{t['mode']:<10}{t['target']:<34}median {fmt(t['median'], '.3g'):>7}  "
              f"worst {fmt(t['worst'], '.3g'):>7}  {verdict}{bound}")
    for mode, c in record["curve"].items():
        print(f"  no collapse, {mode:<9} published/s {c['published_fps']}: "
              f"{'MET' if c['no_collapse'] else 'falls at ' + str(c['falls_at'])}")


# -- profile: py-spy on a running scenario --------------------------------------------------------
def profile_one(sc: dict, spy: str, rate: int, mode: str) -> dict:
    """Start the scenario, attach py-spy once it is warm, sample for the window. `gil`: only the thread
    holding the GIL (one at a time: the process's serial Python work, in us per ingested frame). `idle`:
    every thread, waiting ones too (where each spends its wall time, as a share of it: a thread that waits
    for a lock shows there). py-spy's default (active threads) is not used: on an oversubscribed machine it
    counts runnable threads waiting for a core or the GIL as busy."""
    path = f"/tmp/bench_host_spy_{os.getpid()}_{sc['streams']}x{sc['size']}_{mode}.txt"
    res = run_child(sc, sc["warmup_s"] + sc["window_s"] + 60, spy={"path": path, "rate": rate, "mode": mode,
                                                                 "exe": spy})
    spied = res.pop("spy", None) or {}
    if "error" in res or not Path(path).exists():
        return {"scenario": name_of(sc), "mode": mode, "error": f"{res.get('error')}; py-spy: {spied}"}
    s = spied["seconds"]
    return {"scenario": name_of(sc), "mode": mode, "rate_hz": rate, "window": res, "collapsed_stacks": path,
            **summarize_profile(Path(path).read_text(), mode, rate, s, res["ingested_fps"] * s)}


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
    thread group. gil: us per frame (of `frames`); idle: share of the group's samples."""
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
        out["gil_held_share"] = round(gil_share(text, rate, seconds), 3)
    return out


def main_profile(args) -> None:
    spy = spy_exe()
    if spy is None:
        raise SystemExit("bench_host --profile needs py-spy: bash scripts/install-bench-deps.sh "
                         "(or pip install py-spy)")
    base = {"warmup_s": args.warmup, "window_s": max(args.window, 10.0), "max_batch": args.max_batch, "fps": 60,
            "source": args.source}
    record = {"date": now_utc(), **engine_info(), "profiles": []}
    out = Path(args.out).with_name(Path(args.out).stem + "_profile.json")
    scs = [{**base, "kind": kind, "streams": n, "size": size} for kind, n, size in PROFILED]
    with h264_clips(scs, args.clip_s) as source:
        record["source"] = source
        for sc, mode in [(sc, m) for sc in scs for m in SPY_MODES]:
            profile_one_printed(record, out, sc, spy, args.rate, mode)
    print(f"\nwrote {out}")


def profile_one_printed(record: dict, out: Path, sc: dict, spy: str, rate: int, mode: str) -> None:
    """One profile, added to the record (rewritten at once) and its top lines printed."""
    prof = profile_one(sc, spy, rate, mode)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one run each, short windows, fewer scenarios (~1 min)")
    ap.add_argument("--profile", action="store_true", help="py-spy profiles instead of the timing matrix")
    ap.add_argument("--modes", default="threads,processes",
                    help="ingest modes to run each engine scenario in, alternated: threads (ingest.processes: 0), "
                         "processes (ingest.processes: --processes); default both (processes skipped where absent)")
    ap.add_argument("--processes", default="auto", help="ingest.processes in the processes mode (default auto)")
    ap.add_argument("--gil", action="store_true",
                    help="then one run of each target scenario per mode with py-spy --gil: the engine's GIL share")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the scenarios (default 2; --quick 1)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds before the window (default 2; --quick 1)")
    ap.add_argument("--window", type=float, default=5.0, help="timed window, s (default 5; --quick 1.5; --profile 10)")
    ap.add_argument("--max-batch", type=int, default=8, help="the null pool's max_batch (default 8, as gpu_check)")
    ap.add_argument("--budget-ms", type=float, default=5000.0,
                    help="the streams' latency budget (default 5000: the host measured, not deadlines)")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    ap.add_argument("--box", type=float, default=60.0, help="seconds a scenario may take beyond warm-up + window")
    ap.add_argument("--source", choices=SOURCES, default="synthetic",
                    help="synthetic (default: rendered frames, the host alone) or h264 (a libx264 clip per size and "
                         "rate in memory, looped through PyAV's demux, decode and RGB conversion: what a camera "
                         "costs)")
    ap.add_argument("--clip-s", type=int, default=CLIP_S,
                    help=f"--source h264: the clip's length, s (default {CLIP_S})")
    ap.add_argument("--out", default=None,
                    help="the JSON (default benchmarks/results/bench_host.json; with --source h264 "
                         "bench_host_h264.json, so the synthetic source's results are not overwritten)")
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
    if args.processes != "auto" and not (args.processes.isdigit() and int(args.processes) > 0):
        raise SystemExit(f"--processes: 'auto' or a positive count, got {args.processes!r}")
    args.processes = args.processes if args.processes == "auto" else int(args.processes)
    if args.clip_s < 1:
        raise SystemExit(f"--clip-s: at least 1 s, got {args.clip_s}")
    if args.out is None:
        args.out = str(ROOT / "benchmarks" / "results" / ("bench_host.json" if args.source == "synthetic"
                                                          else f"bench_host_{args.source}.json"))
    if args.quick:
        args.repeats, args.warmup, args.window = 1, 1.0, 1.5
    (main_profile if args.profile else main_bench)(args)


if __name__ == "__main__":
    main()
