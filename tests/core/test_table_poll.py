"""The stream table's poll looks only at streams with something to poll for (commit 273dc55).

`StreamTable.poll` runs at every core step; it now looks only at the entries in its watch set: a stream with a
ring closed (FrameRing.on_close: a finite source's end, a removal's detach, a stop), removed, stopped or whose
eos is queued. A running stream's rings are all open, so it is never asked whether it is done (`_done`, and so
`Pool.stream_idle`). Each test drives a running engine (NoopRunner, synthetic sources) with `_done`,
`Pool.stream_idle` and `_queue_eos` wrapped to record the entries they were called for, on the core thread."""

from __future__ import annotations

import pytest

from engine.core.engine import Engine
from engine.core.stream_table import StreamTable
from engine.executor.pool import Pool
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.engines import engine_config

LIVE = "synthetic://shapes?size=32x32&fps=30"


class _Seen:
    """What the core thread's poll asked about: entries given to _done, stream ids given to Pool.stream_idle,
    and (entry, eos reason) for each eos queued."""

    def __init__(self, monkeypatch):
        self.done, self.idle, self.eos = [], [], []
        real_done, real_idle, real_queue = StreamTable._done, Pool.stream_idle, StreamTable._queue_eos

        def done(table, entry):
            self.done.append(entry)
            return real_done(table, entry)

        def idle(pool, stream):
            self.idle.append(stream)
            return real_idle(pool, stream)

        def queue_eos(table, entry):
            real_queue(table, entry)
            self.eos.append((entry, entry.eos_reason))
        monkeypatch.setattr(StreamTable, "_done", done)
        monkeypatch.setattr(Pool, "stream_idle", idle)
        monkeypatch.setattr(StreamTable, "_queue_eos", queue_eos)

    def polled(self) -> set:
        return {id(e) for e in list(self.done)}

    def eos_of(self, sid: str) -> list[str]:
        return [reason for e, reason in list(self.eos) if e.id == sid]


def _published(eng, sid):
    return eng.pools["classify"].acct.snapshot(sid).published


def _all_progress(eng, sids, more=5):
    """Wait until every stream in sids published `more` results beyond what it had: many core steps ran."""
    base = {s: _published(eng, s) for s in sids}
    assert wait_for(lambda: all(_published(eng, s) >= base[s] + more for s in sids), 20, 0.01), \
        {s: (base[s], _published(eng, s)) for s in sids}


@pytest.mark.timeout(90)
def test_running_streams_are_not_polled_and_a_finite_one_still_ends_and_is_forgotten(endpoint, monkeypatch):
    """Four live streams run while a finite one (added at run time) ends: the finite one is asked whether it is
    done, its eos is queued once ("end of stream") after its five results, and it is forgotten (its final state
    in the history); the running ones are never asked, across many core steps. At shutdown (stop_all), each of
    them gets its eos ("shutdown")."""
    seen = _Seen(monkeypatch)
    cams = [f"cam{i}" for i in range(4)]
    cfg = engine_config([{"id": s, "url": LIVE} for s in cams], endpoint, budget={"latency_ms": 2000},
                        ended_keep_s=0.05, max_ended=8)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        running = {s: eng.streams[s] for s in cams}
        _all_progress(eng, cams, more=3)
        reply = eng.control({"op": "add_stream", "stream": {"id": "clip", "mode": "offline",
                                                              "url": "synthetic://shapes?size=32x32&frames=5"}})
        assert reply["ok"], reply
        clip = eng.streams.get("clip")
        assert wait_for(lambda: "clip" not in eng.streams and any(r["id"] == "clip" for r in eng.table.ended()),
                        20, 0.01), "the finite stream's end was never seen: not forgotten"
        _all_progress(eng, cams)
        [record] = [r for r in eng.table.ended() if r["id"] == "clip"]
        assert record["state"] == "ended" and record["reason"] == "end of stream"
        assert record["counts"]["classify"]["published"] == 5
        assert seen.eos_of("clip") == ["end of stream"]
        polled = seen.polled()
        assert clip is None or id(clip) in polled
        assert not polled & {id(e) for e in running.values()}, "a running stream was polled"
        assert not set(seen.idle) & set(cams)
        assert all(seen.eos_of(s) == [] for s in cams)
        assert all(e.state == "running" and not e.eos_queued for e in running.values())
    finally:
        eng.stop()
    for s in cams:
        assert seen.eos_of(s) == ["shutdown"]
        assert id(running[s]) in seen.polled()  # stop_all: watched, asked, ended
        assert running[s].eos_sent


@pytest.mark.timeout(90)
def test_a_removed_stream_is_polled_ends_and_goes_while_the_others_are_not_polled(endpoint, monkeypatch):
    """Three live streams; one removed: the removal's reply comes once its eos ("removed") is queued, it is
    forgotten, and its id can be used again. The new stream of that id and the two others keep running and
    are never asked whether they are done."""
    seen = _Seen(monkeypatch)
    cams = ["a", "b", "c"]
    cfg = engine_config([{"id": s, "url": LIVE} for s in cams], endpoint, budget={"latency_ms": 2000})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        _all_progress(eng, cams, more=3)
        old_b = eng.streams["b"]
        assert eng.control({"op": "remove_stream", "stream": "b"}) == {"ok": True}
        # the removal's reply can come before the wrapper records (the future resolves inside _queue_eos)
        assert wait_for(lambda: seen.eos_of("b") == ["removed"], 10, 0.01), seen.eos_of("b")
        assert wait_for(lambda: "b" not in eng.streams, 20, 0.01), "the removed stream was never forgotten"
        assert id(old_b) in seen.polled()
        reply = eng.control({"op": "add_stream", "stream": {"id": "b", "url": LIVE}})
        assert reply["ok"], reply
        running = {s: eng.streams[s] for s in cams}
        assert running["b"] is not old_b
        _all_progress(eng, cams)
        assert not seen.polled() & {id(e) for e in running.values()}, "a running stream was polled"
        assert seen.eos_of("a") == [] and seen.eos_of("c") == [] and seen.eos_of("b") == ["removed"]
        assert all(e.state == "running" and not e.eos_queued for e in running.values())
    finally:
        eng.stop()
    assert seen.eos_of("b") == ["removed", "shutdown"]  # the old stream's, then the new one's
