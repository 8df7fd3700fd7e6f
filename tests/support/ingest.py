"""Helpers for the ingest-process tests (tests/ingest/): an engine whose streams decode in processes, its stop
with the check that nothing of it is left, and readers of what a Collector got."""

from __future__ import annotations

import contextlib
import os

import psutil

from engine.core.engine import Engine
from engine.ingest import slots as ingest_slots
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.engines import engine_config

SYN = "synthetic://shapes?size=64x48&fps=60"


def ingest_engine(streams, endpoint, per_frame_s=0.001, **sections):
    # nice 0: a heartbeat late by a second under a loaded suite would count as a hang (the nice test sets its own)
    ingest = {"processes": 2, "heartbeat_s": 0.1, "hang_after_s": 1.0, "nice": 0, **sections.pop("ingest", {})}
    cfg = engine_config(streams, endpoint, ingest=ingest, budget=sections.pop("budget", {"latency_ms": 1000}),
                        **sections)
    return Engine(cfg, models={"classify": NoopRunner(per_frame_s=per_frame_s)})


def stop_engine(eng):
    """Stop the engine and check that no ingest process is left (by the pids it started)."""
    pids = list(eng.ingest.pids().values()) if eng.ingest else []
    run = eng.ingest._run if eng.ingest else None
    eng.stop()
    assert run is None or not [n for n in os.listdir(ingest_slots.SHM_DIR) if n.startswith((f"vidar-{run}-",
                                                                                           f"vidar-{run}."))]
    assert wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                    for p in pids), 10), "an ingest process outlived the engine"


def results_of(msgs, stream):
    return [m for m in msgs if m.get("stream") == stream and m["type"] != "event"]


def events_of(msgs, stream):
    return [(m["kind"], m.get("reason", "")) for m in msgs if m.get("stream") == stream and m["type"] == "event"]


def balanced(eng):
    for e in eng.table.snapshot():
        for name in e.pools:
            s = eng.pools[name].acct.snapshot(e.id)
            assert s.ingested == s.published + sum(s.dropped.values()) + sum(s.failed.values()) + s.in_flight, s
    assert eng.audit() == {}


def proc_of(eng, stream):
    label = eng.streams[stream].ingest.process  # "ingest-1 (pid 1234)"
    return int(label.rsplit("pid ", 1)[1].rstrip(")")) if "pid" in label else None


@contextlib.contextmanager
def one_lent_slot(monkeypatch, tmp_path, stream: str, h: int, w: int, *, pixel_format: str = "nv12",
                  live: bool = True):
    """An ingest process's RemoteRing with one slot of h x w lent to it (segment in tmp_path), and a FrameMeta-like
    object for its write(): (ring, segment, meta). Both closed and unlinked after."""
    from engine.ingest import process as ingest_process
    from engine.ingest import wire

    monkeypatch.setattr(ingest_slots, "SHM_DIR", str(tmp_path))
    ring = ingest_process.RemoteRing(stream, live=live, gen=1, send=lambda m: None, max_frame_pixels=10 ** 6,
                                     run="0123abcdp1s2", pixel_format=pixel_format)
    seg = ingest_slots.Segment(f"vidar-0123abcdp1s2-{stream}-1", 1, h, w, create=True, pixel_format=pixel_format)
    try:
        ring.attach(wire.Slots(stream, 1, seg.name, 1, h, w))
        ring.credit(wire.Credit(stream, 1, [0]))
        meta = type("M", (), {"seq": 0, "pts": 0.0, "t_capture": 0.0, "t_capture_mono": 0.0, "deadline": 1e9,
                              "decode_s": 0.0, "colour": ("bt601", "limited")})()
        yield ring, seg, meta
    finally:
        ring.close()
        seg.unlink()
