"""gpu_check's `probe` part (issue 32 item 7, issue 43 item 5): the first minutes of a device session answer the
open questions about NVDEC, the host's waits and CUDA IPC, one JSON line each (`emit("probe", question=..., ...)`).
These first, each in a thread, in under 10 s:

  caps        GetDecoderCaps (8-bit 4:2:0) for H264, HEVC, AV1, VP8, VP9, MPEG2
  params      H.264 whose SPS/PPS are kept out of the packets: frames from a decoder given none of them,
              given them before the first keyframe's slice (what streams/nvdec.py's dump_extra does), and given
              them as a packet of their own
  oversize    a 4160x64 H.264 stream (over NVDEC's 4096 H.264 limit on Hopper, per NVIDIA's note): whether
              CreateDecoder accepts it and only Decode fails, and what GetDecoderCaps says of it
  event_wait  CPU seconds of this thread during a host wait on a torch.cuda.Event(blocking=False) and on a
              blocking one, while the GPU sleeps 1 s (torch.cuda._sleep, its cycles measured first)
  syncs_classify, syncs_sam2
              what torch.cuda.set_sync_debug_mode("warn") reports around one classify batch, and around one SAM 2
              step (encoder + tracking stage + masks, 2 objects), on NV12 frames in GPU memory
  stream      whether CreateDecoder takes torch's pooled stream with cudacontext=0 (streams/nvdec.py's call),
              and whether each frame's timestamp echoes the ticket its packet was given

Then the seven questions of benchmarks/gpu_ipc_probe.py, each in a spawned process of its own with a 20-30 s box
(../shared/gpu/review-gpu-paths.md, "First-device-minute questions"; NOT RUN ON A GPU YET):
  ipc_record_seen          a record in the importing process: seen by the exporter's query at once?
  ipc_dead_recorder        the query of an event whose recorder was killed with its record queued; a new recorder
  ipc_consumer_death_leak  a killed consumer's block stays reserved until _release_ipc_counter (and with
                           expandable_segments:True: does the import work at all?)
  context_memory           GPU memory per extra CUDA context (6 processes)
  busy_contexts_latency    a bf16 matmul's p50/p99 alone and beside 6 busy contexts
  event_create_48_threads  us per event created and recorded from 1 and 48 threads (and per re-record)
  nvdec_torn_frames        32 threads decoding one clip with decode="cuda": does every frame index hash alike?

On the CPU (gpu_check --dry-run) every question says "no GPU"; the NVDEC ones run their code against the fake
PyNvVideoCodec of engine/testing/fake_nvdec.py (its answers are the fake's, made up: they only show the code
runs), and the `syncs_*` questions run their classify and SAM 2 step on the CPU (RGB frames: NV12 input is a
GPU path) without the sync accounting, which needs CUDA; the seven run their scripts with stand-ins
(benchmarks/gpu_ipc_fake.py, the fake PyNvVideoCodec) and name every answer field dry_*. None of this has run on
a GPU yet.
"""

from __future__ import annotations

import ctypes
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import av
import torch

from engine.testing.clips import write_clip
from streams import nvdec

LIMIT_S = 10.0  # per question: the "each in under 10 s"
CODECS = ["H264", "HEVC", "AV1", "VP8", "VP9", "MPEG2"]
NO_GPU = ("no GPU: answered by the fake PyNvVideoCodec (engine/testing/fake_nvdec.py) to check this code; says "
          "nothing about NVDEC")


