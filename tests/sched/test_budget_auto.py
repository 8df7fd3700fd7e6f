"""`budget.latency_ms: auto` (the default): the budget chosen at start for where the pools run
(engine/sched/budget_auto.py), a value the config sets always winning, and said at start (issue 42: a CPU engine
with the GPU's 17 ms published almost nothing)."""

from __future__ import annotations

import logging

import pytest

from engine.config import build_config
from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.sched.budget_auto import PoolTiming, choose_budget, runs_on_gpu
from tests.support.engines import engine_config
from tests.support.net import free_port

CPU, GPU = False, True
AUTO_END = "; set budget.latency_ms to choose)"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("configured, pools, ms, said", [
    # unset, on a GPU: 17 ms, whatever the model's time (it is not measured for this)
    (None, {"classify": PoolTiming(GPU)}, 17, "(auto on a GPU: the 17 ms target of a pool on a GPU"),
    # unset, on the CPU: the floor for a fast model ...
    (None, {"classify": PoolTiming(CPU, 0.0142)}, 150, "(auto, on the CPU: the larger of 150 ms and 4 x the slowest "
                                                      "batch 1 at warm-up (classify 14.2 ms), rounded up to 10 ms"),
    (None, {"noop": PoolTiming(CPU, 0.0)}, 150, "(noop 0.0 ms)"),
    (None, {"plugin": PoolTiming(CPU, None)}, 150, "(plugin not measured)"),
    # ... 4 x batch 1, rounded up to 10 ms, for a slow one (ViT-L/16 on 2 cores: ~0.5 s)
    (None, {"classify": PoolTiming(CPU, 0.512)}, 2050, "(classify 512.0 ms)"),
    (None, {"classify": PoolTiming(CPU, 0.06)}, 240, "(classify 60.0 ms)"),  # 4 x 0.06 is 240.00000000000003
    # several pools: the slowest sets it; a pool on the CPU beside one on a GPU sets it too
    (None, {"classify": PoolTiming(CPU, 0.02), "sam2": PoolTiming(CPU, 0.3)}, 1200, "(classify 20.0 ms, sam2 300.0 ms)"),
    (None, {"classify": PoolTiming(GPU), "noop": PoolTiming(CPU, 0.05)}, 200, "(auto, pool noop runs on the CPU: "),
    # set: wins on either machine, whatever the model
    (33, {"classify": PoolTiming(GPU)}, 33, "budget.latency_ms: 33 ms (set in the config)"),
    (33.0, {"classify": PoolTiming(CPU, 0.5)}, 33, "budget.latency_ms: 33 ms (set in the config)"),
])
def test_the_budget_table(configured, pools, ms, said):
    choice = choose_budget(configured, pools)
    assert choice.latency_ms == ms
    assert choice.note.startswith(f"budget.latency_ms: {ms} ms (") and said in choice.note, choice.note
    assert choice.note.endswith(AUTO_END) == (configured is None), choice.note


@pytest.mark.timeout(10)
@pytest.mark.parametrize("device, cuda, on_gpu", [
    ("auto", True, True), ("cuda", True, True), ("cpu", True, False), (None, True, False),  # None: noop, no device
    ("auto", False, False), ("cpu", False, False), (None, False, False),
])
def test_a_pool_runs_on_a_gpu_only_where_its_device_resolves_to_one(device, cuda, on_gpu):
    assert runs_on_gpu(device, cuda) is on_gpu


@pytest.mark.timeout(10)
@pytest.mark.parametrize("cuda, in_file, on_cpu, override, expected", [
    (CPU, None, None, None, 150),     # a CPU, unset: auto (ViT-Ti's 14.2 ms: the floor)
    (GPU, None, None, None, 17),      # a GPU, unset: auto
    (CPU, 40, None, None, 40),        # set in the file: wins on either
    (GPU, 40, None, None, 40),
    (CPU, None, 250, None, 250),      # on_cpu sets it on a CPU ...
    (GPU, None, 250, None, 17),       # ... and not on a GPU (auto there)
    (CPU, 40, 250, None, 250),        # on_cpu over the file, on a CPU
    (CPU, None, 250, 90, 90),         # --set over on_cpu
    (GPU, 40, None, 90, 90),          # --set over the file
    (CPU, 40, None, "auto", 150),     # --set budget.latency_ms=auto: back to the machine's choice
    (GPU, 40, None, "auto", 17),
])
def test_set_on_cpu_and_set_win_over_auto_on_either_machine(cuda, in_file, on_cpu, override, expected):
    tree = {"streams": [{"id": "s", "url": "synthetic://shapes"}], "models": {"classify": {"device": "auto"}}}
    if in_file is not None:
        tree["budget"] = {"latency_ms": in_file}
    if on_cpu is not None:
        tree["on_cpu"] = {"budget.latency_ms": on_cpu}
    cfg, _ = build_config(tree, overrides=[f"budget.latency_ms={override}"] if override is not None else [],
                          cuda_available=cuda)
    on_gpu = runs_on_gpu(cfg.models.classify.device, cuda)
    choice = choose_budget(cfg.budget.configured_ms, {"classify": PoolTiming(on_gpu, None if on_gpu else 0.0142)})
    assert choice.latency_ms == expected


