"""Defaults that fit the machine (engine/tuning.py) and the warm-up check that widens them."""

import logging

import pytest

from engine.config import FaultsConfig
from engine.pool import Pool
from engine.publisher import Publisher
from engine.config import PublishConfig
from engine.tuning import ThreadPlan, plan_classify, split
from engine.workers.null import NullWorker
from engine.workers.registry import PoolSpec


@pytest.mark.parametrize("cores, pools, cuda, workers, threads, expect", [
    (2, 1, False, None, None, (2, 1)),      # our CI: two one-thread instances
    (1, 1, False, None, None, (1, 1)),
    (2, 2, False, None, None, (1, 1)),      # two pools share two cores
    (16, 1, False, None, None, (8, 2)),     # past 8 instances, cores become threads
    (16, 2, False, None, None, (8, 1)),
    (32, 1, False, None, None, (8, 4)),
    (8, 1, False, 2, None, (2, 4)),         # workers given: threads fill the share
    (8, 1, False, None, 4, (2, 4)),         # threads given: instances fill the share
    (8, 1, False, 3, 5, (3, 5)),            # both given: kept
    (16, 1, True, None, None, (1, None)),   # GPU: one instance
])
def test_plan_table(cores, pools, cuda, workers, threads, expect):
    plan = plan_classify(cores=cores, pools=pools, cuda=cuda, workers=workers, threads=threads)
    assert (plan.workers, plan.threads) == expect
    assert plan.auto == (workers is None and threads is None and not cuda)


def test_split_never_exceeds_the_cores():
    for cores in range(1, 65):
        w, t = split(cores)
        assert 1 <= w * t <= cores and w <= 8


class Slow(NullWorker):
    def __init__(self, b1_s):
        super().__init__()
        self.b1_s, self.closed = b1_s, False

    def warmup(self, batch_sizes):
        return {b: self.b1_s * b for b in batch_sizes}

    def close(self):
        self.closed = True


def _pool(workers, plan):
    spec = PoolSpec("classify", workers, None, max_batch=2, threads=plan.threads, plan=plan)
    pub = Publisher(PublishConfig(endpoint="tcp://127.0.0.1:0"))
    return Pool(spec, publisher=pub, faults=FaultsConfig(), max_wait_s=0.004, credit=8), pub


@pytest.mark.parametrize("b1_s, budget_s, widened", [(0.3, 0.4, True), (0.1, 0.4, False), (0.3, None, False)])
def test_warmup_widens_one_thread_instances_that_would_eat_the_budget(b1_s, budget_s, widened, caplog):
    workers = [Slow(b1_s), Slow(b1_s)]
    pool, pub = _pool(workers, ThreadPlan(2, 1, "test", auto=True))
    try:
        with caplog.at_level(logging.INFO, logger="vidar.pool"):
            pool.warmup(budget_s=budget_s)
    finally:
        pub.close(timeout=1)
    assert (len(pool.spec.workers), pool.spec.threads) == ((1, 2) if widened else (2, 1))
    assert workers[1].closed == widened
    assert ("1 worker x 2 threads instead" in caplog.text) == widened


def test_a_configured_plan_is_never_widened():
    pool, pub = _pool([Slow(0.3), Slow(0.3)], ThreadPlan(2, 1, "as configured", auto=False))
    try:
        pool.warmup(budget_s=0.1)
    finally:
        pub.close(timeout=1)
    assert (len(pool.spec.workers), pool.spec.threads) == (2, 1)


def test_engine_logs_the_chosen_plan(endpoint, monkeypatch, caplog):
    from engine import engine as engine_mod
    from engine.engine import Engine
    from tests.conftest import engine_config
    monkeypatch.setattr(engine_mod, "usable_cores", lambda: 2)
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=96x64&fps=30&frames=3", "mode": "offline"}],
                        endpoint)
    assert cfg.models.classify.workers is None and cfg.models.classify.threads is None
    eng = Engine(cfg)
    with caplog.at_level(logging.INFO, logger="vidar.pool"):
        eng.start()
    eng.stop()
    assert "pool classify: 2 worker(s) x 1 thread(s) (2 of 2 core(s): one-thread instances" in caplog.text
    assert len(eng.pools["classify"].slots.workers) == 2
