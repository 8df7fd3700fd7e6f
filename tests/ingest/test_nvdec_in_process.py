"""A stream that may decode with NVDEC runs in an ingest process (ingest.gpu_transport shm, issue 43 item 3a): NVDEC's
NV12 copied into the stream's host slots, the pool getting the decoder's planes; the process says it decodes on the
GPU (one CUDA context there: logged, shown in `list`). With fakes for PyNvVideoCodec and CUDA (not run on a GPU)."""

from __future__ import annotations

import logging
import re

import av
import numpy as np
import pytest
import torch

from engine.core.engine import Engine
from engine.errors import SourceError
from engine.frames import ring as ring_mod
from engine.frames.storage import DeviceSlots
from engine.testing.fake_cuda import FakeCuda
from engine.ingest import procs as ingest_procs
from engine.models.noop import NoopRunner
from engine.testing.fake_nvdec import FakeNvdec
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.engines import engine_config
from tests.support.ingest import balanced, one_lent_slot, stop_engine
from tests.support.nvdec_helpers import install

pytestmark = pytest.mark.timeout(60)


class _Reader(NoopRunner):
    """The null pool (it takes NV12), keeping each frame's pixel format and pixels by seq."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, tuple[str, torch.Tensor]] = {}

    def prepare(self, frames):
        for f in frames:
            self.seen[f.meta.seq] = (f.meta.pixel_format, f.pixels().clone())
        return super().prepare(frames)


def _run(monkeypatch, clip, endpoint, *, decode="cuda", hook="tests.support.fake_nvdec_process",
         **ingest) -> tuple[_Reader, dict, list, Engine]:
    """The clip as one offline stream with `decode`, the fakes installed on both sides: (what the pool saw, the
    stream's `list` entry, the ingest processes as described once one said it made a CUDA context, the stopped
    engine, its metrics still readable)."""
    install(monkeypatch, FakeNvdec())  # the engine's side: CUDA and PyNvVideoCodec "available"
    monkeypatch.setattr(ingest_procs, "TEST_IMPORTS", [hook])  # the process's side
    streams = [{"id": "g", "url": str(clip), "mode": "offline", "decode": decode}]
    cfg = engine_config(streams, endpoint, models={"classify": {"device": "cpu"}}, budget={"latency_ms": 1000},
                        ingest={"processes": 1, "heartbeat_s": 0.1, "hang_after_s": 2.0, "nice": 0, **ingest})
    reader, col = _Reader(), Collector(endpoint, ["g"])
    eng = Engine(cfg, models={"classify": reader})  # the pool's runner: a null pool that keeps what it saw
    procs: list = []
    try:
        eng.start()
        assert wait_for(lambda: eng.describe()["g"]["decode"]["device"] is not None, 40)
        if eng.ingest is not None and ingest.get("gpu_transport") != "threads":  # the next heartbeat says it
            assert wait_for(lambda: any(p["cuda_context"] for p in eng.ingest.describe()), 10)
            procs = eng.ingest.describe()
            assert eng.metrics.registry.get_sample_value("vidar_ingest_cuda_contexts") == 1
        assert wait_for(eng.finished, 40)
        described = eng.describe()["g"]
        balanced(eng)
    finally:
        stop_engine(eng)
        col.wait(10)
    return reader, described, procs, eng


@pytest.mark.parametrize("pixel_format", ["auto", "rgb24"])  # rgb24 is for CPU decoders: NVDEC's frames are NV12
def test_an_nvdec_stream_decodes_in_an_ingest_process_into_host_nv12_slots(monkeypatch, clip48, endpoint, caplog,
                                                                           pixel_format):
    caplog.set_level(logging.INFO, "vidar.ingest")
    reader, described, procs, _ = _run(monkeypatch, clip48, endpoint, pixel_format=pixel_format)
    assert described["process"].startswith("ingest-") and described["decode"]["device"] == "cuda"
    with av.open(str(clip48)) as c:
        frames = list(c.decode(video=0))
    assert sorted(reader.seen) == list(range(len(frames)))
    fmt, px = reader.seen[5]
    assert fmt == "nv12" and torch.equal(px, torch.from_numpy(frames[5].reformat(format="nv12").to_ndarray()))
    # a process that made a CUDA context holds it for its life: listed, and the count said when it changes
    assert [p["cuda_context"] for p in procs] == [True]
    said = [r.getMessage() for r in caplog.records if "CUDA context" in r.getMessage()]
    assert said and re.search(r"ingest-0 \(pid \d+\) made a CUDA context .*: 1 ingest process\(es\) now hold", said[0])


def test_gpu_transport_threads_keeps_an_nvdec_stream_in_the_engine(monkeypatch, clip48, endpoint):
    # the engine's own GPU slots, their CUDA streams and events faked (the frames are CPU tensors here)
    monkeypatch.setattr(ring_mod, "DeviceSlots", lambda device: DeviceSlots(device, cuda=FakeCuda()))
    reader, described, _, _ = _run(monkeypatch, clip48, endpoint, gpu_transport="threads")
    assert described["process"] == "engine" and described["decode"]["device"] == "cuda"
    assert reader.seen and all(fmt == "nv12" for fmt, _ in reader.seen.values())


def test_remote_ring_copies_an_nvdec_frame_into_a_host_slot_after_its_event(tmp_path, monkeypatch):
    """The ingest process's side: the frame waits for its `ready` event, then lands byte for byte in the slot; a
    slot of another layout (RGB) is refused with the stream named, never written."""
    nv12 = torch.arange(48 * 3 // 2 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(72, 64)
    ready, waited = FakeNvdec().cuda.new_event(), []
    ready.synchronize = lambda: waited.append(True)
    with one_lent_slot(monkeypatch, tmp_path, "g", 48, 64, live=False) as (ring, seg, meta):
        assert ring.write(meta, nv12, ready=ready)
        assert waited == [True] and np.array_equal(seg.array[0], nv12.numpy())
    with one_lent_slot(monkeypatch, tmp_path, "h", 48, 64, pixel_format="rgb24", live=False) as (ring, seg, meta):
        seg.array[0].fill(7)
        with pytest.raises(SourceError, match=r"stream 'h': .*does not fit a slot"):
            ring.write(meta, nv12, ready=ready)
        assert (seg.array[0] == 7).all()


def test_nvdec_refusing_a_stream_is_a_cpu_fallback_in_list_and_in_a_metric(monkeypatch, clip48, endpoint):
    """decode auto, NVDEC failing before the stream's first frame: the CPU decodes it (the engine keeps
    publishing), `list` says where and why, and vidar_decode_fallback{stream, reason} is 1 (issue 43 item 4).
    Here as a thread (gpu_transport threads); in a process the engine's copy of the source carries what the
    process reported, the same way (the device and reason of the test above)."""
    install(monkeypatch, FakeNvdec(fail_on_calls=(1,)))
    streams = [{"id": "g", "url": str(clip48), "mode": "offline", "decode": "auto"}]
    cfg = engine_config(streams, endpoint, models={"classify": {"device": "cpu"}}, budget={"latency_ms": 1000},
                        ingest={"processes": 1, "gpu_transport": "threads"})
    reader, col = _Reader(), Collector(endpoint, ["g"])
    eng = Engine(cfg, models={"classify": reader})
    try:
        eng.start()
        assert wait_for(eng.finished, 40)
        decode = eng.describe()["g"]["decode"]
        value = eng.metrics.registry.get_sample_value("vidar_decode_fallback",
                                                      {"stream": "g", "reason": decode["reason"]})
    finally:
        stop_engine(eng)
        col.wait(10)
    assert decode["device"] == "cpu" and "NVDEC failed before the stream's first frame" in decode["reason"], decode
    assert value == 1
    with av.open(str(clip48)) as c:
        assert len(reader.seen) == sum(1 for _ in c.decode(video=0))  # every frame published, decoded on the CPU


def test_nvdec_refusing_a_stream_in_its_process_decodes_it_there_on_the_cpu(monkeypatch, clip48, endpoint):
    """decode auto, gpu_transport shm, NVDEC failing the stream's first Decode in the ingest process: the process
    decodes it on the CPU into the same NV12 slots, every frame published; `list` and vidar_decode_fallback say
    why; the process still holds the CUDA context it made."""
    reader, described, procs, eng = _run(monkeypatch, clip48, endpoint, decode="auto",
                                         hook="tests.support.fake_nvdec_process_refusing")
    decode = described["decode"]
    assert described["process"].startswith("ingest-") and decode["device"] == "cpu", described
    assert "NVDEC failed before the stream's first frame" in decode["reason"], decode
    assert eng.metrics.registry.get_sample_value("vidar_decode_fallback", {"stream": "g", "reason": decode["reason"]}) == 1
    with av.open(str(clip48)) as c:
        frames = list(c.decode(video=0))
    assert sorted(reader.seen) == list(range(len(frames))) and {f for f, _ in reader.seen.values()} == {"nv12"}
    assert torch.equal(reader.seen[5][1], torch.from_numpy(frames[5].reformat(format="nv12").to_ndarray()))
    assert [p["cuda_context"] for p in procs] == [True]
