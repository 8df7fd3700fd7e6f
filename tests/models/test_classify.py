"""The classification worker against timm's own pipeline, and its weights handling."""

import numpy as np
import pytest
import timm
import torch

from engine.config import ClassifyConfig as VitConfig
from engine.errors import ConfigError, WeightsError
from engine.models.classify import ClassifierRunner
from engine.testing.clips import decode_all
from tests.support.models import MODEL, rel_err, seeded_model, timm_reference, views


@pytest.fixture(scope="module")
def frames(clip48):
    return decode_all(clip48)[::6]  # 8 frames across the clip


@pytest.fixture(scope="module")
def model():
    return seeded_model()


def worker_logits(model, frames, preprocess):
    w = ClassifierRunner(VitConfig(name=MODEL, weights="random", preprocess=preprocess, device="cpu"),
                         model=model, weights_tag="random")
    return w.forward(w.prepare(views(frames)))[0]


def test_exact_preprocessing_equals_timm(model, frames):
    ref = timm_reference(model, frames)
    out = worker_logits(model, frames, "exact")
    assert rel_err(out, ref) <= 1e-4
    assert torch.equal(out.topk(5).indices, ref.topk(5).indices)


def test_fast_preprocessing_is_close_to_timm(model, frames):
    """fast resizes uint8 tensors (torchvision) instead of PIL: <= 1 level on a few pixels."""
    ref = timm_reference(model, frames)
    out = worker_logits(model, frames, "fast")
    assert rel_err(out, ref) <= 2e-3
    assert torch.equal(out.topk(1).indices, ref.topk(1).indices)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_fidelity_check_catches_colour_order_and_normalisation_bugs(model, frames, mode, monkeypatch):
    """The tolerance above is tight enough to fail on the classic bugs."""
    ref = timm_reference(model, frames)
    bgr = worker_logits(model, [np.ascontiguousarray(f[..., ::-1]) for f in frames], mode)
    assert rel_err(bgr, ref) > 1e-2
    from engine.models import classify
    real_init = classify.Preprocessor.__init__

    def imagenet_norm(self, *a, **k):  # the "constants scattered in the pipeline" bug
        real_init(self, *a, **k)
        self.mean = torch.tensor(timm.data.IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(timm.data.IMAGENET_DEFAULT_STD).view(1, 3, 1, 1)
    monkeypatch.setattr(classify.Preprocessor, "__init__", imagenet_norm)
    wrong = worker_logits(model, frames, mode)
    assert rel_err(wrong, ref) > 1e-2


def test_outputs_topk_labels_and_embedding(model, frames):
    w = ClassifierRunner(VitConfig(name=MODEL, weights="random", topk=3, embedding=True, device="cpu"),
                         model=model, weights_tag="random")
    out = w.infer(w.prepare(views(frames[:2])))
    assert len(out) == 2
    top = out[0]["topk"]
    assert len(top) == 3 and all(isinstance(i, int) and isinstance(lbl, str) for i, lbl, _ in top)
    assert top[0][2] >= top[1][2] >= top[2][2]
    assert top[0][1] == w.labels[top[0][0]] and "class_" not in w.labels[1]  # ImageNet labels, offline
    emb = np.frombuffer(out[0]["embedding"], np.float16)
    assert emb.shape == (model.num_features,)


def test_preprocessing_comes_from_the_model_config(model):
    w = ClassifierRunner(VitConfig(name=MODEL, weights="random", device="cpu"), model=model)
    assert w.pre.data_config["input_size"] == (3, 160, 160)  # test_vit's own, not 224
    x = w.prepare(views([np.zeros((90, 200, 3), np.uint8)]))
    assert x.shape == (1, 3, 160, 160)


def test_weights_file_roundtrip_and_strict_errors(tmp_path, frames):
    m = seeded_model(seed=3)
    path = tmp_path / "w.pth"
    torch.save(m.state_dict(), path)
    w = ClassifierRunner(VitConfig(name=MODEL, weights=str(path), device="cpu"))
    assert w.weights_tag == "w.pth"
    ref = timm_reference(m, frames[:2])
    out = w.forward(w.prepare(views(frames[:2])))[0]
    assert rel_err(out, ref) < 2e-3
    sd = m.state_dict()
    sd.pop("blocks.0.attn.qkv.weight")
    sd["bogus.weight"] = torch.zeros(1)
    torch.save({"state_dict": sd}, path)
    with pytest.raises(WeightsError, match=r"w.pth does not fit test_vit: missing keys \['blocks.0.attn.qkv.weight'\]"
                                           r".*unexpected keys \['bogus.weight'\]"):
        ClassifierRunner(VitConfig(name=MODEL, weights=str(path), device="cpu"))


def test_safetensors_weights(tmp_path):
    from safetensors.torch import save_file
    m = seeded_model(seed=4)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "w.safetensors")
    w = ClassifierRunner(VitConfig(name=MODEL, weights=str(tmp_path / "w.safetensors"), device="cpu"))
    assert torch.equal(w.model.head.weight, m.head.weight)


