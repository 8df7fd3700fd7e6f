"""The one script a GPU session runs: the GPU tests, then the GPU data plane timed part by part.

    bash ../shared/gpu/device-prep.sh nvdec && python3 benchmarks/gpu_media.py   # on our machine, first
    # then device calls, carrying [".whl", ".gpu"], whose command begins as ../shared/gpu/README.md says:
    python3 benchmarks/gpu_check.py --only probe  # first, a call of its own (box 280 s; expected ~2 minutes)
    python3 benchmarks/gpu_check.py            # the data plane; JSON lines to $OUT/gpu_check.jsonl
    python3 benchmarks/gpu_check.py --dry-run  # on the CPU (make test runs it): every part, CPU-sized

Each part runs in its own subprocess with a time box and appends JSON lines as it goes, so a hang or a
crash loses only that part; each call stays under ~9 minutes. Parts:
  probe       first, in a call of its own: the open questions of issue 32, each answered in under 10 s
              (benchmarks/gpu_probe.py): GetDecoderCaps per codec, parameter sets out of band, an oversized
              H.264 stream, CPU seconds of a blocking vs non-blocking event wait, the syncs set_sync_debug_mode
              reports around classify and SAM 2 on NV12, CreateDecoder with torch's pooled stream and the
              timestamps it echoes; then issue 43's seven (benchmarks/gpu_ipc_probe.py), each in a process of its
              own with a time box of 20-30 s: an IPC event's record seen by its exporter, a dead recorder's event,
              a dead consumer's leaked block and its release (and under expandable_segments), GPU memory per
              extra context, kernel latency beside 6 busy contexts, event creation across 48 threads, torn NVDEC
              frames under 32 decoding threads
  tests       the `gpu`-marked tests with VIDAR_REQUIRE_GPU=1 (none may pass by skipping)
  vit         ViT-L/16 bf16, batch 1/8/32/64: eager vs the CUDA-graph runner (GraphDispatcher)
  nvdec       NVDEC frames/s into GPU memory for 1, 8 and 48 decoder threads (720p60 H.264)
  preprocess  the batched NV12 -> model input op, a batch of 32 720p frames
  live        the engine, N live 720p60 H.264 streams (looped), ViT-L at 17 ms: goodput, p50/p99, drops
              by reason, for N = 1, 8, 16, 32, 48
  offline     8 file streams offline through the engine against the bare graph model at batch 64
  ingest_gpu  issue 33 item 8, NOT RUN ON A GPU YET (benchmarks/gpu_ingest.py): 6 ingest processes x 8 NVDEC
              720p60 streams writing into core-owned CUDA IPC slots while the core replays ViT-L's graph:
              goodput and p99 at 17 ms, each CUDA context's memory. Not in the default run (it would push the call
              past 10 minutes): `python3 benchmarks/gpu_check.py --only ingest_gpu` in a call of its own
  sam2        SAM 2 against Meta's predictor (benchmarks/gpu_sam2.py): not in the default run, which fits one
              device call; run it in a second call: `python3 benchmarks/gpu_check.py --only sam2`
The dry run exercises the same code on the CPU with a tiny model, a small clip and small counts, two parts at
a time after the probe: it proves the script runs, nothing about the GPU paths.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.window import window_counts  # noqa: E402 (after the path)
DRY = "--dry-run" in sys.argv[1:]
# the dry run writes beside the temp files, never into benchmarks/results (which holds device runs only)
OUT = Path(os.environ.get("OUT") or (Path(tempfile.gettempdir()) if DRY else ROOT / "benchmarks" / "results"))
# a part's subprocess writes where its parent does (main renames the log for --only)
LOG = Path(os.environ.get("VIDAR_GPU_CHECK_LOG") or OUT / ("gpu_check_dry.jsonl" if DRY else "gpu_check.jsonl"))
CLIP = ROOT / ".gpu" / "media" / "bbb720p60.mp4"  # benchmarks/gpu_media.py makes it
GPU_TESTS = ["tests/models/test_gpu.py", "tests/models/test_graphs.py", "tests/models/test_batch_preprocess.py",
             "tests/models/test_classify.py", "tests/frames/test_device_slots.py", "tests/streams/test_nvdec.py",
             "tests/models/test_sam2_gpu.py"]
VIT = "test_vit" if DRY else "vit_large_patch16_224"
DEVICE = "cpu" if DRY else "cuda"


def emit(part: str, **data) -> None:
    line = json.dumps({"part": part, "t": round(time.time(), 1), **data}, default=str)
    with open(LOG, "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


def sync() -> None:
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def med_ms(fn, reps: int) -> dict:
    """Median and worst of `reps` timed calls, after 3 untimed ones."""
    for _ in range(3):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"med_ms": round(ts[len(ts) // 2] * 1e3, 3), "max_ms": round(ts[-1] * 1e3, 3)}


def clip() -> Path:
    """The 720p60 H.264 clip (real footage on the device; a small synthetic H.264 clip in the dry run)."""
    if not DRY:
        if not CLIP.is_file():
            raise SystemExit(f"{CLIP} missing: run `python3 benchmarks/gpu_media.py` before the device call "
                             "and carry .gpu")
        return CLIP
    from engine.testing.clips import write_clip
    # beside the log (make test: its tmp_path, removed with it), not in /tmp for good; written under a name of
    # its own and renamed, so a part never reads another's half-written clip
    path = OUT / "vidar_gpu_check_dry.mp4"
    if not path.is_file():
        part = path.with_name(f"{path.stem}.{os.getpid()}{path.suffix}")
        write_clip(part, 24)
        os.replace(part, path)
    return path


# -- parts ------------------------------------------------------------------------------------------------

def part_tests() -> None:
    env = dict(os.environ, VIDAR_REQUIRE_GPU="1")
    # the gpu-marked tests only (these files' CPU tests ran in make test; together they would outrun the box)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TESTS]
    if DRY:  # the files exist and the gpu-marked tests collect (they would fail here, by design)
        cmd += ["--collect-only"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PARTS["tests"][1] - 10)
    except subprocess.TimeoutExpired as e:  # what pytest printed so far still goes into the log
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        emit("tests", rc="timeout", summary=f"over {e.timeout} s", out=out[-3000:])
        raise SystemExit("gpu tests: timeout")
    tail = r.stdout.strip().splitlines()[-1:] or [r.stderr[-300:]]
    emit("tests", rc=r.returncode, summary=tail[0], out=r.stdout[-3000:])
    if r.returncode != 0:
        raise SystemExit(f"gpu tests: rc {r.returncode}")


def vit_runner(graphs: bool, sizes: list[int]):
    from engine.config import ClassifyConfig
    from engine.models.classify import ClassifierRunner
    cfg = ClassifyConfig(name=VIT, weights="random", device=DEVICE, max_batch=max(sizes), cuda_graphs=graphs,
                         graph_batch_sizes=sizes)
    w = ClassifierRunner(cfg)
    w.capture_graphs()
    return w


def part_vit() -> None:
    import torch
    sizes = [1, 2] if DRY else [1, 8, 32, 64]
    for graphs in (False, True):
        w = vit_runner(graphs, sizes)
        if graphs:
            emit("vit", graphs_captured=getattr(w.graphs, "sizes", None), eager_reason=getattr(w.graphs, "eager_reason", None))
        c, h, wd = w.pre.data_config["input_size"]
        for b in sizes:
            x = torch.randn(b, c, h, wd, device=DEVICE).to(w.dtype)
            r = med_ms(lambda: w.forward(x), 5 if DRY else 20)
            emit("vit", model=VIT, graphs=graphs, batch=b, **r, img_per_s=round(b / r["med_ms"] * 1e3, 1))
        w.close()


def part_nvdec() -> None:
    """Decoder threads, each looping the clip through vidar's source (decode: cuda on the device)."""
    import psutil
    from streams import open_source
    path, decode = clip(), ("auto" if DRY else "cuda")
    for k in ((1, 2) if DRY else (1, 8, 48)):
        stop, counts, errors = threading.Event(), [0] * k, []

        def work(i):
            try:
                while not stop.is_set():
                    src = open_source(f"d{i}", str(path), decode=decode)
                    for _ in src.frames():
                        counts[i] += 1
                        if stop.is_set():
                            break
                    src.close()
            except Exception as err:  # reported, not raised: the other threads' count still means something
                errors.append(repr(err)[:300])
        ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(k)]
        for t in ts:
            t.start()
        time.sleep(0.5 if DRY else 1.5)
        p = psutil.Process()
        c0, n0, t0 = p.cpu_times(), sum(counts), time.perf_counter()
        time.sleep(1.0 if DRY else 3.0)
        c1, n1, t1 = p.cpu_times(), sum(counts), time.perf_counter()
        stop.set()
        for t in ts:
            t.join(10)
        probe = open_source("probe", str(path), decode=decode)
        probe.open()
        emit("nvdec", threads=k, fps=round((n1 - n0) / (t1 - t0), 1), decode_device=probe.decode_device,
             decode_reason=probe.decode_reason, errors=errors[:3],
             cpu_cores=round((c1.user + c1.system - c0.user - c0.system) / (t1 - t0), 2))
        probe.close()


