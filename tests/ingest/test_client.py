"""Ingest processes against a running engine (issue 33): frames through a process, a kill -9 under load, a
segfault, a hang, credit exhausted, /dev/shm too small, a stale descriptor, a stream that keeps dying."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter

import psutil
import pytest

from engine.errors import ConfigError
from engine.ingest import leases as ingest_leases
from engine.ingest import procs as ingest_procs
from engine.ingest import slots as ingest_slots
from engine.ingest import uplink, wire
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.ingest import SYN, balanced as _balanced, events_of as _events, ingest_engine as _engine
from tests.support.ingest import proc_of as _proc_of, results_of as _results, stop_engine as _stop

@pytest.mark.timeout(60)
def test_offline_and_live_streams_through_processes(endpoint):
    """An offline stream publishes every frame in order through its process; a live one at 60 fps publishes
    what it offers (nothing shed at this load); list says which process decodes each; the ledger balances."""
    col = Collector(endpoint, ["off", "live"])
    eng = _engine([{"id": "off", "url": SYN + "&frames=90", "mode": "offline"},
                   {"id": "live", "url": SYN + "&frames=90"}], endpoint)
    try:
        eng.start()
        assert wait_for(eng.finished, 30)
        desc = eng.describe()
        assert desc["off"]["process"].startswith("ingest-") and desc["live"]["process"].startswith("ingest-")
        assert desc["off"]["process"] != desc["live"]["process"]  # processes: 2, spread
        _balanced(eng)
    finally:
        _stop(eng)
    msgs = col.wait(10)
    assert [m["seq"] for m in _results(msgs, "off")] == list(range(90))
    live = [m["seq"] for m in _results(msgs, "live")]
    assert live == sorted(live) and len(live) >= 0.9 * 90, len(live)


@pytest.mark.timeout(90)
def test_kill_9_under_load_restarts_only_its_streams(endpoint):
    """kill -9 of one ingest process: its stream is announced reconnecting naming SIGKILL and runs again in a
    new process within 5 s with seq continuing; the other process's stream never stops; frames delivered
    before the kill are published; the ledger balances."""
    col = Collector(endpoint, ["a", "b"])
    eng = _engine([{"id": "a", "url": SYN}, {"id": "b", "url": SYN}], endpoint)
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 30 and eng.streams["b"].ingest.seq > 30, 30)
        pid = _proc_of(eng, "a")
        assert pid is not None and pid != _proc_of(eng, "b")
        seq_before = eng.streams["a"].ingest.seq
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: _proc_of(eng, "a") not in (None, pid) and eng.streams["a"].ingest.seq > seq_before + 10,
                        5.0), "stream a did not run again within 5 s"
        restarted_s = time.monotonic() - t_kill
        b_seq = eng.streams["b"].ingest.seq
        assert wait_for(lambda: eng.streams["b"].ingest.seq > b_seq + 10, 5)
        _balanced(eng)  # exact while both run, not only once they are gone
        eng.control({"op": "remove_stream", "stream": "a"})
        eng.control({"op": "remove_stream", "stream": "b"})
        assert wait_for(lambda: not eng.streams, 10)
        assert eng.audit() == {}
        assert eng.stream_counters()["ingest"]["restarts"] == 1
    finally:
        _stop(eng)
    msgs = col.wait(10)
    kinds = _events(msgs, "a")
    assert any(k == "reconnecting" and "SIGKILL" in r for k, r in kinds), kinds
    assert not any(k == "reconnecting" for k, _ in _events(msgs, "b"))
    a = [m["seq"] for m in _results(msgs, "a")]
    assert a == sorted(a) and a[-1] > seq_before  # seq continued in the new process
    b = [m["t_capture"] for m in _results(msgs, "b")]
    # b never stopped: no pause in its results near the kill longer than the time a's restart took
    gaps = [y - x for x, y in zip(b, b[1:])]
    assert max(gaps) < max(1.0, restarted_s), max(gaps)


@pytest.mark.timeout(120)
def test_segfaulting_stream_is_quarantined_then_fails_alone(endpoint, monkeypatch):
    """A source that segfaults its process (a test-only source): reconnecting naming SIGSEGV, restarted;
    past ingest.max_restarts it is moved to a process of its own, and past that it fails alone with the
    reason; its neighbour in the first process keeps running."""
    monkeypatch.setattr(ingest_procs, "TEST_IMPORTS", ["tests.support.crashing_source"])
    col = Collector(endpoint, ["segv"], linger_s=0.5)
    eng = _engine([{"id": "segv", "url": SYN}, {"id": "ok", "url": SYN}], endpoint,
                  ingest={"processes": 1, "max_restarts": 1})
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["segv"].ingest.failed, 60)
        ok = eng.streams["ok"].ingest
        seq = ok.seq
        assert ok.state == "running" and wait_for(lambda: ok.seq > seq + 10, 5)
        assert ok.reconnects <= 2  # it died with segv twice before segv was moved out, never after
        assert eng.stream_counters()["ingest"]["restarts"] == 4
    finally:
        _stop(eng)
    kinds = _events(col.wait(20), "segv")
    assert any(k == "reconnecting" and "SIGSEGV" in r for k, r in kinds), kinds
    assert any(k == "reconnecting" and "process of its own" in r for k, r in kinds), kinds
    assert any(k == "error" and "max_restarts" in r for k, r in kinds), kinds


@pytest.mark.timeout(60)
def test_frames_past_their_deadline_are_dropped_in_their_process_before_the_copy(endpoint, monkeypatch):
    """A test-only source that makes a frame every 25 ms for a 100 fps stream falls ever further behind; with a
    50 ms budget most of its frames are past their deadline before they are written. Its process drops them
    there (no copy, no slot, no descriptor) and reports them: the core counts them `deadline`, as its scheduler
    would have, so descriptors committed = frames ingested - those, and the ledger balances."""
    monkeypatch.setattr(ingest_procs, "TEST_IMPORTS", ["tests.support.crashing_source"])
    eng = _engine([{"id": "slow", "url": "synthetic://shapes?size=64x48&fps=100"}, {"id": "ok", "url": SYN}],
                  endpoint, budget={"latency_ms": 50})
    committed = Counter()
    try:
        eng.start()
        commit = eng.ingest.leases._commit

        def counted(lease, msg):  # every descriptor the core's I/O thread commits (its own thread: no race)
            committed[msg.stream] += 1
            return commit(lease, msg)
        eng.ingest.leases._commit = counted
        acct = eng.pools["classify"].acct
        assert wait_for(lambda: acct.snapshot("slow").dropped.get("deadline", 0) > 0, 20)
        ok0 = acct.snapshot("ok").published
        c0, s0 = committed["slow"], acct.snapshot("slow")
        time.sleep(2)
        c1, s1 = committed["slow"], acct.snapshot("slow")
        expired = s1.dropped.get("deadline", 0) - s0.dropped.get("deadline", 0)
        assert expired >= 20, (s0, s1)  # ~40 frames a second made, nearly all late
        # the old way every ingested frame was committed to a slot first; the slack: frames in transit at the ends
        assert c1 - c0 <= (s1.ingested - s0.ingested) - expired + 5, (c1 - c0, s0, s1)
        assert acct.snapshot("ok").published > ok0 + 30  # the stream beside it goes on
        eng.control({"op": "remove_stream", "stream": "slow"})
        assert wait_for(lambda: "slow" not in eng.streams, 10)
        _balanced(eng)
    finally:
        _stop(eng)


@pytest.mark.timeout(60)
def test_hung_process_is_killed_and_restarted(endpoint):
    """SIGSTOP an ingest process: no heartbeat for ingest.hang_after_s -> killed and its stream restarted,
    announced as hung."""
    col = Collector(endpoint, ["h"])
    eng = _engine([{"id": "h", "url": SYN}], endpoint, ingest={"processes": 1})
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["h"].ingest.seq > 10, 30)
        pid = _proc_of(eng, "h")
        os.kill(pid, signal.SIGSTOP)
        assert wait_for(lambda: _proc_of(eng, "h") not in (None, pid), 10)
        seq = eng.streams["h"].ingest.seq
        assert wait_for(lambda: eng.streams["h"].ingest.seq > seq + 10, 5)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        _stop(eng)
    kinds = _events(col.wait(10), "h")
    assert any(k == "reconnecting" and "hung: no heartbeat" in r for k, r in kinds), kinds


@pytest.mark.timeout(60)
def test_credit_exhausted_live_sheds_at_source_offline_waits(endpoint, monkeypatch):
    """A slow pool holds every slot: the live stream's frames are dropped in its process before any copy,
    counted ring_full in the core's ledger, which stays exact; the offline stream waits and loses nothing."""
    from engine.frames.ring import FrameRing
    shed = Counter()  # what the processes reported dropped before the copy (not the core's own lend drops)
    drop_at_source = FrameRing.drop_at_source

    def counted(ring, n, *args):
        shed[ring.stream] += n
        return drop_at_source(ring, n, *args)
    monkeypatch.setattr(FrameRing, "drop_at_source", counted)
    col = Collector(endpoint, ["live", "off"])
    eng = _engine([{"id": "live", "url": SYN + "&frames=120"},
                   {"id": "off", "url": SYN + "&frames=30", "mode": "offline"}], endpoint, per_frame_s=0.05,
                  ring={"min_slots": 2, "max_slots": 2})
    try:
        eng.start()
        assert wait_for(eng.finished, 40)
        live = eng.pools["classify"].acct.snapshot("live")
        off = eng.pools["classify"].acct.snapshot("off")
        assert live.dropped.get("ring_full", 0) >= shed["live"] > 0, (live, shed)
        assert live.ingested == 120 and live.ingested == live.published + sum(live.dropped.values()), live
        assert off.published == 30 and not off.dropped, off
        _balanced(eng)
    finally:
        _stop(eng)
    msgs = col.wait(10)
    assert [m["seq"] for m in _results(msgs, "off")] == list(range(30))


