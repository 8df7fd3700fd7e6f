"""gpu_check's SAM 2 part (issue 24): vidar's SAM 2 pool against Meta's predictor, on the GPU.

    python3 benchmarks/gpu_check.py --only sam2            # on the device (its own call: ~4 minutes)
    python3 benchmarks/gpu_check.py --dry-run              # every part CPU-sized, this one included

Records (JSON lines, through gpu_check's `emit`), hiera-t with a random checkpoint whose object-score head is
biased to "object present" (engine/testing/sam2_ref.make_checkpoint: with plain random weights every mask is
empty), two box prompts per stream on the 720p clip:
  sam2_meta      Meta's SAM2VideoPredictor under bf16 autocast: ms per frame (median after warm-up)
  sam2_fidelity  vidar, 1 stream x 2 objects, offline, `preprocess: exact` (Meta's own resize): mask IoU
                 against Meta's under the same autocast, min and mean (issue 24: >= 0.99, mean >= 0.995)
  sam2_offline   vidar offline, 1 x 2 and 8 x 2 streams x objects: ms per stream-frame, and against Meta;
                 8 x 2 again with the tracking stage's steady-state CUDA graphs off (`tracking_graphs`)
  sam2_live      vidar live, 4, 8 and 16 streams x 1 object at 30 FPS, 100 ms budget: goodput, p99, drops
  sam2_profile   8 x 2 offline with the tracking sub-stages timed (memory attention, mask decoder, memory
                 encoder), the encoder's batch times and the tracking calls' batch sizes: where the time goes
  sam2_render    one 720p frame's 2 masks rendered (resize, RLE, bbox): the run boundaries found on the GPU
                 (mask_rle.py) against the whole masks copied to the host for pycocotools, ms each
The same offline and live records at 512 px follow. The dry run: 256 px, a few frames, one or two streams.
"""

from __future__ import annotations

import tempfile
from collections import Counter
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.window import window_counts

# two boxes as shares of the frame (x0, y0, x1, y1): on the 1280x720 clip, two regions of the bunny's meadow
BOXES = {1: (0.30, 0.20, 0.55, 0.78), 2: (0.60, 0.36, 0.85, 0.89)}