class Probe:
    """What every question gets: the module (real, or the fake on the CPU), whether a GPU is there, a folder."""

    def __init__(self, dry: bool, workdir: Path):
        self.gpu = torch.cuda.is_available() and not dry
        self.workdir = workdir
        self.nvc: Any = None
        try:  # what the real package says here (on a machine without the driver: RuntimeError)
            real = nvdec.load_pynvvideocodec()
            self.real_import = f"imported {getattr(real, '__version__', '')}".strip()
        except (ImportError, RuntimeError, OSError) as err:
            real, self.real_import = None, f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:150]}"
        if self.gpu:
            self.nvc = real  # None: the NVDEC questions say why (the other questions still run)
        else:
            from engine.testing.fake_nvdec import FakeNvdec
            self.nvc = FakeNvdec()
            nvdec.cuda_ops = self.nvc.cuda  # this subprocess only: the probe's decoders get the fake's streams
        self.note = {"real_import": self.real_import, **({} if self.gpu else {"note": NO_GPU})}

    def decoder(self, codec: str, stream: Any = None) -> Any:
        """A decoder as streams/nvdec.py makes one: cudacontext=0, a stream of its own, low latency."""
        nvc = self.nvc
        stream = stream or nvdec.cuda_ops.new_stream(0)
        return nvc.CreateDecoder(gpuid=0, codec=getattr(nvc.cudaVideoCodec, codec), cudacontext=0,
                                 cudastream=stream.cuda_stream, usedevicememory=True,
                                 latency=nvc.DisplayDecodeLatencyType.LOW)

    def feed(self, dec: Any, datas: list[bytes], flags: list[bool] | None = None) -> int:
        """Frames out of `dec` for these Annex-B buffers (each flagged end-of-picture unless told) and the flush."""
        n = 0
        for i, data in enumerate(datas):
            buf = ctypes.create_string_buffer(data, len(data))  # alive until Decode returned
            pd = self.nvc.PacketData()
            pd.bsl_data, pd.bsl, pd.pts = ctypes.addressof(buf), len(data), i + 1
            if flags is None or flags[i]:
                pd.decode_flag = self.nvc.VideoPacketFlag.ENDOFPICTURE
            n += len(dec.Decode(pd))
        pd = self.nvc.PacketData()
        pd.bsl_data, pd.bsl = 0, 0
        return n + len(dec.Decode(pd))


# -- H.264 as Annex-B, with the parameter sets split off ---------------------------------------------------
def annexb_packets(path: Path) -> list[bytes]:
    """The clip's H.264 packets, Annex-B (h264_mp4toannexb puts SPS/PPS before the IDR)."""
    with av.open(str(path)) as c:
        st = c.streams.video[0]
        bsf = av.bitstream.BitStreamFilterContext("h264_mp4toannexb", st)
        return [bytes(p) for pkt in c.demux(st) if pkt.size for p in bsf.filter(pkt)]


def split_nals(data: bytes) -> list[bytes]:
    """An Annex-B buffer's NAL units, each with its start code."""
    starts, i = [], data.find(b"\x00\x00\x01")
    while i >= 0:
        starts.append(i - 1 if i and data[i - 1] == 0 else i)  # a 4-byte start code keeps its leading zero
        i = data.find(b"\x00\x00\x01", i + 3)
    return [data[a:b] for a, b in zip(starts, starts[1:] + [len(data)])]


def nal_type(nal: bytes) -> int:
    return nal[nal.index(b"\x00\x00\x01") + 3] & 0x1F


def without_params(packets: list[bytes]) -> tuple[list[bytes], bytes]:
    """(the packets with every SPS (7) and PPS (8) taken out, the first ones taken out): the parameter sets
    out of band, as an RTSP camera with them in its SDP only sends them."""
    params, out = b"", []
    for data in packets:
        nals = split_nals(data)
        if not params:
            params = b"".join(n for n in nals if nal_type(n) in (7, 8))
        out.append(b"".join(n for n in nals if nal_type(n) not in (7, 8)))
    return out, params


# -- the questions ---------------------------------------------------------------------------------------
def q_caps(p: Probe) -> dict:
    answers = {}
    for codec in CODECS:
        try:
            answers[codec] = dict(p.nvc.GetDecoderCaps(gpuid=0, codec=getattr(p.nvc.cudaVideoCodec, codec)))
        except Exception as err:  # one codec's refusal is an answer too
            answers[codec] = f"{type(err).__name__}: {err}"[:200]
    return {"caps": answers}


def q_params(p: Probe) -> dict:
    packets, params = without_params(annexb_packets(write_clip(p.workdir / "params.mp4", 10, (160, 128), gop=5)))
    first = packets[0]
    return {"packets": len(packets), "param_bytes": len(params),
            "frames_without_params": p.feed(p.decoder("H264"), packets),
            "frames_params_before_first_slice": p.feed(p.decoder("H264"), [params + first] + packets[1:]),
            "frames_params_own_packet_no_flag": p.feed(p.decoder("H264"), [params] + packets,
                                                       [False] + [True] * len(packets)),
            "frames_params_own_packet_end_of_picture": p.feed(p.decoder("H264"), [params] + packets)}


