"""Track objects through a video file with vidar's SAM 2 pool and write an annotated mp4.

Usage (from the repository root, with the project's venv):

    python examples/track.py VIDEO --box X0 Y0 X1 Y1 --checkpoint sam2.1_hiera_tiny.pt [--out out.mp4]
    python examples/track.py VIDEO --points 120 80 1 200 90 0 --checkpoint ...   # x y label triples
    python examples/track.py VIDEO --box 40 30 160 150 --box 200 60 300 200 ...   # two objects, ids 1 and 2
    python examples/track.py VIDEO --box ... --checkpoint ckpt.pt --image-size 256 --config sam2.1_hiera_t --png 10

Each --box or --points adds one object (ids 1, 2, ... in the order given), prompted on the first
frame. Coordinates are pixels of the video's frames; a point label is 1 (foreground) or 0 (background).

Every frame of VIDEO goes through the engine (offline mode: nothing is dropped). The output mp4
shows each object's mask blended in its own colour, its bounding box and "id score"; one line per
frame is printed: seq, latency_ms and per object id/score/area. One annotated frame (--png N,
default 10, or the last frame of a shorter video) is also saved as <out stem>_frame<N>.png.
latency_ms runs from a frame's decoding to its result; in offline mode the decoder runs ahead of
the model (up to the ring's size), so it includes the time a frame waited behind earlier ones.

Without --checkpoint the model runs on RANDOM weights: the pipeline works end to end, but the
masks mean nothing. Official checkpoints: https://github.com/facebookresearch/sam2 (sam2.1_hiera_*.pt).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

import av
import cv2
import numpy as np
from pycocotools import mask as mask_utils

from _draw import PALETTE, label  # examples/ is on sys.path when a script here runs

from engine.publish.client import Subscriber
from engine.config import build_config
from engine.core.engine import Engine

ALPHA = 0.5  # mask overlay opacity
RECV_TIMEOUT_S = 60.0  # one frame at 1024 px on a small CPU takes seconds, not a minute


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("video", help="input video file (any container PyAV opens)")
    p.add_argument("--box", nargs=4, type=float, action="append", default=[], metavar=("X0", "Y0", "X1", "Y1"),
                   help="box prompt of one object, in pixels (repeat for more objects)")
    p.add_argument("--points", nargs="+", type=float, action="append", default=[], metavar="X Y L",
                   help="point prompts of one object: x y label triples, label 1 = foreground, 0 = background "
                        "(repeat for more objects)")
    p.add_argument("--checkpoint", default="random",
                   help="official SAM 2 checkpoint (.pt); default: random weights (masks are meaningless)")
    p.add_argument("--config", default="sam2.1_hiera_t", help="sam2 model config (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=1024,
                   help="encoder input size, a multiple of 32; 512 or 256 trade accuracy for speed "
                        "(default: %(default)s, SAM 2's own)")
    p.add_argument("--out", type=Path, default=Path("out.mp4"), help="annotated mp4 (default: %(default)s)")
    p.add_argument("--png", type=int, default=10, metavar="N",
                   help="also save annotated frame N as a PNG next to the mp4 (default: 10, or the last frame)")
    args = p.parse_args()
    if not args.box and not args.points:
        p.error("give at least one --box or --points")
    for pts in args.points:
        if len(pts) % 3:
            p.error(f"--points takes x y label triples; got {len(pts)} numbers")
    return args


def free_port() -> int:
    # The engine binds the publisher itself; ask the OS for a port nobody uses right now.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def annotate(rgb: np.ndarray, msg: dict) -> tuple[np.ndarray, list[str]]:
    """Blend each object's mask, draw its bbox and 'id score'. Returns the frame and per-object summaries."""
    out = rgb.copy()
    summaries = []
    # Masks first, then boxes and labels, so no mask is blended over another object's label.
    for obj in msg["objects"]:
        colour = PALETTE[(obj["id"] - 1) % len(PALETTE)]
        mask = mask_utils.decode(obj["mask"]).astype(bool)  # HxW, at the stream's resolution
        out[mask] = (out[mask] * (1 - ALPHA) + np.array(colour) * ALPHA).astype(np.uint8)
        summaries.append(f"id {obj['id']} score {obj['score']:.3f} area {int(mask.sum())}")
    for obj in msg["objects"]:
        if obj["bbox"] is None:  # empty mask: SAM 2 says the object is not in this frame
            continue
        colour = PALETTE[(obj["id"] - 1) % len(PALETTE)]
        x0, y0, x1, y1 = obj["bbox"]  # x1, y1 exclusive
        cv2.rectangle(out, (x0, y0), (x1 - 1, y1 - 1), colour, 2)
        label(out, f"{obj['id']} {obj['score']:.2f}", x0, y0, colour)
    if msg.get("weights") == "random":
        label(out, "RANDOM WEIGHTS: masks are meaningless", 0, out.shape[0], (255, 255, 255))
    return out, summaries


