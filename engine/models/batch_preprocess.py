"""A model's preprocessing contract as batched ops, from NV12 (NVDEC's frames) or RGB uint8 to the model's input.

Frames of one batch are grouped by (size, colour) and each group runs as one batched op per step, never one
per frame: NV12 -> RGB (colour.py), the contract's resize (`_BatchResize`: two interpolate calls, horizontal
then vertical, as PIL; one torchvision uint8 call for RGB on the CPU) and centre crop (v2's, which takes
leading batch dims), then the normalisation folded into one multiply-add, cast to the model's dtype. Host
frames (RGB ring slots, or NV12 frames decoded on the CPU) reach the device through one reusable staging
buffer per batch (pinned when CUDA is there) and one copy, instead of one upload per frame: on the H200 the
per-frame upload + resize cost 9 ms for 64 720p frames (../shared/gpu/README.md). Steps the batched path does
not know (a custom contract's) run per frame (`_PerFrame`), as in Preprocessor's fast mode.

Against the references (tests/models/test_batch_preprocess.py, in 8-bit levels):
  * from RGB on the CPU: `Preprocessor(contract, "fast", ...)` up to the float rounding of the folded
    normalisation (the same uint8 kernel); against timm's PIL transform <= 1 level, also for the float
    two-pass resize a GPU runs (the fast mode's one 2-D pass on a GPU can be 6 levels off at hard edges);
  * from NV12: against PyAV rgb24 + timm's PIL eval transform, max 3.6, mean 1.1: the differences of
    colour.py (swscale's fast path is ~1-1.5 levels low) plus the resize's.

Not thread-safe (the staging buffer is reused): one BatchPreprocessor per worker thread.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from engine.models.device import host_event, pinned_empty
from engine.models.colour import MATRICES, RANGES, check_nv12, nv12_to_rgb
from engine.models.preprocess import InputContract, _CenterCropOrPad, _KeepRatioResize, _tensor_step

FORMATS = ("rgb24", "nv12")


def _torchvision_size(h: int, w: int, size: Any, max_size: int | None) -> tuple[int, int]:
    """torchvision's Resize size rule (its `_compute_resized_output_size`, private, so restated here): an int
    (or [int]) is the shorter side, the longer one int(size * long / short), both scaled down if the longer
    would exceed max_size; (h, w) is the size itself."""
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    new_short = int(size if isinstance(size, int) else size[0])
    short, long = min(h, w), max(h, w)
    new_long = int(new_short * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_long, new_short) if h > w else (new_short, new_long)


class _BatchResize:
    """A contract's resize (torchvision's Resize, timm's ResizeKeepRatio) for a whole (n, C, H, W) batch.

    uint8 on the CPU: torchvision v2's native uint8 kernel (what Preprocessor's fast mode runs, and like PIL
    two passes with a uint8 image in between). Anything else (NV12 frames converted to float; uint8 on a
    GPU, which v2 would resize in float anyway) runs as PIL does: the horizontal pass, clamp to 0..255, then
    the vertical pass, clamp. One 2-D interpolate would skip the clamp between the passes: measured against
    PIL on a photograph (skimage's astronaut, 512 -> 168 bicubic), max 6.0 levels off vs 0.9 in two passes."""

    def __init__(self, step: Any):
        from torchvision.transforms import InterpolationMode, v2

        self.step = step
        if isinstance(step, v2.Resize):
            self.interpolation, self.antialias = step.interpolation, bool(step.antialias)
            self.size: Callable[[int, int], tuple[int, int]] = \
                lambda h, w: _torchvision_size(h, w, step.size, step.max_size)
        else:  # _KeepRatioResize: timm's own size rule
            self.interpolation, self.antialias = step.t.interpolation, True
            self.size = lambda h, w: tuple(step.t.get_params(
                torch.empty((1, h, w), device="meta"), step.t.size, step.t.longest))
        self.two_pass = self.interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.two_pass or (x.dtype == torch.uint8 and x.device.type == "cpu"):
            return self.step(x)
        h, w = self.size(*x.shape[-2:])
        x = x.float()
        for size in ((x.shape[-2], w), (h, w)):  # horizontal, then vertical, as PIL
            if tuple(x.shape[-2:]) != size:
                x = F.interpolate(x, size=size, mode=self.interpolation.value, align_corners=False,
                                  antialias=self.antialias).clamp_(0.0, 255.0)
        return x


class _PerFrame:
    """A step not known to take a batch (a transform a custom contract adds) might read its input as one
    CHW image: it runs frame by frame, as in Preprocessor's fast mode."""

    def __init__(self, step: Callable[[Any], Any]):
        self.step = step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.step(f) for f in x.unbind(0)])