@pytest.mark.parametrize("weights, message", [
    ("/nonexistent/w.pth", r"models.classify.weights: file '/nonexistent/w.pth' not found"),
])
def test_weights_errors(weights, message):
    with pytest.raises(WeightsError, match=message):
        ClassifierRunner(VitConfig(name=MODEL, weights=weights, device="cpu"))


def test_garbage_weights_file(tmp_path):
    p = tmp_path / "junk.pth"
    p.write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match=r"cannot read '.*junk.pth'"):
        ClassifierRunner(VitConfig(name=MODEL, weights=str(p), device="cpu"))


def test_unknown_model_name():
    with pytest.raises(ConfigError, match=r"models.classify.name: 'vit_hyuge_patch16' is not a timm model; close names"):
        ClassifierRunner(VitConfig(name="vit_hyuge_patch16", weights="random", device="cpu"))


def test_pretrained_without_internet_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine has no internet; make the failure immediate
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(WeightsError, match=r"could not download pretrained weights for 'test_vit'.*"
                                           r"set models.classify.weights to a local state_dict file or to 'random'"):
        ClassifierRunner(VitConfig(name=MODEL, weights="pretrained", device="cpu"))


def test_random_weights_warn(caplog):
    with caplog.at_level("WARNING"):
        w = ClassifierRunner(VitConfig(name=MODEL, weights="random", device="cpu"))
    assert w.weights_tag == "random"
    assert "RANDOM weights" in caplog.text


@pytest.mark.timeout(120)
def test_nv12_frames_and_mixed_batches_give_each_frame_its_own_input(model):
    """NVDEC frames (NV12 slots) go through the batched NV12 op, RGB frames through the configured
    preprocessing, and a batch mixing the two (streams decoded differently) keeps every frame's own
    input in its place. Each frame's input equals its own batch-of-one input."""
    import av

    from engine.frames.ref import LooseFrames

    w = ClassifierRunner(VitConfig(name=MODEL, weights="random", device="cpu"), model=model, weights_tag="random")
    rng = np.random.default_rng(3)
    frames = [av.VideoFrame.from_ndarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8), format="rgb24")
              .reformat(format="nv12") for _ in range(3)]
    nv12 = [torch.from_numpy(f.to_ndarray(format="nv12")) for f in frames]
    rgb = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in frames]
    nv12_refs = LooseFrames(nv12).refs("gpu-cam", pixel_format="nv12")
    rgb_refs = LooseFrames(rgb).refs("cpu-cam")
    alone = [w.prepare([r])[0] for r in nv12_refs] + [w.prepare([r])[0] for r in rgb_refs]
    mixed = [nv12_refs[0], rgb_refs[0], rgb_refs[1], nv12_refs[1], rgb_refs[2], nv12_refs[2]]
    order = [0, 3, 4, 1, 5, 2]  # where each of `mixed` sits in `alone`
    x = w.prepare(mixed)
    for i, j in enumerate(order):
        assert torch.allclose(x[i], alone[j], atol=1e-5), i
    assert w.release_event() is None  # on the CPU prepare has read the slots already