@pytest.mark.timeout(60)
def test_dev_shm_too_small_is_a_start_error(endpoint, monkeypatch):
    """/dev/shm smaller than ring.total_memory_mb: the engine refuses to start (exit 2 in `vidar run`), naming
    the size needed and Docker's --shm-size; nothing is left running."""
    monkeypatch.setattr(ingest_slots, "shm_free_bytes", lambda path=ingest_slots.SHM_DIR: 64 * 2 ** 20)
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ring={"total_memory_mb": 512})
    with pytest.raises(ConfigError, match=r"needs 512 MB.*--shm-size"):
        eng.start()
    assert eng.ingest is None and eng.state in ("stopping", "stopped")  # no hub, no process left running


@pytest.mark.timeout(60)
def test_descriptor_of_a_dead_generation_is_dropped_and_counted(endpoint):
    """A FrameReady of a generation the stream no longer has (injected on the core's socket, as a dead
    process's leftover would arrive) is dropped and counted, never committed; one naming a slot that is not
    lent is refused too; the ledger stays exact."""
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 1})
    push = None
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 10, 30)
        lease = eng.ingest.leases.leases["a"]
        push = eng.ingest.open_uplink()  # read by the engine as an ingest process's uplink is
        acct = eng.pools["classify"].acct
        before = eng.stream_counters()["ingest"]
        stale = wire.FrameReady("a", 0, lease.assign_gen - 1, 10 ** 6, 0.0, 0.0, 0.0, 1e12, 0.0, 48, 64, ("bt601", "limited"))
        forged = wire.FrameReady("a", 10 ** 4, lease.gen, 10 ** 6, 0.0, 0.0, 0.0, 1e12, 0.0, 48, 64, ("bt601", "limited"))
        push.send(wire.encode(stale))
        push.send(wire.encode(forged))
        push.send(b"\xffjunk")
        assert wait_for(lambda: eng.stream_counters()["ingest"]["stale_descriptors"] == before["stale_descriptors"] + 1
                        and eng.stream_counters()["ingest"]["bad_messages"] == before["bad_messages"] + 2, 5)
        eng.control({"op": "remove_stream", "stream": "a"})
        assert wait_for(lambda: not eng.streams, 10)
        assert eng.audit() == {}
        assert acct.snapshot("a").ingested == 0  # forgotten; and no result with the injected seq went out
    finally:
        if push is not None:
            push.close()
        _stop(eng)


