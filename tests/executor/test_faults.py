"""G6: worker faults are contained. A failing batch fails its frames and gets a fresh worker; a hung
batch is caught by the watchdog; K failures within W seconds make the engine dead (exit code 3)."""

import time


from engine.core.engine import Engine
from engine.control.runtime import EXIT_DEAD, run
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.engines import engine_config


def test_failed_batch_fails_its_frames_and_the_worker_is_rebuilt(endpoint):
    built = []

    def factory():
        built.append(NoopRunner())
        return built[-1]
    first = NoopRunner(fail_on_batch=3)
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x64&fps=30&frames=40", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 2}})
    eng = Engine(cfg, models={"classify": [first]}, model_factories={"classify": factory})
    eng.start()
    assert wait_for(eng.finished, 20, 0.02)
    eng.stop()
    s = eng.pools["classify"].acct.snapshot("s")
    assert s.failed == {"model_error": first.batch_sizes[2]} and s.published == 40 - first.batch_sizes[2]
    assert len(built) == 1 and built[0].batches > 0 and first.batches == 3  # the broken one ran no more
    assert eng.check_dead() is None  # one failure is not K


def test_hung_batch_is_caught_by_the_watchdog(endpoint):
    hung = NoopRunner(hang_on_batch=2)
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x64&fps=30&frames=30", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 2}}, faults={"batch_timeout_s": 0.5})
    eng = Engine(cfg, models={"classify": [hung]}, model_factories={"classify": NoopRunner})
    eng.start()
    assert wait_for(eng.finished, 20, 0.02)
    eng.stop()
    hung.release_hang.set()
    s = eng.pools["classify"].acct.snapshot("s")
    assert s.failed == {"model_hang": hung.batch_sizes[1]} and s.published + s.failed["model_hang"] == 30
    assert eng.pools["classify"].slots.rebuilds == 1 and s.in_flight == 0


def test_k_failures_make_the_engine_dead_with_exit_code_3(endpoint):
    cfg = engine_config([{"id": f"s{i}", "url": "synthetic://shapes?size=64x64&fps=30"} for i in range(2)],
                        endpoint, faults={"max_failures": 3, "window_s": 10}, publish={"min_subscribers": 1},
                        control={"enabled": False})

    class Broken(NoopRunner):
        def infer(self, inputs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    col = Collector(endpoint, ["s0", "s1"])
    eng = Engine(cfg, models={"classify": [Broken()]}, model_factories={"classify": Broken})
    t0 = time.monotonic()
    assert run(eng) == EXIT_DEAD
    assert time.monotonic() - t0 < 10
    eos = [m for m in col.wait(10) if m["type"] == "event" and m["kind"] == "eos"]
    assert sorted(m["stream"] for m in eos) == ["s0", "s1"]
    assert all("3 failed batches within 10 s" in m["reason"] and "illegal memory access" in m["reason"] for m in eos)


def test_failed_start_exits_3_and_releases_everything(endpoint):
    """No subscriber within wait_subscribers_s: engine dead at start, clean stop, exit code 3."""
    import threading
    cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        publish={"min_subscribers": 1, "wait_subscribers_s": 0.5}, control={"enabled": False})
    before = set(threading.enumerate())
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    assert run(eng) == EXIT_DEAD
    assert eng.state == "stopped"
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith(("source-", "pool-", "publisher"))]
    assert left == []
