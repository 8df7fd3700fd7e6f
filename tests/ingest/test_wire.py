"""The core <-> ingest process messages (engine/ingest/wire.py) and how credits travel: one frame a message, and
one Credits message per process for every stream lent slots in one wake-up of the core's I/O thread."""

from __future__ import annotations

import functools
import select
import threading
from types import SimpleNamespace

import pytest
import zmq

from engine.ingest import client as ingest_client
from engine.ingest import leases as ingest_leases
from engine.ingest import process as ingest_process
from engine.ingest import uplink, wire

pytestmark = pytest.mark.timeout(30)


def test_a_message_is_one_frame_and_anything_else_is_a_wire_error():
    ready = wire.FrameReady("cam", 2, 7, 41, 0.68, 1.7e9, 12.5, 12.6, 0.002, 48, 64, ("bt709", "limited"), 3, 12.4)
    credits = wire.Credits([wire.Credit("a", 5, [0, 1]), wire.Credit("b", 7, [3])])
    for msg in (ready, credits, wire.Exit()):
        data = wire.encode(msg)
        assert isinstance(data, bytes) and wire.decode(data) == msg
        assert wire.decode(memoryview(data)) == msg  # a zero-copy frame's buffer decodes the same
    for junk in (b"", b"\xffjunk", wire.encode(ready)[:1] + b"junk", bytes([len(wire._TYPES)])):
        with pytest.raises(wire.WireError):
            wire.decode(junk)


class _Ring:
    def __init__(self, slots):
        self.slots = slots

    def lend(self, credit=None, most=None):
        out, self.slots = self.slots, []
        return out


def test_credits_for_several_streams_go_to_their_process_as_one_message():
    leases = ingest_leases.Leases.__new__(ingest_leases.Leases)  # only top_up's state: no sockets, no thread
    leases.cfg = SimpleNamespace(ingest=SimpleNamespace(live_credit=2))
    p1, p2 = SimpleNamespace(idx=1), SimpleNamespace(idx=2)
    lease = lambda proc, gen, slots: SimpleNamespace(proc=proc, segment=object(), gen=gen, ring=_Ring(slots),  # noqa: E731
                                                     fanout=())
    leases.leases = {"a": lease(p1, 5, [0, 1]), "b": lease(p1, 7, [3]), "c": lease(p2, 9, [2]),
                     "d": lease(p1, 4, []), "e": lease(None, 3, [1])}  # d: nothing free; e: not placed
    sent = []
    leases._procs = SimpleNamespace(send=lambda proc, msgs: sent.append((proc.idx, msgs)))
    leases.top_up({"a", "b", "c", "d", "e", "gone"})
    by_proc = dict(sent)
    assert len(sent) == 2 and set(by_proc) == {1, 2}  # one send per process, not one per stream
    [many] = by_proc[1]
    assert isinstance(many, wire.Credits)
    assert sorted((c.stream, c.gen, c.slots) for c in many.credits) == [("a", 5, [0, 1]), ("b", 7, [3])]
    assert by_proc[2] == [wire.Credit("c", 9, [2])]


