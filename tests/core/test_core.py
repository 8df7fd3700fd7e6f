"""Engine core v2: state has one owner, output is its own stage, and the accounting can fail.

Each test here was written against a defect of the first engine (see the engine core v2 issue) and
checks the behaviour through the whole engine with NullWorkers (no model, no machine-speed budget)."""

import threading
import time
from collections import Counter

import pytest

from engine.core.engine import Engine
from engine.core.requests import RemoveStream
from engine.control.runtime import EXIT_DEAD, StatusPrinter, run
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.engines import engine_config, run_engine


def snap(eng, sid, pool="classify"):
    return eng.pools[pool].acct.snapshot(sid)


def test_removing_a_stream_ends_its_frames_before_its_eos(endpoint):
    """Frames of a removed stream that are queued or on a worker end as dropped(stream_removed) or are
    published, all before its eos; no result after it; the other stream loses nothing."""
    cfg = engine_config([{"id": "a", "url": "synthetic://shapes?size=64x48&fps=60"},
                         {"id": "b", "url": "synthetic://shapes?size=64x48&fps=60"}], endpoint,
                        budget={"latency_ms": 2000}, models={"classify": {"max_batch": 4, "workers": 2}},
                        publish={"min_subscribers": 1})
    col = Collector(endpoint, ["b"])
    eng = Engine(cfg, models={"classify": [NoopRunner(per_frame_s=0.01), NoopRunner(per_frame_s=0.01)]})
    eng.start()
    try:
        assert wait_for(lambda: snap(eng, "b").published > 20, 20, 0.01)
        held = {}
        assert wait_for(lambda: (held.update(snap(eng, "b").held) or held.get("workers", 0)) > 0, 20, 0.01)  # b is on a worker
        assert eng.control({"op": "remove_stream", "stream": "b"}) == {"ok": True}
        msgs = [m for m in col.wait(10) if m["stream"] == "b"]
        a_before = snap(eng, "a").published
        assert wait_for(lambda: snap(eng, "a").published > a_before + 20, 20, 0.01)
    finally:
        eng.stop()
    results = [m for m in msgs if m["type"] == "classify"]
    assert msgs[-1]["type"] == "event" and msgs[-1]["kind"] == "eos" and msgs[-1]["reason"] == "removed"
    assert [m["seq"] for m in results] == sorted(m["seq"] for m in results)
    a = snap(eng, "a")
    assert a.failed == {} and "stream_removed" not in a.dropped and a.balanced()
    assert eng.audit() == {}


def test_removal_reply_waits_for_the_eos_and_the_id_comes_back(endpoint):
    cfg = engine_config([{"id": "a", "url": "synthetic://shapes?size=64x48&fps=30"}], endpoint, budget={"latency_ms": 1000})
    eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=0.002)})
    eng.start()
    try:
        for i in range(3):
            assert eng.control({"op": "add_stream", "stream": {"id": "b", "url": "synthetic://shapes?size=32x32"}})["ok"]
            assert wait_for(lambda: snap(eng, "b").published > 2, 20, 0.01)
            assert eng.control({"op": "remove_stream", "stream": "b"}) == {"ok": True}
            # the reply came after b's eos was queued: nothing of b is held anywhere any more
            assert snap(eng, "b").in_flight == 0
        again = eng.control({"op": "remove_stream", "stream": "b"})
        assert again["ok"] is False and "unknown stream 'b'" in again["error"]
    finally:
        eng.stop()


