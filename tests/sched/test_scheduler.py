"""The scheduler driven step by step with a fake clock: no model, no sleep."""

import math
from dataclasses import dataclass

import pytest

from engine.sched.latency import LatencyModel
from engine.sched.scheduler import EdfScheduler


@dataclass
class Item:
    name: str
    deadline: float


def make(max_batch=4, max_wait=0.004, times=None):
    lat = LatencyModel()
    for b, s in (times or {1: 0.010, 4: 0.025}).items():
        lat.observe(b, s)
    return EdfScheduler(max_batch=max_batch, latency=lat, max_wait_s=max_wait)


def add(s, now, *items, key=None):
    """Each item is its own stream unless a key is given (a live stream gives only its newest frame)."""
    for it in items:
        s.add(it, deadline=it.deadline, now=now, key=key or it.name)


def names(items):
    return [i.name for i in items]


def test_earliest_deadline_first_across_streams():
    s = make(max_batch=2)
    add(s, 0.0, Item("b1", 0.30), Item("a1", 0.10), Item("c1", 0.20))
    plan = s.schedule(0.0)
    assert names(plan.batch) == ["a1", "c1"]
    assert names(s.schedule(0.0).batch) == [] and s.pending() == 1  # b1 waits for a partner...
    assert names(s.schedule(0.005).batch) == ["b1"]                   # ...but not longer than max_wait


def test_drops_frames_that_cannot_meet_their_deadline_before_compute():
    s = make()
    est1 = s.latency.estimate(1)
    add(s, 0.0, Item("doomed", 0.5 * est1), Item("ok", 1.0))
    plan = s.schedule(0.0)
    assert names(plan.dropped) == ["doomed"]
    assert "doomed" not in names(plan.batch)


def test_batch_size_limited_by_the_earliest_deadline():
    s = make(max_batch=4, times={1: 0.010, 2: 0.018, 3: 0.026, 4: 0.034})
    tight = s.latency.estimate(2) + 0.001  # room for a batch of 2, not 3
    add(s, 0.0, Item("t", tight), *(Item(f"x{i}", 1.0) for i in range(5)))
    plan = s.schedule(0.0)
    assert names(plan.batch) == ["t", "x0"]
    assert plan.wake_at == 0.0  # more is pending: ask again at once


def test_full_batch_dispatches_immediately():
    s = make(max_batch=4)
    add(s, 0.0, *(Item(f"f{i}", 10.0) for i in range(4)))
    assert len(s.schedule(0.0).batch) == 4


def test_waits_for_a_batch_then_dispatches_at_max_wait():
    s = make(max_batch=4, max_wait=0.004)
    add(s, 0.0, Item("a", 10.0))
    plan = s.schedule(0.0)
    assert plan.batch == [] and plan.wake_at == pytest.approx(0.004)
    add(s, 0.002, Item("b", 10.0))
    assert s.schedule(0.003).batch == []
    assert names(s.schedule(0.004).batch) == ["a", "b"]


def test_dispatches_early_when_waiting_longer_would_miss_the_deadline():
    s = make(max_batch=4, max_wait=1.0)  # a long allowed wait: the deadline must cut it short
    est2 = s.latency.estimate(2)
    add(s, 0.0, Item("a", 0.050))
    plan = s.schedule(0.0)
    assert plan.batch == [] and plan.wake_at == pytest.approx(0.050 - est2)
    assert s.schedule(plan.wake_at - 1e-6).batch == []
    assert names(s.schedule(plan.wake_at).batch) == ["a"]


def test_offline_frames_have_no_deadline_and_go_after_live_ones():
    s = make(max_batch=2)
    add(s, 0.0, Item("off1", math.inf), Item("off2", math.inf), key="offline")
    add(s, 0.0, Item("live", 1.0))
    plan = s.schedule(10.0)  # offline frames are never dropped, however late it is
    assert plan.dropped == [Item("live", 1.0)]
    assert names(plan.batch) == ["off1", "off2"]


