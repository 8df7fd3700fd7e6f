"""The one script to run on a GPU machine: checks the CUDA paths, then times them.

    python3 benchmarks/gpu_check.py            # writes $OUT/gpu_check.json (or benchmarks/results/)
    python3 benchmarks/gpu_check.py --dry-run  # on the CPU: what can be checked without a GPU (below)

1. the GPU tests (tests/models/test_gpu.py) with VIDAR_REQUIRE_GPU=1, so nothing passes by skipping;
2. ViT-L/16 (random weights) bf16 on the GPU: model-only latency per batch size, and the
   upload + preprocessing cost of 720p uint8 frames from pinned memory;
3. vidar live on N synthetic 1280x720 60 fps streams at the 17 ms budget: goodput
   (share of frames published within their deadline) and p50/p99 latency, per stream count.
Not run yet on a GPU: vidar's development machines have none (see README).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"p50_ms": ts[len(ts) // 2] * 1e3, "p99_ms": ts[-1] * 1e3}


def model_latency(results):
    import timm
    from engine.config import ClassifyConfig
    from engine.models.classify import ClassifierRunner
    from engine.frames.ref import LooseFrames
    w = ClassifierRunner(ClassifyConfig(name="vit_large_patch16_224", weights="random", device="cuda"))
    for b in (1, 2, 4, 8):
        x = torch.randn(b, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
        results[f"vitl_bf16_b{b}"] = timed(lambda: w.forward(x))
    frames = [torch.randint(0, 255, (720, 1280, 3), dtype=torch.uint8).pin_memory() for _ in range(8)]
    views = LooseFrames(frames).refs()
    results["prepare_720p_b8"] = timed(lambda: w.prepare(views))
    w.close()


def goodput_config(streams: int):
    """The live run's config; building it needs no GPU (the CPU-side check of this script)."""
    from engine.config import build_config
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg, _ = build_config({
        "streams": [{"id": f"s{i}", "url": "synthetic://shapes?size=1280x720&fps=60"} for i in range(streams)],
        "models": {"classify": {"name": "vit_large_patch16_224", "weights": "random", "max_batch": 8}},
        "budget": {"latency_ms": 17}, "publish": {"endpoint": f"tcp://127.0.0.1:{port}"},
        # nothing is changed at run time: no control socket (Engine.start would bind port 5557)
        "metrics": {"enabled": False}, "control": {"enabled": False}}, cuda_available=True)
    return cfg


def engine_goodput(results, streams: int, seconds: float = 10.0):
    from engine.core.engine import Engine
    eng = Engine(goodput_config(streams))
    eng.start()
    time.sleep(seconds)
    snaps = [eng.pools["classify"].acct.snapshot(f"s{i}") for i in range(streams)]
    eng.stop()
    ing = sum(s.ingested for s in snaps)
    pub = sum(s.published for s in snaps)
    results[f"live_{streams}x720p60_17ms"] = {
        "goodput": pub / max(ing, 1), "ingested": ing, "published": pub,
        "dropped": {k: sum(s.dropped.get(k, 0) for s in snaps) for k in {k for s in snaps for k in s.dropped}},
        "p50_ms": max(s.p50_ms for s in snaps), "p99_ms": max(s.p99_ms for s in snaps)}


def dry_run() -> None:
    """Before a device session: the parts of this script that need no GPU. The live runs' configs build
    (and pass the engine's start-up checks: binds, frame memory for 8 streams of 720p), the modules
    the GPU steps import load, and the GPU test files exist. It proves nothing about the GPU paths."""
    from engine.security.binds import exposure_error
    from engine.frames.budget import total_memory_bytes
    from engine.frames.ref import LooseFrames  # noqa: F401  (model_latency's imports)
    from engine.frames.ring import slots_for
    from engine.models.classify import ClassifierRunner  # noqa: F401
    for n in (1, 4, 8):
        cfg = goodput_config(n)
        assert exposure_error(cfg) is None, exposure_error(cfg)
        r = cfg.ring
        need = n * slots_for(1280 * 720 * 3, r.memory_mb * 2**20, r.min_slots, r.max_slots) * 1280 * 720 * 3
        assert need <= total_memory_bytes(r.total_memory_mb), (n, need)
    for test in ("tests/models/test_gpu.py", "tests/models/test_classify.py"):
        assert (ROOT / test).is_file(), test
    print("gpu_check --dry-run: configs, imports and test files ok (no GPU path has run)")


def main():
    if "--dry-run" in sys.argv[1:]:
        return dry_run()
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "torch": torch.__version__}
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    env = dict(os.environ, VIDAR_REQUIRE_GPU="1")
    t = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/models/test_gpu.py", "tests/models/test_classify.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    results["gpu_tests"] = {"rc": t.returncode, "tail": t.stdout[-2000:]}
    print(t.stdout[-1500:], flush=True)
    model_latency(results)
    for n in (1, 4, 8):
        engine_goodput(results, n)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    for k, v in results.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
