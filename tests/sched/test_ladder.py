"""The degradation ladder: pure, with a fake clock (ladder.py), and once under a real overload."""

import threading
import time

import pytest

from engine.publish.client import Subscriber
from engine.config import QosConfig
from engine.core.engine import Engine
from engine.sched.ladder import TICK_S, Ladder, Rung, rungs
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.engines import engine_config

Q = QosConfig(degrade_drop_share=0.2, degrade_after_s=2.0, restore_load=0.7, restore_after_s=3.0)


class Feed:
    """Cumulative counters a pool would feed, advanced tick by tick with a fake clock."""

    def __init__(self, ladder: Ladder):
        self.ladder, self.now = ladder, 0.0
        self.offered = self.drops = 0
        self.busy = self.cap = 0.0
        self.steps = []
        ladder.observe(0.0, offered=0, load_drops=0, busy_s=0.0, capacity_s=0.0)

    def run(self, seconds: float, *, offered_per_s: float, drop_share: float, busy_share: float):
        for _ in range(round(seconds / TICK_S)):
            self.now += TICK_S
            n = offered_per_s * TICK_S
            self.offered += round(n)
            self.drops += round(n * drop_share)
            self.busy += TICK_S * busy_share
            self.cap += TICK_S
            step = self.ladder.observe(self.now, offered=self.offered, load_drops=self.drops, busy_s=self.busy,
                                       capacity_s=self.cap)
            if step:
                self.steps.append((self.now, step))


def test_rungs_are_intervals_then_quality_levels():
    assert rungs(3, 1) == [Rung(1, 0), Rung(2, 0), Rung(3, 0)]
    assert rungs(2, 3) == [Rung(1, 0), Rung(2, 0), Rung(2, 1), Rung(2, 2)]
    assert rungs(1, 2) == [Rung(1, 0), Rung(1, 1)]  # no interval rung: straight to the quality level


def test_steps_down_only_after_drops_persist_for_the_window():
    f = Feed(Ladder(Q, max_interval=4))
    f.run(1.5, offered_per_s=60, drop_share=0.5, busy_share=1.0)
    assert f.steps == []                                   # not yet the 2 s window
    f.run(1.0, offered_per_s=60, drop_share=0.05, busy_share=1.0)
    f.run(1.5, offered_per_s=60, drop_share=0.5, busy_share=1.0)
    assert f.steps == []                                   # the window restarted when drops fell
    f.run(1.0, offered_per_s=60, drop_share=0.5, busy_share=1.0)
    assert [s.direction for _, s in f.steps] == ["degraded"] and f.ladder.rung == Rung(2, 0)


def test_one_rung_per_window_down_to_the_bottom_and_no_further():
    f = Feed(Ladder(Q, max_interval=3, level_costs=[1.0, 0.25]))
    f.run(30, offered_per_s=60, drop_share=0.6, busy_share=1.0)
    times = [t for t, _ in f.steps]
    assert [s.rung for _, s in f.steps] == [1, 2, 3]
    assert all(b - a >= Q.degrade_after_s for a, b in zip(times, times[1:]))
    assert f.ladder.rung == Rung(3, 1)


def test_restores_when_the_rung_above_would_fit_and_not_before():
    f = Feed(Ladder(Q, max_interval=4))
    f.run(2.5, offered_per_s=60, drop_share=0.5, busy_share=1.0)
    assert f.ladder.rung == Rung(2, 0)
    # busy 40 % at 1 in 2 frames -> 80 % at every frame: over restore_load, stays
    f.run(10, offered_per_s=30, drop_share=0.0, busy_share=0.4)
    assert f.ladder.rung == Rung(2, 0)
    # busy 30 % -> 60 % predicted: restored after restore_after_s
    f.run(2.5, offered_per_s=30, drop_share=0.0, busy_share=0.3)
    assert f.ladder.rung == Rung(2, 0)
    f.run(1.0, offered_per_s=30, drop_share=0.0, busy_share=0.3)
    assert f.ladder.rung == Rung(1, 0) and f.steps[-1][1].direction == "restored"


