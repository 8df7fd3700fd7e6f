"""The shared model support (engine/workers/models): errors that name their config key, weights files,
the preprocessing contract of both families in both modes on real photographs, and SAM 2's
`checkpoint: pretrained` (the hub stood in for: this machine has no internet)."""

from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import timm
import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from PIL import Image

from engine.config import ClassifyConfig, Sam2Config
from engine.errors import ConfigError, WeightsError
from engine.models.classify import ClassifierRunner, timm_contract
from engine.models.preprocess import InputContract, Preprocessor
from engine.models.weights import read_state_dict
from engine.models.device import resolve_device, resolve_dtype
from engine.models.sam2 import Sam2EncoderRunner
from engine.models.sam2_model import available_configs, official_checkpoints, sam2_contract
from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint

CPU = torch.device("cpu")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No internet, and an empty Hugging Face cache (a user's real cache must not change the outcome)."""
    import huggingface_hub.constants as c
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    (d / "junk.pth").write_bytes(b"not a checkpoint")
    torch.save({"w": torch.zeros(1)}, d / "flat.pt")
    torch.save({"model": {"bogus.weight": torch.zeros(1)}}, d / "bogus.pt")
    sd = timm.create_model("test_vit").state_dict()
    sd["pos_embed"] = torch.zeros(1, 5, sd["pos_embed"].shape[-1])
    torch.save(sd, d / "misshapen.pth")
    return {p.stem: str(p) for p in d.iterdir()}


def classify(**kw):
    return ClassifierRunner(ClassifyConfig(**{"name": "test_vit", "weights": "random", "device": "cpu", **kw}))


def sam2(**kw):
    return Sam2EncoderRunner(Sam2Config(**{"config": CONFIG, "checkpoint": "random", "image_size": SIZE,
                                           "device": "cpu", **kw}))


OFFLINE_FIX = r"\)\. Without internet, set {key} to a local {local} or to 'random'$"

# (start-up, error, message): every message starts with the config key it is about
ERRORS = {
    "classify.device": (lambda f: classify(device="cuda"), ConfigError,
                        r"^models\.classify\.device: 'cuda' asked for but no CUDA GPU is available; use 'auto' or 'cpu'$"),
    "sam2.device": (lambda f: sam2(device="cuda"), ConfigError,
                    r"^models\.sam2\.device: 'cuda' asked for but no CUDA GPU is available; use 'auto' or 'cpu'$"),
    "classify.dtype": (lambda f: resolve_dtype("float16", CPU, "models.classify.dtype"), ConfigError,
                       r"^models\.classify\.dtype: 'float16' is not a dtype; use 'auto', 'float32', 'bfloat16'$"),
    "classify.name": (lambda f: classify(name="vit_hyuge_patch16"), ConfigError,
                      r"^models\.classify\.name: 'vit_hyuge_patch16' is not a timm model; close names: \[.*'vit_huge_patch14_224'"),
    "sam2.config": (lambda f: sam2(config="sam2.1_hiera_xl"), ConfigError,
                    r"^models\.sam2\.config: 'sam2\.1_hiera_xl' is not a config of the installed sam2 package; "
                    r"available: \[.*'sam2\.1_hiera_t'"),
    "classify.weights: no file": (lambda f: classify(weights="/nonexistent/w.pth"), WeightsError,
                                  r"^models\.classify\.weights: file '/nonexistent/w\.pth' not found "
                                  r"\(use 'pretrained', 'random' or a path\)$"),
    "sam2.checkpoint: no file": (lambda f: sam2(checkpoint="/nonexistent/s.pt"), WeightsError,
                                 r"^models\.sam2\.checkpoint: file '/nonexistent/s\.pt' not found "
                                 r"\(use 'pretrained', 'random' or a path\)$"),
    "classify.weights: garbage": (lambda f: classify(weights=f["junk"]), WeightsError,
                                  r"^models\.classify\.weights: cannot read '.*/junk\.pth': "),
    "sam2.checkpoint: garbage": (lambda f: sam2(checkpoint=f["junk"]), WeightsError,
                                 r"^models\.sam2\.checkpoint: cannot read '.*/junk\.pth': "),
    "classify.weights: misshapen": (lambda f: classify(weights=f["misshapen"]), WeightsError,
                                    r"^models\.classify\.weights: misshapen\.pth does not fit test_vit: "
                                    r"Error\(s\) in loading state_dict .*size mismatch for pos_embed"),
    "sam2.checkpoint: other model": (lambda f: sam2(checkpoint=f["bogus"]), WeightsError,
                                     r"^models\.sam2\.checkpoint: bogus\.pt does not fit this config: "
                                     r"missing keys \['maskmem_tpos_enc', .*\]\.\.\., unexpected keys \['bogus\.weight'\]$"),
    "sam2.checkpoint: not official": (lambda f: sam2(checkpoint=f["flat"]), WeightsError,
                                      r"^models\.sam2\.checkpoint: flat\.pt is not in the official format "
                                      r"\{'model': state_dict\}$"),
    "sam2.checkpoint: no official one": (lambda f: sam2(config="sam2.1_hiera_b+_MOSE_finetune", checkpoint="pretrained"),
                                         ConfigError,
                                         r"^models\.sam2\.checkpoint: 'pretrained', but config "
                                         r"'sam2\.1_hiera_b\+_MOSE_finetune' has no official checkpoint \(official: "
                                         r"\[.*'sam2\.1_hiera_t'.*\]\); set models\.sam2\.checkpoint to a local "
                                         r"checkpoint file or to 'random'$"),
    "classify.weights: offline": (lambda f: classify(weights="pretrained"), WeightsError,
                                  r"(?s)^models\.classify\.weights: could not download pretrained weights for "
                                  r"'test_vit' \(.*" + OFFLINE_FIX.format(key=r"models\.classify\.weights",
                                                                          local="state_dict file")),
    "sam2.checkpoint: offline": (lambda f: sam2(checkpoint="pretrained"), WeightsError,
                                 r"(?s)^models\.sam2\.checkpoint: could not download the official checkpoint "
                                 r"facebook/sam2\.1-hiera-tiny/sam2\.1_hiera_tiny\.pt \(LocalEntryNotFoundError: .*"
                                 + OFFLINE_FIX.format(key=r"models\.sam2\.checkpoint",
                                                      local=r"checkpoint file \(\{'model': state_dict\}\)")),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_their_config_key(case, files, no_cuda, offline):
    start, error, message = ERRORS[case]
    with pytest.raises(error, match=message):
        start(files)


@pytest.mark.parametrize("device, cuda, dtype, expect", [
    ("auto", False, "auto", ("cpu", torch.float32)),
    ("auto", True, "auto", ("cuda", torch.bfloat16)),
    ("cpu", True, "auto", ("cpu", torch.float32)),
    ("cpu", False, "bfloat16", ("cpu", torch.bfloat16)),
    ("cuda", True, "float32", ("cuda", torch.float32)),
])
def test_device_and_dtype(device, cuda, dtype, expect, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    d = resolve_device(device, "models.x.device")
    assert (d.type, resolve_dtype(dtype, d, "models.x.dtype")) == expect


@pytest.mark.parametrize("wrap", ["flat", "state_dict", "model", "safetensors"])
def test_state_dict_files_and_their_wrappers(wrap, tmp_path):
    sd = {"a.weight": torch.arange(6.0).view(2, 3), "a.bias": torch.ones(2)}
    if wrap == "safetensors":
        from safetensors.torch import save_file
        path = tmp_path / "w.safetensors"
        save_file(sd, path)
    else:
        path = tmp_path / "w.pth"
        torch.save(sd if wrap == "flat" else {wrap: sd, "epoch": 3}, path)
    got = read_state_dict(path, "models.classify.weights")
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


# -- the preprocessing contract, on real photographs -------------------------------------------------

@pytest.fixture(scope="module")
def photos():
    from skimage import data
    return [data.chelsea(), data.coffee(), data.astronaut()]  # 451x300, 600x400, 512x512


def tensors(photos):
    return [torch.from_numpy(np.ascontiguousarray(p)) for p in photos]


def assert_within_one_level(fast, ref, std):
    """fast resizes uint8 tensors (torchvision v2) instead of PIL: at most one intensity level, on few pixels."""
    levels = ((fast - ref) * torch.tensor(std).view(1, -1, 1, 1) * 255).abs()
    assert levels.max() <= 1 + 1e-4
    assert (levels > 0.5).float().mean() < 0.01


# timm's contracts: its default (resize shortest side + center crop), squash, border (keep ratio + pad), non-square
TIMM_CONTRACTS = {
    "center": {},
    "squash": {"crop_mode": "squash", "interpolation": "bilinear"},
    "border": {"crop_mode": "border", "crop_pct": 0.9},
    "non-square": {"crop_pct": 0.9, "input_size": (3, 128, 160)},
}


@pytest.mark.parametrize("overlay", TIMM_CONTRACTS)
def test_timm_contract_exact_is_timm_bit_for_bit_fast_within_a_level(overlay, photos):
    model = timm.create_model("test_vit", pretrained_cfg_overlay=TIMM_CONTRACTS[overlay])
    contract = timm_contract(model)
    tf = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    ref = torch.stack([tf(Image.fromarray(p)) for p in photos])
    exact = Preprocessor(contract, "exact", CPU)(tensors(photos))
    assert exact.shape == (3, *contract.data_config["input_size"]) and torch.equal(exact, ref)
    fast = Preprocessor(contract, "fast", CPU)(tensors(photos))
    assert_within_one_level(fast, ref, contract.data_config["std"])


def test_sam2_contract_exact_is_the_predictors_frame_loader_bit_for_bit_fast_within_a_level(photos, tmp_path):
    from sam2.utils.misc import load_video_frames_from_jpg_images
    for i, p in enumerate(photos):  # the loader reads "<n>.jpg" only; PNG data keeps the pixels (PIL reads by content)
        Image.fromarray(p).save(tmp_path / f"{i:05d}.jpg", format="PNG")
    ref, _, _ = load_video_frames_from_jpg_images(str(tmp_path), SIZE, offload_video_to_cpu=True, compute_device=CPU)
    contract = sam2_contract(SIZE)
    exact = Preprocessor(contract, "exact", CPU)(tensors(photos))
    assert exact.shape == (3, 3, SIZE, SIZE) and torch.equal(exact, ref)
    assert_within_one_level(Preprocessor(contract, "fast", CPU)(tensors(photos)), ref, contract.data_config["std"])


def test_one_normalisation_serves_both_references():
    """torchvision's ToTensor divides by 255 in float32 (timm), sam2's loader in float64 with numpy and rounds
    to float32: the same numbers for all 256 uint8 values, so one normalisation is exact for both."""
    from torchvision.transforms.functional import to_tensor
    values = np.arange(256, dtype=np.uint8).reshape(1, 256, 1).repeat(3, axis=2)  # (H, W, 3)
    x = Preprocessor(InputContract({"mean": (0, 0, 0), "std": (1, 1, 1)}, ()), "exact", CPU)(tensors([values]))[0]
    assert torch.equal(x, to_tensor(values))
    assert torch.equal(x, torch.from_numpy(values / 255.0).permute(2, 0, 1).float())


def test_workers_take_the_contract_from_their_model(photos):
    """The classifier's input size is test_vit's (160), SAM 2's is the model's image_size."""
    w = classify(preprocess="exact")
    ref = Preprocessor(timm_contract(w.model), "exact", CPU)(tensors(photos))
    assert w.pre.data_config["input_size"] == (3, 160, 160)
    from engine.frames.ref import LooseFrames
    assert torch.equal(w.prepare(LooseFrames(tensors(photos)).refs()), ref)
    s = sam2(image_size=128)
    assert s.pre.data_config["input_size"] == (3, 128, 128) == (3, s.model.image_size, s.model.image_size)


# -- SAM 2: checkpoint: pretrained --------------------------------------------------------------------

@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """Stands in for the official sam2.1_hiera_tiny.pt: a random checkpoint with the biased object-score head."""
    return make_checkpoint(tmp_path_factory.mktemp("hub") / "sam2.1_hiera_tiny.pt", seed=7)


@pytest.fixture
def hub(monkeypatch):
    """A stand-in for `huggingface_hub.hf_hub_download`: records calls; `files` maps (cache?) -> path or error."""
    calls, files = [], {}

    def download(repo_id, filename, local_files_only=False, **kw):
        calls.append((repo_id, filename, local_files_only))
        got = files[local_files_only]
        if isinstance(got, Exception):
            raise got
        return str(got)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return calls, files


@pytest.mark.parametrize("cached", [True, False])
def test_sam2_pretrained_loads_the_official_checkpoint_of_its_config(cached, official, hub):
    calls, files = hub
    files[True] = official if cached else LocalEntryNotFoundError("not in the cache")
    files[False] = official
    assert Sam2Config().checkpoint == "pretrained"  # the default
    w = sam2(checkpoint="pretrained")
    tiny = ("facebook/sam2.1-hiera-tiny", "sam2.1_hiera_tiny.pt")
    assert calls == ([(*tiny, True)] if cached else [(*tiny, True), (*tiny, False)])  # the cache first, no network
    assert w.weights_tag == "pretrained"
    sd = torch.load(official, weights_only=True)["model"]
    head_bias = "sam_mask_decoder.pred_obj_score_head.layers.2.bias"
    assert sd[head_bias].min() > 4  # the stand-in's biased head: random weights would be near 0
    assert torch.equal(w.model.state_dict()[head_bias], sd[head_bias])
    assert all(torch.equal(v, sd[k]) for k, v in w.model.state_dict().items())


@pytest.mark.parametrize("error", [  # what the hub raises here once its retries give up, and a transport error
    LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub ..."),
    ConnectionError("[Errno 101] Network is unreachable"),
])
def test_sam2_pretrained_without_network_fails_before_building_the_model(error, hub, monkeypatch):
    calls, files = hub
    files[True], files[False] = LocalEntryNotFoundError("not in the cache"), error
    from sam2 import build_sam

    def never(*a, **k):
        raise AssertionError("the model was built before the checkpoint was found")
    monkeypatch.setattr(build_sam, "build_sam2_video_predictor", never)
    with pytest.raises(WeightsError, match=rf"^models\.sam2\.checkpoint: could not download the official checkpoint "
                                           rf"facebook/sam2\.1-hiera-tiny/sam2\.1_hiera_tiny\.pt \({type(error).__name__}: "
                                           rf".*\)\. Without internet, set models\.sam2\.checkpoint to a local checkpoint "
                                           rf"file \(\{{'model': state_dict\}}\) or to 'random'$"):
        sam2(checkpoint="pretrained")
    assert len(calls) == 2


def test_every_shipped_model_config_has_its_official_checkpoint():
    """sam2's own table maps Hugging Face ids to configs: every config but the training ones resolves."""
    shipped = {name for name, path in available_configs().items() if "training" not in path}
    assert {Path(cfg).stem for cfg in official_checkpoints()} == shipped
    assert official_checkpoints()["configs/sam2.1/sam2.1_hiera_l.yaml"] == ("facebook/sam2.1-hiera-large",
                                                                            "sam2.1_hiera_large.pt")