def main() -> int:
    args = parse_args()
    # The engine logs through `logging`; show its warnings (random weights, missing sam2._C, ...).
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.checkpoint == "random":
        print("!" * 78 + "\n!! No --checkpoint: SAM 2 runs on RANDOM WEIGHTS. The masks are MEANINGLESS;\n"
              "!! this only shows the pipeline working. Pass an official sam2.1_hiera_*.pt.\n" + "!" * 78,
              file=sys.stderr, flush=True)

    objects = [{"stream": "video", "id": i + 1, "box": box} for i, box in enumerate(args.box)]
    objects += [{"stream": "video", "id": len(objects) + i + 1,
                 "points": [pts[j:j + 3] for j in range(0, len(pts), 3)]} for i, pts in enumerate(args.points)]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg, _ = build_config({
        # offline: every frame is processed in order (back-pressure instead of drops), so seq N is frame N.
        "streams": [{"id": "video", "url": str(args.video), "mode": "offline"}],
        # only the pools named here run: SAM 2 alone
        "models": {"sam2": {"config": args.config, "checkpoint": args.checkpoint,
                            "image_size": args.image_size, "max_batch": 1}},
        "objects": objects,
        # min_subscribers: the engine waits for us before decoding, so no result is sent before we listen.
        "publish": {"endpoint": endpoint, "min_subscribers": 1},
        "metrics": {"enabled": False}, "control": {"enabled": False}})

    # Subscribe before start(): start() blocks until it sees this subscriber.
    sub = Subscriber(endpoint, ["sam2.video", "event.video"])
    eng = Engine(cfg)
    src = av.open(str(args.video))
    sink = None
    try:
        eng.start()
        vstream = src.streams.video[0]
        w, h = vstream.codec_context.width, vstream.codec_context.height
        # libx264 with yuv420p needs even dimensions: drop an odd last row/column.
        ew, eh = w - w % 2, h - h % 2
        args.out.parent.mkdir(parents=True, exist_ok=True)
        sink = av.open(str(args.out), "w")
        ost = sink.add_stream("libx264", rate=vstream.average_rate or 30)
        ost.width, ost.height, ost.pix_fmt = ew, eh, "yuv420p"
        png_path = args.out.with_name(f"{args.out.stem}_frame{args.png}.png")

        # We decode the video ourselves, in step with the results: results arrive in seq order and
        # seq is the 0-based frame index, so only the current frame is held in memory.
        frames = (f.to_ndarray(format="rgb24") for f in src.decode(vstream))
        index, last, png_saved = -1, None, False

        def write(rgb: np.ndarray) -> None:
            nonlocal last, png_saved
            if index == args.png:
                cv2.imwrite(str(png_path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
                png_saved = True
            for pkt in ost.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb[:eh, :ew]), format="rgb24")):
                sink.mux(pkt)
            last = rgb

        while True:
            msg = sub.recv(timeout=RECV_TIMEOUT_S)
            if msg is None:
                raise RuntimeError(eng.check_dead() or f"no result for {RECV_TIMEOUT_S:.0f} s")
            if msg["type"] == "event":
                if msg["kind"] == "eos":
                    break
                if msg["kind"] == "error":
                    print(f"engine: {msg['reason']}", file=sys.stderr)
                continue
            # Frames without a result (e.g. a frame that failed) go out unannotated.
            rgb = None
            while index < msg["seq"]:
                rgb, index = next(frames), index + 1
                if index < msg["seq"]:
                    write(rgb)
            if rgb is None:  # a seq we already passed: cannot happen in offline mode, but never rewind
                continue
            annotated, summaries = annotate(rgb, msg)
            write(annotated)
            print(f"seq {msg['seq']:5d}  latency_ms {msg['latency_ms']:8.1f}  " + ("  |  ".join(summaries) or "no objects"),
                  flush=True)
        for rgb in frames:  # anything after the last result (the stream ended early, or failed)
            index += 1
            write(rgb)
        for pkt in ost.encode():  # flush the encoder
            sink.mux(pkt)
        if not png_saved and last is not None:  # video shorter than --png: keep the last frame
            png_path = args.out.with_name(f"{args.out.stem}_frame{index}.png")
            cv2.imwrite(str(png_path), cv2.cvtColor(last, cv2.COLOR_RGB2BGR))
        print(f"wrote {args.out} ({index + 1} frames) and {png_path}")
        if args.checkpoint == "random":
            print("reminder: RANDOM WEIGHTS - the masks in this video are meaningless", file=sys.stderr)
        return 0
    finally:
        eng.stop()
        sub.close()
        src.close()
        if sink is not None:
            sink.close()


if __name__ == "__main__":
    sys.exit(main())
