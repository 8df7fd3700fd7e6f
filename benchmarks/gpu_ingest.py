"""gpu_check part `ingest_gpu` (issue 33 item 8): NVDEC streams decoded in ingest processes, written into CUDA IPC
slots the core owns, while the core replays ViT-L's CUDA graph. NOT RUN ON A GPU YET: written for the device from
the APIs that ran there (../shared/gpu/README.md) and torch's CUDA IPC docs; only the dry run has run.

    python3 benchmarks/gpu_check.py --only ingest_gpu            # on the device: 6 processes x 8 streams, 720p60
    python3 benchmarks/gpu_check.py --dry-run --only ingest_gpu  # on the CPU: threads + the fake CUDA, tiny sizes

Device: the core allocates one CudaSlotPool per stream (engine/ingest/cuda_slots.py) and exports each once to
its process (spawn: no fork after CUDA); each process decodes its 8 streams with NVDEC (streams/nvdec.py, live
pacing at 60 fps), copies each frame into a lent slot on its copy stream after the core's released[slot], records
written[slot] and sends a descriptor. The core polls written[slot] (PendingFrames), takes the freshest frame of
each stream, batches up to 8, replays ViT-L bf16's graph (a static input: the slot-to-input preprocessing is
timed by the `preprocess` part), records released[slot] after it and lends the slot back. Reported: goodput
(frames done within 17 ms of capture, of all decoded: a frame shed for want of a slot counts as missed), p50/p99
capture-to-done, and each CUDA context's memory (torch.cuda.memory_allocated/reserved in the process, and
nvidia-smi's used_memory per pid, which includes the context itself).

This drives the pool, the events and both sides' paths directly, not the engine's ingest hub: NVDEC streams are
not placed in ingest processes by the engine yet (engine/core/stream_table.py `_in_process`). Descriptors travel
on multiprocessing queues here (the engine's are ZeroMQ, wire.py): ~3,000 a second is far below either's limit.
The dry run plays the processes as threads over engine/testing/fake_cuda.py (one process: the fake shares its
events in memory) with synthetic NV12 frames and a small matmul for the model: it proves the script runs and the
accounting adds up, nothing about a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import subprocess
import threading
import time
from collections import deque
from typing import Any, Callable

BUDGET_S = 0.017
FPS = 60


def _produce(proc: int, attached: list, cuda: Any, frames: Callable[[int], Any], put: Callable[[tuple], None],
             credit_get: Callable[[], Any], stop: threading.Event) -> None:
    """One ingest process's streams (threads, as in engine/ingest/process.py): paced at FPS, each frame copied into
    a lent slot (or shed, counted, without a credit), then its descriptor put."""
    credits = [deque() for _ in attached]
    lock = threading.Lock()  # one copy stream per process, as RemoteRing has
    copy_stream = cuda.Stream()
    shed = [0] * len(attached)

    def credit_loop():
        while not stop.is_set():
            item = credit_get()
            if item is not None:
                credits[item[0]].append(item[1])

    def stream_loop(k: int):
        t0, n = time.monotonic(), 0
        for nv12, ready in frames(k):
            due = t0 + n / FPS
            n += 1
            if stop.wait(max(0.0, due - time.monotonic())):
                return
            t_cap = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
            if not credits[k]:
                shed[k] += 1
                put(("shed", proc, k, t_cap))
                continue
            slot = credits[k].popleft()
            with lock:
                attached[k].write(slot, nv12, ready, copy_stream, cuda)
            put(("frame", proc, k, slot, t_cap))

    ts = [threading.Thread(target=credit_loop, daemon=True)]
    ts += [threading.Thread(target=stream_loop, args=(k,), daemon=True) for k in range(len(attached))]
    for t in ts:
        t.start()
    stop.wait()
    for t in ts:
        t.join(5)


def _open_all(msgs: list[bytes], cuda: Any) -> list:
    """The pools an ingest process opens, from their CudaSlots messages as they travel (wire.encode's bytes): the
    dry run goes through the same encode and decode as the device's processes."""
    from engine.ingest import cuda_slots, wire
    return [cuda_slots.AttachedSlots.open(wire.decode(m), cuda) for m in msgs]


def _child(proc: int, msgs: list[bytes], up: Any, credit_q: Any, clip: str, stop: Any, *, cuda: Any = None,
           frames: Any = None, mem_after_s: float = 3.0) -> None:
    """An ingest process on the device (spawned): opens its pools once, decodes with NVDEC, reports its memory, and
    stops when the parent sets `stop` (a multiprocessing Event). The dry run calls the same function in a thread
    with the same arguments, plus the fake CUDA and synthetic frames in place of torch's IPC and NVDEC."""
    import torch
    from engine.ingest import cuda_slots
    from streams import open_source
    cuda = cuda_slots.TorchIpc() if cuda is None else cuda
    attached = _open_all(msgs, cuda)

    def nvdec(k):
        while not stop.is_set():
            src = open_source(f"p{proc}s{k}", clip, decode="cuda")
            for f in src.frames():
                yield f.nv12, f.ready
                if stop.is_set():
                    break
            src.close()

    def get():
        try:
            return credit_q.get(timeout=0.1)
        except queue.Empty:
            return None
    mem = threading.Timer(mem_after_s, lambda: up.put(("mem", proc, os.getpid(), torch.cuda.memory_allocated(),
                                                       torch.cuda.memory_reserved())))
    mem.daemon = True  # never holds the process (or the dry run) open after its streams stopped
    mem.start()
    _produce(proc, attached, cuda, nvdec if frames is None else frames, up.put, get, stop)


def _nvidia_smi() -> dict[int, int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return {int(p): int(m) for p, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}
    except (OSError, ValueError, subprocess.TimeoutExpired) as err:
        return {-1: f"nvidia-smi: {err}"}  # type: ignore[dict-item]


def _core(pools: list[list], cuda: Any, device: Any, get_up: Callable[[], Any], credit_put: Callable[[int, int, int], None],
          model: Callable[[], Any], seconds: float, state: dict) -> dict:
    """The core: poll written[slot], freshest frame per stream, batches of up to 8 through the model, released[slot]
    recorded after it on the core's stream, the slot lent back. Returns the counts and latencies. `state` carries
    the held and ready frames from the warm-up call to the timed one (their slots are not lost)."""
    from engine.ingest.cuda_slots import PendingFrames
    pending = state.setdefault("pending", PendingFrames())
    ready: dict[tuple[int, int], deque] = state.setdefault("ready", {})
    lat, shed, superseded = [], 0, 0
    mem = state.setdefault("mem", [])  # the processes report once, a few seconds in: during the warm-up call
    core_stream = cuda.Stream(device=device)
    t_end = time.monotonic() + seconds

    def release(p, k, slot, after=None):
        if after is not None:
            with cuda.stream(core_stream):
                core_stream.wait_event(after)
                pools[p][k].released[slot].record(core_stream)
        credit_put(p, k, slot)

    while time.monotonic() < t_end:
        for _ in range(4096):
            item = get_up()
            if item is None:
                break
            if item[0] == "shed":
                shed += 1
            elif item[0] == "mem":
                mem.append(item[1:])
            else:
                _, p, k, slot, t_cap = item
                pending.add(f"{p}/{k}", 0, slot, pools[p][k].written[slot],
                            lambda p=p, k=k, slot=slot, t=t_cap: ready.setdefault((p, k), deque()).append((slot, t)))
        pending.poll()
        batch = []
        for key, q in ready.items():
            while len(q) > 1:  # freshest first: an older frame of the stream is superseded
                slot, _ = q.popleft()
                superseded += 1
                release(*key, slot)
            if q and len(batch) < 8:
                batch.append((key, *q.popleft()))
        if not batch:
            time.sleep(0.0005)
            continue
        done = model()
        if done is not None:
            done.synchronize()  # the benchmark's own host wait, to time the frames (the engine never does this)
        t = time.monotonic()
        for (p, k), slot, t_cap in batch:
            lat.append(t - t_cap)
            release(p, k, slot, done)
    offered = len(lat) + shed + superseded + sum(len(q) for q in ready.values()) + len(pending.held)
    lat.sort()
    q = (lambda f: round(lat[min(len(lat) - 1, int(f * len(lat)))] * 1e3, 2)) if lat else (lambda f: None)
    return {"offered": offered, "done": len(lat), "shed_at_source": shed, "superseded": superseded,
            "goodput": round(sum(x <= BUDGET_S for x in lat) / max(1, offered), 4), "p50_ms": q(0.5),
            "p99_ms": q(0.99), "frames_per_s": round(len(lat) / seconds, 1), "mem": mem}


def part_ingest_gpu(emit: Callable[..., None], *, clip: Any, dry: bool) -> None:
    import torch
    from engine.ingest import wire
    from engine.ingest.cuda_slots import CudaSlotPool
    procs, per, seconds = (2, 2, 1.5) if dry else (6, 8, 12.0)
    h, w, n_slots = (16, 16, 4) if dry else (720, 1280, 8)
    if dry:
        from engine.testing.fake_cuda import FakeCuda
        cuda, device = FakeCuda(), torch.device("cpu")
    else:
        from engine.ingest.cuda_slots import TorchIpc
        cuda, device = TorchIpc(), torch.device("cuda", 0)
    pools = [[CudaSlotPool(f"p{p}s{k}", n_slots, h, w, device=device, cuda=cuda) for k in range(per)]
             for p in range(procs)]
    model = _model(dry)
    # each pool exported once to its process, as the CudaSlots message travels (the bytes): the dry run opens the same
    msgs = [[wire.encode(pools[p][k].export(f"p{p}s{k}", 1)) for k in range(per)] for p in range(procs)]
    if dry:  # threads over the fake (it shares its events and blocks in memory), running the children's code
        stop: Any = threading.Event()
        up: Any = queue.Queue()
        credit_qs: list = [queue.Queue() for _ in range(procs)]
        frame = torch.zeros((h * 3 // 2, w), dtype=torch.uint8)

        def synthetic(k):
            while not stop.is_set():
                yield frame, None
        workers = [threading.Thread(target=_child, args=(p, msgs[p], up, credit_qs[p], str(clip), stop), daemon=True,
                                    kwargs={"cuda": cuda, "frames": synthetic, "mem_after_s": 0.1}) for p in range(procs)]
    else:
        mp = multiprocessing.get_context("spawn")  # never fork a process that has CUDA (torch's docs)
        stop = mp.Event()  # one for every process: each child's streams stop on it
        up, credit_qs = mp.Queue(), [mp.Queue() for _ in range(procs)]
        workers = [mp.Process(target=_child, daemon=True, args=(p, msgs[p], up, credit_qs[p], str(clip), stop))
                   for p in range(procs)]
    for p in range(procs):  # every slot lent at the start
        for k in range(per):
            for slot in range(n_slots):
                credit_qs[p].put((k, slot))
    for t in workers:
        t.start()

    def get_up():
        try:
            return up.get_nowait()
        except queue.Empty:
            return None
    try:
        warm = 0.3 if dry else 6.0  # the processes' start, torch import and NVDEC sessions
        state: dict = {}
        _core(pools, cuda, device, get_up, lambda p, k, s: credit_qs[p].put((k, s)), model, warm, state)
        r = _core(pools, cuda, device, get_up, lambda p, k, s: credit_qs[p].put((k, s)), model, seconds, state)
    finally:
        stop.set()
        t_end = time.monotonic() + 10
        for t in workers:
            # a child's queue feeder blocks on a full `up` pipe until it is read: drained while joining, so that
            # every child exits within the 10 s, not 10 s each
            while t.is_alive() and time.monotonic() < t_end:
                while get_up() is not None:
                    pass
                t.join(0.05)
            if not dry and t.is_alive():
                t.kill()
    mem = r.pop("mem")
    contexts = ("no GPU: the dry run has no CUDA context to measure" if dry else
                {"per_process": [{"proc": m[0], "pid": m[1], "allocated_mb": round(m[2] / 2**20, 1),
                                  "reserved_mb": round(m[3] / 2**20, 1)} for m in mem],
                 "nvidia_smi_mb_by_pid": _nvidia_smi(),
                 "core_allocated_mb": round(torch.cuda.memory_allocated() / 2**20, 1)})
    emit("ingest_gpu", processes=procs, streams_per_process=per, size=f"{w}x{h}", fps=FPS, budget_ms=BUDGET_S * 1e3,
         slots_per_stream=n_slots, **r, contexts=contexts,
         events_created=len(cuda.events_made) if dry else None, mem_reports=len(mem), dry_run=dry,
         note="threads and the fake CUDA on the CPU: proves the script, nothing about a GPU" if dry else
         "6 ingest processes x 8 NVDEC streams into core-owned CUDA IPC slots, ViT-L graph replay in the core")


def _model(dry: bool) -> Callable[[], Any]:
    """ViT-L/16 bf16 at batch 8 as a CUDA graph (the core's model), returning an event after its replay; the dry
    run: a small matmul and no event."""
    import torch
    if dry:
        x = torch.randn(64, 64)
        return lambda: (x @ x, None)[1]
    from benchmarks.gpu_check import vit_runner
    wkr = vit_runner(True, [8])
    c, hh, ww = wkr.pre.data_config["input_size"]
    x = torch.randn(8, c, hh, ww, device="cuda").to(wkr.dtype)
    stream = torch.cuda.Stream()

    from engine.models.device import host_event

    def run():
        with torch.cuda.stream(stream):
            wkr.forward(x)
            ev = host_event()  # blocking: the host's wait for it sleeps, never spins a core the ingest needs
            ev.record(stream)
        return ev
    return run