def test_an_add_that_timed_out_while_waiting_for_a_removal_never_starts(endpoint):
    """add_stream of an id still being removed waits for that removal; if the caller's wait times out it
    is told the add failed, so the add must never happen (the first v2 core started it anyway: the
    timeout marked the outer future, not the table's deferred one)."""
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30"}], endpoint,
                        budget={"latency_ms": 60_000}, models={"classify": {"max_batch": 1}})
    eng = Engine(cfg, models={"classify": NoopRunner(latency_s=1.5)})  # a batch holds the removal ~1.5 s
    eng.start()
    try:
        acct = eng.pools["classify"].acct
        assert wait_for(lambda: acct.snapshot("s").held.get("workers", 0) > 0, 10, 0.01)
        removal = eng.core.submit(RemoveStream("s"))  # completes when the frame on the worker is done
        reply = eng.control({"op": "add_stream", "stream": {"id": "s", "url": "synthetic://shapes?size=32x32"}},
                            timeout=0.2)
        assert reply["ok"] is False and "no answer" in reply["error"], reply
        removal.result(10)
        time.sleep(0.5)  # the core forgets s right after its eos; a deferred add would start it then
        assert "s" not in eng.streams and acct.streams() == []
    finally:
        eng.stop()


def test_the_core_refuses_a_request_type_it_does_not_know_and_keeps_running(endpoint):
    """Requests to the core are typed (engine/core/requests.py): one it has no handler for is refused with
    a ControlError naming its type, never run; the core goes on and serves the next request."""
    from dataclasses import dataclass

    from engine.errors import ControlError

    @dataclass(frozen=True)
    class Reboot:
        now: bool  # no such request

    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30"}], endpoint)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        with pytest.raises(ControlError, match="does not take a Reboot request; it takes AddStream, RemoveStream, Stop"):
            eng.core.submit(Reboot(True)).result(5)
        assert eng.core.alive and eng.core.dead is None and eng.core.state == "running"
        assert eng.core.submit(RemoveStream("s", "gone")).result(10) is None
        assert eng.control({"op": "add_stream", "stream": {"id": "s", "url": "synthetic://shapes?size=32x32"}}) \
            == {"ok": True, "stream": "s"}
    finally:
        eng.stop()
    # a request to a core that has stopped fails at once, without waiting
    with pytest.raises(ControlError, match="the engine core is not running"):
        eng.core.submit(RemoveStream("s")).result(0)


def test_an_ended_streams_eos_does_not_wait_for_a_busy_pool(endpoint):
    """A short offline stream ends while two live streams keep the only worker busy: its eos goes out
    right after its last result, not when the pool is next idle (the first engine waited for that)."""
    cfg = engine_config([{"id": "short", "url": "synthetic://shapes?size=32x32&fps=30&frames=10", "mode": "offline"},
                         {"id": "l1", "url": "synthetic://shapes?size=32x32&fps=60"},
                         {"id": "l2", "url": "synthetic://shapes?size=32x32&fps=60"}], endpoint,
                        budget={"latency_ms": 300}, models={"classify": {"max_batch": 1}}, publish={"min_subscribers": 1})
    col = Collector(endpoint, ["short"])
    worker = NoopRunner(per_frame_s=0.01)  # 100 frames/s of capacity against 120 offered: never idle
    eng = Engine(cfg, models={"classify": worker})
    eng.start()
    try:
        assert wait_for(lambda: eng.streams["short"].eos_sent, 10, 0.01)
        busy = worker.batches
        time.sleep(0.3)
        assert worker.batches > busy  # the pool was still busy with the live streams
    finally:
        eng.stop()
    msgs = [m for m in col.wait(5) if m["stream"] == "short"]
    assert [m["seq"] for m in msgs if m["type"] == "classify"] == list(range(10))
    assert msgs[-1]["kind"] == "eos" and msgs[-1]["t"] - msgs[-2]["t_publish"] < 1.0


def test_one_offline_stream_with_fewer_slots_than_a_batch_still_delivers_every_frame(endpoint, caplog):
    """ring.max_slots under max_batch is allowed (batches are formed across streams; ring_shortfalls says
    so at start, after ring_needs' line of what the batch asks): a lone offline stream then runs in smaller
    batches, and loses nothing."""
    import logging
    caplog.set_level(logging.INFO, logger="vidar")
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30&frames=40", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 8}}, ring={"min_slots": 2, "max_slots": 3})
    sizes = []

    class Sized(NoopRunner):
        def prepare(self, frames):
            sizes.append(len(frames))
            return super().prepare(frames)
    eng, finished = run_engine(cfg, models={"classify": Sized(per_frame_s=0.001)})
    assert finished
    s = snap(eng, "s")
    assert (s.ingested, s.published) == (40, 40)
    assert sum(sizes) == 40 and max(sizes) <= 3  # never more frames of one stream at once than its slots
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("pool classify: ")]
    assert ("INFO", "pool classify: rings of up to 3 slots per stream") in [(lv, m.split(" (")[0]) for lv, m in said]
    assert any(lv == "WARNING" and "offer at most 2 frames at once" in m for lv, m in said), said