def part_preprocess() -> None:
    import av
    import torch
    from engine.models.batch_preprocess import BatchPreprocessor
    from engine.models.classify import build_classifier, timm_contract
    model, _ = build_classifier(VIT, "random")
    pre = BatchPreprocessor(timm_contract(model), torch.device(DEVICE), torch.bfloat16)
    with av.open(str(clip())) as c:
        f = next(c.decode(video=0))
    nv12 = torch.from_numpy(f.to_ndarray(format="nv12")).to(DEVICE)
    n = 2 if DRY else 32
    frames = [nv12.clone() for _ in range(n)]
    r = med_ms(lambda: pre(frames, "nv12", [("bt601", "limited")] * n), 3 if DRY else 20)
    emit("preprocess", batch=n, size=f"{f.width}x{f.height}", **r)


def run_engine(n: int, *, mode: str, seconds: float, warm_s: float, max_batch: int | str, budget_ms: float,
               transport: str = "threads") -> dict:
    """The engine on n streams of the clip (live: looped at its 60 fps; offline: once each), ViT-L
    random, graphs on; counts over `seconds` after `warm_s` (live), or to the end (offline). `transport`: how the
    NVDEC streams reach the pool: "threads" (decoders as threads in the engine process, NV12 in GPU memory) or
    "shm" (ingest processes, NV12 copied into shared-memory slots: ingest.gpu_transport, the default)."""
    from engine.config import build_config
    from engine.core.engine import Engine
    from engine.testing.net import free_endpoint
    path = clip()
    streams = [{"id": f"s{i}", "url": str(path), "mode": mode, "loop": mode == "live"} for i in range(n)]
    cfg, _ = build_config({
        "streams": streams,
        "models": {"classify": {"name": VIT, "weights": "random", "max_batch": max_batch, "device": DEVICE}},
        "budget": {"latency_ms": budget_ms}, "qos": {"ladder": False}, "publish": {"endpoint": free_endpoint()},
        "ring": {"min_slots": 2, "max_slots": 8}, "metrics": {"enabled": False}, "control": {"enabled": False},
        # threads: NVDEC in the engine process (the dry run on the CPU then takes that path too, not the ingest
        # processes', which bench_host measures); shm: NVDEC in ingest processes, into host slots (issue 43 item 3a)
        "view": {"enabled": False},
        "ingest": {"processes": 0} if transport == "threads" else {"processes": "auto", "gpu_transport": "shm"}},
        cuda_available=True)
    eng = Engine(cfg)
    t_start = time.perf_counter()
    eng.start()
    started_s = time.perf_counter() - t_start
    pool = eng.pools["classify"]
    acct = pool.acct
    chosen = {"max_batch": pool.scheduler.max_batch,
              "why": pool.batch_choice.why if pool.batch_choice is not None else "configured",
              "warmup_ms": {b: round(s * 1e3, 2) for b, s in pool.scheduler.latency.measured().items()}}
    ids = [s["id"] for s in streams]
    try:
        if mode == "offline":
            t0 = time.perf_counter()
            deadline = t0 + seconds
            while not eng.finished() and time.perf_counter() < deadline:
                time.sleep(0.05)
            elapsed = time.perf_counter() - t0
            snaps = [acct.snapshot(i) for i in ids]
            pub = sum(s.published for s in snaps)
            return {"streams": n, "frames_per_s": round(pub / elapsed, 1), "published": pub,
                    "finished": eng.finished(), "start_s": round(started_s, 1), **chosen}
        counted = window_counts(acct, ids, warm_s=warm_s, seconds=seconds)
        described = eng.describe()
    finally:
        eng.stop()
    return {"streams": n, "budget_ms": budget_ms, "transport": transport, **counted,
            "decode": described[ids[0]].get("decode"), "process": described[ids[0]].get("process"),
            "start_s": round(started_s, 1), **chosen}