def test_quality_levels_predict_their_cost():
    f = Feed(Ladder(Q, max_interval=1, level_costs=[1.0, 0.25]))
    f.run(2.5, offered_per_s=30, drop_share=0.5, busy_share=1.0)
    assert f.ladder.rung == Rung(1, 1)
    f.run(10, offered_per_s=30, drop_share=0.0, busy_share=0.5)  # x4 at full size: 200 %, stays
    assert f.ladder.rung == Rung(1, 1)
    f.run(4, offered_per_s=30, drop_share=0.0, busy_share=0.15)  # 60 %: restored
    assert f.ladder.rung == Rung(1, 0)


def test_streams_leaving_clamp_the_interval_and_do_not_fake_a_signal():
    lad = Ladder(Q, max_interval=4)
    f = Feed(lad)
    f.run(8, offered_per_s=60, drop_share=0.5, busy_share=1.0)
    assert lad.rung == Rung(4, 0)
    lad.resize(2)
    assert lad.rung == Rung(2, 0) and len(lad.rungs) == 2
    f.offered, f.drops = 0, 0  # the counters went down with the stream that left: no step from that
    assert lad.observe(f.now + TICK_S, offered=0, load_drops=0, busy_s=f.busy, capacity_s=f.cap) is None


# -- a real overload ----------------------------------------------------------------------------------

def test_real_overload_degrades_to_regular_sampling_and_climbs_back(endpoint):
    """Two 30 fps streams into a worker with capacity for 30 frames/s (2x overload): the ladder steps
    down to sampling 1 frame in k, so the published frames of each stream become regular; nothing is
    late; when the load ends (the worker becomes fast), it climbs back to every frame. Each step is an
    event on every stream and shows in the metric. The worker sleeps (NoopRunner), so its capacity
    does not depend on this machine's speed."""
    budget_ms = 400
    streams = [{"id": f"s{i}", "url": "synthetic://shapes?size=160x120&fps=30", "max_interval": 3} for i in range(2)]
    cfg = engine_config(streams, endpoint, budget={"latency_ms": budget_ms}, models={"classify": {"max_batch": 2}},
                        publish={"hwm": 100_000},
                        qos={"degrade_after_s": 1.0, "restore_after_s": 1.5, "degrade_drop_share": 0.2})
    worker = NoopRunner(per_frame_s=1 / 30)
    sub = Subscriber(endpoint, ["classify.", "event."])
    results, events, late = {"s0": [], "s1": []}, [], []
    stop = threading.Event()

    def read():
        while not stop.is_set():
            m = sub.recv(0.5)
            if m is None:
                continue
            if m["type"] == "event":
                events.append(m)
            else:
                results[m["stream"]].append((time.monotonic(), m["seq"]))
                if m["latency_ms"] > budget_ms + 1.0:
                    late.append(m["latency_ms"])
    reader = threading.Thread(target=read)
    reader.start()
    eng = Engine(cfg, models={"classify": worker})
    eng.start()
    pool = eng.pools["classify"]
    try:
        wait_for(lambda: pool.qos.state()["rung"] != 0, 30, 0.1)
        assert pool.qos.state()["rung"] >= 1, pool.qos.state()
        time.sleep(1.0)  # settle at the rung it reached
        k = pool.qos.state()["interval"]
        t0 = time.monotonic()
        time.sleep(4.0)
        t1 = time.monotonic()
        state_degraded = pool.qos.state()
        worker.per_frame_s = 1 / 600  # the load ends: 20x the capacity
        wait_for(lambda: pool.qos.state()["rung"] <= 0, 30, 0.1)
        restored = pool.qos.state()
        metrics = eng.metrics.registry.get_sample_value("vidar_qos_steps_total", {"pool": "classify",
                                                                                  "direction": "restored"})
    finally:
        eng.stop()
        stop.set()
        reader.join(5)
        sub.close()
    assert late == []
    assert restored["rung"] == 0 and restored["restored"] >= 1, restored
    assert metrics == restored["restored"]
    assert state_degraded["interval"] == k >= 2
    for stream, got in results.items():
        seqs = [seq for t, seq in got if t0 <= t <= t1]
        gaps = [b - a for a, b in zip(seqs, seqs[1:])]
        assert len(gaps) >= 10, (stream, seqs)
        regular = sum(g == k for g in gaps) / len(gaps)
        assert regular >= 0.8, (stream, k, gaps)  # regular sampling, not random deadline drops
    kinds = {(m["stream"], m["kind"]) for m in events}
    assert {("s0", "degraded"), ("s1", "degraded"), ("s0", "restored"), ("s1", "restored")} <= kinds, events
    snaps = [pool.acct.snapshot(s) for s in ("s0", "s1")]
    assert all(s.dropped.get("interval", 0) > 0 and s.balanced() for s in snaps)