def render_times(device: str, reps: int) -> dict:
    """render_frame for 2 objects, 256 x 256 mask logits on `device` to 1280 x 720: the RLE found on the device
    (mask_rle.py) against the whole masks copied to the host for pycocotools (what the GPU path did before),
    medians in ms, results checked equal."""
    import torch

    from engine.models import sam2_tracker
    g = torch.Generator(device=device).manual_seed(0)
    objs = [{"id": i, "logits": torch.randn(1, 1, 256, 256, device=device, generator=g) * 4
             + torch.linspace(-8, 8, 256, device=device) * (1 if i else -1), "score": torch.zeros(1, 1, device=device)}
            for i in range(2)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    flag = sam2_tracker.RLE_ON_DEVICE
    out, results = {}, []
    try:
        for name, on_device in (("device_rle_ms", True), ("host_rle_ms", False)):
            sam2_tracker.RLE_ON_DEVICE = on_device
            times = []
            for _ in range(reps + 1):
                sync()
                t0 = time.perf_counter()
                got = sam2_tracker.render_frame(objs, 720, 1280)
                times.append(time.perf_counter() - t0)
            out[name] = round(float(np.median(times[1:])) * 1e3, 3)
            results.append(got)
    finally:
        sam2_tracker.RLE_ON_DEVICE = flag
    out["equal"] = results[0] == results[1]
    return out


def boxes(width: int, height: int) -> dict[int, list[int]]:
    return {o: [round(x0 * width), round(y0 * height), round(x1 * width), round(y1 * height)]
            for o, (x0, y0, x1, y1) in BOXES.items()}


def first_frames(src: Path, n: int, dst: Path, fps: int) -> list[np.ndarray]:
    """The first n frames of src as RGB arrays, and written to dst as H.264 at `fps` (a clip the engine
    can loop or read offline: the same pixels Meta's predictor is given)."""
    import av
    from fractions import Fraction

    frames = []
    with av.open(str(src)) as inp:
        for f in inp.decode(video=0):
            frames.append(f.to_ndarray(format="rgb24"))
            if len(frames) == n:
                break
    h, w = frames[0].shape[:2]
    with av.open(str(dst), "w") as out:
        vs = out.add_stream("libx264", rate=fps)
        vs.width, vs.height, vs.pix_fmt, vs.time_base = w, h, "yuv420p", Fraction(1, fps)
        vs.options = {"g": str(fps), "bf": "0", "preset": "veryfast", "crf": "18"}
        for i, a in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(a, format="rgb24").reformat(format="yuv420p")
            vf.pts, vf.time_base = i, Fraction(1, fps)
            for p in vs.encode(vf):
                out.mux(p)
        for p in vs.encode():
            out.mux(p)
    # what the engine will see: the re-encoded pixels (the reference must get the same frames)
    with av.open(str(dst)) as inp:
        return [f.to_ndarray(format="rgb24") for f in inp.decode(video=0)]


class _Results:
    """Every sam2.* message with its arrival time, on a thread, until stopped."""

    def __init__(self, endpoint: str):
        from engine.publish.client import Subscriber
        self.sub = Subscriber(endpoint, ["sam2."])
        self.msgs: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self.sub.recv(0.2)
            if m is not None:
                self.msgs.append((time.perf_counter(), m))

    def stop(self) -> list[tuple[float, dict]]:
        self._stop.set()
        self._t.join(5)
        self.sub.close()
        return self.msgs


def run_engine(*, clip: Path, n: int, objects: int, mode: str, image_size: int, ckpt: Path, device: str,
               size: tuple[int, int], preprocess: str = "fast", seconds: float = 60.0, warm_s: float = 0.0,
               budget_ms: float = 100.0, timed: bool = False, tracking_graphs: bool = True) -> dict:
    """n streams of `clip`, `objects` box prompts each; offline: to the end; live: looped, counted over
    `seconds` after `warm_s`. Returns counts, per-stream arrival times and the masks of stream s0."""
    from engine.config import build_config
    from engine.core.engine import Engine
    from engine.testing.net import free_endpoint
    endpoint = free_endpoint()
    ids = [f"s{i}" for i in range(n)]
    tree = {"streams": [{"id": i, "url": str(clip), "mode": mode, "loop": mode == "live"} for i in ids],
            "models": {"sam2": {"config": "sam2.1_hiera_t", "checkpoint": str(ckpt), "image_size": image_size,
                                "device": device, "preprocess": preprocess, "tracking_graphs": tracking_graphs}},
            "objects": [{"stream": i, "id": o, "box": b} for i in ids for o, b in list(boxes(*size).items())[:objects]],
            "budget": {"latency_ms": budget_ms}, "qos": {"ladder": False}, "publish": {"endpoint": endpoint},
            "metrics": {"enabled": False}, "control": {"enabled": False}, "view": {"enabled": False}}
    cfg, _ = build_config(tree, cuda_available=device == "cuda")
    results = _Results(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher before the first result
    eng = Engine(cfg)
    t0 = time.perf_counter()
    eng.start()
    start_s = time.perf_counter() - t0
    pool = eng.pools["sam2"]
    acct, stage = pool.acct, pool.spec.processor.stage
    stage.timed = timed  # synchronises between the tracking sub-stages to time them (the profile run only)
    try:
        if mode == "offline":
            deadline = time.perf_counter() + seconds
            while not eng.finished() and time.perf_counter() < deadline:
                time.sleep(0.05)
            counted = {}
        else:
            counted = window_counts(acct, ids, warm_s=warm_s, seconds=seconds)
        finished = eng.finished()
    finally:
        eng.stop()
    msgs = results.stop()
    arrivals = {i: [t for t, m in msgs if m.get("stream") == i] for i in ids}
    masks = {m["seq"]: m.get("objects", []) for _, m in msgs if m.get("stream") == "s0"}
    # where the time goes: the encoder's measured batch times, the tracking calls' batch sizes (one call per
    # step for every object of the streams in the encoder's batch), and with `timed` each sub-stage's median
    profile = {"encoder_ms": {b: round(v * 1e3, 2) for b, v in pool.scheduler.latency.measured().items()},
               "tracking_calls": dict(sorted(Counter(stage.calls).items())), "padded_calls": stage.padded_calls}
    if timed:
        profile["stage_ms"] = {k: round(float(np.median(v)) * 1e3, 2) for k, v in stage.stage_s.items() if v}
    # steps replayed from the steady-state CUDA graphs (engine/models/sam2_step.py; 0 on the CPU)
    graphed = sum(g.replays for g in stage.graphs.values())
    return {"start_s": round(start_s, 1), "finished": finished, "results": [len(v) for v in arrivals.values()],
            "tracking_graphs": tracking_graphs, "graphed_steps": graphed,
            **counted, "_profile": profile, "_arrivals": arrivals, "_masks": masks}


def ms_per_stream_frame(arrivals: dict[str, list[float]], warm: int) -> float | None:
    """Milliseconds per published stream-frame over the window every stream was running in after its first
    `warm` results: (window) / (results of all streams inside it). Not the slowest stream's mean interval,
    which inflates the cost when streams progress unevenly."""
    runs = [v for v in arrivals.values() if len(v) > warm + 2]
    if len(runs) < len(arrivals):
        return None
    t0, t1 = max(v[warm] for v in runs), min(v[-1] for v in runs)
    inside = sum(1 for v in runs for t in v if t0 < t <= t1)
    return round((t1 - t0) / inside * 1e3, 2) if t1 > t0 and inside else None


def fidelity(ours: dict[int, list[dict]], ref: dict[int, dict[int, np.ndarray]]) -> dict:
    from pycocotools import mask as mask_utils

    from engine.testing.sam2_ref import iou
    ious, areas = [], []
    for seq, objs in ours.items():
        for o in objs:
            theirs = ref.get(seq, {}).get(o["id"])
            if theirs is not None:
                ious.append(iou(mask_utils.decode(o["mask"]).astype(bool), theirs))
                areas.append(float(theirs.mean()))
    # the masks' share of the frame beside the IoU: random (biased) weights may give masks so large that any
    # tracker agrees with them; the comparison means something only for masks well inside (0, 1)
    return {"pairs": len(ious), "iou_min": round(min(ious), 4) if ious else None,
            "iou_mean": round(float(np.mean(ious)), 4) if ious else None,
            "mask_area_min": round(min(areas), 4) if areas else None,
            "mask_area_max": round(max(areas), 4) if areas else None}


def part_sam2(emit: Callable[..., None], *, clip: Path, dry: bool) -> None:
    import torch

    from engine.testing.sam2_ref import make_checkpoint, reference_masks
    device = "cpu" if dry else "cuda"
    work = Path(tempfile.mkdtemp(prefix="vidar_gpu_sam2_"))
    ckpt = make_checkpoint(work / "sam2_biased.pt")  # the weights do not depend on the input size
    n_frames, warm = (6, 1) if dry else (48, 8)
    short = work / "clip_offline.mp4"
    frames = first_frames(clip, n_frames, short, fps=30)
    live_clip = work / "clip_30fps.mp4"
    first_frames(clip, 8 if dry else 90, live_clip, fps=30)  # 30 FPS cameras, looped
    wh = (frames[0].shape[1], frames[0].shape[0])
    prompts = {o: {"box": b} for o, b in boxes(*wh).items()}
    emit("sam2_render", **render_times(device, reps=3 if dry else 30))
    for size in ((256,) if dry else (1024, 512)):
        timing: dict = {}
        ref = reference_masks(ckpt, frames, prompts, work / f"ref{size}", timing=timing, device=device,
                              image_size=size, bf16=not dry)
        meta_ms = round(float(np.median(timing["frame_s"][warm:])) * 1e3, 2)
        emit("sam2_meta", image_size=size, frames=len(frames), bf16_autocast=not dry, ms_per_frame=meta_ms)
        r = run_engine(clip=short, n=1, objects=2, mode="offline", image_size=size, ckpt=ckpt, device=device,
                       size=wh, preprocess="exact")
        emit("sam2_fidelity", image_size=size, **fidelity(r.pop("_masks"), ref),
             **{k: v for k, v in r.items() if not k.startswith("_")})
        n_prof = 2 if dry else 8  # the sub-stages timed (synchronised: slower than the untimed runs)
        r = run_engine(clip=short, n=n_prof, objects=2, mode="offline", image_size=size, ckpt=ckpt, device=device,
                       size=wh, timed=True)
        emit("sam2_profile", image_size=size, streams=n_prof, objects_per_stream=2, **r.pop("_profile"))
        # the many-stream run twice: the tracking stage's steady-state graphs on, then off (measured alone)
        for n, graphs in (((1, True), (2, True), (2, False)) if dry else ((1, True), (8, True), (8, False))):
            r = run_engine(clip=short, n=n, objects=2, mode="offline", image_size=size, ckpt=ckpt, device=device,
                           size=wh, tracking_graphs=graphs)
            per_frame = ms_per_stream_frame(r.pop("_arrivals"), warm)
            r.pop("_masks")
            r.update(r.pop("_profile"))
            emit("sam2_offline", image_size=size, streams=n, objects_per_stream=2, ms_per_stream_frame=per_frame, vs_meta=round(per_frame / meta_ms, 3) if per_frame else None,
                 **r)
        for n in ((1,) if dry else (4, 8, 16)):
            r = run_engine(clip=live_clip, n=n, objects=1, mode="live", image_size=size, ckpt=ckpt, device=device,
                           size=wh, seconds=1.5 if dry else 5.0, warm_s=0.5 if dry else 3.0, budget_ms=2000 if dry else 100)
            r.pop("_arrivals"), r.pop("_masks")
            r.update(r.pop("_profile"))
            emit("sam2_live", image_size=size, streams=n, objects_per_stream=1, fps=30,
                 budget_ms=2000 if dry else 100, **r)
        if device == "cuda":
            torch.cuda.empty_cache()
