"""The ingest processes hardened (issue 41 items 1-6), each against a running engine: a process that cannot be
started (a real pids limit on the forkserver), a process that ends without being told to, what a process is told
(segment names), a SIGKILLed engine at any moment, an engine stalled by SIGSTOP, the forkserver SIGKILLed."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing.forkserver
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml
import zmq

from engine.ingest import janitor, slots as ingest_slots, wire
from engine.ingest import process as ingest_process
from engine.testing.wait import wait_for
from tests.support.ingest import SYN, events_of as _events, ingest_engine as _engine, proc_of as _proc_of
from tests.support.ingest import stop_engine as _stop
from tests.support.collector import Collector
from tests.support.net import free_port

PIDS_CG = "/sys/fs/cgroup/pids"


def _forkserver_pid():
    return multiprocessing.forkserver._forkserver._forkserver_pid


def _pids_cgroup():
    """A fresh pids cgroup (v1), or skip: creating one needs root and a writable pids hierarchy."""
    path = os.path.join(PIDS_CG, f"vidar-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(path)
    except OSError as err:
        pytest.skip(f"no pids cgroup can be made here ({err}): the pids-limit case needs root and cgroup v1 pids")
    return path


def _limit(cg: str, pid: int) -> None:
    """`pid` into the cgroup, which may then hold no more tasks than it has (its next fork fails: EAGAIN)."""
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(pid))
    with open(os.path.join(cg, "pids.current")) as f:
        current = f.read().strip()
    with open(os.path.join(cg, "pids.max"), "w") as f:
        f.write(current)


@pytest.mark.timeout(90)
def test_a_process_that_cannot_be_started_never_ends_the_engine(endpoint):
    """Item 1. The forkserver at a real pids limit: a stream added while a second process is due goes to the running
    process (the forkserver's failure arrives as EOFError); a stream whose process was SIGKILLed cannot be restarted
    at first (the new forkserver limited too): it is announced `reconnecting` with the reason, retried with backoff,
    and runs again once a forkserver can fork. The engine and the other stream never stop."""
    cg = _pids_cgroup()
    col = Collector(endpoint, ["a", "b"])
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 2, "streams_per_process": 1})
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 10, 30)
        _limit(cg, _forkserver_pid())
        eng.control({"op": "add_stream", "stream": {"id": "b", "url": SYN}})
        assert wait_for(lambda: "b" in eng.streams and eng.streams["b"].ingest.seq > 10, 15), eng.describe().get("b")
        assert _proc_of(eng, "b") == _proc_of(eng, "a")  # the start failed: b went to the running process
        assert eng.dead_reason is None and eng.ingest.health() is None
        multiprocessing.forkserver.ensure_running()  # the failed fork ended the forkserver: a new one, limited too
        _limit(cg, _forkserver_pid())
        pid = _proc_of(eng, "a")
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: _proc_of(eng, "a") not in (None, pid) and eng.streams["a"].ingest.seq > 0
                        and eng.streams["a"].ingest.state == "running", 20), eng.describe()
        published = eng.pools["classify"].acct.snapshot("b").published
        assert wait_for(lambda: eng.pools["classify"].acct.snapshot("b").published > published + 10, 10)
        assert eng.dead_reason is None and eng.ingest.health() is None
    finally:
        _stop(eng)
        try:
            os.rmdir(cg)
        except OSError:
            pass
    kinds = _events(col.wait(10), "a")
    assert any(k == "reconnecting" and "no ingest process could be started" in r and "EOFError" in r
               for k, r in kinds), kinds
    assert not any(k == "eos" for k, _ in kinds[:-1])


@contextlib.contextmanager
def _running_with_forger(endpoint):
    """An engine with stream `a` running in its one ingest process, and a PUSH connected to that process's command
    endpoint: commands the engine never sent, as a forger (or a bug) would send them."""
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 1})
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 10, 30)
        [proc] = eng.ingest.procs.procs.values()
        push.connect(proc.cmd.getsockopt(zmq.LAST_ENDPOINT).decode())
        yield eng, proc, push
    finally:
        push.close(0)
        ctx.term()
        _stop(eng)


@pytest.mark.timeout(60)
def test_a_bad_command_is_counted_and_an_exit_not_sent_by_the_engine_is_a_death(endpoint):
    """Item 2. A command that does not decode is counted and ignored (the process and its stream go on); an Exit
    the engine did not send stops the process's streams, and that is no end of stream: the process is killed with
    the reason and its stream restarted, never ended with an eos."""
    col = Collector(endpoint, ["a"])
    with _running_with_forger(endpoint) as (eng, proc, push):
        push.send(b"\x00not a message")
        push.send(wire.encode(wire.Heartbeat(0, 0, 0.0)))  # an up message sent down
        assert wait_for(lambda: eng.stream_counters()["ingest"]["bad_commands"] == 2, 10)
        pid, seq = proc.handle.pid, eng.streams["a"].ingest.seq
        assert proc.alive() and wait_for(lambda: eng.streams["a"].ingest.seq > seq + 10, 5)
        push.send(wire.encode(wire.Exit()))
        assert wait_for(lambda: _proc_of(eng, "a") not in (None, pid) and eng.streams["a"].ingest.seq > seq + 30, 15)
        assert eng.streams["a"].ingest.state == "running" and not eng.streams["a"].ingest.failed
    msgs = col.wait(10)
    kinds = _events(msgs, "a")
    assert any(k == "reconnecting" and "without being told to" in r for k, r in kinds), kinds
    assert [k for k, _ in kinds].count("eos") == 1 and kinds[-1][0] == "eos", kinds  # only the engine's own stop


def test_a_process_attaches_only_its_own_run_s_segments_for_that_stream(tmp_path, monkeypatch):
    """Item 3. A Slots message naming a path (`../`), another run's or another stream's segment is refused before
    anything is opened; the file it names is never written."""
    monkeypatch.setattr(ingest_slots, "SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    target = tmp_path / "outside"
    target.write_bytes(bytes(16 * 16 * 3 * 2))
    ring = ingest_process.RemoteRing("a", live=True, gen=1, send=lambda m: None, max_frame_pixels=10 ** 6,
                                     run="0123abcdp1s2")
    for name in ("../outside", "vidar-0123abcdp1s2-a-1/../../outside", "vidar-ffffffffp1s2-a-1",
                 "vidar-0123abcdp1s2-b-1", "vidar-0123abcdp1s2-a-x"):
        with pytest.raises(ValueError, match="refused"):
            ring.attach(wire.Slots("a", 2, name, 2, 16, 16))
    assert target.read_bytes() == bytes(16 * 16 * 3 * 2)
    ours = ingest_slots.Segment("vidar-0123abcdp1s2-a-1", 2, 16, 16, create=True)
    try:
        ring.attach(wire.Slots("a", 2, ours.name, 2, 16, 16))  # its own: attached
    finally:
        ours.unlink()


def _run_names(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/vidar-*p{pid}s*") + glob.glob(f"/tmp/vidar-*p{pid}s*")


def _engine_yaml(tmp_path, streams=2, **sections) -> str:
    cfg = {"streams": [{"id": f"k{i}", "url": "synthetic://shapes?size=320x240&fps=30"} for i in range(streams)],
           "models": {"noop": {"per_frame_s": 0.001}}, "budget": {"latency_ms": 300}, "shutdown_timeout_s": 5,
           "publish": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}, "metrics": {"enabled": False},
           "view": {"enabled": False}, "control": {"enabled": False}, **sections}
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.timeout(240)
def test_sigkill_of_the_engine_at_any_moment_leaves_nothing(tmp_path):
    """Item 4. `vidar run` SIGKILLed at random moments (3 in make test; VIDAR_KILL_RUNS=20 for the issue's count) from
    the start of its ingest (its run folder exists) to steady state: within 5 s nothing of it remains in /dev/shm or /tmp (its segments, its run folder, the
    forkserver's pymp folder), and no process of it runs."""
    rng = random.Random(41)
    path = _engine_yaml(tmp_path)
    left, moments = [], []
    # a temp folder of its own: the forkserver's pymp-* folder is made there (tempfile.gettempdir), so what is left
    # is the killed engine's, never that of another test run on the machine; the run folder stays in /tmp
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(own_tmp)}
    for _ in range(int(os.environ.get("VIDAR_KILL_RUNS", "3"))):
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", path], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        try:
            assert wait_for(lambda: _run_names(proc.pid), 60), "the engine never started its ingest"
            moments.append(rng.uniform(0.0, 1.5))
            time.sleep(moments[-1])
            family = psutil.Process(proc.pid).children(recursive=True)
        finally:
            proc.kill()
            proc.wait(10)
        gone = wait_for(lambda: not _run_names(proc.pid) and not os.listdir(own_tmp), 5)
        left += [] if gone else _run_names(proc.pid) + sorted(os.listdir(own_tmp))
        _, alive = psutil.wait_procs(family, timeout=10)
        assert alive == [], f"processes of a SIGKILLed engine still running: {alive}"
    assert left == [], f"left behind by SIGKILLed engines (killed {moments} s after their ingest started): {left}"


def test_a_starting_engine_removes_what_a_dead_engine_left_and_nothing_of_a_live_one(tmp_path):
    """Item 4. Names carry their owner (pid and start time): a dead owner's segment and folder are removed, a live
    one's (this process's), a reused pid's with another start time, and names that are not a run's are not."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_pid = gone.pid  # a pid that has exited (and been reaped)
    me, ticks = os.getpid(), janitor.start_ticks(os.getpid())
    dead = [f"vidar-0000aaaap{dead_pid}s123-cam-1", f"vidar-0000bbbbp{me}s{ticks + 1}-cam-1"]  # gone; pid reused
    kept = [f"vidar-0000ccccp{me}s{ticks}-cam-1", "vidar-old-format-cam-1", "other"]
    for n in dead + kept:
        (shm / n).write_bytes(b"x")
    (tmp / f"vidar-0000aaaap{dead_pid}s123-abcd").mkdir()
    removed = janitor.sweep_dead(str(shm), str(tmp))
    assert sorted(os.listdir(shm)) == sorted(kept) and os.listdir(tmp) == []
    assert len(removed) == 3


@pytest.mark.timeout(240)
def test_an_engine_stalled_by_sigstop_never_kills_a_healthy_process(tmp_path):
    """Item 5. `vidar run` (hang_after_s 1 s) SIGSTOPped 3 times in make test (VIDAR_STALLS=30 for the issue's count) for 1.1-3.3 s
    (3-10 s at the default 3 s), each followed by 0.5 s of running: no ingest process is ever killed as hung or
    restarted. The race it hunts is narrow (see the next test, which pins the rule down)."""
    path = _engine_yaml(tmp_path, streams=4, ingest={"processes": 2, "streams_per_process": 2, "heartbeat_s": 0.25,
                                                      "hang_after_s": 1.0})
    log = tmp_path / "engine.log"
    rng = random.Random(5)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", path], stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        assert wait_for(lambda: "started ingest-1" in log.read_text(), 60), log.read_text()
        time.sleep(1.0)
        pids = {p.pid for p in psutil.Process(proc.pid).children() if "janitor" not in " ".join(p.cmdline())}
        for _ in range(int(os.environ.get("VIDAR_STALLS", "3"))):
            proc.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(1.1, 3.3))
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.5)
        time.sleep(1.0)
        text = log.read_text()
        assert not re.search(r"hung|killing it|died", text), text[-3000:]
        assert pids <= {p.pid for p in psutil.Process(proc.pid).children()}  # the same processes, all alive
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(20)


@pytest.mark.timeout(90)
def test_sigkill_of_the_forkserver_kills_no_live_process_and_a_later_restart_works(endpoint):
    """Item 6. The forkserver SIGKILLed under load: both live ingest processes go on (not reported dead, nothing
    restarted, their segments attached); a process killed later is restarted by a new forkserver within 5 s."""
    col = Collector(endpoint, ["a", "b"])
    eng = _engine([{"id": "a", "url": SYN}, {"id": "b", "url": SYN}], endpoint)
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 10 and eng.streams["b"].ingest.seq > 10, 30)
        pa, pb = _proc_of(eng, "a"), _proc_of(eng, "b")
        os.kill(_forkserver_pid(), signal.SIGKILL)
        acct = eng.pools["classify"].acct
        pub = {s: acct.snapshot(s).published for s in "ab"}
        time.sleep(2.0)
        assert eng.stream_counters()["ingest"]["restarts"] == 0
        assert (_proc_of(eng, "a"), _proc_of(eng, "b")) == (pa, pb)
        assert all(acct.snapshot(s).published > pub[s] + 30 for s in "ab")
        os.kill(pa, signal.SIGKILL)
        assert wait_for(lambda: _proc_of(eng, "a") not in (None, pa) and eng.streams["a"].ingest.state == "running",
                        5), eng.describe()
        p = acct.snapshot("a").published
        assert wait_for(lambda: acct.snapshot("a").published > p + 10, 5)
        assert eng.stream_counters()["ingest"]["restarts"] == 1
    finally:
        _stop(eng)
    kinds = _events(col.wait(10), "a") + _events(col.wait(1), "b")
    assert not any("cannot attach" in r for _, r in kinds)


def test_a_hang_is_judged_on_time_the_engine_was_there_to_read():
    """Item 5, the rule itself (the SIGSTOP run above can miss the moment: the stop has to land between the I/O
    thread's poll and its check): a check that comes late (the engine stalled) credits the stall to every process;
    a process that looks hung has its uplink read first, and a heartbeat waiting there clears it; only a process
    silent while the engine was reading is killed."""
    from types import SimpleNamespace

    from engine.ingest.procs import ProcessManager
    from engine.ingest.supervisor import IngestProcess

    killed = []

    def manager(last_check_ago: float, beat_ago: float):
        pm = ProcessManager.__new__(ProcessManager)
        pm.cfg = SimpleNamespace(ingest=SimpleNamespace(hang_after_s=1.0, start_timeout_s=20.0))
        now = time.monotonic()
        proc = IngestProcess(0, 0, SimpleNamespace(pid=1), None, None, ready=True)
        proc.last_beat = now - beat_ago
        proc.alive = lambda: True
        proc.open_pidfd = lambda: None
        proc.kill = lambda: killed.append(proc)
        pm.procs, pm._last_check = {0: proc}, now - last_check_ago
        return pm, proc, now

    pm, proc, now = manager(last_check_ago=2.5, beat_ago=2.5)  # the engine stopped 2.5 s: not the process's fault
    assert pm.check(now, drain=lambda p: None) == [] and killed == [] and not proc.kill_reason

    pm, proc, now = manager(last_check_ago=0.05, beat_ago=2.5)  # a heartbeat waiting unread in its uplink
    drained = []
    assert pm.check(now, drain=lambda p: (drained.append(p), setattr(p, "last_beat", time.monotonic()))) == []
    assert drained == [proc] and killed == []

    pm, proc, now = manager(last_check_ago=0.05, beat_ago=2.5)  # silent while the engine read: hung
    pm.check(now, drain=lambda p: None)
    assert killed == [proc] and proc.kill_reason.startswith("hung")

    # a busy I/O thread (checks 0.3 s apart, not a stall) still finds a silent process within hang_after_s + a gap
    pm, proc, now = manager(last_check_ago=0.0, beat_ago=0.0)
    killed.clear()
    t = now
    while not killed and t - now < 5.0:
        t += 0.3
        pm.check(t, drain=lambda p: None)
    assert killed == [proc] and t - now <= 1.0 + 0.3 + 1e-9, t - now


@pytest.mark.timeout(60)
def test_a_re_added_stream_s_old_generation_is_stale_for_the_new_lease(endpoint):
    """Item 7: lease generations come from one counter for the whole hub: a stream removed and added again under
    the same id starts above every generation its old lease used, so a leftover descriptor of the old lease (as
    the old process would still send it) is dropped and counted, never committed to the new ring."""
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 1})
    up = None
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 10, 30)
        old = eng.ingest.leases.leases["a"]
        old_gen = old.gen
        eng.control({"op": "remove_stream", "stream": "a"})
        assert wait_for(lambda: "a" not in eng.streams, 10)
        eng.control({"op": "add_stream", "stream": {"id": "a", "url": SYN}})
        assert wait_for(lambda: "a" in eng.streams and eng.streams["a"].ingest.seq > 10, 15)
        new = eng.ingest.leases.leases["a"]
        assert new is not old and new.assign_gen > old_gen
        up = eng.ingest.open_uplink()
        stale = eng.stream_counters()["ingest"]["stale_descriptors"]
        ingested = eng.pools["classify"].acct.snapshot("a").ingested
        up.send(wire.encode(wire.FrameReady("a", 0, old_gen, 10 ** 6, 0.0, 0.0, 0.0, 1e12, 0.0, 48, 64,
                                            ("bt601", "limited"))))
        assert wait_for(lambda: eng.stream_counters()["ingest"]["stale_descriptors"] == stale + 1, 5)
        assert not any(m.seq == 10 ** 6 for m in _ring_metas(eng, "a")) and \
            eng.pools["classify"].acct.snapshot("a").ingested >= ingested
    finally:
        if up is not None:
            up.close()
        _stop(eng)


def _ring_metas(eng, stream):
    ring = eng.pools["classify"].rings.get(stream)
    return [m for m in getattr(ring, "_meta", []) if m is not None] if ring is not None else []


@pytest.mark.timeout(30)
def test_a_blocked_geometry_send_never_holds_the_ring_s_condition():
    """Item 7: RemoteRing.write sends Geometry without its condition held: while that send blocks (the engine not
    reading), the process's main thread can still hand the ring credits and the stream's state is still read."""
    import threading

    release = threading.Event()
    sent = []

    def send(msg):
        sent.append(msg)
        if isinstance(msg, wire.Geometry):
            release.wait(10)  # the uplink full: blocked until the engine reads again

    ring = ingest_process.RemoteRing("a", live=True, gen=1, send=send, max_frame_pixels=10 ** 6, run="r")
    from engine.frames.lifecycle import FrameMeta
    meta = FrameMeta("a", 0, 0.0, time.time(), deadline=float("inf"), height=16, width=16)
    writer = threading.Thread(target=ring.write, args=(meta, np.zeros((16, 16, 3), np.uint8)), daemon=True)
    writer.start()
    assert wait_for(lambda: any(isinstance(m, wire.Geometry) for m in sent), 5)
    t0 = time.monotonic()
    ring.credit(wire.Credit("a", 1, [0]))  # the main thread: must not wait for the blocked send
    ring.close()
    assert time.monotonic() - t0 < 1.0
    release.set()
    writer.join(5)
    assert not writer.is_alive()


@pytest.mark.timeout(180)
def test_classify_and_sam2_on_the_same_streams_decode_in_a_process_and_survive_its_kill(tmp_path, endpoint):
    """Item 10. Streams feeding a classifier and SAM 2 (the demo's own shape) decode in an ingest process, not as
    threads of the engine: the frame is written once by the process and copied into the other pool's ring by
    the engine. SIGKILL of that process: both streams restart in a new one, both pools publish again, and every
    pool's ledger balances. An offline stream feeding both pools loses no frame in either."""
    from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint

    ckpt = make_checkpoint(tmp_path / "c.pt")
    col = Collector(endpoint, ["a", "b", "off"])
    col.sub._sock.setsockopt(zmq.SUBSCRIBE, b"sam2.")
    eng = _engine([{"id": "a", "url": SYN}, {"id": "b", "url": SYN},
                   {"id": "off", "url": "synthetic://shapes?size=64x48&fps=60&frames=40", "mode": "offline"}],
                  endpoint, ingest={"processes": 1},
                  models={"sam2": {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE, "max_batch": 1}},
                  budget={"latency_ms": 5000})  # classify: the no-op runner _engine injects
    try:
        eng.start()
        assert set(eng.pools) == {"classify", "sam2"}
        assert wait_for(lambda: all(eng.describe()[s]["process"].startswith("ingest-") for s in ("a", "b", "off")),
                        30), eng.describe()
        pub = lambda pool, s: eng.pools[pool].acct.snapshot(s).published  # noqa: E731
        assert wait_for(lambda: all(pub(p, s) > 2 for p in ("classify", "sam2") for s in ("a", "b")), 90)
        assert wait_for(lambda: "off" not in eng.streams or eng.streams["off"].state == "ended", 90)
        pid = _proc_of(eng, "a")
        before = {(p, s): pub(p, s) for p in ("classify", "sam2") for s in ("a", "b")}
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: _proc_of(eng, "a") not in (None, pid) and all(
            pub(p, s) > before[(p, s)] + 2 for p in ("classify", "sam2") for s in ("a", "b")), 90), eng.describe()
        for name in ("classify", "sam2"):
            for s in ("a", "b"):
                snap = eng.pools[name].acct.snapshot(s)
                assert snap.ingested == snap.published + sum(snap.dropped.values()) + sum(snap.failed.values()) \
                    + snap.in_flight, (name, s, snap)
    finally:
        _stop(eng)
    msgs = col.wait(10)
    for kind in ("classify", "sam2"):
        off = sorted(m["seq"] for m in msgs if m.get("stream") == "off" and m["type"] == kind)
        assert off == list(range(40)), (kind, off)
    assert any(k == "reconnecting" and "SIGKILL" in r for k, r in _events(msgs, "a"))


@pytest.mark.timeout(60)
def test_a_running_process_told_to_attach_a_path_opens_nothing_and_its_stream_goes_on(tmp_path, endpoint):
    """Item 3 against a running engine: a Slots command naming `../` (a file outside /dev/shm, as a forged command
    would) reaches a live ingest process: the file is never opened for writing nor written, the stream goes on."""
    target = tmp_path / "outside"
    target.write_bytes(bytes(48 * 64 * 3 * 4))
    os.chmod(target, 0o600)
    rel = os.path.relpath(target, ingest_slots.SHM_DIR)
    with _running_with_forger(endpoint) as (eng, proc, push):
        lease = eng.ingest.leases.leases["a"]
        mtime = os.stat(target).st_mtime_ns
        push.send(wire.encode(wire.Slots("a", lease.gen, rel, 4, 48, 64)))
        push.send(wire.encode(wire.Credit("a", lease.gen, [0, 1])))
        published = eng.pools["classify"].acct.snapshot("a").published
        assert wait_for(lambda: eng.pools["classify"].acct.snapshot("a").published > published + 30, 15)
        assert target.read_bytes() == bytes(48 * 64 * 3 * 4) and os.stat(target).st_mtime_ns == mtime
        assert proc.alive() and eng.stream_counters()["ingest"]["restarts"] == 0


def test_a_process_is_watched_through_a_pidfd_numbered_past_1024():
    """A pidfd of 1024 or above (an engine with many cameras and clients: vidar run raises the descriptor limit)
    is watched with poll, not select (which refuses it: ValueError in the I/O thread was the engine's death)."""
    import resource
    from types import SimpleNamespace

    from engine.ingest.supervisor import IngestProcess

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1600:
        pytest.skip(f"the hard descriptor limit ({hard}) is below 1600")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    child = subprocess.Popen(["sleep", "30"])
    fd = None
    try:
        first = os.pidfd_open(child.pid)
        fd = os.dup2(first, 1500)
        os.close(first)
        proc = IngestProcess(0, 0, SimpleNamespace(pid=child.pid, exitcode=None), None, None, pidfd=fd)
        assert proc.alive() and not proc.wait(0.05)
        proc.kill()
        assert proc.wait(5) and not proc.alive()
        proc.forget()
        fd = None
    finally:
        child.kill()
        child.wait(5)
        if fd is not None:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_copy_into_another_pool_s_ring_that_fails_fails_that_stream_only():
    """The fan-out's copy (ingest-io) raising what a thread's copy would (out of memory for a slot): the stream
    fails with the reason; nothing escapes into the I/O thread (which would be every stream's end)."""
    from types import SimpleNamespace

    from engine.ingest.leases import Leases

    class _Broken:
        pool = "sam2"

        def write(self, *a, **k):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    failed = []
    leases = Leases.__new__(Leases)
    leases.fail = lambda lease, reason: failed.append(reason)
    lease = SimpleNamespace(stream="a", segment=SimpleNamespace(array=np.zeros((2, 4, 4, 3), np.uint8)),
                            fanout=(_Broken(),))
    leases._fan_out(lease, 0, [object()])
    assert failed and "can't allocate memory" in failed[0]


def test_room_for_the_fan_out_is_counted_at_the_new_size_and_a_full_ring_never_waits():
    """After a size change the other pool's ring reports its room at the slots it will have at that size (it
    resizes at its next write), so an offline stream is not lent slots that the copy would wait for; and a copy
    that finds no room anyway (wait=False) is dropped and counted at once, never waited for."""
    import math as _math

    from engine.frames.accounting import Accounting
    from engine.frames.lifecycle import FrameMeta
    from engine.frames.ring import FrameRing

    acct = Accounting("sam2")
    ring = FrameRing("cam", live=False, accounting=acct, memory_bytes=4 * 16 * 16 * 3, min_slots=1, max_slots=4,
                     max_frame_pixels=10 ** 6)
    try:
        for seq in range(2):  # two 16x16 frames held (slots 0 and 1), two free
            assert ring.write(FrameMeta("cam", seq, 0.0, time.time(), deadline=_math.inf),
                              np.zeros((16, 16, 3), np.uint8), wait=False)
        assert ring.free_slots(16, 16) == 2
        assert ring.free_slots(32, 16) == 0  # at 32x16 the ring has 2 slots, both held
        t0 = time.monotonic()
        assert ring.write(FrameMeta("cam", 2, 0.0, time.time(), deadline=_math.inf),
                          np.zeros((32, 16, 3), np.uint8), wait=False)
        assert time.monotonic() - t0 < 0.05
        assert acct.snapshot("cam").dropped.get("ring_full") == 1
    finally:
        ring.close()


def test_a_live_engine_s_names_are_never_swept_even_when_its_pid_means_nothing_here(tmp_path):
    """Two containers sharing /dev/shm or /tmp see each other's pids as absent: a run whose owner holds its lock
    (janitor.Owner) is kept, whatever its pid says; once the lock is released, it is swept."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    run = "0000dddd" + "p999999999s1"  # a pid that does not exist here
    (shm / f"vidar-{run}-cam-1").write_bytes(b"x")
    run_dir = tmp / f"vidar-{run}-abcd"
    run_dir.mkdir()
    owner = janitor.Owner(run, str(run_dir), shm_dir=str(shm))
    try:
        assert janitor.sweep_dead(str(shm), str(tmp)) == []
        assert sorted(os.listdir(shm)) == [f"vidar-{run}-cam-1", f"vidar-{run}.lock"]
    finally:
        os.close(os.open(shm / f"vidar-{run}.lock", os.O_CREAT | os.O_RDONLY))  # kept for the sweep below
        owner._fds, fds = [], owner._fds
        for fd in fds:
            os.close(fd)
    assert len(janitor.sweep_dead(str(shm), str(tmp))) == 3 and os.listdir(shm) == [] and os.listdir(tmp) == []


@pytest.mark.timeout(90)
def test_a_dead_process_leaves_no_descriptor_behind_in_the_engine(endpoint):
    """Each ingest process that dies is let go of at once: its handle's pipes to the forkserver are closed when it
    is reaped, not at the next full garbage collection (which a long-running engine may not run for many minutes:
    the soak saw 2 pipes a death pile up). Three kills, the collector off: the engine holds no more pipes after."""
    import gc

    def pipes():
        out = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                out += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
            except OSError:
                pass
        return out

    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 1})
    gc.disable()
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 10, 30)
        before = pipes()
        for n in range(3):
            pid = _proc_of(eng, "a")
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: _proc_of(eng, "a") not in (None, pid) and
                            eng.streams["a"].ingest.state == "running", 10), eng.describe()
        assert eng.streams["a"].ingest.reconnects == 3
        assert wait_for(lambda: pipes() <= before, 5), (before, pipes())
    finally:
        gc.enable()
        _stop(eng)


def test_a_restarted_stream_s_reconnects_add_to_those_of_its_earlier_processes():
    """A new process counts its stream's reconnects from 0: the stream's count is what its earlier processes counted
    (their deaths included) plus the new one's, never the larger of the two."""
    from types import SimpleNamespace

    from engine.ingest.leases import Leases

    leases = Leases.__new__(Leases)
    remote = SimpleNamespace(reconnects=3, failed=False, state="running", end_reason="", total_frames=None, seq=0,
                             source=SimpleNamespace(decode_errors=0, decode_device=None))
    lease = SimpleNamespace(remote=remote, reconnects_before=3, next_seq=0, removing=False,
                            ring=SimpleNamespace(closed=False))
    msg = wire.StreamState("a", 9, "running", False, "", None, 2, 0, 10, 0)
    leases._state(lease, msg)
    assert remote.reconnects == 5


def test_a_process_that_died_before_its_ready_is_named_after_its_handle_was_closed():
    """A process that exits before its Ready is reaped (multiprocessing's handle closed: `handle.pid` raises
    ValueError) before its streams are told why, in lines naming it: its label must not ask the handle, or the
    ingest I/O thread, and with it the engine, dies of a failed start."""

    class Closed:
        @property
        def pid(self):
            raise ValueError("process object is closed")
    from engine.ingest.supervisor import IngestProcess
    proc = IngestProcess(2, 1, Closed(), None, None, os_pid=4321)
    assert proc.label == "ingest-2 (pid 4321)"