def _emfile(times):
    """A callable that raises EMFILE `times` times (as os.open or a socket does with no descriptor left)."""
    import errno
    left = [times]

    def short(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
    return short, left


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["process", "segment"])
def test_no_descriptor_left_is_retried_and_the_stream_runs(endpoint, monkeypatch, what):
    """The engine out of descriptors (a flood of connections) when a stream is placed: starting the first
    process, or making the stream's segment, fails with EMFILE twice; the engine stays up, retries every second,
    and the stream then runs, its frames published."""
    short, left = _emfile(2)
    if what == "segment":
        real_seg = ingest_leases.Segment
        monkeypatch.setattr(ingest_leases, "Segment", lambda *a, **k: short() or real_seg(*a, **k))
    else:
        real = ingest_procs.ProcessManager.start
        monkeypatch.setattr(ingest_procs.ProcessManager, "start", lambda self, dedicated: short() or real(self, dedicated))
    col = Collector(endpoint, ["a"])
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 1})
    try:
        eng.start()
        assert wait_for(lambda: left[0] == 0, 10)
        # published, not seq: a stream without slots sheds its frames at the source, and its seq still rises
        assert wait_for(lambda: eng.pools["classify"].acct.snapshot("a").published > 5, 15), eng.describe().get("a")
        assert eng.dead_reason is None
        _balanced(eng)
    finally:
        _stop(eng)
    assert _results(col.wait(5), "a")