def test_a_streams_state_says_where_its_video_is_decoded_and_why(endpoint, clip48):
    """decode: auto (the default) decodes on the CPU where NVDEC cannot serve the stream, and says why: no
    CUDA device, or a pool that reads RGB frames only (a pool on the CPU: NVDEC frames are NV12 in
    GPU memory and go into every pool's ring alike); decode: cpu says so; decode: cuda into such a pool is
    refused, naming the pool."""
    import torch
    from engine.errors import ConfigError

    class Nv12Runner(NoopRunner):
        accepts_nv12 = True

    class RgbRunner(NoopRunner):
        accepts_nv12 = False  # a pool that reads RGB (the null pool itself reads no pixels: it takes NV12)
    streams = [{"id": "auto", "url": str(clip48), "mode": "offline"},
               {"id": "cpu", "url": str(clip48), "mode": "offline", "decode": "cpu"}]
    seen = {}
    for name, runner in (("nv12", Nv12Runner()), ("rgb", RgbRunner())):
        eng = Engine(engine_config(streams, endpoint), models={"classify": runner})
        eng.start()
        try:
            seen[name] = eng.describe()
        finally:
            eng.stop()
    assert seen["nv12"]["cpu"]["decode"] == {"device": "cpu", "reason": "decode: cpu"}
    if not torch.cuda.is_available():
        assert seen["nv12"]["auto"]["decode"] == {"device": "cpu",
                                                  "reason": "auto: no CUDA device (torch.cuda.is_available() is False)"}
    assert seen["rgb"]["auto"]["decode"] == {"device": "cpu", "reason": "auto: pool(s) ['classify'] read RGB frames only"}
    forced = engine_config([{"id": "gpu", "url": str(clip48), "mode": "offline", "decode": "cuda"}], endpoint)
    with pytest.raises(ConfigError, match=r"streams\.0 \(gpu\): stream\.decode: cuda, but pool\(s\) \['classify'\] "
                                          r"read RGB frames only .*set decode: cpu or auto"):
        Engine(forced, models={"classify": RgbRunner()}).start()


def test_an_aborting_stop_waits_for_the_batch_a_worker_runs(endpoint):
    """stop(drain=False) takes back the batch a worker runs; the worker thread must still have ended when
    stop returns (it used to be left running: a process exiting under a running torch forward dies with
    "terminate called without an active exception", exit 134, as bench_view did with vit_tiny)."""
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30&frames=1000", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 1}})
    worker = NoopRunner(per_frame_s=0.4)
    eng = Engine(cfg, models={"classify": worker})
    eng.start()
    assert wait_for(lambda: worker.batches >= 2, 20, 0.01)  # a batch is running now (each takes 0.4 s)
    eng.stop(drain=False)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("worker-classify")]