def test_an_ingest_process_applies_every_command_waiting_and_each_credit_to_its_stream():
    rings = {s: ingest_process.RemoteRing(s, live=True, gen=g, send=lambda m: None, max_frame_pixels=10 ** 6)
             for s, g in (("a", 5), ("b", 7))}
    child = SimpleNamespace(ring=rings.get, streams={})
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind("inproc://cmd")
        push.connect("inproc://cmd")
        push.send(wire.encode(wire.Credits([wire.Credit("a", 5, [0, 1]), wire.Credit("b", 6, [3]),
                                            wire.Credit("gone", 1, [2])])))
        push.send(wire.encode(wire.Credit("b", 7, [4])))
        push.send(wire.encode(wire.Exit()))
        assert pull.poll(5000)
        assert ingest_process._commands(child, pull, 0) is True  # all three in one wake-up; Exit says so
        assert list(rings["a"]._credits) == [0, 1]
        assert list(rings["b"]._credits) == [4]  # generation 6 is not the ring's: those slots stay the core's
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_a_dead_process_s_messages_are_drained_to_the_end_not_to_the_first_batch_without_a_frame():
    """_died commits what a process sent before dying, then drops its uplink: it reads to the uplink's end of
    file, past a batch that held no frame (here 5,000 heartbeats of nobody, then a frame), though the process
    is gone (a socketpair keeps what was sent)."""
    hub = _reading_hub()
    core, theirs = uplink.pair()
    reader = uplink.Reader(core)
    try:
        theirs.setblocking(False)
        sent = 0
        for _ in range(5000):  # as many as its send buffer takes (net.core.wmem_max caps it), up to 5,000
            try:
                theirs.send(wire.encode(wire.Heartbeat(9, 1, 0.0)))
            except BlockingIOError:
                break
            sent += 1
        assert sent > 100  # several of the reader's batches' worth would need a smaller limit: see below
        theirs.setblocking(True)
        theirs.send(wire.encode(wire.FrameReady("gone", 0, 1, 0, 0.0, 0.0, 0.0, 1.0, 0.0, 16, 16, ("bt601", "limited"))))
        theirs.close()  # the process is gone: what it sent is still there
        hub._add_reader(reader)
        hub._read = functools.partial(hub._read, limit=max(1, sent // 8))  # a batch is a few heartbeats only
        dead = SimpleNamespace(exit_reason=lambda: "test", idx=9, handle=SimpleNamespace(join=lambda _: None),
                               cmd=SimpleNamespace(close=lambda _: None), up=reader, streams=set(), cuda=False)
        hub._died(dead)  # a process holding no stream: drained, its uplink dropped, nothing to restart
        assert hub.leases.stale_descriptors == 1  # the frame after the heartbeats was read (of a stream gone)
        assert reader.eof and not hub._readers
    finally:
        reader.close()
        theirs.close()


def test_an_uplink_message_too_long_or_empty_is_counted_and_the_next_one_read():
    """A packet longer than the reader's buffer (a forgery: a process clips its texts to wire.TEXT_MAX) is
    counted in bad_messages, never decoded from its cut bytes; an empty one is counted too, not taken for the
    end of file; the message after them is read."""
    hub = _reading_hub()
    core, theirs = uplink.pair()
    reader = uplink.Reader(core)
    try:
        theirs.send(wire.encode(wire.StreamEvent("x", "error", "r" * uplink.MAX_MESSAGE, 1)))
        theirs.send(b"")  # an empty packet: not the end of file (the peer is still there)
        theirs.send(wire.encode(wire.FrameReady("gone", 0, 1, 0, 0.0, 0.0, 0.0, 1.0, 0.0, 16, 16, ("bt601", "limited"))))
        assert hub._read(reader, set()) is True  # emptied
        assert hub.bad_messages == 2 and hub.leases.stale_descriptors == 1 and not reader.eof
        assert len(wire.encode(wire.StreamEvent("x", "error", wire.clip("r" * 10 ** 6), 1))) < uplink.MAX_MESSAGE
    finally:
        reader.close()
        theirs.close()


def _reading_hub() -> ingest_client.IngestHub:
    """A hub with only what reading its uplinks needs: no thread, no process."""
    hub = ingest_client.IngestHub.__new__(ingest_client.IngestHub)
    leases = ingest_leases.Leases.__new__(ingest_leases.Leases)
    leases.leases, leases.stale_descriptors, leases.bad_messages, leases.restarts = {}, 0, 0, 0
    leases._procs = SimpleNamespace(send=lambda proc, msgs: None)
    hub.procs = SimpleNamespace(procs={}, reap=lambda proc: None)
    hub.leases, hub.bad_messages, hub._closing = leases, 0, True
    hub._readers, hub._poller, hub._buf = {}, select.poll(), bytearray(uplink.MAX_MESSAGE)
    return hub


def test_an_uplink_takes_sends_from_many_threads_at_once_each_message_whole_and_in_its_thread_s_order():
    """The ingest process's threads share its uplink without a lock (process._Sender): every message arrives
    whole (one packet each: the kernel keeps the boundaries) and each thread's messages in its order, which is
    what puts a stream's final state after its last frame."""
    core, theirs = uplink.pair()
    reader, send = uplink.Reader(core), ingest_process._Sender(theirs)
    threads_n, each = 8, 400
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(threads_n)}
    buf = bytearray(uplink.MAX_MESSAGE)

    def sender(i: int) -> None:
        for seq in range(each):
            send(wire.FrameReady(f"s{i}", 0, 1, seq, 0.0, 0.0, 0.0, 1.0, 0.0, 16, 16, ("bt601", "limited"),
                                 0, 0.0, 0))

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(threads_n)]
    try:
        for t in threads:
            t.start()
        sel = select.poll()
        sel.register(reader.fd, select.POLLIN)
        while sum(map(len, got.values())) < threads_n * each:
            assert sel.poll(10_000), "the senders stalled"
            while (n := reader.read(buf)) is not None:
                assert 0 < n <= len(buf)
                msg = wire.decode(memoryview(buf)[:n])
                got[msg.stream].append(msg.seq)
        assert all(seqs == list(range(each)) for seqs in got.values())
    finally:
        reader.close()  # first: a sender still blocked on a full buffer gets EPIPE and ends
        for t in threads:
            t.join(10)
        theirs.close()


def test_a_send_that_finds_the_core_gone_calls_on_gone_first():
    """The core's end closed (the core died): the sending thread calls on_gone (the process cleans up its
    segments and exits) before anything else can happen to its stream, rather than ending it on the error."""
    core, theirs = uplink.pair()
    send, gone = ingest_process._Sender(theirs), []
    send.on_gone = lambda: gone.append(True)
    try:
        core.close()
        with pytest.raises(BrokenPipeError):
            send(wire.Heartbeat(0, 0, 0.0))
        assert gone == [True]
    finally:
        theirs.close()


def test_a_stream_state_carries_its_lag_and_one_without_it_still_decodes():
    """StreamState.lag_s (a live network stream's lag behind its camera) was added last, with a default: a message
    of a process from before it decodes as "not known", and a process's lag reaches the stream the engine lists."""
    old = wire.StreamState("cam", 3, "running", False, "", None, 0, 0, 10, 0, "cpu", "", False, 2)
    assert wire.decode(wire.encode(old)).lag_s is None
    new = wire.StreamState("cam", 3, "running", False, "", None, 0, 0, 10, 0, "cpu", "", False, 2, 0.75)
    assert wire.decode(wire.encode(new)) == new and wire.encode(old) != wire.encode(new)
    thread = SimpleNamespace(stream="cam", state="running", failed=False, end_reason="", total_frames=None,
                             reconnects=0, seq=10, lag_s=0.75, source=SimpleNamespace(decode_errors=0,
                             decode_device="cpu", decode_reason=""), ring=SimpleNamespace(dropped=0, expired=2))
    assert ingest_process._state(thread, 3) == new