@pytest.mark.timeout(60)
def test_a_process_that_cannot_start_leaves_the_stream_to_a_running_one(endpoint, monkeypatch):
    """A second process is due (processes: 2) but cannot start (EMFILE): the new stream goes to the running
    process at once rather than waiting (streams_per_process is a stated cap, not a hard one)."""
    short, left = _emfile(10 ** 6)
    eng = _engine([{"id": "a", "url": SYN}], endpoint)
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 5, 30)
        real = ingest_procs.ProcessManager.start
        monkeypatch.setattr(ingest_procs.ProcessManager, "start", lambda self, dedicated: short() or real(self, dedicated))
        eng.control({"op": "add_stream", "stream": {"id": "b", "url": SYN}})
        assert wait_for(lambda: "b" in eng.streams and eng.streams["b"].ingest.seq > 5, 15), eng.describe().get("b")
        assert _proc_of(eng, "b") == _proc_of(eng, "a") and left[0] < 10 ** 6
    finally:
        _stop(eng)


@pytest.mark.timeout(60)
def test_a_stream_whose_process_never_starts_fails_with_the_reason(endpoint, monkeypatch):
    """EMFILE at every try and no process running: past ingest.start_timeout_s the stream fails with the reason
    (an error event); the engine itself stays up."""
    short, _ = _emfile(10 ** 6)
    real = ingest_procs.ProcessManager.start
    monkeypatch.setattr(ingest_procs.ProcessManager, "start", lambda self, dedicated: short() or real(self, dedicated))
    col = Collector(endpoint, ["a"])
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 1, "start_timeout_s": 2})
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.failed, 15)
        assert eng.dead_reason is None and eng.ingest.health() is None
    finally:
        _stop(eng)
    events = _events(col.wait(5), "a")
    assert any(k == "error" and "no ingest process could be started for it" in r and "Too many open files" in r
               for k, r in events), events