def test_a_leaked_frame_breaks_the_conservation_check(endpoint, monkeypatch):
    """in_flight is counted from what the holders hold, so a frame lost between two of them shows: the
    accounting no longer closes for that stream, while it closes at every sample when nothing leaks."""
    from engine.executor.output_stage import OutputStage
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30&frames=40", "mode": "offline"}],
                        endpoint)
    samples = []

    def run_and_sample():
        eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=0.002)})
        eng.start()
        while not eng.finished():
            samples.append((snap(eng, "s").balanced(), eng.audit()))
            time.sleep(0.002)
        eng.stop()
        return eng

    eng = run_and_sample()
    assert len(samples) > 10 and all(ok and not bad for ok, bad in samples)
    assert snap(eng, "s").published == 40

    real = OutputStage._publish
    leaked = []

    def leaky(self, res, gen, keep, fields, commit):
        if not leaked:  # lose one frame: it leaves the output stage with no terminal state
            leaked.append(keep.pop(0))
            fields = fields[1:]
        return real(self, res, gen, keep, fields, commit)
    monkeypatch.setattr(OutputStage, "_publish", leaky)
    samples.clear()
    cfg.streams[0].url = cfg.streams[0].url  # same config, fresh engine
    t_end = time.monotonic() + 5
    eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=0.002)})
    eng.start()
    while time.monotonic() < t_end and snap(eng, "s").published < 39:
        time.sleep(0.01)
    time.sleep(0.2)
    s, audit = snap(eng, "s"), eng.audit()
    eng.stop()
    assert leaked and s.published == 39 and s.in_flight == 0
    assert not s.balanced() and audit == {"classify": {"s": (1, 0)}}


class _StallOnce:
    """Output processor stand-in that blocks on its 3rd batch until released (a hung output step)."""

    ops = ()

    def __init__(self):
        self.calls, self.release, self.stalled = 0, threading.Event(), []

    def add_stream(self, stream):
        pass

    def remove_stream(self, stream):
        pass

    def process(self, frames, fields):
        self.calls += 1
        if self.calls == 3:
            self.stalled = [fv.meta.seq for fv in frames]
            self.release.wait(30)
        return fields, lambda: None

    def describe(self):
        return {}

    def counters(self):
        return {}

    def events(self):
        return []


def test_a_hung_output_step_is_caught_by_the_watchdog(endpoint, monkeypatch):
    import engine.core.engine as engine_module
    from engine.models import registry
    proc = _StallOnce()

    def with_processor(name, cfg, models=None, factory=None):
        spec = registry.build_pool(name, cfg, models, factory)
        spec.processor = proc
        return spec
    monkeypatch.setattr(engine_module, "build_pool", with_processor)
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30&frames=30", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 2}}, faults={"batch_timeout_s": 0.5},
                        publish={"min_subscribers": 1})
    col = Collector(endpoint, ["s"])
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    assert wait_for(eng.finished, 20, 0.01)
    proc.release.set()  # the abandoned thread wakes up: what it finishes must change nothing
    time.sleep(0.2)
    eng.stop()
    got = sorted(m["seq"] for m in col.wait(10) if m["type"] == "classify")
    s = snap(eng, "s")
    # exactly the hung step's frames failed; every other frame was published once, including those after it
    assert proc.stalled and s.failed == {"model_hang": len(proc.stalled)} and s.dropped == {}
    assert got == sorted(set(range(30)) - set(proc.stalled)) and max(got) > max(proc.stalled)
    assert s.in_flight == 0 and s.balanced() and eng.pools["classify"].output.replacements == 1


