"""Weights: reading state_dict files, strict loading, and downloads that say what to do offline.

Every function takes the config key the weights come from (`models.classify.weights`,
`models.sam2.checkpoint`) and names it in its errors, with the file and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch

from engine.errors import VidarError, WeightsError

T = TypeVar("T")

#: checkpoint wrappers unwrapped when a family has no official format (timm's train script, many repos)
WRAPPERS = ("state_dict", "model")


def _first(keys: list[str], n: int = 5) -> str:
    return f"{keys[:n]}{'...' if len(keys) > n else ''}"


def read_state_dict(path: str | Path, key: str, *, wrapper: Optional[str] = None) -> dict[str, torch.Tensor]:
    """A state_dict from a `.safetensors` file or a torch file (`torch.load(weights_only=True)`: no code runs).

    wrapper=None unwraps the common `{"state_dict": ...}` / `{"model": ...}` wrappers when present;
    wrapper="model" makes a torch file's official format `{"model": state_dict}` (SAM 2's) a requirement.
    A `.safetensors` file is a flat state_dict by construction and needs no wrapper.
    """
    p = Path(path)
    if not p.is_file():
        raise WeightsError(f"{key}: file {str(p)!r} not found (use 'pretrained', 'random' or a path)")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(p))
        sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as err:  # the loaders raise many types (pickle, zip, safetensors); the message names the file
        raise WeightsError(f"{key}: cannot read {str(p)!r}: {err}") from err
    if wrapper is not None:
        if not isinstance(sd, dict) or not isinstance(sd.get(wrapper), dict):
            raise WeightsError(f"{key}: {p.name} is not in the official format {{{wrapper!r}: state_dict}}")
        return sd[wrapper]
    for w in WRAPPERS:
        if isinstance(sd, dict) and isinstance(sd.get(w), dict):
            sd = sd[w]
    if not isinstance(sd, dict):
        raise WeightsError(f"{key}: {str(p)!r} does not hold a state_dict")
    return sd


def load_strict(model: torch.nn.Module, state_dict: dict, key: str, *, source: str, target: str) -> None:
    """Load every tensor or fail at start-up: missing, unexpected or misshapen keys raise `WeightsError`.

    source: the file name, target: what it should fit (the model name), both for the message.
    """
    try:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as err:  # strict=False still raises on shape mismatches
        raise WeightsError(f"{key}: {source} does not fit {target}: {' '.join(str(err).split())[:600]}") from err
    if missing or unexpected:
        raise WeightsError(f"{key}: {source} does not fit {target}: "
                           f"missing keys {_first(missing)}, unexpected keys {_first(unexpected)}")


def fetch_pretrained(fetch: Callable[[], T], key: str, *, what: str, local: str = "state_dict file") -> T:
    """Run a download (`fetch`); network and hub errors become a `WeightsError` that names the key and the fix.

    Example: `fetch_pretrained(lambda: timm.create_model(name, pretrained=True), "models.classify.weights",
    what=f"pretrained weights for {name!r}")`.
    """
    try:
        return fetch()
    except VidarError:
        raise
    except Exception as err:  # hub/network errors come in many types (OSError, HTTP, hub-specific)
        raise WeightsError(
            f"{key}: could not download {what} ({type(err).__name__}: {str(err)[:200]}). "
            f"Without internet, set {key} to a local {local} or to 'random'") from err


def hub_file(repo_id: str, filename: str, key: str, *, what: str, local: str = "state_dict file") -> str:
    """A file of a Hugging Face model repo, from the user's cache or downloaded into it; returns its path.

    The cache is tried first without any network access: a checkpoint downloaded once then starts
    offline at once (a plain `hf_hub_download` revalidates online first, and without a network it
    retries for ~20 s before it falls back to the cache). Official checkpoints do not change in place.
    """
    import huggingface_hub  # looked up at call time, so tests can stand in for the hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return huggingface_hub.hf_hub_download(repo_id=repo_id, filename=filename, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    return fetch_pretrained(lambda: huggingface_hub.hf_hub_download(repo_id=repo_id, filename=filename),
                            key, what=what, local=local)
