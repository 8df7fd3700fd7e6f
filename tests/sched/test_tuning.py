"""Defaults that fit the machine (engine/tuning.py), as a table, and the plan the engine logs."""

import logging

import pytest

from engine.sched.tuning import plan_classify, split


@pytest.mark.parametrize("cores, pools, cuda, live, workers, threads, expect", [
    (2, 1, False, False, None, None, (2, 1)),    # our CI, offline: two one-thread instances (throughput)
    (2, 1, False, True, None, None, (1, 2)),     # live: one instance with both cores (latency)
    (1, 1, False, False, None, None, (1, 1)),
    (2, 2, False, False, None, None, (1, 1)),    # two pools share two cores
    (16, 1, False, False, None, None, (8, 2)),   # past 8 instances, cores become threads
    (16, 1, False, True, None, None, (2, 8)),    # past 8 threads, cores become instances
    (16, 2, False, False, None, None, (8, 1)),
    (16, 2, False, True, None, None, (1, 8)),
    (32, 1, False, False, None, None, (8, 4)),
    (8, 1, False, False, 2, None, (2, 4)),       # workers given: threads fill the share
    (8, 1, False, True, None, 4, (2, 4)),        # threads given: instances fill the share
    (8, 1, False, False, 3, 5, (3, 5)),          # both given: kept
    (16, 1, True, False, None, None, (1, None)),  # GPU: one instance
])
def test_plan_table(cores, pools, cuda, live, workers, threads, expect):
    plan = plan_classify(cores=cores, pools=pools, cuda=cuda, live=live, workers=workers, threads=threads)
    assert (plan.workers, plan.threads) == expect


@pytest.mark.parametrize("cores, live, expect", [
    (1, False, (1, 1)), (3, False, (3, 1)), (8, False, (8, 1)), (9, False, (4, 2)), (24, False, (8, 3)),
    (64, False, (8, 8)), (1, True, (1, 1)), (3, True, (1, 3)), (8, True, (1, 8)), (9, True, (2, 4)),
    (24, True, (3, 8)), (64, True, (8, 8)),
])
def test_split_table(cores, live, expect):
    """Instances x threads per pool: at most 8 of the kind the mode prefers, then the other kind."""
    assert split(cores, live=live) == expect


@pytest.mark.parametrize("mode, expect", [("offline", "2 worker(s) x 1 thread(s) (2 of 2 core(s); offline"),
                                          ("live", "1 worker(s) x 2 thread(s) (2 of 2 core(s); live")])
def test_engine_logs_the_chosen_plan(endpoint, monkeypatch, caplog, mode, expect):
    from engine.core import engine as engine_mod
    from engine.core.engine import Engine
    from tests.support.engines import engine_config
    monkeypatch.setattr(engine_mod, "usable_cores", lambda: 2)
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=96x64&fps=30&frames=3", "mode": mode}],
                        endpoint)
    assert cfg.models.classify.workers is None and cfg.models.classify.threads is None
    eng = Engine(cfg)
    with caplog.at_level(logging.INFO, logger="vidar.pool"):
        eng.start()
    eng.stop()
    assert f"pool classify: {expect}" in caplog.text
    assert len(eng.pools["classify"].slots.models) == int(expect[0])