def part_live() -> None:
    # NVDEC as threads in the engine process at every count, then in ingest processes through shared memory (the
    # default since issue 43 item 3a) at 1, 8 and 48: goodput and p99 side by side, the same clip and budget
    runs = [(n, "threads") for n in ((1,) if DRY else (1, 8, 16, 32, 48))]
    runs += [(n, "shm") for n in ((1,) if DRY else (1, 8, 48))]
    for n, transport in runs:
        # max_batch auto: what `make run` does on a GPU (item 6), its choice and the measured times in the record
        # an ingest process that decodes on the GPU imports torch and makes its CUDA context when its first stream
        # opens (seconds): the window starts later for those
        warm = 0.5 if DRY else (2.0 if transport == "threads" else 6.0)
        emit("live", **run_engine(n, mode="live", seconds=1.5 if DRY else 5.0, warm_s=warm,
                                  max_batch="auto", budget_ms=2000 if DRY else 17, transport=transport))


def part_offline() -> None:
    import torch
    r = run_engine(1 if DRY else 8, mode="offline", seconds=30 if DRY else 40, warm_s=0,
                   max_batch=2 if DRY else 64, budget_ms=17)
    b = 2 if DRY else 64
    w = vit_runner(True, [b])
    c, h, wd = w.pre.data_config["input_size"]
    x = torch.randn(b, c, h, wd, device=DEVICE).to(w.dtype)
    bare = b / med_ms(lambda: w.forward(x), 3 if DRY else 10)["med_ms"] * 1e3
    emit("offline", **r, bare_graph_img_per_s=round(bare, 1), ratio=round(r["frames_per_s"] / bare, 3))


