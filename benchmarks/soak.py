"""Soak test: N minutes of four live streams under faults; fails if a resource of any process trends upward,
if a fault injection raises or never fires, or if a published result is neither received nor counted missed.

Runs the engine in-process with the real tiny classifier (timm test_vit, random weights,
2 workers x 1 thread on the CPU, pool `classify`) on four live streams, decoded in the engine's ingest
processes (ingest.processes: auto, the default; engine/ingest):
  cam0, cam1  synthetic://shapes 320x240 @ 15 fps
  cam2        RTSP from Debian's GStreamer server (tests/support/rtsp_server.py --pattern), killed and
              restarted every --rtsp-restart-s (first at that minus 30 s); a third synthetic
              stream when the server is not installed (the JSON says so)
  bad0        a looping H.264 file with ~2 % of its payload bytes flipped: corrupt bursts every loop
and meanwhile (the faults; each is counted when it fires and checked to have been recovered from):
  * a slow subscriber (20 ms per message, RCVHWM 50, 16 KiB SO_RCVBUF) reads every result; the
    engine's publisher socket gets a 16 KiB SO_SNDBUF (through the zmq Context passed to Engine)
    so the HWM, not megabytes of kernel buffer, absorbs the backlog: the messages it misses show up (missed),
  * `disconnect`: every --disconnect-every-s one synthetic stream is removed and re-added (same id)
    --reconnect-after-s later, round robin, through eng.control (as the control socket does); recovered when
    a result captured after the re-add is published,
  * `rtsp_restart`: the RTSP server killed and started again; recovered when cam2 publishes a frame captured
    after the restart,
  * `ingest_kill`: every --ingest-kill-every-s (first at --ingest-kill-offset-s) a random live ingest process
    (eng.ingest.pids()) is SIGKILLed by pid; recovered when its pid is gone, the engine counted a restart and
    every stream it held published a frame captured after the kill,
  * `worker_kill`: once, half-way, one batch of worker 0 raises (the pool must rebuild that worker and go on);
    recovered when exactly one worker was rebuilt and every stream published a frame captured after it.
An injection that raises, a fault that never fires, or one not recovered from within --recover-s is a failure, and
so is a recovery after which the engine holds more descriptors of some kind than just before the fault (checked at
the first sample after it: what a dead process or a removed stream held must be given back when the engine handles
it, not whenever Python's cyclic collector next runs a full collection, which the trend alone may or may not see).

Every --sample-s it samples, per process role:
  engine   RSS (raw, and again right after glibc's malloc_trim(0), so memory the allocator merely caches
           is not taken for a leak), open fds (and their kinds), threads (OS and Python), the rings' slot
           memory, Python's object count, glibc's heap (bytes in use vs free bytes the arenas hold), RSS by kind
           of mapping, the /dev/shm segments it maps (and those unlinked but still mapped: a leaked segment);
  ingest   every ingest process by pid (eng.ingest.pids(); a restarted process is a new pid): RSS, private
           (anonymous) RSS, fds, threads, summed over the role (the trend is the role's, across restarts);
  helpers  the engine's other descendants (multiprocessing's forkserver and resource tracker), summed; zombies;
  /dev/shm this engine's vidar-<run>-* segments: count and bytes,
and every stream's accounting. At every sample: Snapshot.balanced() (ingested == published + dropped + failed +
in_flight, where in_flight is counted from the frames the pipeline's holders really hold, so a leaked or
double-counted frame breaks it), eng.audit() == {} (the same check for every stream of every pool, under the pool's
ledger lock), 0 <= in_flight < 200, no counter ever decreases, engine not dead.
A removed stream's counters are forgotten by the engine once its eos is out, and a re-added id
counts from 0: the soak keeps what each removed incarnation counted (final by then: in_flight
must be 0) and judges every id over the whole run.

Delivery (DeliveryLedger): the publisher counts what a full subscriber misses (stats.missed, per stream; a live
result is sent to the subscribers with room and the full one misses it). The soak records every result the
publisher sent (Publisher.listener, called right after each send) with whether the publisher counted that send
missed, and every result the subscriber received, and matches them per stream in order. At the end, per stream:
received + missed-and-not-received == published (the engine's count) exactly, the ledger's own count of sends ==
published, and a result neither received nor counted missed fails the run (named: stream, seq). A send counted
missed that arrived anyway is reported (`missed_received`): the publisher's count is an upper bound by design
(engine/publish/delivery.py: after a lossy send a full subscriber is "suspect" and every send to it counts).

At the end (after eng.stop()): in_flight == 0 for every stream, the delivery equation, every fault fired and
recovered, no thread of ours or the engine's is left, no ingest process outlives the engine, and the engine's ZeroMQ
context terminates. Trends use the samples after the first 20 % (--warmup-frac): least-squares slopes; an RSS (the
engine's trimmed one, the ingest role's and the helpers' summed RSS) fails if it grows more than --rss-mb-per-10min (5)
and its last-quarter median is above the first-quarter median by more than --rss-noise-mb (2); fds / threads / shm
segments fail if their last-quarter median exceeds the first-quarter median by more than their noise (JUDGED).

Writes benchmarks/results/soak.json (samples, final counts, delivery, faults, slopes, checks, verdict, config,
date, machine), prints a table, exits 1 with the reasons on failure (0 on pass).

It applies the engine's malloc arena cap first (--malloc-arenas, default 2 as in the config; 0 for
glibc's default), before its own threads exist, as `vidar run` does. Without the RTSP server it
refuses to run unless --no-rtsp is given.

usage: .venv/bin/python benchmarks/soak.py [--minutes 30] [--sample-s 10] [--out PATH] [--no-rtsp]
                                           [--malloc-arenas 2] [--ingest-kill-every-s 60]
       (make soak; SOAK_MINUTES=5 make soak)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

T_SCRIPT = time.monotonic()

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import zmq  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.publish.client import Subscriber  # noqa: E402
from engine.config import build_config  # noqa: E402
from engine.core.engine import Engine  # noqa: E402
from engine.errors import ModelError  # noqa: E402
from engine.util.memory import heap_stats, limit_malloc_arenas, malloc_trim  # noqa: E402
from engine.testing.clips import corrupt_mdat, write_clip  # noqa: E402

log = logging.getLogger("soak")

POOL = "classify"  # the pool the soak drives (models.classify; topic classify.<stream>)
RTSP_SERVER = ROOT / "tests" / "support" / "rtsp_server.py"
SYSTEM_PY = "/usr/bin/python3"
SHM_DIR = "/dev/shm"
IN_FLIGHT_BOUND = 200
FAULTS = ("disconnect", "rtsp_restart", "ingest_kill", "worker_kill")
MB = 2 ** 20

# What the trend check judges after warm-up: (sample key, rule, noise). "rss": fails when the least-squares slope
# exceeds --rss-mb-per-10min AND the last-quarter median exceeds the first-quarter one by more than the noise
# (None: --rss-noise-mb); "count": fails when the last-quarter median exceeds the first-quarter one by more than the
# noise. The engine's RSS is the trimmed one when glibc is there (its raw RSS is shown, not judged). Another process's
# allocator cannot be trimmed from here: the ingest and helper roles are judged on raw RSS, summed over the role.
JUDGED = (
    ("rss_trimmed_mb", "rss", None), ("fds", "count", 2), ("threads_os", "count", 2), ("threads_py", "count", 2),
    ("ingest_rss_mb", "rss", None), ("ingest_fds", "count", 2), ("ingest_threads", "count", 2),
    ("helpers_rss_mb", "rss", None), ("helpers_fds", "count", 2), ("helpers_threads", "count", 2),
    ("zombies", "count", 0), ("shm_segments", "count", 0), ("shm_mb", "count", 1.0),
)
INFO = ("rss_mb", "ring_mb", "py_objects", "ingest_anon_mb", "ingest_procs", "engine_shm_unlinked_mapped")


def smaps_mb() -> Optional[dict]:
    """RSS by kind of mapping (Linux): file-backed (libraries, mmapped files, /dev/shm segments), the main heap,
    other anonymous memory (glibc's thread arenas, large mallocs, Python's object arenas, stacks)."""
    out = {"file": 0, "heap": 0, "anon": 0}
    try:
        with open("/proc/self/smaps") as f:
            kind = "anon"
            for line in f:
                head = line.split(None, 5)
                if "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                    name = head[5].strip() if len(head) > 5 else ""
                    kind = "heap" if name == "[heap]" else ("file" if name.startswith("/") else "anon")
                elif head[0] == "Rss:":
                    out[kind] += int(head[1])
    except OSError:
        return None
    return {k: round(v / 1024, 2) for k, v in out.items()}


def proc_status_mb(pid: int) -> dict:
    """RssAnon / RssFile / RssShmem of a process, in MB (/proc/<pid>/status; {} if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = line.split(":", 1)
                    out[k[3:].lower()] = round(int(v.split()[0]) / 1024, 2)
    except OSError:
        pass
    return out


def fd_kinds(pid: int | str = "self") -> Counter:
    """A process's open descriptors by kind (socket, pipe, anon_inode:[eventfd], /dev/shm, a file...): a rising
    count names what leaks."""
    kinds: Counter = Counter()
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return kinds
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            continue
        if target.startswith(("socket:", "pipe:")):
            kind = target.split(":", 1)[0]
        elif target.startswith(SHM_DIR + "/"):
            kind = "shm (unlinked)" if target.endswith("(deleted)") else "shm"
        elif target.startswith("anon_inode:"):
            kind = target
        else:
            kind = "file"
        kinds[kind] += 1
    return kinds


def engine_shm_maps() -> tuple[list[str], int]:
    """This process's /dev/shm/vidar-* mappings: their names, and how many are unlinked but still mapped (a
    segment whose last view outlived its stream holds its pages and a descriptor)."""
    names, unlinked = set(), 0
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if f"{SHM_DIR}/vidar-" in line:
                    path = line.split(None, 5)[-1].strip()
                    if path.endswith("(deleted)"):
                        unlinked += 1
                    names.add(os.path.basename(path.split(" ")[0]))
    except OSError:
        pass
    return sorted(names), unlinked


def shm_usage(prefix: Optional[str]) -> dict:
    """Segments under /dev/shm whose name starts with `prefix` (this engine's run), and all vidar-* ones (info: other
    engines on the machine, tests, make theirs)."""
    count = size = total = 0
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        entries = []
    for e in entries:
        if not e.name.startswith("vidar-"):
            continue
        total += 1
        if prefix and e.name.startswith(prefix):
            try:
                st = e.stat()
            except OSError:
                continue
            count += 1
            size += st.st_blocks * 512  # allocated, as tmpfs holds it (posix_fallocate'd: all of it)
    return {"shm_segments": count, "shm_mb": round(size / MB, 2), "shm_all_vidar": total}


def run_prefix(mapped: list[str]) -> Optional[str]:
    """`vidar-<run>-` from a segment name this engine maps (engine/ingest/slots.py names them vidar-<run>-<stream>-<n>)."""
    for name in mapped:
        parts = name.split("-")
        if len(parts) >= 4:
            return f"{parts[0]}-{parts[1]}-"
    return None


def proc_sample(p: psutil.Process) -> Optional[dict]:
    """RSS, private RSS, fds and threads of one process, or None when it is gone (or a zombie)."""
    try:
        with p.oneshot():
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            rec = {"pid": p.pid, "rss_mb": round(p.memory_info().rss / MB, 2), "fds": p.num_fds(),
                   "threads": p.num_threads(), "age_s": round(time.time() - p.create_time(), 1)}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    rec["anon_mb"] = proc_status_mb(p.pid).get("anon")
    return rec


def role_sums(prefix: str, procs: list[dict]) -> dict:
    return {f"{prefix}_procs": len(procs),
            f"{prefix}_rss_mb": round(sum(r["rss_mb"] for r in procs), 2),
            f"{prefix}_anon_mb": round(sum(r.get("anon_mb") or 0 for r in procs), 2),
            f"{prefix}_fds": sum(r["fds"] for r in procs),
            f"{prefix}_threads": sum(r["threads"] for r in procs)}


def versions() -> dict:
    """Versions of what shapes the process's memory, so runs can be compared."""
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": platform.python_version(), "libc": "-".join(platform.libc_ver())}
    for pkg in ("torch", "timm", "numpy", "av", "pyzmq", "msgpack", "opencv-python-headless"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- RTSP server -----------------------------------------------------------------------------
def rtsp_available() -> tuple[bool, str]:
    if not os.path.exists(SYSTEM_PY):
        return False, f"{SYSTEM_PY} not found"
    probe = "import gi; gi.require_version('GstRtspServer','1.0'); from gi.repository import GstRtspServer"
    r = subprocess.run([SYSTEM_PY, "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, "GStreamer RTSP server bindings missing (scripts/install-rtsp-deps.sh): " + \
            (r.stderr.strip().splitlines() or ["?"])[-1]
    return True, ""


class RtspServer:
    """tests/support/rtsp_server.py --pattern on a fixed port, restartable (same URL for the engine)."""

    def __init__(self, port: int, logdir: Path, fps: int, size: str):
        self.port, self.logdir, self.fps, self.size = port, logdir, fps, size
        self.proc: Optional[subprocess.Popen] = None
        self.url = f"rtsp://127.0.0.1:{port}/test"
        self.starts = 0

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def start(self, tries: int = 10) -> None:
        last = ""
        for _ in range(tries):
            self.starts += 1
            with open(self.logdir / f"rtsp_{self.starts}.log", "w") as err:  # the child keeps its own fd
                p = subprocess.Popen([SYSTEM_PY, str(RTSP_SERVER), "--port", str(self.port), "--pattern",
                                      "--fps", str(self.fps), "--size", self.size],
                                     stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True)
            ready, _, _ = select.select([p.stdout], [], [], 15)
            line = p.stdout.readline().strip() if ready else ""
            if line.startswith("READY "):
                self.proc = p
                return
            last = line or (self.logdir / f"rtsp_{self.starts}.log").read_text()[-300:]
            self._reap(p)
            time.sleep(0.5)  # the port may still be held by the previous server
        raise RuntimeError(f"RTSP server did not start on port {self.port}: {last}")

    @staticmethod
    def _reap(p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p.stdout:
            p.stdout.close()

    def stop(self) -> None:
        if self.proc is not None:
            self._reap(self.proc)
            self.proc = None


# -- delivery: every published result received or counted missed ----------------------------------
class DeliveryLedger:
    """Matches every result the publisher sent against what the subscriber received, per stream, so that a result
    neither received nor counted missed is found and named, not hidden in totals that happen to add up.

    `on_sent` runs on the publisher's thread (Publisher.listener: right after each send, results and events) with the
    publisher's `stats.missed` count of that stream: a send the publisher counted missed moved it (between two
    listener calls there is one send: a refused offline send counts nothing). The publisher forgets a removed stream's
    count; `forgotten` (called as it does, after the stream's last send) keeps it and starts the stream's count
    again from 0. `on_received` runs on the subscriber's thread. `match` runs on the main thread: one TCP
    connection delivers in the order sent and a missed message is simply absent, so a received key settles every
    send before it; both queues stay as short as the backlog between two matches."""

    def __init__(self):
        self._sent: dict[str, deque] = {}      # stream -> (key, counted_missed), publisher thread appends
        self._pending: dict[str, set] = {}     # stream -> keys in _sent (appended before added here)
        self._recv: dict[str, deque] = {}      # stream -> keys, subscriber thread appends
        self._last_missed: dict[str, int] = {}
        self.sent: Counter = Counter()         # publisher thread only: results sent, per stream
        self.sent_missed: Counter = Counter()  # publisher thread only: of them, counted missed by the publisher
        self.events_missed: Counter = Counter()  # publisher thread only: events counted missed, per stream
        self.publisher_missed_forgotten: Counter = Counter()  # stats.missed of removed incarnations (forgotten)
        self.last_capture: dict[str, float] = {}  # publisher thread only: newest t_capture published, per stream
        self.got: Counter = Counter()          # main thread only (match): received and matched
        self.missed_received: Counter = Counter()  # counted missed, received all the same (the count's slack)
        self.missed_lost: Counter = Counter()      # counted missed, not received
        self.lost_uncounted: Counter = Counter()   # neither received nor counted missed: a failure
        self.unknown: Counter = Counter()          # received, never recorded as sent: a failure
        self.examples: list[dict] = []             # the first lost_uncounted / unknown, named

    @staticmethod
    def key(msg: dict) -> tuple:
        return msg["seq"], msg["t_capture"]

    def on_sent(self, msg: dict, missed_now: int) -> None:
        stream = msg["stream"]
        counted = missed_now > self._last_missed.get(stream, 0)
        self._last_missed[stream] = missed_now
        if msg.get("type") == "event":
            self.events_missed[stream] += counted
            return
        k = self.key(msg)
        self._sent.setdefault(stream, deque()).append((k, counted))
        self._pending.setdefault(stream, set()).add(k)
        self.sent[stream] += 1
        self.sent_missed[stream] += counted
        self.last_capture[stream] = max(self.last_capture.get(stream, 0.0), msg["t_capture"])

    def forgotten(self, stream: str, missed: int) -> None:
        """The publisher forgot `stream`'s missed count (`missed`, its value then): its next incarnation counts from 0."""
        self.publisher_missed_forgotten[stream] += missed
        self._last_missed[stream] = 0

    def on_received(self, msg: dict) -> None:
        self._recv.setdefault(msg["stream"], deque()).append(self.key(msg))

    def _settle(self, stream: str, k: tuple, counted: bool, why: str) -> None:
        if counted:
            self.missed_lost[stream] += 1
        else:
            self.lost_uncounted[stream] += 1
            if len(self.examples) < 20:
                self.examples.append({"stream": stream, "seq": k[0], "t_capture": k[1], "why": why})

    def match(self, final: bool = False) -> None:
        """Settle what can be settled now; `final` (publisher and subscriber stopped): everything."""
        for stream in list(self._recv):
            recv, sent = self._recv[stream], self._sent.setdefault(stream, deque())
            pending = self._pending.setdefault(stream, set())
            while recv:
                k = recv[0]
                if k not in pending:  # its on_sent may not have run yet (the send comes first); at the end: never sent
                    if not final:
                        break
                    self.unknown[stream] += 1
                    if len(self.examples) < 20:
                        self.examples.append({"stream": stream, "seq": k[0], "t_capture": k[1],
                                              "why": "received, never recorded as published"})
                    recv.popleft()
                    continue
                while True:
                    sk, counted = sent.popleft()
                    pending.discard(sk)
                    if sk == k:
                        self.got[stream] += 1
                        self.missed_received[stream] += counted
                        break
                    self._settle(stream, sk, counted, "not received, and a later result was")
                recv.popleft()
        if final:
            for stream, sent in self._sent.items():
                while sent:
                    sk, counted = sent.popleft()
                    self._pending[stream].discard(sk)
                    self._settle(stream, sk, counted, "not received by the end")

    def unsettled(self) -> int:
        return sum(len(q) for q in self._sent.values())

    def check(self, published: dict[str, int], publisher_missed: dict[str, int]) -> list[str]:
        """After match(final=True): the per-stream equation against the engine's published counts, and the sends
        flagged missed here against the publisher's own count (`publisher_missed`: its stats.missed now)."""
        out = []
        for stream in sorted(set(self.sent) | set(publisher_missed) | set(self.publisher_missed_forgotten)):
            theirs = publisher_missed.get(stream, 0) + self.publisher_missed_forgotten[stream]
            ours = self.sent_missed[stream] + self.events_missed[stream]
            if theirs != ours:
                out.append(f"delivery: stream {stream}: the publisher counted {theirs} missed, the ledger flagged {ours} "
                           "sends missed (results and events)")
        for stream in sorted(set(published) | set(self.sent) | set(self.got)):
            pub, sent = published.get(stream, 0), self.sent[stream]
            got, lost = self.got[stream], self.missed_lost[stream]
            if sent != pub:
                out.append(f"delivery: stream {stream}: the publisher's listener saw {sent} results sent, the engine "
                           f"counted {pub} published")
            if got + lost != pub:
                out.append(f"delivery: stream {stream}: received {got} + counted missed and not received {lost} = "
                           f"{got + lost}, published {pub}")
            if self.lost_uncounted[stream]:
                out.append(f"delivery: stream {stream}: {self.lost_uncounted[stream]} results neither received nor "
                           "counted missed")
            if self.unknown[stream]:
                out.append(f"delivery: stream {stream}: {self.unknown[stream]} results received that were never "
                           "recorded as published")
        if out and self.examples:
            out.append(f"delivery: first unaccounted results: {self.examples[:5]}")
        return out

    def summary(self) -> dict:
        streams = sorted(set(self.sent) | set(self.got))
        return {s: {"published_seen": self.sent[s], "received": self.got[s],
                    "counted_missed": self.sent_missed[s], "missed_lost": self.missed_lost[s],
                    "missed_received": self.missed_received[s], "lost_uncounted": self.lost_uncounted[s],
                    "unknown": self.unknown[s]} for s in streams} | \
            {"_events_counted_missed": dict(self.events_missed), "_examples": self.examples}


# -- the slow subscriber ----------------------------------------------------------------------
class SlowSubscriber:
    """Reads every result and event, sleeping `delay_s` per message while `slow` is set. Keeps counts (results per
    stream, events per kind) and the last EVENTS_KEPT events, not every message: its memory is the engine
    process's too, and the soak judges that."""

    EVENTS_KEPT = 200

    def __init__(self, endpoint: str, delay_s: float, hwm: int, rcvbuf: int,
                 on_result: Callable[[dict], None] = lambda m: None):
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.RCVBUF, rcvbuf)  # applied to the socket before it connects
        self.sub = Subscriber(endpoint, topics=[f"{POOL}.", "event."], ctx=self.ctx, hwm=hwm)
        self.delay_s = delay_s
        self.on_result = on_result
        self.slow = threading.Event()
        self.slow.set()
        self._stop = threading.Event()
        self.results: Counter = Counter()
        self.events: deque = deque(maxlen=self.EVENTS_KEPT)
        self.event_kinds: Counter = Counter()
        self.max_latency_ms = 0.0
        self.last_latency_ms = 0.0
        self.errors = 0
        self.last_msg = time.monotonic()
        self._t = threading.Thread(target=self._run, name="soak-subscriber", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.sub.recv(timeout=0.2)
            except Exception:  # count and go on: a soak must not die on one bad message
                self.errors += 1
                continue
            if msg is None:
                continue
            self.last_msg = time.monotonic()
            if msg.get("type") == "event":
                self.event_kinds[msg["kind"]] += 1
                self.events.append({"t": time.time(), "stream": msg["stream"], "kind": msg["kind"],
                                    "reason": msg["reason"]})
            else:
                self.results[msg["stream"]] += 1
                self.on_result(msg)
                self.last_latency_ms = (time.time() - msg["t_capture"]) * 1e3
                self.max_latency_ms = max(self.max_latency_ms, self.last_latency_ms)
            if self.slow.is_set():
                time.sleep(self.delay_s)

    def drain_and_close(self, idle_s: float = 1.5, max_s: float = 10.0) -> None:
        self.slow.clear()
        t_end = time.monotonic() + max_s
        while time.monotonic() < t_end and time.monotonic() - self.last_msg < idle_s:
            time.sleep(0.1)
        self._stop.set()
        self._t.join(5)
        self.sub.close()
        self.ctx.term()

    @property
    def received(self) -> int:
        return sum(self.results.values())


# -- sampling and checks ----------------------------------------------------------------------
def snap_dict(s) -> dict:
    return {"ingested": s.ingested, "published": s.published, "dropped": dict(s.dropped), "failed": dict(s.failed),
            "in_flight": s.in_flight, "held": dict(s.held), "balanced": s.balanced(),
            "p50_ms": None if s.p50_ms != s.p50_ms else round(s.p50_ms, 1),
            "p99_ms": None if s.p99_ms != s.p99_ms else round(s.p99_ms, 1)}


def merge(parts: list[dict]) -> dict:
    """One stream id over its incarnations (removed ones first, the current one last): counters
    summed, balanced if every one is; in_flight, holders and latencies are the last one's."""
    out = dict(parts[-1], incarnations=len(parts))
    for k in ("ingested", "published"):
        out[k] = sum(p[k] for p in parts)
    for k in ("dropped", "failed"):
        out[k] = dict(sum((Counter(p[k]) for p in parts), Counter()))
    out["balanced"] = all(p["balanced"] for p in parts)
    return out


def publisher_stats(pub) -> dict:
    """A copy (the per-stream Counter inside goes on changing)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(pub.stats).items()}


def counters(s: dict) -> dict:
    out = {"ingested": s["ingested"], "published": s["published"]}
    out.update({f"dropped.{k}": v for k, v in s["dropped"].items()})
    out.update({f"failed.{k}": v for k, v in s["failed"].items()})
    return out


def slope_per_10min(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(ts), np.asarray(ys, dtype=float), 1)[0] * 600.0)


def quarter_medians(ys: list[float]) -> tuple[float, float]:
    q = max(1, len(ys) // 4)
    return float(np.median(ys[:q])), float(np.median(ys[-q:]))


def judge_trends(samples: list[dict], *, warmup_frac: float, rss_limit: float,
                 rss_noise: float) -> tuple[dict, list[str]]:
    """The trend of every JUDGED and INFO key over the samples after warm-up, and the failures (JUDGED's rules)."""
    post = samples[int(len(samples) * warmup_frac):]
    if len(post) < 4:
        return {}, [f"trend: only {len(post)} samples after warm-up; need 4 (run longer or lower --sample-s)"]
    ts = [s["t"] for s in post]
    judged = list(JUDGED)
    if any(s.get("rss_trimmed_mb") is None for s in post):  # no glibc: judge the raw RSS
        judged = [("rss_mb", "rss", None) if k == "rss_trimmed_mb" else (k, r, n) for k, r, n in judged]
    trend, failures = {}, []
    rules = {k: (r, n) for k, r, n in judged}
    for key in [k for k, _, _ in judged] + [k for k in INFO if k not in rules]:
        ys = [s.get(key) for s in post]
        if any(y is None for y in ys):
            continue
        q1, q4 = quarter_medians(ys)
        rule, noise = rules.get(key, (None, None))
        if rule == "rss" and noise is None:
            noise = rss_noise
        r = trend[key] = {"slope_per_10min": round(slope_per_10min(ts, ys), 3), "first_quarter_median": q1,
                          "last_quarter_median": q4, "min": min(ys), "max": max(ys), "noise": noise,
                          "judged": rule is not None}
        if rule == "rss" and r["slope_per_10min"] > rss_limit and q4 > q1 + noise:
            failures.append(f"trend: {key} grows {r['slope_per_10min']:.1f} MB per 10 min (limit {rss_limit:g}); "
                            f"median {q1:.1f} -> {q4:.1f} MB")
        elif rule == "count" and q4 > q1 + noise:
            failures.append(f"trend: {key} grows: median {q1:g} -> {q4:g} (noise {noise:g}; "
                            f"slope {r['slope_per_10min']:+.2f} per 10 min)")
    return trend, failures


# -- faults -------------------------------------------------------------------------------------
@dataclass
class Watch:
    """A fault fired at `t` (soak seconds): recovered once `done()` is true, a failure if not by `deadline`.
    `fds_before`: the engine's descriptors by kind just before it fired; the first sample after the recovery must
    show no kind above it (what the fault's dead process or removed stream held is given back when it is handled,
    not whenever the cyclic collector next runs a full collection)."""
    fault: str
    what: str
    t: float
    deadline: float
    done: Callable[[], bool]
    fds_before: Optional[Counter] = None


class FaultTally:
    """Per fault: scheduled, fired, recovered, errors (an injection that raised). `problems()` names every fault that
    was scheduled but never fired, raised, or fired without the engine recovering."""

    def __init__(self):
        self.counts = {f: Counter() for f in FAULTS}
        self.held: dict[str, Counter] = {f: Counter() for f in FAULTS}  # descriptors by kind left after recoveries

    def descriptors(self, fault: str, grew: dict) -> None:
        """The resource check after one recovery: `grew` (kind -> how many more than before the fault), {} if none."""
        self.add(fault, "fds_checked")
        if grew:
            self.add(fault, "fds_held")
            self.held[fault].update(grew)

    def add(self, fault: str, what: str, n: int = 1) -> None:
        self.counts[fault][what] += n

    def problems(self) -> list[str]:
        out = []
        for fault, c in self.counts.items():
            if not c["scheduled"]:
                continue
            if c["errors"]:
                out.append(f"faults: {fault}: {c['errors']} injection(s) raised")
            if c["fired"] <= 0:
                out.append(f"faults: {fault}: scheduled {c['scheduled']} time(s), never fired")
            elif c["fired"] < c["scheduled"] - c["errors"]:
                out.append(f"faults: {fault}: fired {c['fired']} of {c['scheduled']} scheduled")
            if c["fired"] and c["recovered"] < c["fired"]:
                out.append(f"faults: {fault}: recovered from {c['recovered']} of {c['fired']} fired")
            if c["fds_held"]:
                kinds = ", ".join(f"{k} +{v}" for k, v in sorted(self.held[fault].items()))
                out.append(f"faults: {fault}: after {c['fds_held']} of {c['fds_checked']} recoveries the engine held more "
                           f"descriptors than before the fault ({kinds} in all)")
        return out

    def as_dict(self) -> dict:
        return {f: dict(c, fds_held_by_kind=dict(self.held[f])) for f, c in self.counts.items()}


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.proc = psutil.Process()
        self.samples: list[dict] = []
        self.failures: list[str] = []
        self.notes: list[str] = []  # what the soak saw that its verdict does not judge
        self.server = None
        self.sub = None
        self.soak_s = self.stop_s = 0.0
        self.stop_error = None
        self.leftover_threads: list[str] = []
        self.leftover_ingest: list[dict] = []
        self.actions: list[dict] = []
        self.eng: Optional[Engine] = None
        self.t0 = 0.0
        self.rng = random.Random(args.seed)
        self.faults = FaultTally()
        self.watches: list[Watch] = []
        self.fd_checks: list[Watch] = []  # recovered, their descriptors checked at the next sample
        self.removed_fds: dict[str, Counter] = {}  # stream -> the engine's descriptors when it was removed
        self.ledger = DeliveryLedger()
        self.ingest_seen: dict[int, float] = {}  # pid -> create_time of every ingest process seen
        self.shm_prefix: Optional[str] = None
        self.kill_fired = threading.Event()
        self.kill_at: Optional[float] = None
        self.kill_fired_t: Optional[float] = None
        self.rebuilds_before: Optional[int] = None
        self.end_collection: Optional[dict] = None
        self.retired: dict[str, list[dict]] = {}  # stream id -> final counts of its removed incarnations

    def fail(self, why: str) -> None:
        if why not in self.failures:
            self.failures.append(why)
            log.error("FAIL: %s", why)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def ring_bytes(self) -> int:
        """Frame-slot memory the live streams' rings hold now."""
        return sum(ring.allocated_bytes() for st in self.eng.streams.values() if st.state != "removing"
                   for ring in st.rings.values())

    def keep_retired(self, acct, publisher) -> None:
        """The engine forgets a removed stream's counters once its eos is out; that is the one moment
        they are final, so record them then (engine core thread, under the ledger lock). Nothing of
        the incarnation may still be held: in_flight must be 0. The publisher forgets the stream's missed
        count at the same moment: the ledger keeps it (DeliveryLedger.forgotten)."""
        forget, pub_forget = acct.forget, publisher.forget

        def forget_and_keep(stream: str) -> None:
            with acct.lock:
                try:  # never let the soak's bookkeeping raise into the engine core
                    last = snap_dict(acct.snapshot(stream))
                    self.retired.setdefault(stream, []).append(last)
                    if last["in_flight"] or not last["balanced"]:
                        self.fail(f"t={self.elapsed():.0f}s: stream {stream} forgotten after removal with {last}")
                except Exception as err:
                    self.fail(f"recording the counts of removed stream {stream}: {type(err).__name__}: {err}")
                forget(stream)

        def publisher_forget(stream: str) -> None:
            try:  # its last send is out (the eos): nothing of the stream is counted between this read and the pop
                self.ledger.forgotten(stream, publisher.stats.missed.get(stream, 0))
            except Exception as err:
                self.fail(f"recording the missed count of removed stream {stream}: {type(err).__name__}: {err}")
            pub_forget(stream)
        acct.forget = forget_and_keep
        publisher.forget = publisher_forget

    def start_engine(self, cfg, ctx) -> Engine:
        """Engine(cfg).start() with the ledger listening from the publisher's first send: the publisher is made inside
        Engine.start, and the configured streams start before it returns, so the listener goes in as the publisher is
        made (a subclass in place of the name engine.core.engine uses, for the call only). Its `listener` attribute is
        the ledger's, calling whatever the engine sets there (the live view's) first. Checked after: a publisher made
        some other way fails here rather than leaving sends unrecorded."""
        import engine.core.engine as core_engine
        base, ledger = core_engine.Publisher, self.ledger

        class ListenedPublisher(base):
            def _soak_listener(self, msg: dict) -> None:
                try:
                    if self._soak_next is not None:
                        self._soak_next(msg)
                finally:  # the view's error is the publisher's to log; the send is recorded all the same
                    ledger.on_sent(msg, self.stats.missed.get(msg["stream"], 0))

            @property
            def listener(self):
                return self._soak_listener

            @listener.setter
            def listener(self, fn) -> None:
                self._soak_next = fn
        self.eng = eng = Engine(cfg, ctx=ctx)  # stopped by shutdown() even if start raises
        core_engine.Publisher = ListenedPublisher
        try:
            eng.start()
        finally:
            core_engine.Publisher = base
        if not isinstance(eng.publisher, ListenedPublisher):
            raise RuntimeError("the soak's listener is not on the engine's publisher (made elsewhere than "
                               "engine.core.engine.Publisher): deliveries cannot be checked")
        return eng

    def stream_counts(self) -> dict:
        """Every stream id's counts over the whole run (its removed incarnations included)."""
        acct = self.eng.pools[POOL].acct
        with acct.lock:  # forget_and_keep holds it too: no incarnation is missed or counted twice
            current = {sid: [snap_dict(acct.snapshot(sid))] for sid in acct.streams()}
            parts = {sid: list(v) for sid, v in self.retired.items()}
        for sid, snap in current.items():
            parts[sid] = parts.get(sid, []) + snap
        return {sid: merge(parts[sid]) for sid in sorted(parts)}

    def control(self, req: dict) -> dict:
        """A control request, as the control socket would pass it; a refusal is a finding."""
        reply = self.eng.control(req)
        if not reply["ok"]:
            raise RuntimeError(f"{req['op']}: {reply['error']}")
        return reply

    # -- sampling ---------------------------------------------------------------------------------
    def sample_processes(self) -> dict:
        """The ingest processes (by pid, from the engine) and the engine's other descendants (forkserver, resource
        tracker; the RTSP server is the soak's, left out), each role summed."""
        pids = self.eng.ingest.pids() if self.eng.ingest is not None else {}
        ingest = []
        for idx, pid in sorted(pids.items()):
            try:
                p = psutil.Process(pid)
                self.ingest_seen.setdefault(pid, p.create_time())
            except psutil.NoSuchProcess:
                continue
            rec = proc_sample(p)
            if rec is not None:
                ingest.append(dict(rec, idx=idx))
        server = self.server.pid if self.server is not None else None
        helpers, zombies = [], 0
        for p in self.proc.children(recursive=True):
            if p.pid in pids.values() or p.pid == server:
                continue
            try:
                if p.ppid() == server:
                    continue
                if p.status() == psutil.STATUS_ZOMBIE:
                    zombies += 1
                    continue
                name = " ".join(p.cmdline()[-1:])[:60]
            except psutil.NoSuchProcess:
                continue
            rec = proc_sample(p)
            if rec is not None:
                helpers.append(dict(rec, cmd=name))
        out = {"ingest": ingest, "helpers": helpers, "zombies": zombies}
        out.update(role_sums("ingest", ingest))
        out.update(role_sums("helpers", helpers))
        return out

    def sample(self) -> dict:
        eng = self.eng
        pool = eng.pools[POOL]
        self.ledger.match()
        streams = self.stream_counts()
        audit = eng.audit()  # every stream of every pool: counters vs the frames the holders hold
        t = self.elapsed()
        with self.proc.oneshot():
            rss = self.proc.memory_info().rss
            threads_os = self.proc.num_threads()
        trimmed = None
        if malloc_trim():  # what glibc keeps cached in its arenas is not a leak: give it back, then measure
            trimmed = round(self.proc.memory_info().rss / MB, 2)
        fds = fd_kinds()
        mapped, unlinked = engine_shm_maps()
        self.shm_prefix = self.shm_prefix or run_prefix(mapped)
        rec = {"t": round(t, 2), "rss_mb": round(rss / MB, 2), "rss_trimmed_mb": trimmed,
               "fds": sum(fds.values()), "fd_kinds": dict(fds),
               "threads_os": threads_os, "threads_py": threading.active_count(),
               "engine_rss_by_kind_mb": proc_status_mb(self.proc.pid),
               "engine_shm_mapped": len(mapped), "engine_shm_unlinked_mapped": unlinked,
               "live_streams": sorted(eng.live_streams()), "published": sum(s["published"] for s in streams.values()),
               "received": self.sub.received, "sub_latency_ms": round(self.sub.last_latency_ms, 1),
               "publisher": publisher_stats(eng.publisher), "publisher_pending": eng.publisher.pending(),
               "rebuilds": pool.slots.rebuilds, "audit": {p: {s: list(v) for s, v in b.items()} for p, b in audit.items()},
               "py_objects": len(gc.get_objects()), "ring_mb": round(self.ring_bytes() / MB, 2),
               "heap": heap_stats(), "smaps": smaps_mb(), "streams": streams,
               "ingest_counters": eng.ingest.counters() if eng.ingest is not None else None,
               # the cyclic collector: what is in reference cycles is freed only by its (full) collections
               "gc_collections": [g["collections"] for g in gc.get_stats()], "gc_count": list(gc.get_count())}
        rec.update(self.sample_processes())
        rec.update(shm_usage(self.shm_prefix))
        bad = eng.streams.get("bad0")
        if bad is not None and bad.ingest is not None:
            rec["bad0_decode_errors"] = getattr(bad.ingest.source, "decode_errors", None)
        rt = eng.streams.get("cam2")
        if rt is not None and rt.ingest is not None and rt.ingest.source.network:
            rec["cam2_reconnects"], rec["cam2_state"] = rt.ingest.reconnects, rt.ingest.state
        # checks at every sample
        tag = f"t={t:.0f}s"
        if audit:
            self.fail(f"{tag}: accounting audit: counters and holders disagree (ingested - terminal, held): {audit}")
        for sid, s in streams.items():
            if not s["balanced"]:
                self.fail(f"{tag}: stream {sid}: conservation broken: {s}")
            if not 0 <= s["in_flight"] < IN_FLIGHT_BOUND:
                self.fail(f"{tag}: stream {sid}: in_flight {s['in_flight']} outside [0, {IN_FLIGHT_BOUND})")
        if self.samples:
            prev = self.samples[-1]["streams"]
            for sid, s in streams.items():
                before = counters(prev[sid]) if sid in prev else {}
                for k, v in counters(s).items():
                    if v < before.get(k, 0):
                        self.fail(f"{tag}: stream {sid}: counter {k} went down {before[k]} -> {v}")
        dead = eng.check_dead()
        if dead:
            self.fail(f"{tag}: {dead}")
        if self.ledger.lost_uncounted.total() or self.ledger.unknown.total():
            self.fail(f"{tag}: delivery: results neither received nor counted missed: {dict(self.ledger.lost_uncounted)}"
                      f", received but never published: {dict(self.ledger.unknown)} ({self.ledger.examples[:3]})")
        self.check_descriptors(rec)
        self.samples.append(rec)
        inf = max((s["in_flight"] for s in streams.values()), default=0)
        missed = self.ledger.sent_missed.total()
        print(f"  t={t:6.0f}s  engine rss {rec['rss_mb']:6.1f} MB ({trimmed} trimmed, rings {rec['ring_mb']}, shm "
              f"mapped {rec['engine_shm_mapped']}/{unlinked} unlinked)  fds {rec['fds']:3d}  threads {threads_os:3d} os "
              f"{rec['threads_py']:2d} py | ingest x{rec['ingest_procs']} rss {rec['ingest_rss_mb']:6.1f} MB "
              f"(anon {rec['ingest_anon_mb']:5.1f}) fds {rec['ingest_fds']:3d} threads {rec['ingest_threads']:3d} | "
              f"helpers x{rec['helpers_procs']} rss {rec['helpers_rss_mb']:5.1f} fds {rec['helpers_fds']} | shm "
              f"{rec['shm_segments']} segs {rec['shm_mb']} MB | published {rec['published']:7d} received "
              f"{rec['received']:7d} missed {missed:6d} max in_flight {inf:3d}"
              + (f" | heap used {h['used_mb']} free {h['free_mb']} arenas {h['arenas']}" if (h := rec["heap"]) else ""),
              flush=True)
        return rec

    # -- faults ---------------------------------------------------------------------------------
    def publishes_after(self, streams: list[str], t_wall: float) -> Callable[[], bool]:
        """True once every stream in `streams` has published a result captured after `t_wall` (wall clock)."""
        return lambda: all(self.ledger.last_capture.get(s, 0.0) > t_wall for s in streams)

    def watch(self, fault: str, what: str, done: Callable[[], bool], fds_before: Optional[Counter] = None) -> None:
        t = self.elapsed()
        self.watches.append(Watch(fault, what, t, t + self.args.recover_s, done, fds_before))

    def check_descriptors(self, rec: dict) -> None:
        """At a sample: the faults recovered since the last one, each against the engine's descriptors before it."""
        now = Counter(rec["fd_kinds"])
        for w in self.fd_checks:
            grew = {k: n - w.fds_before.get(k, 0) for k, n in now.items() if n > w.fds_before.get(k, 0)}
            self.faults.descriptors(w.fault, grew)
            if grew:
                self.action(f"{w.fault}_descriptors_held", what=w.what, fired_at=round(w.t, 1), grew=grew)
        self.fd_checks = []

    def check_watches(self) -> None:
        now = self.elapsed()
        for w in list(self.watches):
            try:
                ok = w.done()
            except Exception as err:  # a check that raises is a finding, not a crash of the soak
                ok = False
                self.fail(f"t={now:.0f}s: {w.fault} ({w.what}): its recovery check raised {type(err).__name__}: {err}")
                w.deadline = now
            if ok:
                self.faults.add(w.fault, "recovered")
                self.watches.remove(w)
                self.action(f"{w.fault}_recovered", what=w.what, after_s=round(now - w.t, 1))
                if w.fds_before is not None:
                    self.fd_checks.append(w)
            elif now > w.deadline:
                self.watches.remove(w)
                self.fail(f"t={w.t:.0f}s: {w.fault} ({w.what}): not recovered within {self.args.recover_s:g} s")

    def arm_worker_kill(self) -> None:
        """The next batch on worker 0 raises, once; the pool must rebuild that worker (WorkerThread.model is the
        instance the thread runs now; its rebuild replaces it)."""
        pool = self.eng.pools[POOL]
        w = pool.slots.workers[0].model
        soak = self

        def boom(inputs):
            del w.infer  # once: the instance attribute goes, the class's infer is back
            soak.kill_fired_t = soak.elapsed()
            soak.kill_fired.set()
            raise ModelError("soak: injected worker failure")
        if not callable(getattr(w, "infer", None)):
            raise AttributeError(f"worker 0's model {type(w).__name__} has no infer() to make fail")
        w.infer = boom
        self.kill_at = self.elapsed()
        self.rebuilds_before = pool.slots.rebuilds
        self.action("worker_kill_armed", worker=0, rebuilds_before=pool.slots.rebuilds)

    def worker_kill_fired(self) -> None:
        """The injected failure ran (seen from the main loop): counted, and watched until the pool rebuilt exactly one
        worker and every live stream published a frame captured after it."""
        self.faults.add("worker_kill", "fired")
        self.action("worker_kill_fired", at=round(self.kill_fired_t, 2))
        pool, t_wall, before = self.eng.pools[POOL], time.time(), self.rebuilds_before
        live = sorted(self.eng.live_streams())
        after = self.publishes_after(live, t_wall)
        self.watch("worker_kill", "worker 0 rebuilt, every stream publishing",
                   lambda: pool.slots.rebuilds == before + 1 and after())

    def kill_ingest(self) -> None:
        """SIGKILL one live ingest process, picked at random (by pid: a restarted one is a new pid)."""
        hub = self.eng.ingest
        if hub is None:
            raise RuntimeError("the engine runs no ingest processes (ingest.processes: 0?): nothing to kill")
        pids = hub.pids()
        if not pids:
            raise RuntimeError("eng.ingest.pids() is empty: no ingest process to kill")
        idx, pid = self.rng.choice(sorted(pids.items()))
        held = next((d["streams"] for d in hub.describe() if f"pid {pid})" in d["process"]), None)
        restarts = hub.counters()["restarts"]
        fds_before = fd_kinds()
        t_wall = time.time()
        os.kill(pid, signal.SIGKILL)
        self.faults.add("ingest_kill", "fired")
        self.action("ingest_kill", idx=idx, pid=pid, streams=held, restarts_before=restarts)
        streams = sorted(held) if held else sorted(self.eng.live_streams())
        after = self.publishes_after(streams, t_wall)
        self.watch("ingest_kill", f"pid {pid}",
                   lambda: pid not in hub.pids().values() and hub.counters()["restarts"] > restarts and after(),
                   fds_before)

    def do(self, kind: str, arg, by_id: dict) -> None:
        if kind == "remove":  # the reply comes once the stream's eos is queued
            t = time.monotonic()
            self.removed_fds[arg] = fd_kinds()
            self.control({"op": "remove_stream", "stream": arg})
            self.action("remove_stream", stream=arg, took_s=round(time.monotonic() - t, 2))
        elif kind == "add":
            t_wall = time.time()
            self.control({"op": "add_stream", "stream": by_id[arg].model_dump(exclude_none=True)})
            self.faults.add("disconnect", "fired")
            self.action("add_stream", stream=arg)
            self.watch("disconnect", f"{arg} re-added", self.publishes_after([arg], t_wall), self.removed_fds.pop(arg, None))
        elif kind == "rtsp_restart":
            t = time.monotonic()
            old = self.server.pid
            fds_before = fd_kinds()
            self.server.stop()
            self.server.start()
            t_wall = time.time()
            self.faults.add("rtsp_restart", "fired")
            self.action("rtsp_restart", took_s=round(time.monotonic() - t, 2), port=self.server.port,
                        pid=f"{old} -> {self.server.pid}")
            self.watch("rtsp_restart", f"server pid {self.server.pid}", self.publishes_after(["cam2"], t_wall), fds_before)
        elif kind == "worker_kill":
            self.arm_worker_kill()
        elif kind == "ingest_kill":
            self.kill_ingest()
        else:
            raise ValueError(f"unknown action {kind!r}")

    def action(self, kind: str, **info) -> None:
        rec = {"t": round(self.elapsed(), 2), "action": kind, **info}
        self.actions.append(rec)
        print(f"  t={rec['t']:6.0f}s  >> {kind} {' '.join(f'{k}={v}' for k, v in info.items())}", flush=True)

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Set up, soak, and always clean up (engine stopped, RTSP server killed, subscriber closed)."""
        try:
            self._soak()
        except KeyboardInterrupt:
            self.fail("interrupted")
        except Exception as err:
            log.exception("soak crashed")
            self.fail(f"soak crashed: {type(err).__name__}: {err}")
        finally:
            self.soak_s = self.elapsed() if self.t0 else 0.0
            self.shutdown()
        return self.report()

    def schedule(self, duration: float, synthetic_ids: list[str], rtsp: bool) -> list[tuple[float, str, object]]:
        """(time, kind, argument), sorted: disconnects round robin over the synthetic streams, RTSP restarts, ingest
        kills, the worker kill half-way. Each is counted as scheduled."""
        a = self.args
        plan: list[tuple[float, str, object]] = []
        k = 1
        while k * a.disconnect_every_s + a.reconnect_after_s < duration - 1:
            sid = synthetic_ids[(k - 1) % len(synthetic_ids)]
            plan.append((k * a.disconnect_every_s, "remove", sid))
            plan.append((k * a.disconnect_every_s + a.reconnect_after_s, "add", sid))
            self.faults.add("disconnect", "scheduled")
            k += 1
        if rtsp:
            t = a.rtsp_restart_s - 30
            while 0 < t < duration - 10:
                plan.append((t, "rtsp_restart", None))
                self.faults.add("rtsp_restart", "scheduled")
                t += a.rtsp_restart_s
        if a.ingest_kill_every_s > 0:
            # the last one early enough to be seen recovered before the end
            t = a.ingest_kill_offset_s
            while t < duration - min(a.recover_s, 20):
                plan.append((t, "ingest_kill", None))
                self.faults.add("ingest_kill", "scheduled")
                t += a.ingest_kill_every_s
        plan.append((duration / 2, "worker_kill", None))
        self.faults.add("worker_kill", "scheduled")
        plan.sort(key=lambda p: p[0])
        return plan

    def _soak(self) -> None:
        a = self.args
        self.work = work = Path(tempfile.mkdtemp(prefix="vidar-soak-"))
        clip = write_clip(work / "clip.mp4", 90, (320, 240), fps=a.fps, seed=3)
        bad = work / "corrupt.mp4"
        corruption = corrupt_mdat(clip, bad, a.corrupt_fraction, a.seed)

        # main() has probed the server already (and stopped if it is missing)
        rtsp_ok, rtsp_why = (False, "disabled by --no-rtsp") if a.no_rtsp else (True, "")
        if rtsp_ok:
            try:
                self.server = RtspServer(free_port(), work, a.fps, "320x240")
                self.server.start()
            except Exception as err:
                rtsp_ok, rtsp_why, self.server = False, f"server did not start: {err}", None
        if not rtsp_ok:
            print(f"RTSP: skipped ({rtsp_why}); cam2 is synthetic", flush=True)

        syn = f"synthetic://shapes?size=320x240&fps={a.fps}"
        streams = [{"id": "cam0", "url": f"{syn}&seed=0", "mode": "live"},
                   {"id": "cam1", "url": f"{syn}&seed=1", "mode": "live"},
                   {"id": "cam2", "url": self.server.url if rtsp_ok else f"{syn}&seed=2", "mode": "live"},
                   {"id": "bad0", "url": str(bad), "mode": "live", "loop": True}]
        synthetic_ids = [s["id"] for s in streams if s["url"].startswith("synthetic://")]
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        tree = {"streams": streams,
                "models": {POOL: {"name": "test_vit", "weights": "random", "max_batch": 4, "workers": 2,
                                  "threads": 1, "device": "cpu"}},
                "budget": {"latency_ms": a.latency_ms},
                "publish": {"endpoint": endpoint, "hwm": 100, "min_subscribers": 1, "wait_subscribers_s": 10},
                # streams are removed and re-added through eng.control, the socket's own path: no socket needed
                "metrics": {"enabled": False}, "control": {"enabled": False},
                "source": {"reconnect_initial_s": 0.5, "reconnect_max_s": 5},
                "faults": {"max_failures": 1000, "window_s": 60, "batch_timeout_s": 5},
                "malloc_arenas": a.malloc_arenas}
        cfg, _ = build_config(tree, cuda_available=True)
        self.config = {"engine": tree, "soak": vars(a), "rtsp": {"used": rtsp_ok, "skipped_because": rtsp_why or None},
                       "corruption": corruption, "clip": {"frames": 90, "size": "320x240", "fps": a.fps},
                       "versions": versions()}

        duration = a.minutes * 60.0
        self.sub = SlowSubscriber(endpoint, a.sub_delay_ms / 1e3, hwm=a.sub_hwm, rcvbuf=a.sub_rcvbuf,
                                  on_result=self.ledger.on_received)
        # The engine's publisher socket comes from this context, so its options apply to it: a small
        # kernel send buffer makes the slow subscriber reach the HWM within seconds instead of after
        # megabytes of backlog have piled up in the kernel (--pub-sndbuf 0: the OS default).
        self.pub_ctx = zmq.Context()
        if a.pub_sndbuf:
            self.pub_ctx.setsockopt(zmq.SNDBUF, a.pub_sndbuf)
        self.eng = eng = self.start_engine(cfg, self.pub_ctx)
        self.keep_retired(eng.pools[POOL].acct, eng.publisher)
        if a.ingest_kill_every_s > 0 and eng.ingest is None:
            raise RuntimeError("the engine runs no ingest processes (ingest.processes: 0): the ingest kills cannot run")
        self.t0 = time.monotonic()
        print(f"soak: {a.minutes:g} min, 4 streams ({', '.join(s['id'] for s in streams)}), sample every "
              f"{a.sample_s:g} s; ingest processes {eng.ingest.pids() if eng.ingest else None}; setup took "
              f"{self.t0 - T_SCRIPT:.1f} s", flush=True)
        plan = self.schedule(duration, synthetic_ids, rtsp_ok)
        by_id = {s.id: s for s in cfg.streams}
        next_sample = next_check = 0.0
        while True:
            now = self.elapsed()
            if now >= next_sample - 1e-3:  # a sample first, then the actions due at the same time
                self.sample()
                next_sample += a.sample_s
                if next_sample > duration + 1e-6:
                    break
                continue
            if plan and now >= plan[0][0]:
                _, kind, arg = plan.pop(0)
                try:
                    self.do(kind, arg, by_id)
                except Exception as err:  # an injection that fails is a finding; keep soaking
                    log.exception("%s %s failed", kind, arg or "")
                    fault = {"remove": "disconnect", "add": "disconnect"}.get(kind, kind)
                    self.faults.add(fault, "errors")
                    self.fail(f"t={self.elapsed():.0f}s: {kind} {arg or ''}: {type(err).__name__}: {err}")
                continue
            if self.kill_fired.is_set() and not self.faults.counts["worker_kill"]["fired"]:
                self.worker_kill_fired()
            if now >= next_check:
                self.check_watches()
                next_check = now + 1.0
            due = min([next_sample, next_check] + [p[0] for p in plan[:1]])
            time.sleep(max(0.0, min(0.25, due - self.elapsed())))
        self.check_watches()
        self.end_collection = self.full_collection()

    def full_collection(self) -> dict:
        """After the last sample (the verdict is not affected): what one full collection gives back. The engine
        freezes its start-up objects (engine/util/gc_pause.py) and the collector then rarely runs a full collection,
        so what is held only by reference cycles (a dead ingest process's handle, a removed stream's ring) stays
        until one runs: the descriptors and memory returned here are such garbage, not live objects. (Frozen
        objects are not collected: a configured stream's first incarnation stays until the engine stops.)"""
        def reading() -> dict:
            malloc_trim()
            return {"fds": dict(fd_kinds()), "rss_mb": round(self.proc.memory_info().rss / MB, 2),
                    "py_objects": len(gc.get_objects())}
        before, runs = reading(), [g["collections"] for g in gc.get_stats()]
        t = time.perf_counter()
        collected = gc.collect()
        out = {"before": before, "after": reading(), "collected": collected,
               "took_ms": round((time.perf_counter() - t) * 1e3, 1), "collections_by_generation_before": runs}
        print(f"  end: one full collection ({out['took_ms']} ms) freed {collected} objects: fds "
              f"{sum(before['fds'].values())} -> {sum(out['after']['fds'].values())}, RSS (trimmed) "
              f"{before['rss_mb']} -> {out['after']['rss_mb']} MB", flush=True)
        return out

    def shutdown(self) -> None:
        t = time.monotonic()
        if self.eng is not None:
            # Let the subscriber catch up first (it reads at full speed from here), so that what the publisher
            # socket's 500 ms linger gets through at close decides nothing.
            self.sub.slow.clear()
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end and (time.monotonic() - t < 1 or self.sub.last_latency_ms > 300):
                time.sleep(0.05)
            try:
                self.eng.stop()
            except Exception as err:  # report, and go on cleaning up
                log.exception("engine stop failed")
                self.stop_error = f"{type(err).__name__}: {err}"
                self.fail(f"eng.stop() raised {self.stop_error}")
        if self.server is not None:
            self.server.stop()
        if self.sub is not None:
            self.sub.drain_and_close()
        if getattr(self, "pub_ctx", None) is not None:  # every socket should be closed by now
            t_term = threading.Thread(target=self.pub_ctx.term, name="soak-ctx-term", daemon=True)
            t_term.start()
            t_term.join(5)
            if t_term.is_alive():
                self.fail("the engine's ZeroMQ context did not terminate within 5 s: a socket was left open")
        if getattr(self, "work", None) is not None:
            shutil.rmtree(self.work, ignore_errors=True)
        self.stop_s = time.monotonic() - t
        self.leftover_threads = sorted(th.name for th in threading.enumerate() if th is not threading.main_thread())
        for pid, created in self.ingest_seen.items():  # the same pid and start time: the same process
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    self.leftover_ingest.append({"pid": pid, "cmd": " ".join(p.cmdline())[:100]})
            except psutil.NoSuchProcess:
                pass

    # -- verdict ------------------------------------------------------------------------------
    def check_worker_kill(self, pool, final: dict) -> dict:
        kill = {"armed_at": self.kill_at, "fired_at": self.kill_fired_t,
                "rebuilds": pool.slots.rebuilds if pool else None}
        if self.kill_at is None or not self.kill_fired.is_set() or pool is None:
            return kill  # FaultTally names it (never fired)
        if pool.slots.rebuilds != 1:
            self.fail(f"worker kill: pool rebuilt {pool.slots.rebuilds} workers, expected 1")
        after = [s for s in self.samples if s["t"] >= self.kill_fired_t]
        kill["failed_frames"] = sum(sum(s["failed"].values()) for s in final.values())
        if len(after) >= 2:
            kill["published_after"] = after[-1]["published"] - after[0]["published"]
            kill["published_after_per_stream"] = {
                sid: after[-1]["streams"].get(sid, {}).get("published", 0)
                - after[0]["streams"].get(sid, {}).get("published", 0) for sid in after[-1]["streams"]}
        return kill

    def note_reconnects(self) -> None:
        """cam2's reconnect count against the disconnects it was dealt: each RTSP restart ends its session, and each
        kill of the ingest process holding it restarts it. Noted, not judged."""
        last = self.samples[-1] if self.samples else {}
        if last.get("cam2_reconnects") is None:
            return
        dealt = sum(1 for x in self.actions if x["action"] == "rtsp_restart") + \
            sum(1 for x in self.actions if x["action"] == "ingest_kill" and "cam2" in (x.get("streams") or []))
        if last["cam2_reconnects"] < dealt:
            self.notes.append(f"cam2: the engine counts {last['cam2_reconnects']} reconnects, but it was disconnected "
                              f"{dealt} times (RTSP restarts + kills of its ingest process)")

    def report(self) -> int:
        a, eng = self.args, self.eng
        pool = eng.pools.get(POOL) if eng and eng.pools else None
        final = self.stream_counts() if pool else {}
        if pool and (bad := eng.audit()):
            self.fail(f"final: accounting audit: counters and holders disagree: {bad}")
        for sid, s in final.items():
            if not s["balanced"]:
                self.fail(f"final: stream {sid}: conservation broken: {s}")
            if s["in_flight"] != 0:
                self.fail(f"final: stream {sid}: {s['in_flight']} frames still in flight after stop")
        # delivery: every published result received, or counted missed by the publisher and not received
        self.ledger.match(final=True)
        published = {sid: s["published"] for sid, s in final.items()}
        if eng is not None and eng.publisher is not None:
            for why in self.ledger.check(published, dict(eng.publisher.stats.missed)):
                self.fail(why)
            received = dict(self.sub.results) if self.sub else {}
            matched = dict(+self.ledger.got)
            if received != matched:  # the subscriber's own count against the ledger's matches
                self.fail(f"delivery: the subscriber counted {received} results, the ledger matched {matched}")
        kill = self.check_worker_kill(pool, final)
        for why in self.faults.problems():
            self.fail(why)
        for w in self.watches:
            self.fail(f"t={w.t:.0f}s: {w.fault} ({w.what}): not recovered by the end")
        trend, failures = judge_trends(self.samples, warmup_frac=a.warmup_frac, rss_limit=a.rss_mb_per_10min,
                                       rss_noise=a.rss_noise_mb)
        for why in failures:
            self.fail(why)
        if self.leftover_threads:
            self.fail(f"threads still alive after stop: {self.leftover_threads}")
        if self.leftover_ingest:
            self.fail(f"ingest processes still alive after stop: {self.leftover_ingest}")
        self.note_reconnects()
        total_s = time.monotonic() - T_SCRIPT
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "cpu": cpu_model(), "torch": __import__("torch").__version__,
                        "memory_gb": round(psutil.virtual_memory().total / 2 ** 30, 1)},
            "config": self.config if hasattr(self, "config") else None,
            "verdict": "fail" if self.failures else "pass", "failures": self.failures, "notes": self.notes,
            "durations_s": {"soak": round(self.soak_s, 1), "stop": round(self.stop_s, 1), "total": round(total_s, 1)},
            "trend": trend, "faults": self.faults.as_dict(), "worker_kill": kill, "actions": self.actions,
            "final": final, "delivery": self.ledger.summary(), "end_full_collection": self.end_collection,
            "subscriber": {"received": dict(self.sub.results), "max_latency_ms": round(self.sub.max_latency_ms, 1),
                           "errors": self.sub.errors, "event_kinds": dict(self.sub.event_kinds),
                           "last_events": list(self.sub.events)} if self.sub else None,
            "publisher": publisher_stats(eng.publisher) if eng and eng.publisher else None,
            "ingest_pids_seen": len(self.ingest_seen), "ingest_left_after_stop": self.leftover_ingest,
            "stop_error": self.stop_error, "threads_after_stop": self.leftover_threads,
            "samples": self.samples}
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, default=str))
        self.print_table(record, final)
        print(f"\nwrote {out}; total runtime {total_s:.0f} s (soak {self.soak_s:.0f} s, stop {self.stop_s:.1f} s)")
        for note in self.notes:
            print(f"NOTE: {note}")
        if self.failures:
            print("FAIL:\n  " + "\n  ".join(self.failures))
            return 1
        print("PASS")
        return 0

    def print_table(self, record: dict, final: dict) -> None:
        d = record["delivery"]
        print("\nstream      ingested  published  received  missed(lost/recv)  in_flight  dropped / failed")
        for sid, s in final.items():
            dropped = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "-"
            failed = ", ".join(f"{k} {v}" for k, v in sorted(s["failed"].items())) or "-"
            x = d.get(sid, {})
            print(f"{sid:<10} {s['ingested']:9d} {s['published']:10d} {x.get('received', 0):9d} "
                  f"{x.get('counted_missed', 0):7d} ({x.get('missed_lost', 0)}/{x.get('missed_received', 0)})"
                  f" {s['in_flight']:9d}  {dropped} / {failed}")
        unaccounted = sum(v.get("lost_uncounted", 0) + v.get("unknown", 0) for k, v in d.items()
                          if not k.startswith("_"))
        print(f"delivery: received + missed-and-lost == published on every stream: "
              f"{'yes' if not any(f.startswith('delivery') for f in record['failures']) else 'NO'}; "
              f"unaccounted results {unaccounted}")
        if record["trend"]:
            print("\nresource (after warm-up)   first-q median  last-q median  slope/10min  min..max")
            for key, r in record["trend"].items():
                print(f"{key + ('' if r['judged'] else ' (info)'):<26} {r['first_quarter_median']:14.1f} "
                      f"{r['last_quarter_median']:14.1f} {r['slope_per_10min']:+12.2f}  {r['min']:g}..{r['max']:g}")
        print("\nfault          scheduled  fired  recovered  errors  fds checked  engine fds held after")
        for fault, c in record["faults"].items():
            held = ", ".join(f"{k} +{v}" for k, v in sorted(c["fds_held_by_kind"].items())) or "-"
            print(f"{fault:<14} {c.get('scheduled', 0):9d} {c.get('fired', 0):6d} {c.get('recovered', 0):10d} "
                  f"{c.get('errors', 0):7d} {c.get('fds_checked', 0):12d}  {c.get('fds_held', 0)} times: {held}")
        k = record["worker_kill"]
        print(f"worker kill: armed t={k['armed_at'] and round(k['armed_at'])} s, fired t="
              f"{k['fired_at'] and round(k['fired_at'], 1)} s, rebuilds {k['rebuilds']}, "
              f"published after {k.get('published_after', '-')}")
        print(f"ingest processes: {record['ingest_pids_seen']} pids over the run, left after stop "
              f"{len(record['ingest_left_after_stop'])}")
        rt = self.config["rtsp"] if hasattr(self, "config") else {}
        if rt.get("used") and self.samples:
            print(f"rtsp: used, {record['faults']['rtsp_restart'].get('fired', 0)} restart(s), cam2 reconnects "
                  f"{self.samples[-1].get('cam2_reconnects')} (the engine's count: ingest kills count too)")
        else:
            print(f"rtsp: skipped: {rt.get('skipped_because')}")
        last = self.samples[-1] if self.samples else {}
        print(f"bad0 decode errors: {last.get('bad0_decode_errors')}; subscriber max latency "
              f"{(record['subscriber'] or {}).get('max_latency_ms')} ms; publisher {record['publisher']}")


def cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="soak duration (default 30)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default 10)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    ap.add_argument("--no-rtsp", action="store_true", help="cam2 synthetic even if the RTSP server is installed")
    ap.add_argument("--fps", type=int, default=15)
    ap.add_argument("--latency-ms", type=float, default=200.0, help="budget.latency_ms")
    ap.add_argument("--disconnect-every-s", type=float, default=60.0)
    ap.add_argument("--reconnect-after-s", type=float, default=5.0)
    ap.add_argument("--rtsp-restart-s", type=float, default=180.0, help="RTSP server restarts: first at this - 30 s")
    ap.add_argument("--ingest-kill-every-s", type=float, default=60.0,
                    help="SIGKILL a random ingest process this often (0: never)")
    ap.add_argument("--ingest-kill-offset-s", type=float, default=45.0,
                    help="the first ingest kill (default 45 s: between the disconnects at whole minutes and the "
                         "RTSP restarts at half minutes, and not on a sample)")
    ap.add_argument("--recover-s", type=float, default=30.0,
                    help="a fault not recovered from within this many seconds fails the run")
    ap.add_argument("--sub-delay-ms", type=float, default=20.0, help="slow subscriber: sleep per message")
    ap.add_argument("--sub-hwm", type=int, default=50, help="slow subscriber: RCVHWM")
    ap.add_argument("--sub-rcvbuf", type=int, default=16384, help="slow subscriber: SO_RCVBUF bytes")
    ap.add_argument("--pub-sndbuf", type=int, default=16384, help="engine publisher: SO_SNDBUF bytes (0: OS default)")
    ap.add_argument("--corrupt-fraction", type=float, default=0.02)
    ap.add_argument("--rss-mb-per-10min", type=float, default=5.0)
    ap.add_argument("--rss-noise-mb", type=float, default=2.0,
                    help="RSS fails only if the last-quarter median also exceeds the first-quarter one by this")
    ap.add_argument("--warmup-frac", type=float, default=0.2, help="leading fraction of samples left out of trends")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--malloc-arenas", type=int, default=2,
                    help="the engine's malloc_arenas (0: glibc's default); applied before any thread, as `vidar run` does")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_malloc_arenas(args.malloc_arenas)  # first, like `vidar run`: before the soak's own threads exist
    signal.signal(signal.SIGTERM, _interrupt)  # stop cleanly (eng.stop, server killed) on SIGTERM too
    if not args.no_rtsp:  # a soak without its RTSP restarts is not the soak: say so rather than run a lesser one
        ok, why = rtsp_available()
        if not ok:
            print(f"soak: no RTSP server ({why}); run scripts/install-rtsp-deps.sh (make soak does), "
                  "or pass --no-rtsp for a soak without RTSP restarts", file=sys.stderr)
            return 2
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
