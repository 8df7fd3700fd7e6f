"""Soak test: N minutes of four live streams under faults; fails if resources trend upward.

Runs the engine in-process with the real tiny classifier (timm test_vit, random weights,
2 workers x 1 thread on the CPU, pool `classify`) on four live streams:
  cam0, cam1  synthetic://shapes 320x240 @ 15 fps
  cam2        RTSP from Debian's GStreamer server (tests/support/rtsp_server.py --pattern), killed and
              restarted every --rtsp-restart-s (first at that minus 30 s); a third synthetic
              stream when the server is not installed (the JSON says so)
  bad0        a looping H.264 file with ~2 % of its payload bytes flipped: corrupt bursts every loop
and meanwhile:
  * a slow subscriber (20 ms per message, RCVHWM 50, 16 KiB SO_RCVBUF) reads every result; the
    engine's publisher socket gets a 16 KiB SO_SNDBUF (through the zmq Context passed to Engine)
    so the HWM, not megabytes of kernel buffer, absorbs the backlog: the messages it misses show up (missed),
  * every --disconnect-every-s one synthetic stream is removed and re-added (same id)
    --reconnect-after-s later, round robin, through eng.control (as the control socket does),
  * once, half-way, one batch of worker 0 raises (the pool must rebuild the worker and go on).

Every --sample-s it samples RSS (raw, and again right after glibc's malloc_trim(0), so memory
the allocator merely caches is not taken for a leak), open fds, threads (OS and Python), the
rings' slot memory, Python's object count, glibc's heap (bytes in use vs free bytes the arenas
hold: a leak vs fragmentation), RSS by kind of mapping, and every stream's accounting. At every sample:
Snapshot.balanced() (ingested == published + dropped + failed + in_flight, where in_flight is
counted from the frames the pipeline's holders really hold, so a leaked or double-counted frame
breaks it), eng.audit() == {} (the same check for every stream of every pool, under the pool's
ledger lock), 0 <= in_flight < 200, no counter ever decreases, engine not dead.
A removed stream's counters are forgotten by the engine once its eos is out, and a re-added id
counts from 0: the soak keeps what each removed incarnation counted (final by then: in_flight
must be 0) and judges every id over the whole run. At the end (after eng.stop()): in_flight == 0 for
every stream, the subscriber received exactly what the engine counted published (per stream),
the injected failure ran, exactly one worker was rebuilt and every stream published after it,
no thread of ours or the engine's is left, and the engine's ZeroMQ context terminates.
Trends use the samples after the first 20 % (--warmup-frac): least-squares slopes, and it fails
if RSS (trimmed, when glibc is there) grows more than --rss-mb-per-10min (5) and its last-quarter
median is above the first-quarter median by more than --rss-noise-mb (2), or if fds / OS threads /
Python threads' last-quarter median exceeds the first-quarter median by more than 2.

Writes benchmarks/results/soak.json (samples, final counts, slopes, checks, verdict, config,
date, machine), prints a table, exits 1 with the reasons on failure (0 on pass).

It applies the engine's malloc arena cap first (--malloc-arenas, default 2 as in the config; 0 for
glibc's default), before its own threads exist, as `vidar run` does. Without the RTSP server it
refuses to run unless --no-rtsp is given.

usage: .venv/bin/python benchmarks/soak.py [--minutes 30] [--sample-s 10] [--out PATH] [--no-rtsp]
                                           [--malloc-arenas 2]
       (make soak; SOAK_MINUTES=5 make soak)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

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
IN_FLIGHT_BOUND = 200


def smaps_mb() -> Optional[dict]:
    """RSS by kind of mapping (Linux): file-backed (libraries, mmapped files), the main heap,
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


FD_NOISE = 2
THREAD_NOISE = 2


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


