"""SAM 2 on the CPU, one checkout against another: run this file from each tree, alternating, and compare.

    cd /tmp/before && /work/main/.venv/bin/python /work/main/benchmarks/ab_sam2.py /tmp/before
    cd /work/main  && .venv/bin/python benchmarks/ab_sam2.py /work/main

Prints one JSON line for the tree given (its `engine` and `benchmarks.bench_sam2` are the ones imported):
the tracking stage alone (2 streams x 2 objects at 256 px, 30 frames, lockstep: encoder and step medians
after 4 frames) and the whole engine (bench_sam2.engine_run, 1x2 and 2x2, `--reps` each). No predictor in
it: on these machines one process runs 15 % faster or slower than the next, so compare medians of several
alternations, not one pair (benchmarks/RESULTS.md, issue 24's A/B).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", help="the checkout whose engine to time")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    root = str(Path(args.tree).resolve())
    sys.path.insert(0, root)
    import torch
    torch.set_num_threads(2)
    from benchmarks import bench_sam2 as b
    import engine
    if not engine.__file__.startswith(root):
        raise SystemExit(f"imported {engine.__file__}, not the engine of {root}")
    tmp = Path(tempfile.mkdtemp())
    ckpt = b.make_checkpoint(tmp / "c.pt")
    clips = {s: b.write_clip(tmp / f"{s}.mp4", 30, size=(320, 240), seed=seed) for s, seed in (("a", 0), ("b", 5))}
    frames = {s: b.decode_all(c) for s, c in clips.items()}
    model = b.build_sam2_model(b.CONFIG, str(ckpt), 256, b.DEVICE)[0]
    enc, step, _, _ = b.run_streams(model, 256, frames, b.PROMPTS, warm=4)
    out = {"tree": root, "enc_ms": round(b.med_ms(enc), 1), "step_ms": round(b.med_ms(step), 1), "1x2": [], "2x2": []}
    for _ in range(args.reps):
        out["1x2"].append(round(b.engine_run(ckpt, {"a": clips["a"]}, 30)[0] * 1e3, 1))
        out["2x2"].append(round(b.engine_run(ckpt, clips, 30)[0] * 1e3, 1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