@pytest.mark.timeout(60)
def test_ingest_processes_run_at_a_lower_priority(endpoint):
    """ingest.nice is added to the processes' nice value (the engine process keeps its own)."""
    eng = _engine([{"id": "a", "url": SYN}], endpoint, ingest={"processes": 1, "nice": 7})
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["a"].ingest.seq > 5, 30)
        pid = _proc_of(eng, "a")
        assert psutil.Process(pid).nice() == min(19, psutil.Process().nice() + 7)
    finally:
        _stop(eng)


def test_auto_starts_up_to_one_process_per_core_and_at_least_two():
    assert ingest_procs.resolve_processes("auto", 48, 8, 2)[0] == 2
    assert ingest_procs.resolve_processes("auto", 48, 8, 1)[0] == 2
    assert ingest_procs.resolve_processes("auto", 48, 8, 16)[0] == 16
    assert ingest_procs.resolve_processes(3, 48, 8, 16)[0] == 3
    assert "-> 6)" in ingest_procs.resolve_processes("auto", 48, 8, 16)[1]


@pytest.mark.timeout(60)
def test_an_unexpected_error_adding_a_stream_fails_that_stream_not_its_process(endpoint, monkeypatch):
    """A bug in a stream's start inside the process (a RuntimeError, not a SourceError): that stream fails with
    the error named; the process and its other stream run on (no restart)."""
    monkeypatch.setattr(ingest_procs, "TEST_IMPORTS", ["tests.support.crashing_source"])
    col = Collector(endpoint, ["boom"])
    eng = _engine([{"id": "ok", "url": SYN}], endpoint, ingest={"processes": 1})
    try:
        eng.start()
        assert wait_for(lambda: eng.streams["ok"].ingest.seq > 5, 30)
        pid = _proc_of(eng, "ok")
        eng.control({"op": "add_stream", "stream": {"id": "boom", "url": SYN}})
        assert wait_for(lambda: eng.streams["boom"].ingest.failed, 15)
        seq = eng.streams["ok"].ingest.seq
        assert wait_for(lambda: eng.streams["ok"].ingest.seq > seq + 5, 5)
        assert _proc_of(eng, "ok") == pid and eng.stream_counters()["ingest"]["restarts"] == 0
        _balanced(eng)
    finally:
        _stop(eng)
    events = _events(col.wait(5), "boom")
    assert any(k == "error" and "RuntimeError: a bug in a decoder's open, on purpose" in r for k, r in events), events


@pytest.mark.timeout(60)
def test_a_process_whose_uplink_is_full_at_shutdown_exits_by_itself(endpoint, monkeypatch, caplog):
    """The hub's close stops its I/O thread, which reads the uplinks, before it tells the processes to exit; a
    process still sending then (its streams running: a drain that timed out) fills its uplink's buffer (here the
    kernel's least, a few messages) and its threads block in their sends, its heartbeat too. The hub reads what
    they send until they have exited, so each exits by itself (exit code 0), none is killed."""
    monkeypatch.setattr(uplink, "SNDBUF", 1)  # the kernel raises it to its least (~4.5 KiB)
    eng = _engine([{"id": f"s{i}", "url": SYN} for i in range(8)], endpoint, ingest={"processes": 1},
                  shutdown_timeout_s=1)
    handles = []
    try:
        eng.start()
        assert wait_for(lambda: all(eng.streams[f"s{i}"].ingest.seq > 20 for i in range(8)), 30)
        handles = [p.handle for p in eng.ingest.procs.procs.values()]
        with caplog.at_level(logging.WARNING, logger="vidar.ingest"):
            eng.ingest.close(timeout=4.0)  # with every stream still running, as after a drain that timed out
        assert len(handles) == 1 and handles[0].exitcode == 0, [h.exitcode for h in handles]
        assert "did not exit in time" not in caplog.text
    finally:
        _stop(eng)
