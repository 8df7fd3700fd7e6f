"""Ended and failed streams are bounded (issue 31, item 4).

`max_streams` counts running streams only, so accepted adds of streams that end at once (a one-frame
synthetic stream, a missing file) used to pile up for ever: list, metrics, the view's state, the pools'
rings and the publisher's outboxes grew by one entry per add. Now a stream added at run time that ended
is forgotten after `ended_keep_s` or beyond `max_ended` (oldest first), its final state kept in list's
`ended`; the config's own streams stay. Each test drives a running engine through `Engine.control`."""

import time
import urllib.request

import pytest

from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.engines import engine_config
from tests.support.net import free_port

MAX_STREAMS, MAX_ENDED = 4, 8


def _series_streams(port: int) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split('stream="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if 'stream="' in line and not line.startswith("#")}


def _add(eng, sid: str, url: str) -> None:
    """Add a stream, waiting for a running slot (max_streams) if every one is taken."""
    def added():
        reply = eng.control({"op": "add_stream", "stream": {"id": sid, "url": url}})
        assert reply["ok"] or "max_streams" in reply["error"], reply
        return reply["ok"]
    assert wait_for(added, 20, 0.01), f"{sid}: no running slot came free"


def _running(eng) -> int:
    return sum(e.state == "running" for e in eng.streams.values())


@pytest.mark.timeout(60)
def test_streams_that_end_at_once_do_not_pile_up(endpoint):
    """80 accepted adds of streams that end at once (half one-frame synthetic streams, half missing files)
    with max_streams 4: the stream table, the pools' rings and accounting, the publisher's outboxes, the
    view's slots, /metrics and the list reply hold at most the running streams + max_ended; the history
    holds the last max_ended with their reasons; a failure forgotten still makes the run fail."""
    port = free_port()
    cfg = engine_config([{"id": "base", "url": "synthetic://shapes?size=32x32&fps=30"}], endpoint,
                        budget={"latency_ms": 2000}, metrics={"enabled": True, "port": port},
                        view={"enabled": True, "port": 0},
                        max_streams=MAX_STREAMS, max_ended=MAX_ENDED, ended_keep_s=3600)  # the count bound only
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    bound = 1 + (MAX_STREAMS - 1) + MAX_ENDED  # base, the others running, the ended ones kept
    peaks = {"table": 0, "rings": 0, "acct": 0, "boxes": 0, "view": 0, "list": 0, "series": 0}
    pool = eng.pools["classify"]

    def sample():
        listed = eng.control({"op": "list"})
        seen = {"table": len(eng.streams), "rings": len(pool.rings), "acct": len(pool.acct.streams()),
                "boxes": len(eng.publisher._boxes), "view": len(eng.view._streams), "list": len(listed["streams"]),
                "series": len(_series_streams(port))}
        for k, v in seen.items():
            peaks[k] = max(peaks[k], v)
        return listed
    ids = []
    try:
        for i in range(80):
            sid = f"e{i}"
            _add(eng, sid, "synthetic://shapes?size=32x32&frames=1" if i % 2 else f"/nonexistent/{sid}.mp4")
            ids.append(sid)
            if i % 10 == 9:
                sample()
        # every add has ended: kept ended ones are exactly the last MAX_ENDED (the count bound, not the time)
        assert wait_for(lambda: _running(eng) == 1 and all(e.eos_sent for e in eng.streams.values() if e.id != "base"),
                        20, 0.01)
        assert wait_for(lambda: len(eng.streams) == 1 + MAX_ENDED, 10, 0.01), sorted(eng.streams)
        listed = sample()
        failed, ok_failed = eng.any_failed(), eng.finished()
    finally:
        eng.stop()
    assert all(v <= bound for v in peaks.values()), (peaks, bound)
    # the newest ended ones are still listed, the ones before them are in the history (oldest first). Up
    # to MAX_STREAMS - 1 streams run at once, so they may end in a slightly different order than added.
    kept = set(listed["streams"]) - {"base"}
    ended = listed["ended"]
    recent = ids[-(2 * MAX_ENDED + MAX_STREAMS):]
    assert len(kept) == MAX_ENDED and kept <= set(recent), sorted(kept)
    assert len(ended) == MAX_ENDED and {r["id"] for r in ended} <= set(recent) - kept, [r["id"] for r in ended]
    assert [r["ended_at"] for r in ended] == sorted(r["ended_at"] for r in ended)
    for r in ended:
        n = int(r["id"][1:])
        if n % 2:  # one-frame synthetic stream: ended well, its one frame counted
            assert r["state"] == "ended" and r["counts"]["classify"]["ingested"] == 1, r
        else:      # missing file: failed, and says why
            assert r["state"] == "failed" and "nonexistent" in r["url"] and r["reason"], r
        assert r["mode"] == "live" and r["ended_at"] > 0
    assert failed and not ok_failed  # a failed stream forgotten still counts; base is still running
    gone = eng.stream_counters()["streams_forgotten"]
    # 80 ended, MAX_ENDED still listed; which kind ended last depends on the order they ended in
    assert sum(gone.values()) == 80 - MAX_ENDED and min(gone.values()) >= 40 - MAX_ENDED, gone


@pytest.mark.timeout(60)
def test_an_ended_stream_is_forgotten_after_ended_keep_s_and_its_id_comes_back(endpoint):
    """The time bound: a stream that ended stays listed (its id refused for a new add, with the reason)
    for ended_keep_s, then goes into the history, and its id may be added again."""
    keep_s = 1.0
    cfg = engine_config([], endpoint, control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
                        budget={"latency_ms": 2000}, max_ended=MAX_ENDED, ended_keep_s=keep_s)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        assert eng.control({"op": "add_stream", "stream": {"id": "one", "url": "synthetic://shapes?size=32x32&frames=3"}})["ok"]
        assert wait_for(lambda: (e := eng.streams.get("one")) is not None and e.eos_sent, 10, 0.01)
        eos_at = eng.streams["one"].ended_at
        assert eng.control({"op": "list"})["streams"]["one"]["state"] == "ended"
        again = eng.control({"op": "add_stream", "stream": {"id": "one", "url": "synthetic://shapes?size=32x32"}})
        assert not again["ok"] and "has ended and stays listed for ended_keep_s=1 s" in again["error"], again
        assert wait_for(lambda: "one" not in eng.streams, 10 * keep_s + 10, 0.01)
        assert time.monotonic() - eos_at >= keep_s
        listed = eng.control({"op": "list"})
        assert listed["streams"] == {} and [r["id"] for r in listed["ended"]] == ["one"]
        assert listed["ended"][0]["counts"]["classify"]["ingested"] == 3
        assert eng.finished() and not eng.any_failed()  # the runtime's exit: every stream ended, none failed
        assert eng.control({"op": "add_stream", "stream": {"id": "one", "url": "synthetic://shapes?size=32x32"}})["ok"]
        assert not eng.finished()
    finally:
        eng.stop()


@pytest.mark.timeout(60)
def test_a_forgotten_failure_still_fails_the_run(endpoint):
    """max_ended 0: a missing file added at run time is forgotten as soon as its eos is out; the engine
    still counts as finished (every stream ended) and as failed (exit 1)."""
    cfg = engine_config([], endpoint, control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
                        max_ended=0)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        assert eng.control({"op": "add_stream", "stream": {"id": "gone", "url": "/nonexistent/gone.mp4"}})["ok"]
        assert wait_for(lambda: eng.stream_counters()["streams_forgotten"]["failed"] == 1, 20, 0.01)
        assert eng.streams == {} and eng.control({"op": "list"})["ended"] == []  # no history at max_ended 0
        assert eng.finished() and eng.any_failed()
    finally:
        eng.stop()


@pytest.mark.timeout(60)
def test_vidar_run_keeps_the_configs_streams_and_exits_1_with_every_final_line(endpoint, monkeypatch):
    """Offline `vidar run`: the config's streams are never forgotten, however short ended_keep_s and
    max_ended are, so the run exits when the last one ends, its final status prints every stream, and
    the stream that failed long before makes it exit 1."""
    from engine.control.runtime import EXIT_STREAM_FAILED, StatusPrinter, run
    printed = []  # StatusPrinter writes to the sys.stdout of its import: its lines are taken here instead
    monkeypatch.setattr(StatusPrinter, "print", lambda self: printed.append(self.lines()))
    cfg = engine_config([{"id": "bad", "url": "/nonexistent/bad.mp4", "mode": "offline"},
                         {"id": "good", "url": "synthetic://shapes?size=32x32&fps=30&frames=45", "mode": "offline"}],
                        endpoint, max_ended=0, ended_keep_s=0.05, status={"interval_s": 60})
    eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=0.01)})  # good runs for 0.45 s or more
    assert run(eng) == EXIT_STREAM_FAILED
    final = printed[-1]
    assert [line.split()[:2] for line in final] == [["[classify]", "bad"], ["[classify]", "good"]], final
    assert "failed" in final[0] and "45/45" in final[1], final
    assert set(eng.streams) == {"bad", "good"} and eng.ended_streams() == []