def part_probe() -> None:  # in a module of its own: seven questions, ~300 lines
    from benchmarks.gpu_probe import part_probe as run
    run(emit, dry=DRY, clip=clip())


def part_ingest_gpu() -> None:  # in a module of its own: processes, CUDA IPC slots and the core loop, ~250 lines
    from benchmarks.gpu_ingest import part_ingest_gpu as run
    run(emit, clip=clip(), dry=DRY)


def part_sam2() -> None:  # in a module of its own: the SAM 2 reference and engine runs are ~150 lines
    from benchmarks.gpu_sam2 import part_sam2 as run
    run(emit, clip=clip(), dry=DRY)


# seconds per part: the data plane's 470 in all, under the 10 minutes a device call may take with the wheels'
# install; the probe's 280 (issue 32's questions of at most 10 s each, then issue 43's seven, boxes of 20-30 s each
# adding to 180) in a call of its own before it (`--only probe`), and SAM 2 (issue 24) in another (`--only sam2`):
# their records are written as they come, so a part cut off at its box keeps what it measured
PARTS = {"probe": (part_probe, 280), "tests": (part_tests, 130), "vit": (part_vit, 60), "nvdec": (part_nvdec, 45),
         "preprocess": (part_preprocess, 25), "live": (part_live, 200), "offline": (part_offline, 60),
         "sam2": (part_sam2, 540), "ingest_gpu": (part_ingest_gpu, 100)}