def test_learns_latency_online():
    s = make(max_batch=2, times={1: 0.010})
    for _ in range(30):
        s.update(1, 0.050)  # the model became slower
    assert s.latency.estimate(1) == pytest.approx(0.050, rel=0.05)
    add(s, 0.0, Item("a", 0.030))
    assert names(s.schedule(0.0).dropped) == ["a"]


def test_remove_and_count():
    s = make()
    add(s, 0.0, Item("a", 1.0), Item("b", 1.0))
    assert s.count(lambda i: i.name == "a") == 1
    assert names(s.remove(lambda i: i.name == "a")) == ["a"] and s.pending() == 1


def test_latency_model_interpolates_conservatively():
    lat = LatencyModel(k=0.0)
    assert lat.estimate(3) == 0.0  # nothing measured: the prior
    lat.observe(2, 0.020)
    lat.observe(8, 0.080)
    assert lat.estimate(1) == pytest.approx(0.020)    # below the smallest: not optimistic
    assert lat.estimate(5) == pytest.approx(0.050)    # between: linear
    assert lat.estimate(16) == pytest.approx(0.160)   # above: linear scaling
    with pytest.raises(ValueError, match="alpha"):
        LatencyModel(alpha=0)


def test_rejects_bad_max_batch():
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        EdfScheduler(max_batch=0, latency=LatencyModel())


def test_probe_recovers_from_a_pessimistic_estimate():
    """A slow spell pushed the estimate past the budget: without a probe every frame would be dropped for ever."""
    s = make(max_batch=2, times={1: 5.0})  # believes a frame takes 5 s; the budget below is 1 s
    t = 0.0
    add(s, t, Item("f0", t + 1.0))
    assert names(s.schedule(t).dropped) == ["f0"]            # no probe yet: the interval starts now
    t = 0.5
    add(s, t, Item("f1", t + 1.0))
    assert names(s.schedule(t).dropped) == ["f1"]
    t = 1.0
    add(s, t, Item("f2", t + 1.0), Item("f3", t + 1.01))
    plan = s.schedule(t)
    assert names(plan.batch) == ["f3"] and names(plan.dropped) == ["f2"] and s.probes == 1  # the newest runs
    for _ in range(20):
        s.update(1, 0.05)  # it was fast after all
    add(s, 1.2, Item("f4", 2.2))
    assert names(s.schedule(1.2).batch) == ["f4"]


@dataclass
class SItem:
    stream: str
    n: int
    deadline: float


def test_fair_across_streams_under_overload():
    """4 streams at 30 fps against capacity for 2 frames per 33 ms: plain EDF phase-locks and starves
    some streams; the fair order serves every stream alike."""
    s = make(max_batch=2, max_wait=0.0, times={1: 0.017, 2: 0.033})
    served = {k: 0 for k in "abcd"}
    busy_until, t, n = 0.0, 0.0, 0
    while t < 10.0:
        for i, k in enumerate("abcd"):  # frames arrive phase-shifted by 8 ms
            if abs((t - i * 0.008) % (1 / 30)) < 0.0005:
                s.add(SItem(k, n, t + 0.2), deadline=t + 0.2, now=t, key=k)
                n += 1
        if t >= busy_until:
            plan = s.schedule(t)
            for it in plan.batch:
                served[it.stream] += 1
            if plan.batch:
                busy_until = t + 0.033
        t = round(t + 0.001, 6)
    counts = list(served.values())
    assert min(counts) > 0 and max(counts) <= 1.2 * min(counts), served


# -- freshest first (live streams) -----------------------------------------------------------------

def test_a_live_stream_gives_its_newest_frame_and_older_ones_are_superseded():
    s = make(max_batch=4)
    add(s, 0.0, Item("f0", 1.0), Item("f1", 1.03), Item("f2", 1.06), key="cam")
    add(s, 0.0, Item("other", 1.0))
    assert s.schedule(0.0).batch == []  # waits up to max_wait for partners; nothing superseded meanwhile
    plan = s.schedule(0.005)
    assert sorted(names(plan.batch)) == ["f2", "other"]
    assert names(plan.superseded) == ["f0", "f1"] and plan.dropped == []
    assert s.pending() == 0


