"""`synthetic://...&fps=auto` (engine/core/auto_rate.py): the CPU demo's rate is chosen from the pools' measured
speed, so that `make run` keeps up on the machine it runs on (issue 34 item 5)."""

from __future__ import annotations

import logging
import re

import pytest

from engine.core.auto_rate import HEADROOM, RATES, choose_rate, resolve
from engine.core.engine import Engine
from engine.errors import SourceOpenError
from streams.synthetic import SyntheticSource
from tests.support.engines import engine_config

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("capacities, fps", [
    ({}, 30),                                   # nothing measured: the usual rate
    ({"classify": 1000.0}, 30),                 # a GPU: at most 30
    ({"classify": 70.0}, 24),                   # ViT-Ti alone at 14 ms a frame on two cores: 24.5 -> 24
    ({"classify": 35.0}, 12),                   # shared with a stream the pool has already
    ({"classify": 60.0, "sam2": 7.0}, 2),       # the slowest pool the stream feeds decides
    ({"classify": 0.5}, 1),                     # never below 1 fps
])
def test_the_rate_is_the_largest_usual_one_within_the_headroom(capacities, fps):
    chosen, why = choose_rate(capacities)
    assert chosen == fps and chosen in RATES and f"{fps} fps" in why
    if capacities:
        assert chosen <= max(1, HEADROOM * min(capacities.values()))


def test_only_fps_auto_of_a_synthetic_url_is_rewritten():
    assert resolve("rtsp://cam/x?fps=auto", {}, [], {}) == ("rtsp://cam/x?fps=auto", None)
    assert resolve("synthetic://shapes?fps=12", {}, [], {}) == ("synthetic://shapes?fps=12", None)
    url, why = resolve("synthetic://shapes?size=640x360&fps=auto&seed=3", {}, [], {})
    assert url == "synthetic://shapes?size=640x360&fps=30&seed=3" and why


def test_the_source_alone_refuses_auto_with_the_reason():
    with pytest.raises(SourceOpenError, match="fps='auto' is chosen by the engine"):
        SyntheticSource("s", "synthetic://shapes?fps=auto")


def test_an_engine_chooses_the_rate_from_its_warm_up_and_says_so(endpoint, caplog):
    """A stream with fps=auto gets a rate within the headroom of what the pool measured, logged with the numbers,
    and shown in its URL; a stream added at run time shares the pool."""
    cfg = engine_config([{"id": "a", "url": "synthetic://shapes?size=64x48&fps=auto"}], endpoint,
                        models={"classify": {"max_batch": 1}})
    eng = Engine(cfg)
    with caplog.at_level(logging.INFO, logger="vidar.engine"):
        eng.start()
    try:
        pool = eng.pools["classify"]
        measured = len(pool.slots.models) / pool.scheduler.latency.estimate(1)  # max_batch 1, one stream
        line = next(r.getMessage() for r in caplog.records if "fps=auto" in r.getMessage())
        fps = int(re.search(r": (\d+) fps$", line).group(1))
        assert fps <= max(1, HEADROOM * measured) and f"pool classify measured {measured:.0f} frames/s" in line
        assert eng.streams["a"].ingest.source.fps == fps
        assert eng.describe()["a"]["url"].endswith(f"fps={fps}")
    finally:
        eng.stop()
