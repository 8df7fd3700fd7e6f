"""synthetic://shapes?size=640x360&fps=30&frames=N&seed=0: a built-in moving test pattern.

`fps=auto` (the CPU demo): the engine chooses the rate when the stream is added, from its pools' measured
speed (engine/core/auto_rate.py), so that a newcomer's first stream is one the machine keeps up with.

Deterministic (same seed, same pixels for frame n), textured (so a resize or a colour bug
shows), and cheap: a background is rendered once and shapes are pasted by slicing (frames() repaints
only where they moved, in one buffer).
`frames` makes the stream finite (tests); without it the stream runs for ever (demo).
"""

from __future__ import annotations

import math
import time
from typing import Iterator, Optional
from urllib.parse import parse_qs, urlparse

import numpy as np

from engine.errors import SourceOpenError

from streams.base import DecodedFrame, Source
from streams.urls import redact_url

_PATTERNS = ("shapes",)
AUTO_FPS = "auto"


def _parse(stream_id: str, url: str) -> dict:
    """The URL's parameters, each checked on its own: an error names the parameter, its value and the
    allowed range (a bad one was once caught only by numpy, as "internal error: ValueError")."""
    u = urlparse(url)
    pattern = u.netloc or u.path.strip("/")
    if pattern not in _PATTERNS:
        shown = redact_url(url)  # `synthetic://user:pw@x`: not a pattern, and no place to echo a password
        pattern = redact_url(f"synthetic://{pattern}")[len("synthetic://"):]
        raise SourceOpenError(stream_id, f"unknown synthetic pattern {pattern!r} in {shown!r}; allowed: {_PATTERNS}")
    q = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
    unknown = set(q) - {"size", "fps", "frames", "seed"}
    if unknown:  # a part without `=` may be a secret pasted by mistake: named as the URL display rule shows it
        named = sorted(k for k in unknown if f"{k}=" in u.query)
        bare = f" and {len(unknown) - len(named)} value(s) without a name" if len(named) < len(unknown) else ""
        raise SourceOpenError(stream_id, f"unknown synthetic parameters {named}{bare}; allowed: size, fps, frames, seed")

    def bad(name: str, allowed: str) -> SourceOpenError:
        return SourceOpenError(stream_id, f"synthetic parameter {name}={q[name]!r}: {allowed}")

    w, h = 640, 360
    if "size" in q:
        parts = q["size"].lower().split("x")
        if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
            raise bad("size", "WIDTHxHEIGHT in pixels, e.g. 640x360")
        w, h = int(parts[0]), int(parts[1])
        if not (16 <= w <= 8192 and 16 <= h <= 8192):
            raise bad("size", "each side from 16 to 8192 pixels")
    fps = 30.0
    if q.get("fps") == AUTO_FPS:
        fps = AUTO_FPS  # chosen by the engine when the stream is added (engine/core/auto_rate.py)
    elif "fps" in q:
        try:
            fps = float(q["fps"])
        except ValueError:
            raise bad("fps", "a number of frames per second, 0 < fps <= 1000") from None
        if not 0 < fps <= 1000:  # also NaN and inf
            raise bad("fps", "a number of frames per second, 0 < fps <= 1000")
    frames = _int_param(q, "frames", 1, 2 ** 62, bad)
    seed = _int_param(q, "seed", 0, 2 ** 32 - 2, bad)  # seed + 1 seeds the shapes: both within 32 bits
    return {"w": w, "h": h, "fps": fps, "frames": frames, "seed": 0 if seed is None else seed}


def _int_param(q: dict, name: str, lo: int, hi: int, bad) -> Optional[int]:
    if name not in q:
        return None
    text = q[name]
    if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 20:
        raise bad(name, f"an integer from {lo} to {hi}")
    value = int(text)
    if not lo <= value <= hi:
        raise bad(name, f"an integer from {lo} to {hi}")
    return value