def test_an_exception_in_output_processing_fails_that_batch_only(endpoint, monkeypatch):
    """The first engine stalled its reorder buffer for ever when completion raised on a worker thread."""
    from engine.executor.output_stage import OutputStage
    real = OutputStage._publish
    calls, bad = Counter(), []

    def flaky(self, res, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            bad.extend(fv.meta.seq for fv in res.frames)
            raise RuntimeError("injected bug in output processing")
        return real(self, res, *args)
    monkeypatch.setattr(OutputStage, "_publish", flaky)
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30&frames=20", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 2}}, publish={"min_subscribers": 1})
    col = Collector(endpoint, ["s"])
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    assert wait_for(eng.finished, 20, 0.01)
    eng.stop()
    got = sorted(m["seq"] for m in col.wait(10) if m["type"] == "classify")
    s = snap(eng, "s")
    # exactly the frames of the batch whose output raised failed; every other frame was published, in
    # full, after it (the first engine published nothing after such a batch: its reorder buffer stalled)
    assert bad and s.failed == {"output_error": len(bad)} and s.dropped == {}
    assert got == sorted(set(range(20)) - set(bad)) and max(got) > max(bad)
    assert s.in_flight == 0 and s.balanced()


def test_a_core_crash_fails_every_frame_in_flight_and_exits_3(endpoint, monkeypatch):
    """The first engine's dispatcher crash left its frames in_flight for ever."""
    from engine.sched.scheduler import EdfScheduler
    real = EdfScheduler.schedule
    calls = Counter()

    def crashing(self, now):
        calls["n"] += 1
        if calls["n"] == 40:
            raise RuntimeError("injected scheduler bug")
        return real(self, now)
    monkeypatch.setattr(EdfScheduler, "schedule", crashing)
    cfg = engine_config([{"id": f"s{i}", "url": "synthetic://shapes?size=32x32&fps=30"} for i in range(2)], endpoint,
                        budget={"latency_ms": 500}, publish={"min_subscribers": 1})
    col = Collector(endpoint, ["s0", "s1"])
    eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=0.01)})
    assert run(eng) == EXIT_DEAD
    eos = [m for m in col.wait(10) if m["type"] == "event" and m["kind"] == "eos"]
    assert sorted(m["stream"] for m in eos) == ["s0", "s1"]
    assert all("core crashed: RuntimeError: injected scheduler bug" in m["reason"] for m in eos)
    for sid in ("s0", "s1"):
        s = snap(eng, sid)
        assert s.in_flight == 0 and s.balanced() and s.published > 0, s
    assert eng.audit() == {}


def test_a_late_success_after_the_watchdog_changes_nothing(endpoint):
    """Batch 2 hangs; the watchdog fails it and replaces the worker; the new worker is busy with a slow
    batch when the hung one finishes: that late success must not publish or touch the new worker."""
    hung = NoopRunner(hang_on_batch=2)
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30&frames=30", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 2}}, faults={"batch_timeout_s": 0.5},
                        publish={"min_subscribers": 1})
    col = Collector(endpoint, ["s"])
    eng = Engine(cfg, models={"classify": [hung]}, model_factories={"classify": lambda: NoopRunner(per_frame_s=0.05)})
    eng.start()
    pool = eng.pools["classify"]
    assert wait_for(lambda: pool.slots.rebuilds == 1 and pool.slots.workers[0].current is not None, 10, 0.01)
    new_runner, its_batch = pool.slots.workers[0], pool.slots.workers[0].current
    hung.release_hang.set()  # the abandoned thread finishes batch 2 now, successfully
    time.sleep(0.1)
    # the late success was refused: the new worker kept its slot and its batch (the first engine could mark
    # it idle while busy, so a second batch was submitted to a busy worker)
    assert pool.slots.workers[0] is new_runner and its_batch.id >= 2
    assert wait_for(eng.finished, 20, 0.01) and eng.check_dead() is None
    eng.stop()
    seqs = [m["seq"] for m in col.wait(5) if m["type"] == "classify" and m["stream"] == "s"]
    s = snap(eng, "s")
    assert len(seqs) == len(set(seqs)) == s.published and s.failed == {"model_hang": hung.batch_sizes[1]}
    assert s.published + s.failed["model_hang"] == 30 and s.in_flight == 0


def test_status_rates_are_per_pool_and_stream():
    """One stream feeding two pools: each pool's line has its own rate (the first engine keyed the last
    sample by stream only, so the second pool's rate was taken against the first pool's counts)."""
    from types import SimpleNamespace
    from engine.frames.accounting import Accounting
    fast, slow = Accounting("classify"), Accounting("sam2")
    entry = SimpleNamespace(id="cam", state="running", pools=["classify", "sam2"], ingest=None,
                            display_state="running", cfg=SimpleNamespace(mode="live"))
    every = SimpleNamespace(interval=lambda stream: 1)  # the ladder at rung 0
    eng = SimpleNamespace(pools={"classify": SimpleNamespace(acct=fast, qos=every),
                                 "sam2": SimpleNamespace(acct=slow, qos=every)}, streams={"cam": entry})
    printer = StatusPrinter(eng)
    time.sleep(0.5)
    for _ in range(60):
        fast.ingest("cam")
        fast.publish("cam", 5.0)
    for _ in range(6):
        slow.ingest("cam")
        slow.publish("cam", 50.0)
    lines = printer.lines()
    rate = {line.split()[0]: float(line.split("out")[1].split()[0]) for line in lines}
    assert rate["[classify]"] > 5 * rate["[sam2]"] > 0, lines