def _batched(step: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A contract step (as preprocess._tensor_step translates it) for a batch. Crops batch as they are
    (v2's crop and the pad in preprocess.py read only the last two dims)."""
    from torchvision.transforms import v2

    if isinstance(step, (v2.Resize, _KeepRatioResize)):
        return _BatchResize(step)
    if isinstance(step, (v2.CenterCrop, _CenterCropOrPad)):
        return step
    return _PerFrame(step)


def _on(where: torch.device, device: torch.device) -> bool:
    """Whether a tensor on `where` is on `device` ("cuda" without an index means the current GPU)."""
    if where.type != device.type:
        return False
    if device.index is None:
        return device.type != "cuda" or where.index == torch.cuda.current_device()
    return where.index == device.index


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The one host -> device copy of a batch (asynchronous from pinned memory; a no-op on the CPU).
    A function of its own so that a test can count the copies."""
    return host.to(device, non_blocking=True)


class _Staging:
    """One reusable flat uint8 host buffer: a batch's host frames are written into it back to back
    (one pass, like torch.stack) and go to the device in one copy.

    Reuse is safe because the next batch waits, before writing, for the event recorded after the previous
    copy; only the rare growth allocates (pinned memory is slow to allocate, ~ms per MB)."""

    def __init__(self, device: torch.device):
        self.device = device
        # pin_memory raises without an NVIDIA driver: pin only for a CUDA device with CUDA present
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._copied: Any = None  # torch.cuda.Event of the last copy out of `buffer`

    def __call__(self, frames: Sequence[torch.Tensor]) -> torch.Tensor:
        """Host uint8 frames -> one flat uint8 tensor on the device: the frames back to back, in order."""
        total = sum(f.numel() for f in frames)
        if self._copied is not None:
            self._copied.synchronize()  # the previous batch's copy may still be reading the buffer
        if total > self.buffer.numel():
            # pinned: this buffer is what the upload DMAs from (the ring's host slots are not pinned: storage.py)
            self.buffer = pinned_empty(total, torch.uint8) if self.pin else torch.empty(total, dtype=torch.uint8)
        flat = self.buffer[:total]
        torch.cat([f.reshape(-1) for f in frames], out=flat)
        out = upload(flat, self.device)
        if self.pin:
            self._copied = host_event()  # the next batch waits on it on the host: blocking, no spinning core
            self._copied.record()
        return out


def scatter_rows(out: torch.Tensor, rows: Sequence[int], x: torch.Tensor) -> None:
    """out[rows[k]] = x[k], copied run by run of consecutive rows with slices: device-to-device copies, where
    an index list would first be uploaded from pageable host memory (a blocking copy)."""
    start = 0
    for k in range(1, len(rows) + 1):
        if k == len(rows) or rows[k] != rows[k - 1] + 1:  # the end of a run
            out[rows[start]:rows[k - 1] + 1] = x[start:k]
            start = k


class BatchPreprocessor:
    """Frames -> one normalised (N, C, h, w) batch on `device`, in `dtype`, in input order.

    Example (a classifier's prepare; `colours` from each stream's metadata, colour.frame_colour):
        pre = BatchPreprocessor(timm_contract(model), torch.device("cuda"), torch.bfloat16)
        x = pre([f.nv12 for f in frames], "nv12", [f.colour for f in frames])
        x = pre([ref.pixels() for ref in refs], "rgb24")
    """

    def __init__(self, contract: InputContract, device: torch.device | str, dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype
        self.data_config = contract.data_config
        self.steps = [_batched(_tensor_step(t)) for t in contract.geometric]
        mean = torch.tensor(contract.data_config["mean"], dtype=torch.float64).view(1, -1, 1, 1)
        std = torch.tensor(contract.data_config["std"], dtype=torch.float64).view(1, -1, 1, 1)
        # (x / 255 - mean) / std folded into x * scale + shift (one addcmul), computed in float64 once
        self.scale = (1.0 / (255.0 * std)).to(self.device, torch.float32)
        self.shift = (-mean / std).to(self.device, torch.float32)
        self._staging = _Staging(self.device)

    def __call__(self, frames: Sequence[torch.Tensor], fmt: str,
                 colours: Sequence[tuple[str, str]] | None = None) -> torch.Tensor:
        """Args:
            frames: (H, W, 3) uint8 RGB (fmt "rgb24"), or (H * 3 // 2, W) uint8 NV12 (fmt "nv12"); on the
                host (pinned or not) or already on `device`; sizes may differ within a batch.
            fmt: "rgb24" | "nv12".
            colours: per frame, (matrix, range) as colour.colour_from_av gives; required for nv12, ignored
                for rgb24.
        """
        keys = self._check(frames, fmt, colours)
        groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        # Host frames go to the device in one copy, group after group; frames already there are stacked.
        host = [i for (_, _, on_host), idx in groups.items() if on_host for i in idx]
        flat = self._staging([frames[i] for i in host]) if host else None
        results, offset = [], 0
        for (shape, colour, on_host), idx in groups.items():
            if on_host:  # this group's frames lie back to back in `flat`
                n = len(idx) * frames[idx[0]].numel()
                x = flat[offset:offset + n].view(len(idx), *shape)
                offset += n
            else:
                x = torch.stack([frames[i] for i in idx])
            results.append(self._normalise(self._geometry(self._to_rgb(x, fmt, colour))))
        return self._in_order(results, list(groups.values()), len(frames))

    def _in_order(self, results: list[torch.Tensor], groups: list[list[int]], n: int) -> torch.Tensor:
        """The groups' outputs as one batch in input order (no copy when there is one group).

        Copied run by run (scatter_rows)."""
        if len(results) == 1:
            return results[0]  # one group holds every frame, in order
        size = results[0].shape[1:]
        out = torch.empty((n, *size), device=self.device, dtype=self.dtype)
        for y, idx in zip(results, groups):
            if y.shape[1:] != size:
                raise ValueError(f"the contract's steps gave outputs of {tuple(size)} and {tuple(y.shape[1:])} "
                                 f"for frames of different sizes: its geometry must end in a fixed size (a crop)")
            scatter_rows(out, idx, y)
        return out

    def _check(self, frames: Sequence[torch.Tensor], fmt: str,
               colours: Sequence[tuple[str, str]] | None) -> list[tuple]:
        """The group key of each frame: (shape, colour, on the host), or a ValueError naming the frame."""
        if fmt not in FORMATS:
            raise ValueError(f"frame format {fmt!r}: use one of {FORMATS}")
        if not frames:
            raise ValueError("no frames: a batch needs at least one")
        if fmt == "nv12":
            if colours is None or len(colours) != len(frames):
                raise ValueError(f"nv12 needs one (matrix, range) per frame: got {len(frames)} frames and "
                                 f"{'no' if colours is None else len(colours)} colours")
            for c in colours:
                if tuple(c) not in {(m, r) for m in MATRICES for r in RANGES}:
                    raise ValueError(f"colour {c!r}: expected (matrix, range) with matrix in {MATRICES}, "
                                     f"range in {RANGES}")
        keys = []
        for i, f in enumerate(frames):
            if not isinstance(f, torch.Tensor):
                raise ValueError(f"frame {i}: expected a torch.Tensor, got {type(f).__name__}")
            if fmt == "rgb24" and (f.dtype != torch.uint8 or f.dim() != 3 or f.shape[2] != 3):
                raise ValueError(f"frame {i}: rgb24 frames must be uint8 tensors of shape (H, W, 3), "
                                 f"got {f.dtype} {tuple(f.shape)}")
            if fmt == "nv12":
                if f.dim() != 2:
                    raise ValueError(f"frame {i}: nv12 frames must be uint8 tensors of shape (H * 3 // 2, W), "
                                     f"got {f.dtype} {tuple(f.shape)}")
                check_nv12(f.unsqueeze(0), f"frame {i} (nv12)")
            on_host = f.device.type == "cpu"
            if not on_host and not _on(f.device, self.device):
                raise ValueError(f"frame {i} is on {f.device}: frames must be on the host or on {self.device}")
            keys.append((tuple(f.shape), tuple(colours[i]) if fmt == "nv12" else None, on_host))
        return keys

    @staticmethod
    def _to_rgb(x: torch.Tensor, fmt: str, colour: tuple[str, str] | None) -> torch.Tensor:
        """(n, 3, H, W): uint8 (a view of the NHWC frames) for rgb24, float32 0..255 for nv12."""
        if fmt == "nv12":
            return nv12_to_rgb(x, *colour)
        return x.permute(0, 3, 1, 2)

    def _geometry(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, x, self.scale).to(self.dtype)


def frames_input(frames: Sequence[Any], batch_pre: BatchPreprocessor,
                 rgb: Callable[[list[torch.Tensor]], torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """A model's input from ring frames (FrameRefs), in order: NV12 frames (NVDEC's, in GPU slots) through
    `batch_pre`, one op per group; RGB frames (host slots) through `rgb` (a runner's choice: the batched op
    on a GPU, its Preprocessor otherwise), mixed in one batch when a pool's streams decode differently.
    Returns (input, whether NV12 frames were read: then the slots are read by queued GPU work, and the
    runner releases them on an event after it, ModelRunner.release_event)."""
    nv12 = [i for i, f in enumerate(frames) if f.meta.pixel_format == "nv12"]
    if not nv12:
        return rgb([f.pixels() for f in frames]), False
    x = batch_pre([frames[i].pixels() for i in nv12], "nv12", [frames[i].meta.colour for i in nv12])
    if len(nv12) == len(frames):
        return x, True
    keep = set(nv12)
    others = [i for i in range(len(frames)) if i not in keep]
    out = torch.empty((len(frames), *x.shape[1:]), dtype=x.dtype, device=x.device)
    scatter_rows(out, nv12, x)
    scatter_rows(out, others, rgb([frames[i].pixels() for i in others]))
    return out, True