def test_offline_streams_give_every_frame_in_order():
    s = make(max_batch=4)
    add(s, 0.0, *(Item(f"o{i}", math.inf) for i in range(6)), key="file")
    assert names(s.schedule(0.0).batch) == ["o0", "o1", "o2", "o3"]
    assert names(s.schedule(0.0).batch) == []  # o4, o5 wait for partners (max_wait)
    plan = s.schedule(0.01)
    assert names(plan.batch) == ["o4", "o5"] and plan.superseded == []


def _simulate(*, period, service, budget, workers=1, max_batch=1, streams=("a",), seconds=20.0):
    """Live streams arriving every `period` s; each batch takes `service` s per frame. Returns
    (dispatch order per stream, latencies of processed frames, counts per outcome)."""
    s = make(max_batch=max_batch, max_wait=0.0, times={1: service, 2: 2 * service, 4: 4 * service})
    busy = [0.0] * workers
    done, lat, outcome = {k: [] for k in streams}, [], {"batch": 0, "dropped": 0, "superseded": 0, "offered": 0}
    t, n, step = 0.0, 0, 0.001
    next_frame = {k: i * period / len(streams) for i, k in enumerate(streams)}
    while t < seconds:
        for k in streams:
            if t >= next_frame[k] - 1e-9:
                s.add(SItem(k, n, t + budget), deadline=t + budget, now=t, key=k)
                n, next_frame[k], outcome["offered"] = n + 1, next_frame[k] + period, outcome["offered"] + 1
        for w in range(workers):
            if t >= busy[w]:
                plan = s.schedule(t)
                outcome["dropped"] += len(plan.dropped)
                outcome["superseded"] += len(plan.superseded)
                if plan.batch:
                    outcome["batch"] += len(plan.batch)
                    busy[w] = t + service * len(plan.batch)
                    for it in plan.batch:
                        done[it.stream].append(it.n)
                        lat.append(busy[w] - (it.deadline - budget))
        t = round(t + step, 6)
    return done, sorted(lat), outcome


def test_without_overload_nothing_is_superseded():
    done, lat, out = _simulate(period=1 / 30, service=0.020, budget=0.2, streams=("a", "b"), workers=2, max_batch=2)
    assert out["superseded"] == 0 and out["dropped"] == 0
    assert out["batch"] >= out["offered"] - 2  # everything but the last frames in flight


def test_twice_overloaded_serves_fresh_frames_in_order_and_fairly():
    """2x overload (a frame every 33 ms, 67 ms to run one): the published latency stays far below the
    budget (oldest-first would sit next to it), each stream's frames run in increasing order, and the
    streams are served alike."""
    budget = 0.4
    done, lat, out = _simulate(period=1 / 15, service=0.066, budget=budget, streams=("a", "b"), workers=1,
                               max_batch=1)
    p50 = lat[len(lat) // 2]
    assert p50 <= 0.5 * budget, p50
    assert max(lat) <= budget
    assert out["superseded"] > 0.3 * out["offered"]
    for k, seqs in done.items():
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), k
    counts = [len(v) for v in done.values()]
    assert max(counts) <= 1.1 * min(counts), counts


def test_never_older_than_a_frame_already_dispatched_with_several_workers():
    done, _, out = _simulate(period=1 / 60, service=0.030, budget=0.3, streams=("a", "b", "c"), workers=3, max_batch=2)
    assert out["superseded"] > 0  # it was overloaded
    for k, seqs in done.items():
        assert all(x < y for x, y in zip(seqs, seqs[1:])), k
    assert out["batch"] + out["dropped"] + out["superseded"] <= out["offered"]