# -- the slow subscriber ----------------------------------------------------------------------
class SlowSubscriber:
    """Reads every result and event, sleeping `delay_s` per message while `slow` is set."""

    def __init__(self, endpoint: str, delay_s: float, hwm: int, rcvbuf: int):
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.RCVBUF, rcvbuf)  # applied to the socket before it connects
        self.sub = Subscriber(endpoint, topics=[f"{POOL}.", "event."], ctx=self.ctx, hwm=hwm)
        self.delay_s = delay_s
        self.slow = threading.Event()
        self.slow.set()
        self._stop = threading.Event()
        self.results: dict[str, int] = {}
        self.events: list[dict] = []
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
                self.events.append({"t": time.time(), "stream": msg["stream"], "kind": msg["kind"],
                                    "reason": msg["reason"]})
            else:
                self.results[msg["stream"]] = self.results.get(msg["stream"], 0) + 1
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


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.proc = psutil.Process()
        self.samples: list[dict] = []
        self.failures: list[str] = []
        self.server = None
        self.sub = None
        self.soak_s = self.stop_s = 0.0
        self.stop_error = None
        self.leftover_threads: list[str] = []
        self.actions: list[dict] = []
        self.eng: Optional[Engine] = None
        self.t0 = 0.0
        self.kill_fired = threading.Event()
        self.kill_at: Optional[float] = None
        self.kill_fired_t: Optional[float] = None
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

    def keep_retired(self, acct) -> None:
        """The engine forgets a removed stream's counters once its eos is out; that is the one moment
        they are final, so record them then (engine core thread, under the ledger lock). Nothing of
        the incarnation may still be held: in_flight must be 0."""
        forget = acct.forget

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
        acct.forget = forget_and_keep

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

    def sample(self) -> dict:
        eng = self.eng
        pool = eng.pools[POOL]
        streams = self.stream_counts()
        audit = eng.audit()  # every stream of every pool: counters vs the frames the holders hold
        t = self.elapsed()
        with self.proc.oneshot():
            rss = self.proc.memory_info().rss
            threads_os = self.proc.num_threads()
        trimmed = None
        if malloc_trim():  # what glibc keeps cached in its arenas is not a leak: give it back, then measure
            trimmed = round(self.proc.memory_info().rss / 2 ** 20, 2)
        rec = {"t": round(t, 2), "rss_mb": round(rss / 2 ** 20, 2), "rss_trimmed_mb": trimmed,
               "fds": len(os.listdir("/proc/self/fd")),
               "threads_os": threads_os, "threads_py": threading.active_count(),
               "live_streams": sorted(eng.live_streams()), "published": sum(s["published"] for s in streams.values()),
               "received": self.sub.received, "sub_latency_ms": round(self.sub.last_latency_ms, 1),
               "publisher": publisher_stats(eng.publisher), "publisher_pending": eng.publisher.pending(),
               "rebuilds": pool.slots.rebuilds, "audit": {p: {s: list(v) for s, v in b.items()} for p, b in audit.items()},
               "py_objects": len(gc.get_objects()), "ring_mb": round(self.ring_bytes() / 2 ** 20, 2),
               "heap": heap_stats(), "smaps": smaps_mb(), "streams": streams}
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
        self.samples.append(rec)
        inf = max((s["in_flight"] for s in streams.values()), default=0)
        print(f"  t={t:6.0f}s  rss {rec['rss_mb']:6.1f} MB ({trimmed} trimmed, rings {rec['ring_mb']})  "
              f"fds {rec['fds']:3d}  threads {threads_os:3d} os "
              f"{rec['threads_py']:2d} py  published {rec['published']:7d}  received {rec['received']:7d}  "
              f"max in_flight {inf:3d}  missed by the slow subscriber {sum(rec['publisher']['missed'].values())}"
              + (f"  heap used {h['used_mb']} free {h['free_mb']} mmap {h['mmap_mb']} arenas {h['arenas']}"
                 if (h := rec["heap"]) else "")
              + (f"  rss file {m['file']} heap {m['heap']} anon {m['anon']}" if (m := rec["smaps"]) else ""),
              flush=True)
        return rec

    # -- faults ---------------------------------------------------------------------------------
    def arm_worker_kill(self) -> None:
        """The next batch on worker 0 raises, once; the pool must rebuild that worker."""
        pool = self.eng.pools[POOL]
        w = pool.slots.workers[0].worker  # the instance worker thread 0 runs now (a rebuild replaces pool.slots.models[0])
        soak = self

        def boom(inputs):
            del w.infer  # once: the instance attribute goes, the class's infer is back
            soak.kill_fired_t = soak.elapsed()
            soak.kill_fired.set()
            raise ModelError("soak: injected worker failure")
        w.infer = boom
        self.kill_at = self.elapsed()
        self.action("worker_kill_armed", worker=0, rebuilds_before=pool.slots.rebuilds)

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
        self.sub = SlowSubscriber(endpoint, a.sub_delay_ms / 1e3, hwm=a.sub_hwm, rcvbuf=a.sub_rcvbuf)
        # The engine's publisher socket comes from this context, so its options apply to it: a small
        # kernel send buffer makes the slow subscriber reach the HWM within seconds instead of after
        # megabytes of backlog have piled up in the kernel (--pub-sndbuf 0: the OS default).
        self.pub_ctx = zmq.Context()
        if a.pub_sndbuf:
            self.pub_ctx.setsockopt(zmq.SNDBUF, a.pub_sndbuf)
        self.eng = eng = Engine(cfg, ctx=self.pub_ctx)
        eng.start()
        self.keep_retired(eng.pools[POOL].acct)
        self.t0 = time.monotonic()
        print(f"soak: {a.minutes:g} min, 4 streams ({', '.join(s['id'] for s in streams)}), sample every "
              f"{a.sample_s:g} s; setup took {self.t0 - T_SCRIPT:.1f} s", flush=True)
        # the schedule: (time, kind, argument); disconnects round robin over the synthetic streams
        plan: list[tuple[float, str, object]] = []
        k = 1
        while k * a.disconnect_every_s + a.reconnect_after_s < duration - 1:
            sid = synthetic_ids[(k - 1) % len(synthetic_ids)]
            plan.append((k * a.disconnect_every_s, "remove", sid))
            plan.append((k * a.disconnect_every_s + a.reconnect_after_s, "add", sid))
            k += 1
        if rtsp_ok:
            t = a.rtsp_restart_s - 30
            while 0 < t < duration - 10:
                plan.append((t, "rtsp_restart", None))
                t += a.rtsp_restart_s
        plan.append((duration / 2, "worker_kill", None))
        plan.sort(key=lambda p: p[0])
        by_id = {s.id: s for s in cfg.streams}
        next_sample = 0.0
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
                except Exception as err:  # an action that fails is a finding; keep soaking
                    log.exception("%s %s failed", kind, arg or "")
                    self.fail(f"t={self.elapsed():.0f}s: {kind} {arg or ''}: {type(err).__name__}: {err}")
                continue
            if self.kill_fired.is_set() and not any(x["action"] == "worker_kill_fired" for x in self.actions):
                self.action("worker_kill_fired", at=round(self.kill_fired_t, 2))
            due = min([next_sample] + [p[0] for p in plan[:1]])
            time.sleep(max(0.0, min(0.25, due - self.elapsed())))

    def do(self, kind: str, arg, by_id: dict) -> None:
        if kind == "remove":  # the reply comes once the stream's eos is queued
            t = time.monotonic()
            self.control({"op": "remove_stream", "stream": arg})
            self.action("remove_stream", stream=arg, took_s=round(time.monotonic() - t, 2))
        elif kind == "add":
            self.control({"op": "add_stream", "stream": by_id[arg].model_dump(exclude_none=True)})
            self.action("add_stream", stream=arg)
        elif kind == "rtsp_restart":
            t = time.monotonic()
            self.server.stop()
            self.server.start()
            self.action("rtsp_restart", took_s=round(time.monotonic() - t, 2), port=self.server.port)
        elif kind == "worker_kill":
            self.arm_worker_kill()

    def published_now(self) -> int:
        return sum(s["published"] for s in self.stream_counts().values())

    def shutdown(self) -> None:
        t = time.monotonic()
        if self.eng is not None:
            # Let the subscriber catch up first, so the final delivered == published check does not
            # depend on what the publisher socket's 500 ms linger gets through at close.
            self.sub.slow.clear()
            deadline = time.monotonic() + 5
            while (POOL in self.eng.pools and time.monotonic() < deadline
                   and self.sub.received < self.published_now() - 10):
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

    # -- verdict ------------------------------------------------------------------------------
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
        published = {sid: s["published"] for sid, s in final.items()}
        delivered = dict(sorted(self.sub.results.items())) if self.sub else {}
        if published and delivered != {k: v for k, v in published.items() if v}:
            self.fail(f"final: subscriber received {delivered} but the engine counted {published} published")
        # the worker kill: fired, the worker rebuilt, results kept flowing
        kill = {"armed_at": self.kill_at, "fired_at": self.kill_fired_t, "rebuilds": pool.slots.rebuilds if pool else None}
        if self.kill_at is not None:
            if not self.kill_fired.is_set():
                self.fail("worker kill: the injected failure never ran")
            elif pool.slots.rebuilds != 1:
                self.fail(f"worker kill: pool rebuilt {pool.slots.rebuilds} workers, expected 1")
            else:
                after = [s for s in self.samples if s["t"] >= self.kill_fired_t]
                kill["failed_frames"] = sum(sum(s["failed"].values()) for s in final.values())
                if len(after) >= 2:
                    flow = after[-1]["published"] - after[0]["published"]
                    kill["published_after"] = flow
                    if flow <= 0:
                        self.fail("worker kill: no results after the worker was rebuilt")
                    per = {sid: after[-1]["streams"].get(sid, {}).get("published", 0)
                           - after[0]["streams"].get(sid, {}).get("published", 0) for sid in after[-1]["streams"]}
                    kill["published_after_per_stream"] = per
                    starved = [sid for sid, n in per.items() if n <= 0]
                    if starved:
                        self.fail(f"worker kill: streams {starved} published nothing after the rebuild")
        elif self.samples and self.soak_s >= self.args.minutes * 60 / 2:
            self.fail("worker kill: never armed")
        # trends on the samples after warm-up
        trend = {}
        post = self.samples[int(len(self.samples) * a.warmup_frac):]
        if len(post) < 4:
            self.fail(f"trend: only {len(post)} samples after warm-up; need 4 (run longer or lower --sample-s)")
        else:
            ts = [s["t"] for s in post]
            rss_key = "rss_trimmed_mb" if post[0].get("rss_trimmed_mb") is not None else "rss_mb"
            for key, noise in (("rss_mb", a.rss_noise_mb), ("rss_trimmed_mb", a.rss_noise_mb),
                               ("ring_mb", None), ("fds", FD_NOISE),
                               ("threads_os", THREAD_NOISE), ("threads_py", THREAD_NOISE), ("py_objects", None)):
                ys = [s[key] for s in post]
                if any(y is None for y in ys):
                    continue
                q1, q4 = quarter_medians(ys)
                trend[key] = {"slope_per_10min": round(slope_per_10min(ts, ys), 3), "first_quarter_median": q1,
                              "last_quarter_median": q4, "min": min(ys), "max": max(ys), "noise": noise,
                              "judged": key in (rss_key, "fds", "threads_os", "threads_py")}
            r = trend[rss_key]
            grew = r["last_quarter_median"] > r["first_quarter_median"] + a.rss_noise_mb
            if r["slope_per_10min"] > a.rss_mb_per_10min and grew:
                self.fail(f"trend: {rss_key} grows {r['slope_per_10min']:.1f} MB per 10 min "
                          f"(limit {a.rss_mb_per_10min:g}); "
                          f"median {r['first_quarter_median']:.1f} -> {r['last_quarter_median']:.1f} MB")
            for key in ("fds", "threads_os", "threads_py"):
                r = trend[key]
                if r["last_quarter_median"] > r["first_quarter_median"] + r["noise"]:
                    self.fail(f"trend: {key} grows: median {r['first_quarter_median']:g} -> "
                              f"{r['last_quarter_median']:g} (slope {r['slope_per_10min']:+.2f} per 10 min)")
        if self.leftover_threads:
            self.fail(f"threads still alive after stop: {self.leftover_threads}")
        total_s = time.monotonic() - T_SCRIPT
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": __import__("torch").__version__,
                        "memory_gb": round(psutil.virtual_memory().total / 2 ** 30, 1)},
            "config": self.config if hasattr(self, "config") else None,
            "verdict": "fail" if self.failures else "pass", "failures": self.failures,
            "durations_s": {"soak": round(self.soak_s, 1), "stop": round(self.stop_s, 1), "total": round(total_s, 1)},
            "trend": trend, "worker_kill": kill, "actions": self.actions,
            "final": final,
            "subscriber": {"received": delivered, "max_latency_ms": round(self.sub.max_latency_ms, 1),
                           "errors": self.sub.errors, "events": self.sub.events} if self.sub else None,
            "publisher": publisher_stats(eng.publisher) if eng and eng.publisher else None,
            "stop_error": self.stop_error, "threads_after_stop": self.leftover_threads,
            "samples": self.samples}
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, default=str))
        self.print_table(record, final)
        print(f"\nwrote {out}; total runtime {total_s:.0f} s (soak {self.soak_s:.0f} s, stop {self.stop_s:.1f} s)")
        if self.failures:
            print("FAIL:\n  " + "\n  ".join(self.failures))
            return 1
        print("PASS")
        return 0

    def print_table(self, record: dict, final: dict) -> None:
        print("\nstream      ingested  published  received  in_flight  dropped / failed")
        for sid, s in final.items():
            dropped = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "-"
            failed = ", ".join(f"{k} {v}" for k, v in sorted(s["failed"].items())) or "-"
            got = (record["subscriber"] or {}).get("received", {}).get(sid, 0)
            print(f"{sid:<10} {s['ingested']:9d} {s['published']:10d} {got:9d} "
                  f"{s['in_flight']:10d}  {dropped} / {failed}")
        if record["trend"]:
            print("\nresource (after warm-up)  first-q median  last-q median  slope/10min  min..max")
            for key, r in record["trend"].items():
                print(f"{key + ('' if r['judged'] else ' (info)'):<24} {r['first_quarter_median']:14.1f} "
                      f"{r['last_quarter_median']:14.1f} {r['slope_per_10min']:+12.2f}  {r['min']:g}..{r['max']:g}")
        k = record["worker_kill"]
        print(f"\nworker kill: armed t={k['armed_at'] and round(k['armed_at'])} s, fired t="
              f"{k['fired_at'] and round(k['fired_at'], 1)} s, rebuilds {k['rebuilds']}, "
              f"published after {k.get('published_after', '-')}")
        rt = self.config["rtsp"] if hasattr(self, "config") else {}
        restarts = sum(1 for x in self.actions if x["action"] == "rtsp_restart")
        if rt.get("used") and self.samples:
            print(f"rtsp: used, {restarts} restart(s), cam2 reconnects {self.samples[-1].get('cam2_reconnects')}")
        else:
            print(f"rtsp: skipped: {rt.get('skipped_because')}")
        last = self.samples[-1] if self.samples else {}
        print(f"bad0 decode errors: {last.get('bad0_decode_errors')}; subscriber max latency "
              f"{(record['subscriber'] or {}).get('max_latency_ms')} ms; publisher {record['publisher']}")


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
