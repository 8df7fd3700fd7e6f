"""Helpers for the ingest-process tests (tests/ingest/): an engine whose streams decode in processes, its stop
with the check that nothing of it is left, and readers of what a Collector got."""

from __future__ import annotations

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