def test_internal_errors_never_log_the_request(endpoint, caplog, monkeypatch):
    """A control request can hold a camera's password in its URL: an internal error logs neither."""
    cfg = engine_config([{"id": "a", "url": "synthetic://shapes?size=32x32&fps=10"}], endpoint)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        def broken(scfg, *a):
            raise RuntimeError(f"bug while adding {scfg.url}")
        monkeypatch.setattr(eng.table, "add", broken)
        reply = eng.control({"op": "add_stream", "stream": {"id": "cam", "url": "rtsp://admin:hunter2@cam.local/s"}})
    finally:
        eng.stop()
    assert reply["ok"] is False and reply["error"].startswith("internal error: RuntimeError: bug while adding rtsp://***@")
    assert "hunter2" not in caplog.text and "hunter2" not in reply["error"]


def test_admission_limit_on_streams(endpoint):
    cfg = engine_config([{"id": f"s{i}", "url": "synthetic://shapes?size=32x32&fps=10"} for i in range(2)],
                        endpoint, max_streams=2)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        reply = eng.control({"op": "add_stream", "stream": {"id": "s2", "url": "synthetic://shapes"}})
        assert reply["ok"] is False and "max_streams=2 streams are running" in reply["error"]
        assert eng.control({"op": "remove_stream", "stream": "s0"})["ok"]
        assert eng.control({"op": "add_stream", "stream": {"id": "s2", "url": "synthetic://shapes?size=32x32"}})["ok"]
    finally:
        eng.stop()


@pytest.mark.parametrize("pools, expect", [(None, {"classify", "null2"}), (["null2"], {"null2"})])
def test_a_stream_feeds_only_its_pools(endpoint, pools, expect, monkeypatch):
    """streams[].pools picks the pools; the engine builds only the configured ones (families are plug-ins)."""
    from engine.models import registry
    monkeypatch.setitem(registry.FAMILIES, "null2", "tests.support.plugin_family")
    from engine.config import ModelsConfig
    monkeypatch.setattr(ModelsConfig, "configured", lambda self: {"classify": self.classify, "null2": self.classify})
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=32x32&fps=30&frames=5", "mode": "offline"}],
                        endpoint)
    cfg.streams[0].pools = pools  # after validation: the config knows no family called null2
    eng = Engine(cfg, models={"classify": NoopRunner(), "null2": NoopRunner(kind="null2")})
    eng.start()
    assert wait_for(eng.finished, 10, 0.01)
    eng.stop()
    got = {name for name, p in eng.pools.items() if p.acct.snapshot("s").published == 5}
    assert got == expect and set(eng.pools) == {"classify", "null2"}