def render_background(w: int, h: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    bg = np.empty((h, w, 3), np.float32)
    bg[..., 0] = 90 + 60 * np.sin(x / 37.0)
    bg[..., 1] = 80 + 50 * np.cos(y / 23.0)
    bg[..., 2] = 120 + 40 * np.sin((x + y) / 51.0)
    bg += ((x // 16 + y // 16) % 2)[..., None] * 25  # checker texture
    bg += rng.normal(0, 6, size=(h, w, 1)).astype(np.float32)  # film grain
    return np.clip(bg, 0, 255).astype(np.uint8)


class SyntheticSource(Source):
    def __init__(self, stream_id: str, url: str):
        super().__init__(stream_id, url)
        p = _parse(stream_id, url)
        if p["fps"] == AUTO_FPS:
            raise SourceOpenError(stream_id, "synthetic parameter fps='auto' is chosen by the engine when the stream "
                                             "is added (from its pools' measured speed); give a number to use the source "
                                             "on its own")
        self.w, self.h, self.fps, self._n, self.seed = p["w"], p["h"], p["fps"], p["frames"], p["seed"]
        self._bg: Optional[np.ndarray] = None
        rng = np.random.default_rng(self.seed + 1)
        s = min(self.w, self.h)
        # (size, colour, phase, speed) of three shapes: a red square, a green disc, a blue bar
        self._shapes = [(int(s * f), c, rng.uniform(0, 2 * math.pi), rng.uniform(0.5, 1.5))
                        for f, c in ((0.25, (220, 40, 40)), (0.2, (40, 200, 60)), (0.15, (40, 60, 230)))]
        d = self._shapes[1][0]
        yy, xx = np.mgrid[0:d, 0:d] - (d - 1) / 2
        disc = (xx * xx + yy * yy) <= (d / 2) ** 2
        # the disc as flat byte offsets from its square's corner, and their values: one fancy assignment a frame
        # (35 us at 720p) where `patch[disc] = colour` broadcasts a colour through a boolean mask (215 us)
        ys, xs = np.nonzero(disc)
        px = (ys * self.w + xs) * 3
        self._disc_at = np.concatenate([px, px + 1, px + 2])
        self._disc_rgb = np.repeat(np.array(self._shapes[1][1], np.uint8), len(px))
        # the square (with its stripes) and the bar as blocks: copying a block runs at memory speed, filling a
        # view with a 3-tuple broadcasts it pixel by pixel (115 us for the 720p square)
        (sq, sq_rgb, _, _), (bar, bar_rgb, _, _) = self._shapes[0], self._shapes[2]
        self._square = np.empty((sq, sq, 3), np.uint8)
        self._square[:] = sq_rgb
        self._square[::8, :] //= 2  # stripes: texture inside the shape
        self._bar = np.empty((2 * bar // 3 - bar // 3, bar, 3), np.uint8)
        self._bar[:] = bar_rgb

    def open(self) -> None:
        if self._bg is None:
            self._bg = render_background(self.w, self.h, self.seed)

    @property
    def total_frames(self) -> Optional[int]:
        return self._n

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height), known before opening: the engine reserves the stream's ring memory at add."""
        return self.w, self.h

    def render(self, n: int) -> np.ndarray:
        """Frame n (deterministic), in a new array."""
        self.open()
        img = self._bg.copy()
        self._draw(img, n)
        return img

    def _rects(self, n: int) -> list[tuple[int, int, int]]:
        """(y, x, size) of each shape's square in frame n."""
        t = n / self.fps
        out = []
        for k, (size, _, phase, speed) in enumerate(self._shapes):
            cx = int((self.w - size) * (0.5 + 0.45 * math.sin(speed * t + phase)))
            cy = int((self.h - size) * (0.5 + 0.45 * math.cos(0.7 * speed * t + phase * (k + 1))))
            out.append((max(0, min(cy, self.h - size)), max(0, min(cx, self.w - size)), size))
        return out

    def _draw(self, img: np.ndarray, n: int) -> list[tuple[int, int, int]]:
        """Paint frame n's shapes over `img`, which holds the background wherever they go; their squares."""
        rects = self._rects(n)
        for k, (cy, cx, size) in enumerate(rects):
            if k == 0:
                img[cy:cy + size, cx:cx + size] = self._square
            elif k == 1:
                img.reshape(-1)[self._disc_at + (cy * self.w + cx) * 3] = self._disc_rgb  # img is contiguous
            else:
                img[cy + size // 3:cy + 2 * size // 3, cx:cx + size] = self._bar
        return rects

    def frames(self) -> Iterator[DecodedFrame]:
        """Frame after frame, each equal to render(n), in one reused buffer (read-only): a frame's pixels are
        valid until the next one is asked for, as a decoder's frame pool, and every vidar sink copies them
        into a slot first. Why not render(n): a fresh 720p array costs its page faults plus a full copy of the
        background (580 us here), which made this test source, not the engine, the bottleneck of the host
        benchmark; repainting only the squares the last frame's shapes covered costs 75 us (15 us at 240p)."""
        self.open()
        buf, drawn = self._bg.copy(), []
        view = buf.view()
        view.flags.writeable = False
        n = 0
        while self._n is None or n < self._n:
            t0 = time.perf_counter()
            for cy, cx, size in drawn:  # back to the background where the last frame's shapes were
                buf[cy:cy + size, cx:cx + size] = self._bg[cy:cy + size, cx:cx + size]
            drawn = self._draw(buf, n)
            yield DecodedFrame(view, n / self.fps, time.perf_counter() - t0)
            n += 1