def q_oversize(p: Probe) -> dict:
    packets = annexb_packets(write_clip(p.workdir / "wide.mp4", 2, (4160, 64), gop=1))
    caps = p.nvc.GetDecoderCaps(gpuid=0, codec=p.nvc.cudaVideoCodec.H264)
    out: dict = {"size": "4160x64", "caps_width_max": caps.get("width_max"), "caps_height_max": caps.get("height_max"),
                 "caps_say": streams_caps_say(caps)}
    try:
        dec = p.decoder("H264")
        out["create"] = "ok"
    except Exception as err:
        return {**out, "create": f"{type(err).__name__}: {err}"[:300]}
    try:
        out["frames"], out["decode"] = p.feed(dec, packets), "ok"
    except Exception as err:
        out["decode"] = f"{type(err).__name__}: {err}"[:300]
    return out


def streams_caps_say(caps: Any) -> str:
    from streams.nvdec_caps import caps_refusal
    return caps_refusal(caps, "h264", (4160, 64)) or "accepted"


def q_event_wait(p: Probe) -> dict:
    if not p.gpu:
        return {"skipped": "no GPU: needs CUDA events and torch.cuda._sleep"}
    cycles = sleep_cycles(1.0)
    out = {"sleep_cycles_for_1s": cycles}
    for blocking in (False, True):
        ev = torch.cuda.Event(blocking=blocking)
        torch.cuda._sleep(cycles)
        ev.record()
        c0, w0 = time.thread_time(), time.perf_counter()
        ev.synchronize()
        out["blocking" if blocking else "non_blocking"] = {"cpu_s": round(time.thread_time() - c0, 3),
                                                           "wall_s": round(time.perf_counter() - w0, 3)}
    return out


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles torch.cuda._sleep spins for `seconds` (measured: 20 M cycles timed by events)."""
    n, start, end = 20_000_000, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return int(n * seconds * 1e3 / max(start.elapsed_time(end), 1e-3))


def q_syncs_classify(p: Probe) -> dict:
    return _syncs(p, _classify_step)


def q_syncs_sam2(p: Probe) -> dict:
    return _syncs(p, _sam2_step)


def _syncs(p: Probe, build: Callable[[str, Path], Callable[[], Any]]) -> dict:
    device = "cuda" if p.gpu else "cpu"
    step = build(device, p.workdir)
    step()  # warm: first-call syncs (allocations, cuDNN/cuBLAS set-up) are not the per-frame path
    if not p.gpu:
        return {"skipped": "no GPU: torch.cuda.set_sync_debug_mode needs CUDA; the step ran on the CPU (RGB "
                           "frames) to check this code", "ran_on": "cpu"}
    return _synced(step)


def _synced(step: Callable[[], Any]) -> dict:
    """The syncs set_sync_debug_mode("warn") reports during one call of `step`: count and where from."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {"syncs": len(syncs), "where": dict(where.most_common(12)),
            "first_message": str(syncs[0].message)[:160] if syncs else None}


