"""The SAM 2 pool: image-encoder worker instances (batched across streams) feeding one shared
tracking stage (batched across every due (stream, object) pair). See sam2_tracker.py."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
from pydantic import ValidationError

from engine.config import MAX_OBJECT_ID, ObjectConfig, Sam2Config
from engine.util.request_fields import need
from engine.errors import ControlError
from engine.sched.tuning import ThreadPlan, usable_cores
from engine.models.base import PostProcessor, ModelRunner, time_batches
from engine.models.batch_preprocess import BatchPreprocessor, frames_input
from engine.models.preprocess import Preprocessor
from engine.models.device import host_event, model_stream, on_stream, resolve_device, resolve_dtype, wait_for_slots
from engine.models.registry import FAMILY_OPS, PoolSpec
from engine.models.sam2_model import KEY, autocast, build_sam2_model, resized_model, sam2_contract
from engine.models.graphs import CudaGraphBackend, GraphBackend, GraphDispatcher, default_sizes
from engine.models.sam2_tracker import TrackingStage, Prompt, backbone, encode, render, render_frame

log = logging.getLogger("vidar.sam2")


class Sam2EncoderRunner(ModelRunner):
    """Stage (a): preprocess and encode frames; the features go on to the tracking stage.

    Levels (set_level): 0 encodes at the configured image_size, i at degrade_sizes[i - 1]; the models
    for those sizes share the main model's weights and are built at start (~0.4 s each for hiera-t
    here), not on first use: the ladder steps down when the pool is overloaded, the worst moment
    for a build to stall the worker.

    Frames of a stream the tracking stage calls idle (nothing to track: `wanted` is False) are not
    encoded; they reach the tracking stage with no features and are published with no objects.
    """

    kind = "sam2"
    #: skip the encoder for idle streams (off only to measure what it saves)
    skip_idle = True

    def __init__(self, cfg: Sam2Config, *, model: torch.nn.Module | None = None, weights_tag: str | None = None,
                 sized: dict[int, torch.nn.Module] | None = None, graph_backend: GraphBackend | None = None):
        """`graph_backend` replaces the CUDA one (tests drive the graphed encoder on the CPU with a fake)."""
        self.cfg = cfg
        self.device = resolve_device(cfg.device, f"{KEY}.device")
        self.dtype = resolve_dtype(cfg.dtype, self.device, f"{KEY}.dtype")  # autocast; the weights stay float32
        if model is None:
            model, weights_tag = build_sam2_model(cfg.config, cfg.checkpoint, cfg.image_size, self.device)
        self.model, self.weights_tag = model, weights_tag or "random"
        self.sizes = [self.model.image_size, *cfg.degrade_sizes]
        if sized is None:
            sized = {s: resized_model(self.model, cfg.config, s) for s in cfg.degrade_sizes}
        self.sized = sized  # other input sizes, shared with the tracking stage and the other instances
        self.models = {self.model.image_size: self.model, **sized}
        self.pres = {s: Preprocessor(sam2_contract(s), cfg.preprocess, self.device) for s in self.sizes}
        self.pre = self.pres[self.model.image_size]
        # NV12 frames (NVDEC's GPU slots) always, and on a GPU the host RGB frames of `fast` too: one batched op
        # per frame size (batch_preprocess.py), host frames up through one pinned staging copy per batch
        self.batch_pres = {s: BatchPreprocessor(sam2_contract(s), self.device) for s in self.sizes}
        # the batched op runs where the pixels are; `exact` promises PIL's resize of RGB frames, so it keeps them
        self.accepts_nv12 = self.device.type == "cuda" and cfg.preprocess == "fast"
        self._slots_read_on_gpu = False
        # The encoder at image_size as CUDA graphs (captured at start: capture_graphs); degrade sizes run eager.
        # On an H200 hiera-t's bf16 encoder took 12.2 ms at batch 1 and 12.3 at batch 4 (../shared/gpu/README.md):
        # launch-bound, which is what a graph's replay removes.
        self.graphs: GraphDispatcher | None = None
        if cfg.cuda_graphs and (graph_backend is not None or self.device.type == "cuda"):
            self.graphs = GraphDispatcher(self._graphed_backbone, cfg.graph_batch_sizes or default_sizes(cfg.max_batch),
                                          backend=graph_backend or CudaGraphBackend(self.device), key=KEY)
        self.level = 0
        self.wanted: Callable[[str], bool] = lambda stream: True  # set by build_pool: TrackingStage.wants_frames
        # the encoder's own CUDA stream (None on the CPU): the tracking stage has another (TrackingStage.cuda_stream),
        # so the two overlap on the GPU and the encoder's batch time is its own, not the tracking queued before it
        self.stream = model_stream(self.device)

    def set_level(self, level: int) -> None:
        if not 0 <= level < len(self.sizes):
            raise ValueError(f"{KEY}: level {level} does not exist; levels 0..{len(self.sizes) - 1} are "
                             f"image_size {self.sizes}")
        self.level = level

    def prepare(self, frames: Sequence) -> tuple[list[int], int, torch.Tensor | None]:
        """The encoder's input from the frames of streams with something to track. On a GPU the work is
        queued on this instance's stream (infer runs there too, and waits for its batch before it returns the
        features, so the tracking stage reads them whole from its own stream); that stream waits on each NV12
        slot's write event, and NV12 slots are released on the event `release_event` records after this work
        (the ring rewrites a slot only once it fired)."""
        keep = [i for i, f in enumerate(frames) if not self.skip_idle or self.wanted(f.meta.stream)]
        self._slots_read_on_gpu = False
        if not keep:
            return keep, len(frames), None
        size, kept = self.sizes[self.level], [frames[i] for i in keep]
        with on_stream(self.stream):
            self._slots_read_on_gpu = wait_for_slots(self.stream, kept)
            x, _ = frames_input(kept, self.batch_pres[size], lambda px: self._rgb(px, size))
        return keep, len(frames), x

    def _rgb(self, pixels: list[torch.Tensor], size: int) -> torch.Tensor:
        """Host RGB frames: on a GPU (fast), the batched op (one staging copy, read on the host before it
        returns); otherwise the Preprocessor (exact: PIL as sam2's loader; fast on the CPU: uint8 tensor ops)."""
        if self.device.type == "cuda" and self.cfg.preprocess == "fast":
            return self.batch_pres[size](pixels, "rgb24")
        # No sync here: exact reads the slots on the host (PIL) and its upload is a blocking copy from pageable
        # memory, so the slots may be reused once this returns; fast on the CPU has no GPU at all.
        return self.pres[size](pixels)

    def release_event(self):
        """After a prepare that read NV12 slots on the GPU: an event after everything queued so far on this
        instance's stream. None otherwise: prepare has read the slots already."""
        if not self._slots_read_on_gpu:
            return None
        # waited on by the ring's copy stream only (DeviceSlots: stream.wait_event), never by the host: torch's
        # default, non-blocking event (device.host_event says why host-waited ones are not)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def infer(self, inputs: tuple[list[int], int, torch.Tensor | None]) -> list[dict]:
        keep, n, x = inputs
        out: list[dict] = [{"_features": None} for _ in range(n)]
        if x is not None:
            with on_stream(self.stream):
                feats = self._encode(x)
            if self.stream is not None:
                # wait for this batch's encoder: one batch in flight, the features whole before the tracking
                # stage's stream reads them (it records its use of them: Sam2Processor.process), and the batch's
                # time is its run time for the latency model, not its launch time
                done = host_event()  # blocking: the worker thread sleeps, it does not spin a core
                done.record(self.stream)
                done.synchronize()
            for i, f in zip(keep, feats):
                out[i] = {"_features": f}
        return out

    def _encode(self, x: torch.Tensor) -> list:
        """Features per frame: replayed from a graph at image_size (copied out of its static buffers), eager at
        the degrade sizes, over the largest graph, or without graphs."""
        size = x.shape[-1]
        if self.graphs is not None and self.graphs.sizes and size == self.model.image_size:
            return encode(self.model, x, self.graphs.run(x))
        with autocast(self.device, self.dtype):
            return encode(self.models[size], x)

    def _graphed_backbone(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with autocast(self.device, self.dtype, cache=False):
            return backbone(self.model, x)

    def capture_graphs(self) -> None:
        """Capture the encoder's CUDA graphs (once; a no-op without graphs): at start, before any stream's
        thread starts (build_pool); an instance rebuilt after a failure runs eager, as the classifier's."""
        if self.graphs is not None and not self.graphs.attempted:
            s = self.model.image_size
            with on_stream(self.stream):
                self.graphs.capture((3, s, s), torch.float32, self.device)

    def warmup(self, batch_sizes: Sequence[int]) -> dict[int, float]:
        c, h, w = self.pre.data_config["input_size"]
        self.capture_graphs()
        with on_stream(self.stream):
            return time_batches(self._encode, lambda b: torch.randn(b, c, h, w, device=self.device), batch_sizes,
                                self.device)

    def close(self) -> None:
        if self.graphs is not None:  # before the weights go: a replay would read freed memory
            self.graphs.close()
        self.model = None


class Sam2PostProcessor(PostProcessor):
    """The SAM 2 pool's output processor, run on its output thread (the one owner of the tracking
    state): the shared tracking stage, then mask rendering, and the object control requests.

    Frames of one stream inside one encoder batch are tracked in order (one "wave" per frame),
    each wave one batched tracking step for all due pairs of all streams in it. All waves run on
    staged state; `commit` installs it (see TrackingStage).
    """

    ops = FAMILY_OPS["sam2"]

    def __init__(self, stage: TrackingStage):
        self.stage = stage

    def fallbacks(self) -> dict[str, str]:
        """The tracking step's CUDA graphs, when their capture failed (every step eager: sam2_step.StepGraphs)."""
        for graphs in list(self.stage.graphs.values()):
            if graphs.dispatcher.eager_reason:
                return {"tracking_graphs": graphs.dispatcher.eager_reason}
        return {}

    def warmup(self) -> None:
        with on_stream(self.stage.cuda_stream):
            seconds = self.stage.warmup()
        log.info("%s: tracking stage warmed up at input size(s) %s in %.2f s", KEY, sorted(self.stage.models), seconds)

    def add_stream(self, stream: str) -> None:
        self.stage.add_stream(stream)

    def remove_stream(self, stream: str) -> None:
        self.stage.remove_stream(stream)

    def process(self, frames: Sequence, fields: list[dict]) -> tuple[list, Callable[[], None]]:
        with on_stream(self.stage.cuda_stream):
            return self._process(frames, fields)

    def _process(self, frames: Sequence, fields: list[dict]) -> tuple[list, Callable[[], None]]:
        if self.stage.cuda_stream is not None:
            # the features were made on an encoder's stream: without this, the allocator could hand their memory
            # back to that stream (once this thread drops them) while this stage's queued work still reads it
            for f in fields:
                feats = f.get("_features")
                for t in (feats.vision_feats + feats.vision_pos) if feats is not None else ():
                    t.record_stream(self.stage.cuda_stream)
        staged = self.stage.begin([fv.meta.stream for fv in frames])
        events: list = []
        out: list = [None] * len(frames)
        for wave in _waves(frames):
            wave = [i for i in wave if frames[i].meta.stream in staged]
            batch = [(frames[i].meta.stream, fields[i]["_features"], (frames[i].meta.height, frames[i].meta.width))
                     for i in wave]
            tracked, ev = self.stage.track(staged, batch)
            events += ev
            for i, objs in zip(wave, tracked):
                out[i] = _render_frame(objs, frames[i].meta.height, frames[i].meta.width)
        for i, f in enumerate(out):
            if f is None:  # its stream left the stage (removed): the output stage drops such frames first
                out[i] = RuntimeError(f"stream {frames[i].meta.stream!r} is not tracked")
        return out, lambda: self.stage.commit(staged, events)

    def control(self, op: str, request: dict) -> dict:
        if op == "add_object":
            try:
                o = ObjectConfig.model_validate({k: v for k, v in request.items() if k != "op"})
            except ValidationError as err:
                e = err.errors()[0]
                raise ControlError(f"add_object: {'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}") from None
            self.stage.add_object(o.stream, Prompt(o.id, box=o.box, points=o.points))
        elif op == "remove_object":
            oid = need(request, "id", int)
            if not 0 <= oid <= MAX_OBJECT_ID:  # no such object can exist: say so, as add_object does
                raise ControlError(f"remove_object: 'id' must be 0 <= id <= {MAX_OBJECT_ID}, got {oid}")
            self.stage.remove_object(need(request, "stream", str), oid)
        elif op == "reset_stream":
            self.stage.reset_stream(need(request, "stream", str))
        else:
            raise ControlError(f"sam2: unknown op {op!r}")
        return {}

    def describe(self) -> dict[str, dict]:
        return {s: {"objects": d["objects"] + d["pending"], "frame": d["frame"]} for s, d in self.stage.snapshot.items()}

    def close(self) -> None:
        self.stage.close()

    def counters(self) -> dict[str, dict[str, int]]:
        return {"object_failures": dict(self.stage.object_failures)}

    def events(self) -> list[tuple[str, str, str]]:
        out = []
        while self.stage.events:
            out.append(self.stage.events.popleft())
        return out


def _waves(frames: Sequence) -> list[list[int]]:
    """Indices per wave: the k-th frame of every stream in the batch goes into wave k."""
    waves: list[list[int]] = []
    seen: dict[str, int] = {}
    for i, fv in enumerate(frames):
        w = seen.get(fv.meta.stream, 0)
        seen[fv.meta.stream] = w + 1
        if w == len(waves):
            waves.append([])
        waves[w].append(i)
    return waves


#: render all of a frame's masks in one resize (render_frame); off only to measure what it saves
BATCHED_RENDER = True


def _render_frame(objs: list[dict], height: int, width: int) -> dict:
    ok = [r for r in objs if "error" not in r]
    fields = {"objects": render_frame(ok, height, width) if BATCHED_RENDER else [render(r, height, width) for r in ok]}
    errors = [{"id": r["id"], "error": r["error"]} for r in objs if "error" in r]
    if errors:
        fields["errors"] = errors
    return fields


def sam2_thread_defaults(cores: int, device: torch.device | str) -> dict:
    """Encoder instances, intra-op threads per encoder and tracking-stage threads for a SAM 2 pool whose
    config leaves them unset: {"encoders": int, "threads": int | None, "tracking_threads": int | None}
    (None: torch's default).

    The encoders (worker threads) and the tracking stage (the output thread) run at the same time on
    different frames. On the CPU each sets its own OpenMP team, and two teams of `cores` threads on
    `cores` cores oversubscribe: a parallel op waits at its barrier for a thread the other team holds.
    Measured here (2 cores, hiera-t at 256 px): with the cores busy, a (1, 1, 64, 64) -> 240x320
    interpolate took 22 ms at 2 threads and 0.17 ms at 1; the tracking stage is hundreds of such small
    ops per frame, and it scales poorly even on idle cores (2 objects: ~155 ms at 2 threads, ~225 ms
    at 1), while the encoder's large GEMMs scale well (~150 ms at 2 threads, ~290 ms at 1). So: the
    tracking stage gets one thread, one encoder instance gets all the cores (it uses the tracking stage's core
    whenever that stage waits). Whole-engine runs, 1 stream x 2 objects, (encoder, tracking) threads:
    with another process holding ~1 core, (2, 1) took 599 ms/frame against 671-721 for (2, 2); on idle
    cores the two were within noise (bench_sam2.py `levers`: (2, 1) / (2, 2) = 1.02, 1.05). A real
    pipeline shares the cores with decoding and publishing, so the tracking stage gets one thread.
    More cores are untested here: the tracking stage keeps one thread per 8 cores.
    On a GPU the kernels run on the device: today's behaviour (one encoder, torch's default threads)
    is kept; this choice is untested on a GPU.
    """
    if torch.device(device).type != "cpu":
        return {"encoders": 1, "threads": None, "tracking_threads": None}
    cores = max(1, cores)
    tracking = max(1, cores // 8)
    return {"encoders": 1, "threads": cores if cores <= 2 else cores - tracking, "tracking_threads": tracking}


def _apply_thread_defaults(cfg: Sam2Config, device: torch.device, cores: Optional[int] = None) -> Sam2Config:
    """cfg with encoders / threads / tracking_threads that the user left unset filled in for this machine."""
    chosen = sam2_thread_defaults(cores or usable_cores(), device)
    unset = {k: v for k, v in chosen.items() if k not in cfg.model_fields_set}
    return cfg.model_copy(update=unset)


def auto_plan(cfg: Sam2Config, *, cores: int, pools: int, live: bool) -> tuple[Sam2Config, ThreadPlan]:
    """The engine's hook (workers/registry.py): the pool's share of the cores, as `sam2_thread_defaults`
    divides it (one encoder instance whatever the streams' mode). Values the user gave are kept."""
    share = max(1, cores // max(1, pools))
    device = resolve_device(cfg.device, f"{KEY}.device")
    given = cfg.model_fields_set & {"encoders", "threads", "tracking_threads"}
    cfg = _apply_thread_defaults(cfg, device, share)  # model_copy(update=) marks them set: build_pool keeps them
    tracking = cfg.tracking_threads or "torch's"
    why = (f"{share} of {cores} core(s); {cfg.encoders} encoder instance(s), tracking stage {tracking} thread(s)"
           + ("; given: " + ", ".join(sorted(given)) if given else ""))
    return cfg, ThreadPlan(cfg.encoders, cfg.threads, why)


def build_pool(cfg: Sam2Config, *, models: list[ModelRunner] | None = None,
               factory: Callable[[], ModelRunner] | None = None) -> PoolSpec:
    """Encoder instances sharing one model, and the shared tracking stage as the output processor.
    encoders / threads / tracking_threads left unset are chosen by `sam2_thread_defaults`."""
    cfg = _apply_thread_defaults(cfg, resolve_device(cfg.device, f"{KEY}.device"))
    if models is None:
        first = Sam2EncoderRunner(cfg)

        def more() -> Sam2EncoderRunner:  # one model (and one per degrade size) for every instance
            return Sam2EncoderRunner(cfg, model=first.model, weights_tag=first.weights_tag, sized=first.sized)

        def rebuilt() -> ModelRunner:
            # no capture at run time (graphs.py, classify.build_pool: torch.cuda.graph() synchronises the device)
            runner = more()
            if runner.graphs is not None:
                runner.graphs.eager_reason = "rebuilt after a failure: graphs are captured only at start"
                log.warning("%s: a rebuilt encoder instance runs eager (%s)", KEY, runner.graphs.eager_reason)
            return runner
        models = [first] + [more() for _ in range(cfg.encoders - 1)]
        for m in models:  # every instance its own graphs, at start, before any stream's thread
            m.capture_graphs()
        factory = factory or rebuilt
    main = models[0]
    device = resolve_device(cfg.device, f"{KEY}.device")
    stage = TrackingStage(main.model, sized=getattr(main, "sized", None), max_objects=cfg.max_objects,
                          dtype=resolve_dtype(cfg.dtype, device, f"{KEY}.dtype"), graphs=cfg.tracking_graphs)

    def wire(w: ModelRunner) -> ModelRunner:
        if isinstance(w, Sam2EncoderRunner):
            w.wanted = stage.wants_frames
        return w
    for w in models:
        wire(w)
    rebuild = (lambda: wire(factory())) if factory is not None else None
    sizes = getattr(main, "sizes", [cfg.image_size])
    return PoolSpec("sam2", models, rebuild, cfg.max_batch, cfg.threads,
                    processor=Sam2PostProcessor(stage), output_threads=cfg.tracking_threads,
                    levels=[f"image_size={s}" for s in sizes],
                    # the encoder's cost grows with the pixels: what the ladder expects a step up to cost
                    level_costs=[(s / sizes[0]) ** 2 for s in sizes])
