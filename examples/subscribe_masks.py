"""Subscribe to a running vidar's SAM 2 results and draw each frame's masks into PNG files.

Usage (from the repository root, with the project's venv, while `vidar run CONFIG.yaml` runs
with a models.sam2 pool and some objects):

    python examples/subscribe_masks.py                                  # every stream, tcp://127.0.0.1:5556
    python examples/subscribe_masks.py --stream cam1 --out-dir masks/ --every 10
    python examples/subscribe_masks.py --endpoint tcp://10.0.0.5:5556 --count 100

Each PNG, <out-dir>/<stream>_<seq>.png (seq zero-padded to 6 digits so the files sort in
order), is a black canvas of the frame's size with every object's mask in its own colour, its
bounding box, and "id score". One line per result is printed: stream, seq, latency and per
object id, area (pixels), bbox and score. Stream events (started, eos, error, ...) are printed
too. Stops after --count results, or on Ctrl-C.

Results on random weights are marked "[random weights]": their masks mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np
from pycocotools import mask as mask_utils

from _draw import PALETTE, label  # examples/ is on sys.path when a script here runs

from engine.publish.client import Subscriber


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5556",
                   help="vidar's publish.endpoint (default: %(default)s)")
    p.add_argument("--stream", help="only this stream id (default: every stream)")
    p.add_argument("--out-dir", type=Path, default=Path("masks"), help="where the PNGs go (default: %(default)s)")
    p.add_argument("--every", type=int, default=1, metavar="K",
                   help="write a PNG for every K-th result received (default: every one)")
    p.add_argument("--count", type=int, default=0, metavar="N",
                   help="exit after N results (default: run until Ctrl-C)")
    args = p.parse_args()
    if args.every < 1:
        p.error("--every must be at least 1")
    return args


def draw(msg: dict) -> tuple[np.ndarray, list[str]]:
    """A black canvas of the frame's size with each object's mask, bbox and 'id score'."""
    canvas = None
    summaries = []
    for obj in msg["objects"]:
        mask = mask_utils.decode(obj["mask"]).astype(bool)  # HxW uint8 -> bool, at the stream's resolution
        if canvas is None:
            canvas = np.zeros((*mask.shape, 3), np.uint8)
        colour = np.array(PALETTE[(obj["id"] - 1) % len(PALETTE)])
        # Where objects overlap, mix the colours instead of hiding the first object.
        canvas[mask] = np.where(canvas[mask].any(axis=1, keepdims=True), canvas[mask] // 2 + colour // 2, colour)
        summaries.append(f"id={obj['id']} area={int(mask.sum())} bbox={obj['bbox']} score={obj['score']:.3f}")
    for obj in msg["objects"]:  # boxes and labels on top of every mask
        if obj["bbox"] is None:  # empty mask: SAM 2 says the object is not in this frame
            continue
        colour = PALETTE[(obj["id"] - 1) % len(PALETTE)]
        x0, y0, x1, y1 = obj["bbox"]  # x1, y1 exclusive
        cv2.rectangle(canvas, (x0, y0), (x1 - 1, y1 - 1), (255, 255, 255), 1)
        label(canvas, f"{obj['id']} {obj['score']:.2f}", x0, y0, colour)
    return canvas, summaries


def main() -> int:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # Topics are ZeroMQ prefixes: "sam2.cam1" also matches "sam2.cam10", so the stream id is checked
    # again below. Events carry why masks stop (eos, error: object rejected, reconnecting, ...).
    topics = [f"sam2.{args.stream}", f"event.{args.stream}"] if args.stream else ["sam2.", "event."]
    received = 0
    with Subscriber(args.endpoint, topics) as sub:
        print(f"listening on {args.endpoint} for {', '.join(topics)}; PNGs in {args.out_dir}/", flush=True)
        try:
            while not args.count or received < args.count:
                # A short timeout keeps Ctrl-C responsive; ZeroMQ's SUB socket reconnects on its own,
                # so it does not matter whether vidar is up yet.
                msg = sub.recv(timeout=0.5)
                if msg is None or (args.stream and msg["stream"] != args.stream):
                    continue
                if msg["type"] == "event":
                    print(f"{msg['stream']} event {msg['kind']}: {msg['reason']}", flush=True)
                    continue
                if msg["type"] != "sam2":
                    continue
                received += 1
                canvas, summaries = draw(msg)
                # Every K-th *received* result rather than seq % K: live streams drop frames, so
                # seq % K could skip for a long time.
                # No objects yet (prompts apply from the next frame): no mask, so no frame size, no PNG.
                if canvas is not None and (received - 1) % args.every == 0:
                    cv2.imwrite(str(args.out_dir / f"{msg['stream']}_{msg['seq']:06d}.png"),
                                cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR))
                print(f"{msg['stream']} seq={msg['seq']} latency={msg['latency_ms']:.1f}ms "
                      + ("; ".join(summaries) or "no objects")
                      + (" [random weights]" if msg.get("weights") == "random" else ""), flush=True)
        except KeyboardInterrupt:
            pass
    print(f"{received} result(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