def _frames(device: str, n: int, size: tuple[int, int] = (128, 96)):
    """n frames of random pixels as the ring hands them out: NV12 in GPU memory on a GPU, RGB on the CPU."""
    from engine.frames.ref import LooseFrames
    w, h = size
    g = torch.Generator().manual_seed(0)
    if device == "cuda":
        return LooseFrames([torch.randint(0, 256, (h * 3 // 2, w), generator=g, dtype=torch.uint8).cuda()
                            for _ in range(n)]).refs("probe", pixel_format="nv12")
    return LooseFrames([torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
                        for _ in range(n)]).refs("probe")


def _classify_step(device: str, workdir: Path) -> Callable[[], Any]:
    """One batch of 4 through the classifier (timm's test_vit, random weights; CUDA graphs as configured)."""
    from engine.config import ClassifyConfig
    from engine.models.classify import ClassifierRunner
    w = ClassifierRunner(ClassifyConfig(name="test_vit", weights="random", device=device, max_batch=4,
                                        graph_batch_sizes=[4]))
    w.capture_graphs()
    frames = _frames(device, 4)
    return lambda: w.infer(w.prepare(frames))


def _sam2_step(device: str, workdir: Path) -> Callable[[], Any]:
    """One frame through SAM 2 hiera-t at 256 px (random weights biased to "object present"): the encoder,
    then the tracking stage and the masks for 2 box-prompted objects (eager: graph capture would not fit 10 s)."""
    from engine.config import Sam2Config
    from engine.models.sam2 import Sam2EncoderRunner, Sam2PostProcessor
    from engine.models.sam2_tracker import Prompt, TrackingStage
    from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint
    ckpt = make_checkpoint(workdir / "sam2.pt")
    (ref,) = _frames(device, 1)  # made before: its upload is no sync of the step's
    runner = Sam2EncoderRunner(Sam2Config(config=CONFIG, checkpoint=str(ckpt), image_size=SIZE, device=device,
                                          cuda_graphs=False, preprocess="fast"))
    stage = TrackingStage(runner.model, sized=runner.sized, dtype=runner.dtype, graphs=False)
    stage.add_stream("probe")
    stage.add_object("probe", Prompt(1, box=[10, 10, 60, 50]))
    stage.add_object("probe", Prompt(2, box=[50, 40, 120, 90]))
    processor = Sam2PostProcessor(stage)

    def step():
        feats = runner.infer(runner.prepare([ref]))
        out, commit = processor.process([ref], feats)
        commit()
        return out
    return step


def q_stream(p: Probe) -> dict:
    """streams/nvdec.py's own session (torch's pooled stream, cudacontext=0) on a clip: what the frames echo."""
    path = write_clip(p.workdir / "echo.mp4", 12, (160, 128), gop=6)
    with av.open(str(path)) as c:
        st = c.streams.video[0]
        try:
            session = nvdec.NvdecSession(p.nvc, st)
        except Exception as err:
            return {"create": f"{type(err).__name__}: {err}"[:300]}
        given, echoed = [], []
        for ticket, packet in enumerate(c.demux(st), start=1):
            given += [ticket] if packet.size else []
            echoed += [t for t, _, _ in session.decode(packet, ticket)]
    return {"create": "ok", "stream_handle_nonzero": session.cuda_stream.cuda_stream != 0, "frames": len(echoed),
            "echoes_tickets": echoed == given, "echoed_first": echoed[:4], "given_first": given[:4]}


#: the questions the fake answers on the CPU (the others say they were skipped, and why)
NVDEC_QUESTIONS = {"caps", "params", "oversize", "stream"}
QUESTIONS: dict[str, Callable[[Probe], dict]] = {
    "caps": q_caps, "params": q_params, "oversize": q_oversize, "event_wait": q_event_wait,
    "syncs_classify": q_syncs_classify, "syncs_sam2": q_syncs_sam2, "stream": q_stream,
}


def part_probe(emit: Callable[..., None], *, dry: bool, clip: Path | None = None) -> None:
    """Every question in turn, each in a thread given LIMIT_S (on a GPU): one that runs over is reported and left
    behind (a daemon; the part's own time box ends the process), so the next still gets its turn. Then the seven
    of gpu_ipc_probe, each in a process of its own (`clip`: question 7's; None: .gpu/media's on a GPU)."""
    with tempfile.TemporaryDirectory(prefix="vidar_probe_") as tmp:
        p = Probe(dry, Path(tmp))
        emit("probe", question="setup", gpu=p.gpu, device=torch.cuda.get_device_name(0) if p.gpu else "cpu",
             decoder="PyNvVideoCodec" if p.gpu else "fake", **p.note)
        for name, ask in QUESTIONS.items():
            answer: dict = {}

            def run(ask=ask, answer=answer, name=name):
                if name in NVDEC_QUESTIONS and p.nvc is None:
                    answer["error"] = f"PyNvVideoCodec unavailable: {p.real_import}"
                    return
                try:
                    answer.update(ask(p))
                except Exception as err:  # an answer too: what raised, where the device run can read it
                    answer["error"] = f"{type(err).__name__}: {err}"[:400]
            t0 = time.perf_counter()
            t = threading.Thread(target=run, name=f"probe-{name}", daemon=True)
            t.start()
            # the dry run's CPU (two cores, shared with other tests) builds the models several times slower
            limit_s = LIMIT_S if p.gpu else 3 * LIMIT_S
            t.join(limit_s)
            s = round(time.perf_counter() - t0, 2)
            if t.is_alive():
                answer = {"error": f"no answer within {limit_s:g} s"}
            note = {"note": NO_GPU} if not p.gpu and name in NVDEC_QUESTIONS else {}
            emit("probe", question=name, gpu=p.gpu, s=s, **note, **answer)
    # after the threads' questions (the GPU is then the spawned processes' alone, unless one of those overran)
    from benchmarks.gpu_ipc_probe import run as ipc_questions
    ipc_questions(emit, dry=dry, clip=clip)
