"""What an ingest process writes into a stream's slots (ingest.pixel_format): NV12 as decoded for a pool that takes
it (here the null pool, which reads no pixels), RGB for every other case; the frames are the decoder's either way."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from engine.core.engine import Engine
from engine.models.colour import nv12_to_rgb
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.engines import engine_config
from tests.support.ingest import balanced, stop_engine

pytestmark = pytest.mark.timeout(60)


class _Reader(NoopRunner):
    """The null pool, keeping each frame's pixel format and a copy of its pixels (by seq)."""

    def __init__(self, accepts_nv12: bool = True):
        super().__init__()
        self.accepts_nv12 = accepts_nv12
        self.seen: dict[int, tuple[str, tuple, torch.Tensor]] = {}

    def prepare(self, frames):
        for f in frames:
            self.seen[f.meta.seq] = (f.meta.pixel_format, tuple(f.meta.colour), f.pixels().clone())
        return super().prepare(frames)


def _run(clip, endpoint, runners: dict, streams=None, **ingest):
    streams = streams or [{"id": "f", "url": str(clip), "mode": "offline"}]
    models = {name: {} if name == "noop" else {"device": "cpu"} for name in runners}
    cfg = engine_config(streams, endpoint, models=models, budget={"latency_ms": 1000},
                        ingest={"processes": 1, "heartbeat_s": 0.1, "hang_after_s": 2.0, "nice": 0, **ingest})
    col = Collector(endpoint, [s["id"] for s in streams])
    eng = Engine(cfg, models=runners)
    try:
        eng.start()
        assert wait_for(eng.finished, 40)
        assert eng.describe()[streams[0]["id"]]["process"].startswith("ingest-")
        balanced(eng)
    finally:
        stop_engine(eng)
        col.wait(10)


def _decoded(clip) -> list[av.VideoFrame]:
    with av.open(str(clip)) as c:
        return list(c.decode(video=0))


def test_a_pool_that_takes_nv12_gets_the_decoders_planes_unconverted(clip48, endpoint):
    r = _Reader()
    _run(clip48, endpoint, {"classify": r})
    frames = _decoded(clip48)
    assert sorted(r.seen) == list(range(len(frames)))
    fmt, colour, px = r.seen[5]
    assert fmt == "nv12" and colour == ("bt601", "limited")
    h, w = frames[5].height, frames[5].width
    assert tuple(px.shape) == (h * 3 // 2, w)
    assert torch.equal(px, torch.from_numpy(frames[5].reformat(format="nv12").to_ndarray()))
    # what a pool's batched conversion makes of it is the frame the decoder would have converted
    rgb = nv12_to_rgb(px.unsqueeze(0), *colour)[0].permute(1, 2, 0)
    assert (rgb - torch.from_numpy(frames[5].to_ndarray(format="rgb24")).float()).abs().mean() < 1.5


@pytest.mark.parametrize("case", ["rgb24 configured", "pool reads rgb", "two pools"])
def test_rgb_otherwise(clip48, endpoint, case):
    ingest, runners, streams = {}, {"classify": _Reader()}, None
    if case == "rgb24 configured":
        ingest = {"pixel_format": "rgb24"}
    elif case == "pool reads rgb":
        runners = {"classify": _Reader(accepts_nv12=False)}
    else:
        runners = {"classify": _Reader(), "noop": _Reader()}
        streams = [{"id": "f", "url": str(clip48), "mode": "offline", "pools": ["classify", "noop"]}]
    _run(clip48, endpoint, runners, streams, **ingest)
    frame = _decoded(clip48)[5]
    for r in runners.values():
        fmt, _, px = r.seen[5]
        assert fmt == "rgb24" and tuple(px.shape) == (frame.height, frame.width, 3)
        d = np.abs(px.numpy().astype(int) - frame.to_ndarray(format="rgb24").astype(int))
        assert d.max() <= 4