class Timed(NoopRunner):
    """A model whose batch of b takes 30 + 10 b ms (reported by warm-up), counting the warm-up calls."""

    def __init__(self):
        super().__init__(latency_s=0.03, per_frame_s=0.01)
        self.asked: list[list[int]] = []

    def warmup(self, batch_sizes):
        self.asked.append(list(batch_sizes))
        return super().warmup(batch_sizes)


def _started(cfg, runner) -> Engine:
    eng = Engine(cfg, models={"classify": runner})
    eng.start()
    return eng


@pytest.mark.timeout(60)
def test_a_cpu_engine_chooses_its_budget_after_warm_up_and_every_reader_sees_it(endpoint, caplog):
    """No budget in the config, on the CPU: batch 1 (40 ms) is measured first, the budget is 4 x 40 = 160 ms, said
    once, written into the config; max_batch auto is chosen for it (batch 2's estimate 60 ms fits twice in 160,
    batch 4's 84 does not; in 17 ms nothing would), and the streams' deadlines are cut from it."""
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x48&fps=10", "mode": "live"}], endpoint,
                        models={"classify": {"max_batch": "auto"}})
    assert cfg.budget.latency_ms == "auto"
    runner = Timed()
    with caplog.at_level(logging.INFO, logger="vidar.engine"):
        eng = _started(cfg, runner)
    try:
        note = ("budget.latency_ms: 160 ms (auto, on the CPU: the larger of 150 ms and 4 x the slowest batch 1 at "
                "warm-up (classify 40.0 ms), rounded up to 10 ms; set budget.latency_ms to choose)")
        assert eng.budget_note == note
        assert [r.getMessage() for r in caplog.records].count(note) == 1
        assert eng.cfg.budget.latency_ms == 160.0  # every reader of the key reads the number from now on
        pool = eng.pools["classify"]
        assert runner.asked[:3] == [[1], [1], [1]] and [1] not in runner.asked[3:]  # batch 1 measured once (x3)
        assert pool.scheduler.max_batch == 2 and "160 ms budget" in pool.batch_choice.why
        assert eng.streams["s"].ingest.budget_s == pytest.approx(0.16)  # the stream's deadlines
        assert any("within budget.latency_ms (160 ms)" in r.getMessage() for r in caplog.records)  # ring sizing
    finally:
        eng.stop()
    # the same config object started again is chosen again, not taken for a budget the user set
    again = _started(cfg, Timed())
    try:
        assert again.budget_note == note
    finally:
        again.stop()


@pytest.mark.timeout(60)
def test_a_set_budget_wins_and_is_said_as_set(endpoint):
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x48&fps=10"}], endpoint,
                        models={"classify": {"max_batch": "auto"}}, budget={"latency_ms": 17})
    eng = _started(cfg, Timed())
    try:
        assert eng.budget_note == "budget.latency_ms: 17 ms (set in the config)"
        assert eng.cfg.budget.latency_ms == 17 and eng.pools["classify"].scheduler.max_batch == 1  # 2 x 48 ms > 17
    finally:
        eng.stop()


@pytest.mark.timeout(60)
def test_a_gpu_engine_keeps_17_ms_without_timing_batch_1_for_it(endpoint, monkeypatch):
    """A pool whose device resolves to a GPU gets 17 ms (the model's time does not move it). torch is told there
    is a GPU; the injected model never touches one."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = engine_config([], endpoint, models={"classify": {"device": "auto", "max_batch": 4}},
                        control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    runner = Timed()
    eng = _started(cfg, runner)
    try:
        assert eng.budget_note == ("budget.latency_ms: 17 ms (auto on a GPU: the 17 ms target of a pool on a GPU; "
                                   "set budget.latency_ms to choose)")
        assert eng.cfg.budget.latency_ms == 17.0 and runner.asked == [[1, 4]]  # the warm-up as before, no probe
    finally:
        eng.stop()
