"""SAM 2 tracking state: prompts, memories and the bounded per-object memory bank.

Each object keeps only what SAM 2's memory selection can ever read again (sam2_base.py
`_prepare_memory_conditioned_features`, eval mode, stride 1): its conditioning (prompt) frame,
the last `num_maskmem - 1` mask memories and the last `max_obj_ptrs_in_encoder - 1` object
pointers. Memory per object is therefore constant however long the stream runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.errors import VidarError


class PromptError(VidarError):
    """A prompt names an unknown stream, lies outside the frame, or is malformed."""


@dataclass
class Prompt:
    obj_id: int
    box: Optional[list[float]] = None          # [x0, y0, x1, y1] in pixels
    points: Optional[list[list[float]]] = None  # [[x, y, label], ...]; label 1 foreground, 0 background

    def check(self, width: int, height: int, where: str) -> None:
        coords = []
        if self.box is not None:
            if len(self.box) != 4 or not (self.box[0] < self.box[2] and self.box[1] < self.box[3]):
                raise PromptError(f"{where}: box {self.box} must be [x0, y0, x1, y1] with x0 < x1 and y0 < y1")
            coords += [(self.box[0], self.box[1]), (self.box[2], self.box[3])]
        for p in self.points or []:
            if len(p) != 3 or p[2] not in (0, 1):
                raise PromptError(f"{where}: point {p} must be [x, y, label] with label 1 (foreground) or 0")
            coords.append((p[0], p[1]))
        if not coords:
            raise PromptError(f"{where}: give a box or at least one point")
        for x, y in coords:
            if not (0 <= x <= width and 0 <= y <= height):
                raise PromptError(f"{where}: ({x}, {y}) lies outside the {width}x{height} frame")


@dataclass
class Memory:
    maskmem: Optional[torch.Tensor]  # (1, mem_dim, h, w) bfloat16, as the predictor stores it
    obj_ptr: torch.Tensor            # (1, C)


@dataclass
class ObjectBank:
    """What SAM 2 can still read for one object. Bounded by construction."""

    num_maskmem: int
    max_ptrs: int
    cond: dict[int, Memory] = field(default_factory=dict)  # the prompt frame (re-prompting restarts the bank)
    image_size: int = 0                                    # the encoder size its memories were made at
    last_logits: Optional[torch.Tensor] = None             # (1, 1, s/4, s/4) last mask scores: a new size restarts from it
    maskmems: deque = field(init=False)                    # (t, Memory) of the last num_maskmem - 1 frames
    ptrs: deque = field(init=False)                        # (t, obj_ptr) of the last max_ptrs - 1 frames

    def __post_init__(self) -> None:
        self.maskmems = deque(maxlen=self.num_maskmem - 1)
        self.ptrs = deque(maxlen=self.max_ptrs - 1)

    def push(self, t: int, mem: Memory) -> None:
        self.maskmems.append((t, mem))
        self.ptrs.append((t, mem.obj_ptr))

    def entries(self) -> int:
        return len(self.cond) + len(self.maskmems) + len(self.ptrs)

    def bound(self) -> int:
        return 1 + self.maskmems.maxlen + self.ptrs.maxlen

    def copy(self) -> "ObjectBank":
        """A bank to step on: the entries (tensors) are shared, the containers are not."""
        new = ObjectBank(self.num_maskmem, self.max_ptrs, dict(self.cond), self.image_size, self.last_logits)
        new.maskmems.extend(self.maskmems)
        new.ptrs.extend(self.ptrs)
        return new


@dataclass
class StreamTrack:
    frame_idx: int = 0  # index of the next processed frame
    objects: dict[int, ObjectBank] = field(default_factory=dict)
    pending: dict[int, Prompt] = field(default_factory=dict)  # applied on the next processed frame
    size: Optional[tuple[int, int]] = None  # (height, width) of the stream's frames
    idle: bool = False  # its last processed frame had no objects and no prompts: encoders may skip its frames
    failures: dict[int, int] = field(default_factory=dict)  # consecutive failed steps (or inits) per object
    step_failures: int = 0  # object steps that failed in the step being staged (counted at commit)

    def staged(self) -> "StreamTrack":
        """A copy to step on; it replaces this one only if the step is committed."""
        return StreamTrack(self.frame_idx, {o: b.copy() for o, b in self.objects.items()}, dict(self.pending),
                           self.size, idle=self.idle, failures=dict(self.failures))

    def count(self) -> int:
        return len(self.objects) + len(self.pending.keys() - self.objects.keys())


@dataclass
class FrameFeatures:
    """The image encoder's output for one frame (batch of 1), flattened as SAM 2 uses it."""

    vision_feats: list[torch.Tensor]  # per level (HW, 1, C)
    vision_pos: list[torch.Tensor]
    feat_sizes: list[tuple[int, int]]
    image_size: int                   # the encoder input size (square) these came from