DEFAULT_PARTS = ["tests", "vit", "nvdec", "preprocess", "live", "offline"]


def run_parts(names: list[str], jobs: int) -> list[str]:
    """Each part in a subprocess of its own, time-boxed; the parts that failed. The probe first and alone (its
    answers come before anything else can hang; its stand-ins for busy GPU contexts and decoding threads load
    every core), then the others `jobs` at a time: one on the device, where a part's timings need the GPU to
    itself; two in the dry run, which only proves each part runs (CPU-bound imports and tiny models: on a 2-core
    machine ~40 s instead of ~75), longest box first."""
    rest = [n for n in names if n != "probe"]
    if jobs > 1:
        rest.sort(key=lambda n: -PARTS[n][1])
    queue, running, failed = [n for n in names if n == "probe"] + rest, {}, []  # running: name: (process, start, box)
    while queue or running:
        while queue and len(running) < (1 if queue[0] == "probe" or "probe" in running else jobs):
            name = queue.pop(0)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name] + (["--dry-run"] if DRY else [])
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if jobs > 1:  # OpenMP's idle threads sleep instead of spinning on the core the other part needs
                env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            # its own process group: a part that outruns its box is killed with everything it started (pytest,
            # an engine's threads), so nothing of it keeps the GPU busy during the next part
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
            running[name] = (p, time.perf_counter(), PARTS[name][1] * (2 if DRY else 1))
        time.sleep(0.1)
        for name, (p, t0, box) in list(running.items()):
            rc = p.poll()
            if rc is None and time.perf_counter() - t0 > box:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = "timeout"
            if rc is None:
                continue
            del running[name]
            emit("part_done", name=name, rc=rc, s=round(time.perf_counter() - t0, 1))
            if rc != 0:
                failed.append(name)
    return failed


def main() -> int:
    global LOG
    args = [a for a in sys.argv[1:] if a != "--dry-run"]
    if args[:1] == ["--part"] and len(args) == 2 and args[1] in PARTS:
        PARTS[args[1]][0]()
        return 0
    # --only a,b: those parts; the dry run runs every part (each must keep working), the device run the data
    # plane's unless told (SAM 2 needs a call of its own: the two do not fit one 10-minute call)
    if args and not (args[0] == "--only" and len(args) == 2):
        raise SystemExit(f"gpu_check: unknown arguments {args}; use [--dry-run] [--only PART,PART] "
                         f"(parts: {', '.join(PARTS)})")
    only = args[1].split(",") if args else (list(PARTS) if DRY else DEFAULT_PARTS)
    unknown = [p for p in only if p not in PARTS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown part(s) {unknown}; parts: {', '.join(PARTS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    if args:  # a second call (--only sam2) must not overwrite the first's log in the same folder
        LOG = LOG.with_name(LOG.stem + "_" + "-".join(only) + LOG.suffix)
        os.environ["VIDAR_GPU_CHECK_LOG"] = str(LOG)
    LOG.unlink(missing_ok=True)
    import torch
    if not DRY and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run on the CPU)")
    emit("start", dry_run=DRY, torch=torch.__version__,
         device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    if DRY:
        clip()  # once, before the parts that read it start side by side
    if not DRY and not args:
        print("gpu_check: the data plane; the probe runs first, in a call of its own: --only probe", flush=True)
    failed = run_parts(only, jobs=2 if DRY else 1)
    if DRY:
        if failed:
            print(f"gpu_check --dry-run: FAILED parts {failed}", flush=True)
            return 1
        print("gpu_check --dry-run: every part ran on the CPU (tiny model, small clip); no GPU path has run",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
