"""Issue 32 items 3 and 6: every event the host waits on is blocking, and the per-frame path of classify and
SAM 2 has only the host syncs it needs, counted on a fake device.

The fake device: `Dev`, a tensor subclass every op on it propagates to (torch's default __torch_function__),
whose host syncs on a GPU (`.cpu()`, `.item()`, `.tolist()`, `.numpy()`, `nonzero`, `bool()`/`int()`/`float()` of
a value) are counted by name; torch.cuda.Event is a fake whose synchronize() is counted and refuses an event
not made blocking. A new sync in these paths shows up as a count that changed."""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest
import torch

import engine.models.sam2 as sam2_module
from engine.models import batch_preprocess
from engine.models.graphs import HostCopy

pytestmark = pytest.mark.timeout(120)

SYNCS = Counter()
_SYNC_METHODS = {"cpu": "cpu", "item": "item", "tolist": "tolist", "numpy": "numpy", "nonzero": "nonzero",
                 "__bool__": "bool", "__int__": "int", "__float__": "float", "__index__": "int"}


class Dev(torch.Tensor):
    """A tensor 'on the device': its host syncs are counted; `.cpu()` hands back a plain (host) tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS or func is torch.nonzero:
            SYNCS[_SYNC_METHODS.get(name, "nonzero")] += 1
        out = super().__torch_function__(func, types, args, kwargs or {})
        if name == "cpu":
            return out.as_subclass(torch.Tensor)
        return out


class StrictEvent:
    """torch.cuda.Event's fake: records its kwargs; a host wait on one not made blocking fails."""

    made: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        StrictEvent.made.append(self)

    def record(self, stream=None):
        pass

    def synchronize(self):
        assert self.kwargs.get("blocking") is True, "a host wait on a non-blocking event spins a CPU core"
        SYNCS["event"] += 1

    def query(self):
        assert self.kwargs.get("blocking") is True, "a host wait on a non-blocking event spins a CPU core"
        return True


@pytest.fixture
def fake_cuda(monkeypatch):
    SYNCS.clear()
    StrictEvent.made.clear()
    monkeypatch.setattr(torch.cuda, "Event", StrictEvent)
    yield SYNCS
    SYNCS.clear()


def test_host_copy_waits_on_a_blocking_event(fake_cuda):
    h = HostCopy()
    h.wait()
    assert fake_cuda == {"event": 1} and h._event.kwargs == {"blocking": True}


def test_the_staging_buffer_waits_on_a_blocking_event(fake_cuda, monkeypatch):
    monkeypatch.setattr(batch_preprocess, "pinned_empty", lambda n, dtype: torch.empty(n, dtype=dtype))
    monkeypatch.setattr(batch_preprocess, "upload", lambda host, device: host.clone())
    staging = batch_preprocess._Staging(torch.device("cpu"))
    staging.pin = True  # as on a GPU: the upload reads the buffer asynchronously
    frames = [torch.zeros(4, 4, 3, dtype=torch.uint8)] * 2
    staging(frames)
    staging(frames)  # waits for the first batch's copy before rewriting the buffer
    assert fake_cuda == {"event": 1}


# -- the per-frame paths on the fake device ---------------------------------------------------------------
@pytest.fixture(scope="module")
def classifier():
    import timm

    from engine.config import ClassifyConfig
    from engine.models.classify import ClassifierRunner

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=16, depth=1,
                              num_classes=10)
    return ClassifierRunner(ClassifyConfig(weights="random", cuda_graphs=False, embedding=True), model=model,
                            weights_tag="random")


def test_classify_infer_syncs_once_a_batch(fake_cuda, classifier):
    """On a GPU the results come back through HostCopy (pinned buffers, one event): one host wait a batch, no
    `.cpu()` per tensor. Run here with the GPU branch taken (a HostCopy) and the input on the fake device."""
    classifier._host = HostCopy(pin=False)
    classifier._host._event = StrictEvent(blocking=True)  # as HostCopy() makes it on a GPU
    try:
        c, (h, w) = 3, classifier.model.patch_embed.img_size
        for n in (1, 3):
            fake_cuda.clear()
            out = classifier.infer(torch.randn(n, c, h, w).as_subclass(Dev))
            assert len(out) == n and "embedding" in out[0]
            assert fake_cuda == {"event": 1}, dict(fake_cuda)
    finally:
        classifier._host = None


@pytest.fixture(scope="module")
def sam2_runner(tmp_path_factory):
    from engine.config import Sam2Config
    from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("sam2sync") / "ckpt.pt")
    return Sam2EncoderRunnerOnFakeGpu(Sam2Config(config=CONFIG, checkpoint=str(ckpt), image_size=SIZE, device="cpu",
                                                 cuda_graphs=False, preprocess="exact"))


class Sam2EncoderRunnerOnFakeGpu(sam2_module.Sam2EncoderRunner):
    pass


class _FakeStream:
    def synchronize(self):
        SYNCS["stream"] += 1

    def wait_event(self, event):
        pass


def test_sam2_per_frame_syncs(fake_cuda, sam2_runner, monkeypatch):
    """The encoder: one blocking event wait a batch (its features whole before the tracking stage reads them),
    none in `exact` preprocessing; the tracking stage and rendering a frame of 2 objects: nonzero's size and the
    RLE's one transfer (the scores ride along), nothing else."""
    from engine.frames.ref import LooseFrames
    from engine.models import sam2_tracker
    from engine.models.sam2_tracker import Prompt, TrackingStage

    runner = sam2_runner
    monkeypatch.setattr(runner, "stream", _FakeStream())
    monkeypatch.setattr(sam2_module, "on_stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(sam2_tracker, "RLE_ON_DEVICE", True)  # the GPU's path: RLE found with torch ops
    frames = LooseFrames([torch.from_numpy(np.random.default_rng(s).integers(0, 255, (96, 128, 3), np.uint8))
                          for s in range(2)])
    x = runner.prepare(frames.refs("cam"))
    assert fake_cuda == {}, dict(fake_cuda)  # exact: read on the host, uploaded synchronously; no extra sync
    keep, n, x = x
    fake_cuda.clear()
    feats = [f["_features"] for f in runner.infer((keep, n, x.as_subclass(Dev)))]
    assert fake_cuda == {"event": 1}, dict(fake_cuda)
    stage = TrackingStage(runner.model, graphs=False)
    stage.add_stream("cam")
    stage.add_object("cam", Prompt(1, box=[10, 10, 60, 50]))
    stage.add_object("cam", Prompt(2, box=[50, 40, 120, 90]))
    processor = sam2_module.Sam2PostProcessor(stage)
    counts = []
    for k, f in enumerate(feats):
        fake_cuda.clear()
        ref = frames.refs("cam")[k]
        ref.meta.height, ref.meta.width = 96, 128
        out, commit = processor.process([ref], [{"_features": f}])
        commit()
        assert len(out[0]["objects"]) == 2, out
        counts.append(dict(fake_cuda))
    assert counts == [{"nonzero": 1, "cpu": 1}] * 2, counts  # per frame: nonzero's size, the one transfer
