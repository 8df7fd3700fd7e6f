"""`max_batch: auto`: the largest batch whose estimate fits twice in the budget (engine/sched/batch_size.py),
and the engine's start-up sweep that measures sizes until one does not fit, then runs with the choice."""

import logging

import pytest

from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.sched.batch_size import candidate_sizes, choose_max_batch
from tests.support.engines import engine_config, run_engine


def linear(fixed_ms: float, per_frame_ms: float):
    return lambda b: (fixed_ms + per_frame_ms * b) / 1e3


@pytest.mark.timeout(10)
@pytest.mark.parametrize("estimate, sizes, budget_ms, chosen, said", [
    # 1 + 0.5 b ms: b8 5 ms (x2 = 10 <= 17), b16 9 ms (x2 = 18 > 17)
    (linear(1, 0.5), [1, 2, 4, 8, 16], 17, 8, "batch 8's estimate is 5.0 ms: the largest measured batch that runs twice "
                                              "within the 17 ms budget"),
    (linear(1, 0.5), [1, 2, 4, 8, 16], 18, 16, "batch 16's estimate is 9.0 ms"),  # exactly twice fits
    # nothing fits: batch 1, said loudly
    (linear(10, 0), [1], 17, 1, "even batch 1's estimate is 10.0 ms, over half the 17 ms budget"),
    # everything measured fits: the largest measured, and the sweep's ceiling is said
    (linear(0, 0.01), [1, 2, 4], 17, 4, "4 is the largest size measured"),
    # H200 ViT-L/16 graphs (../shared/gpu/README.md): b1 1.39 ms, b8 2.74 ms; b16 taken as 5.5 ms, b32 as 10 ms
    ({1: 1.39e-3, 2: 1.6e-3, 4: 2.0e-3, 8: 2.74e-3, 16: 5.5e-3, 32: 10e-3}.__getitem__, [1, 2, 4, 8, 16, 32], 17, 16,
     "batch 32's is 10.0 ms"),
])
def test_the_largest_batch_that_runs_twice_within_the_budget(estimate, sizes, budget_ms, chosen, said):
    choice = choose_max_batch(estimate, sizes, budget_ms / 1e3)
    assert choice.max_batch == chosen
    assert said in choice.why


@pytest.mark.timeout(10)
def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="no batch size was measured"):
        choose_max_batch(linear(1, 0), [], 0.017)
    with pytest.raises(ValueError, match="budget must be > 0"):
        choose_max_batch(linear(1, 0), [1], 0)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        candidate_sizes(0)
    assert candidate_sizes(64) == [1, 2, 4, 8, 16, 32, 64] and candidate_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


class SweptRunner(NoopRunner):
    """A model whose batch takes 1 + 0.5 b ms (reported by warmup, slept by infer), recording what warm-up asked."""

    def __init__(self):
        super().__init__(latency_s=0.001, per_frame_s=0.0005)
        self.asked: list[list[int]] = []
        self.stall_on_call = None  # this warm-up call (0-based) reports 100x the time: a stall

    def warmup(self, batch_sizes):
        self.asked.append(list(batch_sizes))
        times = super().warmup(batch_sizes)
        if len(self.asked) - 1 == self.stall_on_call:
            times = {b: 100 * s for b, s in times.items()}
        return times


@pytest.mark.timeout(60)
def test_auto_sweeps_until_a_size_does_not_fit_then_batches_up_to_the_choice(endpoint, caplog):
    """Estimates are the latency model's (mean + 2 deviations; a first measurement reads 1.2x its time):
    b8 6 ms (x2 = 12 <= 17), b16 10.8 ms (x2 > 17): the sweep measures 1..16 and stops; max_batch is 8, and
    an offline stream of 64 frames then runs in batches of at most 8, full ones among them."""
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x48&fps=30&frames=64", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": "auto"}}, budget={"latency_ms": 17})
    runner = SweptRunner()
    runner.stall_on_call = 0  # the very first batch-1 run stalls: one stall changes nothing
    with caplog.at_level(logging.INFO, logger="vidar.pool"):
        eng, finished = run_engine(cfg, models={"classify": runner})
    assert finished
    assert runner.asked == [[b] for b in (1, 2, 4, 8, 16) for _ in range(3)]  # each size 3 times, the median kept
    pool = eng.pools["classify"]
    assert pool.scheduler.max_batch == 8 and pool.batch_choice.max_batch == 8
    assert any("max_batch auto -> 8: batch 8's estimate is 6.0 ms" in r.getMessage() for r in caplog.records)
    assert max(runner.batch_sizes) == 8, runner.batch_sizes
    assert sum(runner.batch_sizes) == 64


@pytest.mark.timeout(30)
def test_a_fixed_max_batch_is_not_swept(endpoint):
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x48&fps=30&frames=4"}], endpoint,
                        models={"classify": {"max_batch": 4}})
    runner = SweptRunner()
    eng = Engine(cfg, models={"classify": runner})
    eng.start()
    try:
        # batch 1 three times first: the unset budget is chosen from it on a CPU (engine/sched/budget_auto.py);
        # then the fixed size once, no sweep
        assert runner.asked == [[1], [1], [1], [4]] and eng.pools["classify"].scheduler.max_batch == 4
        assert eng.pools["classify"].batch_choice is None
    finally:
        eng.stop()


@pytest.mark.timeout(30)
def test_auto_with_a_model_that_reports_no_times_is_refused_at_start(endpoint):
    """An estimate of 0 fits any budget: auto would pick 64 on nothing. A runner whose warm-up times nothing
    (a plug-in family's) with max_batch auto fails the start, naming the key."""
    from engine.errors import ConfigError

    class Untimed(NoopRunner):
        def warmup(self, batch_sizes):
            return {}
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x48&fps=30&frames=4"}], endpoint,
                        models={"classify": {"max_batch": "auto"}})
    eng = Engine(cfg, models={"classify": Untimed()})
    with pytest.raises(ConfigError, match=r"models\.classify\.max_batch: auto, but the pool's model reports no "
                                          r"time for batch 1 at warm-up: set a number"):
        eng.start()
    eng.stop()
