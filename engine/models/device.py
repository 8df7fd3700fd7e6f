"""Device and dtype from a pool's config (`auto`, `cpu`, `cuda`; `auto`, `float32`, `bfloat16`)."""

from __future__ import annotations

import contextlib

import torch

from engine.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str, key: str) -> torch.device:
    """`auto` picks cuda when there is a GPU. `key` is the config key, for the error message.

    Example: `resolve_device(cfg.device, "models.sam2.device")`.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{key}: {device!r} is not a device; use 'auto', 'cpu' or 'cuda'")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}: 'cuda' asked for but no CUDA GPU is available; use 'auto' or 'cpu'")
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device, key: str) -> torch.dtype:
    """`auto`: bfloat16 on cuda (tensor cores), float32 on cpu (bf16 is fast only on CPUs with AMX)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"{key}: {dtype!r} is not a dtype; use 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def model_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """A CUDA stream of a model's own (None on the CPU): high priority, because torch hands out streams
    round-robin from a pool of 32 per priority, which 48 decoders and rings share; from the (separate)
    high-priority pool a model's kernels are not queued behind a decoder's copies, and the GPU schedules
    them first. Never the legacy default stream, which every thread shares: two models on it serialise."""
    return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None


def on_stream(stream: "torch.cuda.Stream | None") -> contextlib.AbstractContextManager:
    """Work queued inside runs on `stream` (nothing changes for None: the CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait_for_slots(stream: "torch.cuda.Stream | None", frames) -> bool:
    """Before a model's prepare reads its frames (FrameRefs): on a GPU, `stream` waits on each slot's write
    event, so nothing waits on the host. Returns whether work queued on `stream` reads NV12 slots in GPU memory:
    those are then released on an event recorded after it (`release_event`); host RGB slots are read on the
    host before prepare returns and need none. Call it before reading: if the RGB half of a mixed batch raises
    after NV12 reads were queued, the slots are still released on an event after those reads."""
    if stream is None:
        return False
    for f in frames:
        ready = f.ready_event()
        if ready is not None:
            stream.wait_event(ready)
    return any(f.meta.pixel_format == "nv12" for f in frames)


def host_event(cuda=None) -> "torch.cuda.Event":
    """A CUDA event the host waits on (`synchronize()`, a `query()` loop): made blocking. torch's default
    (blocking=False) makes `synchronize()` spin a CPU core in a poll loop until the GPU gets there
    (cudaEventBlockingSync off), which takes that core from the decoders and the other threads on a host
    already short of them; a blocking one sleeps in the driver. Events that are only waited on by another
    stream (`stream.wait_event`: the ring slots' write and release events) never block the host and keep
    torch's default. `cuda`: a fake of torch.cuda in tests."""
    return (cuda or torch.cuda).Event(blocking=True)


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory for a copy the GPU's DMA engine reads or writes asynchronously (a batch's
    staging buffer, a result's host copy): pin only that, since pinning costs cudaHostAlloc, rounded up by
    torch's caching host allocator, and locks the pages for the process's life. One function, so a test
    can count what is pinned."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)