def test_200_streams_added_and_removed_release_everything(endpoint):
    """remove_stream releases the stream's ring, decoder thread, accounting entry, outbox and metric
    series: after 200 distinct ids came and went, RSS, threads, fds and series are where they were."""
    import os
    import urllib.request

    import psutil
    from tests.support.net import free_port
    port = free_port()
    cfg = engine_config([{"id": "base", "url": "synthetic://shapes?size=64x48&fps=30"}], endpoint,
                        budget={"latency_ms": 2000}, metrics={"enabled": True, "port": port})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()

    def series():
        """Series of the churned streams (ids c0..c199). The base stream's own series are left out: it
        keeps running and may gain a series (e.g. its first `late` drop) at any time, which is no leak."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sum(1 for line in text.splitlines() if 'stream="c' in line and not line.startswith("#"))

    live_series = []

    def churn(ids):
        for sid in ids:
            reply = eng.control({"op": "add_stream", "stream": {"id": sid, "url": "synthetic://shapes?size=96x64&fps=60"}})
            assert reply["ok"], reply
            assert wait_for(lambda: snap(eng, sid).published >= 2, 10, 0.01), snap(eng, sid)
            if len(live_series) < 3:
                live_series.append(series())  # while it runs, a stream has series: the count below can fail
            assert eng.control({"op": "remove_stream", "stream": sid}) == {"ok": True}

    def released():
        """A removal completes after its reply: the stream's last frames end and its eos goes out
        first, then its entries are forgotten. Sampled before that, the last stream is still there."""
        return (not [t for t in threading.enumerate() if t.name.startswith("source-c")]
                and list(eng.streams) == ["base"] and eng.pools["classify"].acct.streams() == ["base"])

    def sample():
        assert wait_for(released, 10, 0.01), (list(eng.streams), eng.pools["classify"].acct.streams())
        return (psutil.Process().memory_info().rss / 2**20, threading.active_count(), len(os.listdir("/proc/self/fd")),
                series(), len(eng.pools["classify"].acct.streams()), len(eng.streams))
    try:
        churn([f"c{i}" for i in range(20)])  # warm-up: allocator pools, thread stacks, lazily imported code
        rss0, threads0, fds0, series0, acct0, table0 = sample()
        churn([f"c{i}" for i in range(20, 200)])
        rss1, threads1, fds1, series1, acct1, table1 = sample()
    finally:
        eng.stop()
    assert min(live_series) > 0 and series0 == series1 == 0, (live_series, series0, series1)
    assert (threads1, fds1, acct1, table1) == (threads0, fds0, acct0, table0) and table1 == 1
    assert rss1 - rss0 < 15, (rss0, rss1)


def test_an_offline_stream_held_back_by_its_subscriber_never_delays_live_frames(endpoint):
    """Stream `off` (offline) has one subscriber that stopped reading; stream `live` has its own reader.
    The offline stream stops (credit: its frames wait in its ring, its decoder waits), and nothing of it
    is lost; the live stream is served as if alone: no late results, no drops but for its deadline."""
    from engine.publish.client import Subscriber
    from tests.support.collector import stuck_subscriber
    cfg = engine_config([{"id": "off", "url": "synthetic://shapes?size=64x48&fps=30&frames=2000", "mode": "offline"},
                         {"id": "live", "url": "synthetic://shapes?size=64x48&fps=30"}], endpoint,
                        budget={"latency_ms": 300}, publish={"hwm": 20, "queue_size": 32})
    stuck = stuck_subscriber(endpoint, ["classify.off"])
    reader = Subscriber(endpoint, ["classify.live"])

    class Padded(NoopRunner):  # 20 KB results, so the stuck subscriber's queues and socket buffers fill
        def infer(self, inputs):
            return [{"pad": b"x" * 20_000} for _ in super().infer(inputs)]
    eng = Engine(cfg, models={"classify": Padded(per_frame_s=0.001)})
    eng.start()
    try:
        assert wait_for(lambda: eng.publisher.pending().get("off", 0) > 0, 10, 0.01)  # off is held back now
        t0 = time.monotonic()
        got = []
        while time.monotonic() - t0 < 4:
            m = reader.recv(1)
            if m is not None:
                got.append(m)
        off, live = snap(eng, "off"), snap(eng, "live")
        assert off.dropped == {} and off.published < 2000 and off.held.get("publisher", 0) <= 32
        assert live.dropped.get("late", 0) == 0 and len(got) >= 0.9 * 30 * 4, (len(got), live)
        assert max(m["latency_ms"] for m in got) <= 300
        stuck.close()  # the subscriber goes away: the offline stream runs to its end, nothing lost
        assert wait_for(lambda: eng.streams["off"].eos_sent, 30, 0.01)
    finally:
        reader.close()
        eng.stop()
    off = snap(eng, "off")
    assert off.published == 2000 and off.dropped == {} and off.failed == {}