@pytest.mark.timeout(60)
def test_streams_whose_eos_is_not_out_yet_count_against_max_streams(endpoint):
    """A stream that ended but whose eos still waits at the publisher (a subscriber holding it back) is
    not done: it counts against max_streams, or such streams would pile up without any bound (they cannot
    be forgotten before their eos is out). The eos is held here by keeping its sent-callback back."""
    cfg = engine_config([], endpoint, control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
                        max_streams=MAX_STREAMS, max_ended=MAX_ENDED)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    held = []
    real = eng.publisher.submit_event

    def submit_event(stream, kind, reason, on_sent=None, **kw):
        if kind == "eos" and on_sent is not None:
            held.append(on_sent)
            on_sent = None
        return real(stream, kind, reason, on_sent=on_sent, **kw)
    eng.publisher.submit_event = submit_event
    url = "synthetic://shapes?size=32x32&frames=1"
    try:
        for i in range(MAX_STREAMS):
            assert eng.control({"op": "add_stream", "stream": {"id": f"h{i}", "url": url}})["ok"]
        assert wait_for(lambda: len(held) == MAX_STREAMS, 20, 0.01)  # every one ended, no eos out
        refused = eng.control({"op": "add_stream", "stream": {"id": "more", "url": url}})
        assert not refused["ok"] and f"max_streams={MAX_STREAMS}" in refused["error"], refused
        for sent in held:
            sent()
        assert eng.control({"op": "add_stream", "stream": {"id": "more", "url": url}})["ok"]
    finally:
        eng.stop()