@pytest.mark.parametrize("ladder", [False])
def test_ladder_off_never_samples(endpoint, ladder):
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=160x120&fps=30"}], endpoint,
                        budget={"latency_ms": 300}, qos={"ladder": ladder, "degrade_after_s": 0.5})
    eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=1 / 10)})
    eng.start()
    try:
        time.sleep(3)
        s = eng.pools["classify"].acct.snapshot("s")
    finally:
        eng.stop()
    assert s.dropped.get("interval", 0) == 0 and s.dropped.get("superseded", 0) > 0
    assert eng.pools["classify"].qos.state()["rung"] == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize("where, steps", [("source", False), ("scheduler", True)])
def test_frames_late_at_their_source_do_not_thin_the_pool(where, steps):
    """Deadline drops at the source (decoded past the deadline, or skipped to the live edge: the ingest fell behind)
    are not the pool's load: the ladder stays; the same share dropped for its deadline by the scheduler steps it."""
    from engine.frames.accounting import Accounting
    from engine.frames.lifecycle import DropReason
    from engine.frames.ring import FrameRing
    from engine.sched.qos import PoolQos

    acct = Accounting("p")
    ring = FrameRing("s", live=True, accounting=acct, memory_bytes=1 << 20, min_slots=2, max_slots=4,
                     max_frame_pixels=64 * 64)
    qos = PoolQos("p", Q, acct, levels=[], level_costs=None, emit=lambda *a: None)
    qos.attach("s", live=True, max_interval=4)
    stepped = []
    for k in range(int(4 / TICK_S)):
        now = k * TICK_S
        if where == "source":
            ring.drop_at_source(30, DropReason.DEADLINE)   # as IngestThread / the ingest process report them
        else:
            acct.ingest("s", 30)
            acct.drop("s", DropReason.DEADLINE, 30)
        acct.ingest("s", 30)  # and as many frames that got through
        for _ in range(30):
            acct.publish("s", 1.0)
        if qos.step(now, busy_s=now, workers=1) is not None:
            stepped.append(now)
    assert bool(stepped) is steps


@pytest.mark.timeout(10)
def test_drops_with_idle_workers_do_not_thin_the_pool():
    """Thinning relieves the workers: drops while they are mostly idle (the host's cores went to decoding) do not
    step the ladder; the same drops with the workers busy do."""
    idle = Feed(Ladder(Q, max_interval=4))
    idle.run(6.0, offered_per_s=60, drop_share=0.6, busy_share=Q.restore_load - 0.2)
    assert idle.steps == []
    busy = Feed(Ladder(Q, max_interval=4))
    busy.run(6.0, offered_per_s=60, drop_share=0.6, busy_share=Q.restore_load + 0.1)
    assert [s.direction for _, s in busy.steps][:1] == ["degraded"]
