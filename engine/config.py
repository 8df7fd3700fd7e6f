"""Typed configuration: YAML -> pydantic models that reject unknown keys.

Every field has a docstring; `configs/*.yaml` comment every key. Errors name the key
path (``models.classify.max_batch``) and what is allowed, and `load_config` turns pydantic's
errors into one `ConfigError` with one line per problem.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from engine.errors import ConfigError

log = logging.getLogger("vidar.config")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False)


#: matched with fullmatch: `$` also matches before a trailing newline, and `x\n` was taken as an id
STREAM_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Object ids are non-negative 31-bit integers: they travel in every SAM 2 result (msgpack, JSON, the
#: page's JavaScript numbers), and an unbounded one (10**30) was taken, then killed the publisher.
MAX_OBJECT_ID = 2**31 - 1


class StreamConfig(_Strict):
    id: str
    """Stream id: letters, digits, '_' or '-'. Used in topics (`classify.<id>`, `sam2.<id>`, `event.<id>`) and metrics."""
    url: str
    """rtsp://..., a file path (any container PyAV opens), or synthetic://shapes?size=WxH&fps=N."""
    mode: Literal["live", "offline"] = "live"
    """live: paced, drop-oldest when slow, deadlines apply. offline: every frame, back-pressure."""
    loop: bool = False
    """Files only: start again at the end instead of ending the stream (demo footage)."""
    pools: Optional[list[str]] = Field(None, min_length=1)
    """Model pools this stream feeds, e.g. [classify] or [sam2]; default: every configured pool."""
    decode: Optional[Literal["auto", "cpu", "cuda"]] = None
    """Where this stream's video is decoded: cpu (PyAV/FFmpeg), cuda (NVDEC through PyNvVideoCodec, the
    frames stay in GPU memory; fails the stream with the reason when it cannot), auto (NVDEC when there is a
    GPU, the package and a codec it supports, else the CPU with the reason logged once and shown in the
    stream's state). Unset: `source.decode`. Synthetic streams are generated on the CPU."""
    max_interval: int = Field(4, ge=1, le=100)
    """Live streams: under sustained overload the degradation ladder (`qos`) may process only every
    k-th frame of this stream, k <= max_interval. 1: never sample this stream (it still drops frames
    that cannot meet their deadline)."""

    @field_validator("id")
    @classmethod
    def _id_ok(cls, v: str) -> str:
        if not STREAM_ID_RE.fullmatch(v):
            raise ValueError(f"stream id {v!r} must match {STREAM_ID_RE.pattern} (it is used in topics)")
        return v

    @field_validator("url")
    @classmethod
    def _scheme_ok(cls, v: str) -> str:
        """Refused here, when the config is read or a stream is added at run time, rather than when the
        stream's decoder first opens it (a control request would be answered ok, then the stream fail)."""
        from streams.urls import scheme_error
        why = scheme_error(v)
        if why:
            raise ValueError(why)
        return v


class BudgetConfig(_Strict):
    latency_ms: Union[float, Literal["auto"]] = "auto"
    """End-to-end budget in ms: a frame's deadline is its capture time + this. Late frames are dropped. `auto`:
    chosen once at start for where the pools run, after their warm-up, and said at start (`budget.latency_ms:
    150 ms (auto, on the CPU: ...)`): 17 ms for a pool on a GPU; for a pool on the CPU (no CUDA GPU, `device:
    cpu`, or `noop`) the larger of 150 ms and 4 x its batch 1's warm-up time, rounded up to 10 ms; the engine
    takes the largest (engine/sched/budget_auto.py says why). From then on this key holds that number, so
    everything that reads it (`max_batch: auto` included) sees the one value. A number set here, by --set or
    by on_cpu always wins."""
    max_batch_wait_ms: float = Field(4.0, ge=0)
    """Longest a frame waits for a batch to fill when the worker is idle (Triton-style queue delay)."""

    _chosen: bool = PrivateAttr(False)  # latency_ms holds what `auto` chose at start, not a number the user set

    @field_validator("latency_ms", mode="before")
    @classmethod
    def _ms_or_auto(cls, v: Any) -> Any:
        # one message for both forms (a Union's own errors name each member: `latency_ms.float`)
        if v == "auto" or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError(f"must be a number of ms > 0 or `auto`, got {v!r}")

    @property
    def configured_ms(self) -> Optional[float]:
        """The budget the user set, None for `auto` (also once the engine has chosen a value for it)."""
        return None if self.latency_ms == "auto" or self._chosen else float(self.latency_ms)

    def choose(self, latency_ms: float) -> None:
        """Write the budget `auto` resolved to (the engine, once at start): every reader sees the number."""
        self.latency_ms = float(latency_ms)
        self._chosen = True


class QosConfig(_Strict):
    """The degradation ladder of each pool (engine/ladder.py). When a pool's live frames are dropped
    (deadline, superseded, late, ring_full; not those late at their source: the ingest fell behind) above
    `degrade_drop_share` of those it was offered for `degrade_after_s` while its workers are busy (at least
    `restore_load` of the time: thinning relieves the workers, not the decoders), it steps one rung down; when the load at the rung above would fit
    (`restore_load`) with no such drops for `restore_after_s`, it steps back up. Rungs, in order:
    process every 2nd, 3rd, ... frame of each live stream (up to its `max_interval`; the others are
    dropped as `interval`, regularly, instead of at random for their deadline), then the SAM 2 pool's
    smaller input sizes (`models.sam2.degrade_sizes`). Every step is an `event.<stream>` (kind
    `degraded` / `restored`) for each stream of the pool and the `vidar_qos_level` metric."""

    ladder: bool = True
    """Run the degradation ladder (false: overload only drops frames for their deadline)."""
    degrade_drop_share: float = Field(0.2, gt=0, lt=1)
    """Step down when more than this share of the pool's live frames is dropped for load..."""
    degrade_after_s: float = Field(3.0, gt=0)
    """...continuously for this long."""
    restore_load: float = Field(0.7, gt=0, lt=1)
    """Step up when the busy share the workers would have at the rung above stays below this..."""
    restore_after_s: float = Field(5.0, gt=0)
    """...for this long (with no load drops meanwhile)."""


#: `max_batch: auto` measures batch sizes up to this (ClassifyConfig.batch_ceiling; engine/sched/batch_size.py)
AUTO_CEILING = 64


class _GraphKeys(_Strict):
    """The CUDA-graph keys a pool's config shares (engine/models/graphs.py); the pool defines batch_ceiling."""

    cuda_graphs: bool = True
    """On a GPU: capture the model's forward (the classifier; SAM 2's image encoder at image_size) as CUDA graphs
    at start, one per batch size in `graph_batch_sizes` (a batch runs in the next captured size up, padded),
    eager when capture fails (the reason logged). Measured on an H200, ViT-L/16 bf16 batch 1: 1.39 ms replayed
    vs 6-10 ms eager (launch-bound). Ignored on the CPU."""
    graph_batch_sizes: Optional[list[int]] = None
    """Batch sizes to capture, each in [1, max_batch]. Unset: 1, 2, 4, 8, ... up to max_batch, and max_batch."""

    @property
    def batch_ceiling(self) -> int:
        raise NotImplementedError

    @field_validator("graph_batch_sizes")
    @classmethod
    def _sizes_ok(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and (not v or any(b < 1 for b in v)):
            raise ValueError(f"must be a non-empty list of batch sizes >= 1, got {v!r}")
        return v

    @model_validator(mode="after")
    def _sizes_within_batch(self):
        if self.graph_batch_sizes and max(self.graph_batch_sizes) > self.batch_ceiling:
            limit = f"{self.max_batch}" + (f", at most {self.batch_ceiling}" if self.max_batch == "auto" else "")
            raise ValueError(f"graph_batch_sizes {self.graph_batch_sizes} has a size over max_batch "
                             f"({limit}): drop it or raise max_batch")
        return self


class ClassifyConfig(_GraphKeys):
    name: str = "vit_large_patch16_224"
    """Any timm image classifier (ViTs, ConvNets, ...)."""
    weights: str = "pretrained"
    """pretrained (timm download; needs internet) | random (warned, marked) | path to a state_dict."""
    max_batch: Union[int, Literal["auto"]] = 8
    """Largest batch the scheduler forms. `auto`: chosen at start from the pool's measured batch times (1,
    2, 4, ... up to 64, graphs included): the largest batch that runs twice within budget.latency_ms (a frame
    may wait for the batch ahead of it), logged with the times (engine/sched/batch_size.py). So it depends on
    the budget and on the warm-up: with budget.latency_ms `auto`, the budget is chosen first (from batch 1's
    warm-up time on a CPU), then the batch for it."""
    topk: int = Field(5, ge=1, le=1000)
    """Classes per result, as [class_index, label, probability]."""
    embedding: bool = False
    """Also publish the pooled pre-logits embedding as float16 bytes."""
    preprocess: Literal["fast", "exact"] = "fast"
    """fast: the model's preprocessing on uint8 tensors (GPU when present). exact: timm's own PIL transform."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto picks cuda when available."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bfloat16 on cuda, float32 on cpu."""
    workers: Optional[int] = Field(None, ge=1, le=16)
    """ModelRunner instances (threads) sharing one copy of the model. Default: chosen from the cores, the
    pools and the streams' mode at start, and logged (engine/tuning.py): on a CPU, offline streams get
    one-thread instances (throughput), live ones one instance with the pool's cores (latency); on a GPU 1."""
    threads: Optional[int] = Field(None, ge=1)
    """Intra-op threads per worker instance on the CPU. Default: chosen with `workers` (see there)."""
    @field_validator("max_batch", mode="before")
    @classmethod
    def _batch_or_auto(cls, v: Any) -> Any:
        # one message for both forms (a Union's own errors name each member: `max_batch.constrained-int`)
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 256):
            return v
        raise ValueError(f"must be an integer batch size in [1, 256] or `auto`, got {v!r}")

    @property
    def batch_ceiling(self) -> int:
        """max_batch, or with `auto` the largest size the start-up sweep may choose."""
        return AUTO_CEILING if self.max_batch == "auto" else self.max_batch


class Sam2Config(_GraphKeys):
    config: str = "sam2.1_hiera_t"
    """Any config shipped in the sam2 package: sam2.1_hiera_t, _s, _b+, _l (and the sam2 ones)."""
    checkpoint: str = "pretrained"
    """pretrained (the official checkpoint of this config from Hugging Face, cached; needs internet once) |
    random (warned, marked) | path to an official checkpoint ({"model": state_dict}, loaded strictly)."""
    image_size: int = Field(1024, ge=128, le=2048, multiple_of=32)
    """Encoder input size; 512 or 256 trade accuracy for speed (feature sizes follow: size / 16)."""
    encoders: int = Field(1, ge=1, le=16)
    """Image-encoder instances in the pool (the tracking stage is one shared instance)."""
    max_batch: int = Field(4, ge=1, le=64)
    """Largest encoder batch (frames from any streams). 4: the sweet spot of hiera-t's bf16 encoder at 1024 px
    on an H200 (12.2 ms at batch 1, 12.3 at 4, 23.2 at 8, 44.7 at 16; ../shared/gpu/README.md): four
    frames for the price of one, past that time grows with the batch and only adds latency."""
    preprocess: Literal["fast", "exact"] = "fast"
    """fast: tensor resize (GPU when present). exact: PIL, as sam2's own frame loader."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto picks cuda when available."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Autocast dtype of the encoder and the tracking stage (the weights stay float32, as Meta runs SAM 2).
    auto: bfloat16 on cuda (Meta's predictor on an H200: 38.4 ms a frame under bf16 autocast, 60.8 in float32),
    float32 on cpu (bf16 is fast only on CPUs with AMX)."""
    threads: Optional[int] = Field(None, ge=1)
    """Intra-op threads per encoder instance on the CPU. Unset (with `encoders` and `tracking_threads`):
    chosen for the machine's cores by engine.models.sam2.sam2_thread_defaults (logged at start)."""
    # "decoder" is video decoding only (one meaning per name); configs written before 0.2 said
    # `decoder_threads`, which is still read as this key.
    tracking_threads: Optional[int] = Field(None, ge=1,
                                            validation_alias=AliasChoices("tracking_threads", "decoder_threads"))
    """Intra-op threads of the tracking stage (the pool's output thread: memory attention, mask decoder,
    memory encoder) on the CPU; it runs beside the encoders, so the two share the cores. Unset: see `threads`.
    (`decoder_threads`, its name before 0.2, is read too.)"""
    max_objects: int = Field(32, ge=1, le=4096)
    """Admission limit: tracked objects (with pending prompts) across all streams; more are refused."""
    tracking_graphs: bool = True
    """On a GPU: the tracking stage's steady state (every object's memory bank full, at image_size) as CUDA
    graphs, one per object count 1, 2, 4, ... up to max_objects (at most 32; a step is padded to the next),
    captured at start (engine/models/sam2_step.py); other steps, and all if capture fails (the reason
    logged), run eager. Ignored on the CPU."""
    degrade_sizes: list[int] = []
    """Smaller encoder input sizes the engine may step down to under overload, e.g. [512, 256] for
    image_size 1024: each a multiple of 32 (and >= 128), strictly smaller than image_size, descending.
    Weights are shared; objects are carried over at the new size from their last mask. Empty: never."""

    @property
    def batch_ceiling(self) -> int:
        """The largest encoder batch (graphs are captured up to it)."""
        return self.max_batch

    @field_validator("degrade_sizes")
    @classmethod
    def _degrade_sizes(cls, sizes: list[int], info) -> list[int]:
        for s in sizes:
            if s % 32 or s < 128:
                raise ValueError(f"{s} must be a multiple of 32 and >= 128")
        top = info.data.get("image_size")
        chain = [top, *sizes] if top is not None else sizes
        if any(a <= b for a, b in zip(chain, chain[1:])):
            raise ValueError(f"{sizes} must be strictly descending and each smaller than image_size={top}")
        return sizes


class NoopConfig(_Strict):
    """A pool with no model: results carry no fields. By default a frame costs nothing (the engine's own
    overhead, measured: benchmarks/bench_host.py, bench_peers.py). `per_frame_s` gives it a fixed cost (a
    sleep, no CPU), for sizing a deployment and testing the plumbing (placement, relocation, publishing) at
    a known model cost, independent of the machine (benchmarks/bench_cluster.py)."""

    # 0, not a token cost: a "no-op" pool that sleeps 10 ms a frame caps each worker at 100 frames/s, which a
    # benchmark of the engine reads as the engine's limit
    per_frame_s: float = Field(0.0, ge=0, le=10)
    """A sizing knob: seconds each frame takes in a batch (a batch of n takes n times this; a sleep, no
    CPU). 0 (the default): no cost, the pool measures the engine alone. Set it to stand in for a model of a
    known cost, e.g. 0.05 for a 20 frames/s model (benchmarks/bench_cluster.py --frame-ms)."""
    max_batch: int = Field(16, ge=1, le=64)
    """Largest batch. 16: a pool that costs nothing per frame has no reason to run small batches, and each batch
    has a fixed cost in the engine (a dispatch, a completion, an output step, a publish call): measured on a 2-core
    host, 16 RTSP cameras of 240p60, the engine's threads took ~0.19 cores at 16 against ~0.29 at 4 (benchmarks/
    RESULTS.md, issue 42), at the same batch wait (budget.max_batch_wait_ms)."""
    workers: int = Field(1, ge=1, le=64)
    """Instances; with a per_frame_s, each serves at most 1 / per_frame_s frames a second."""


class ModelsConfig(_Strict):
    """Only the pools named here run. Without a `models` section at all, one classify pool runs."""

    classify: Optional[ClassifyConfig] = None
    """The classification pool (any timm classifier; ViT-L/16 by default). Topic `classify.<stream>`."""
    sam2: Optional[Sam2Config] = None
    """The SAM 2 tracking pool. Topic `sam2.<stream>`."""
    noop: Optional[NoopConfig] = None
    """A pool with no model and a fixed cost per frame (benchmarks, sizing). Topic `noop.<stream>`."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_vit(cls, data: Any) -> Any:
        # Schema 1 called the classification pool `vit`; it serves any timm classifier, so it is `classify` now.
        if isinstance(data, dict) and "vit" in data:
            if "classify" in data:
                raise ValueError("models.vit and models.classify are the same pool: keep models.classify only")
            log.warning("models.vit is deprecated: rename it to models.classify (same keys)")
            data = {("classify" if k == "vit" else k): v for k, v in data.items()}
        return data

    def configured(self) -> dict[str, BaseModel]:
        """Pool name -> its config, for every pool that runs."""
        return {name: cfg for name in type(self).model_fields if (cfg := getattr(self, name)) is not None}


class ObjectConfig(_Strict):
    stream: str
    """Stream id the object belongs to."""
    id: int = Field(ge=0, le=MAX_OBJECT_ID, strict=True)
    """Object id, unique within the stream: an integer 0 <= id <= 2**31 - 1 (a JSON `true` or `1.0` is
    refused, not read as 1)."""
    box: Optional[list[float]] = Field(None, min_length=4, max_length=4)
    """[x0, y0, x1, y1] in pixels of the stream's frames."""
    points: Optional[list[list[float]]] = None
    """[[x, y, label], ...]; label 1 = foreground, 0 = background."""

    @model_validator(mode="after")
    def _one_prompt(self) -> "ObjectConfig":
        if self.box is None and not self.points:
            raise ValueError(f"object {self.id} of stream {self.stream!r}: give a box or points")
        return self


class ControlConfig(_Strict):
    enabled: bool = True
    """Serve the control socket (add/remove streams and objects at run time)."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """ZeroMQ REP endpoint; msgpack requests, one reply each. Left unset, a default another program holds (a
    second engine on the machine) moves to a free port, printed at start (clients pass it: `vidar control
    --endpoint`); set, it never moves: taken, the start fails naming this key."""
    max_message_bytes: int = Field(65536, ge=1024)
    """Larger requests are refused by ZeroMQ before they reach vidar."""


class PublishConfig(_Strict):
    endpoint: str = "tcp://127.0.0.1:5556"
    """ZeroMQ endpoint the publisher binds. Left unset, a default another program holds (a second engine on
    the machine) moves to a free port, printed at start (subscribers pass it: `vidar subscribe ENDPOINT`);
    set, it never moves: taken, the start fails naming this key."""
    hwm: int = Field(1000, ge=1)
    """Per-subscriber queue bound (messages). Live: a full queue drops and counts; offline: waits."""
    queue_size: int = Field(256, ge=1)
    """Per stream: results waiting for the publisher thread. Live results over it are dropped
    (publish_queue); an offline stream stops taking frames until its queue has room."""
    min_subscribers: int = Field(0, ge=0)
    """Wait for this many subscribers before streams start (useful for offline runs)."""
    wait_subscribers_s: float = Field(30.0, gt=0)
    """How long to wait for min_subscribers before failing."""


class RingConfig(_Strict):
    memory_mb: float = Field(64.0, gt=0)
    """Frame memory per stream; slots = memory / frame size, clamped to [min_slots, max_slots]."""
    min_slots: int = Field(4, ge=2)
    """At least this many slots (one is the decoder's while the others wait or run)."""
    max_slots: int = Field(16, ge=2)
    """At most this many slots. A live stream holds the frames still within their deadline (at 60 fps and 17 ms,
    2 waiting and 2 running) plus the one being decoded; more only buys decode-ahead for offline streams. A
    cross-stream batch takes up to max_slots - 1 frames of each stream (the start log warns when a pool's
    streams cannot fill its max_batch)."""
    max_frame_pixels: int = Field(8192 * 8192, gt=0)
    """Frames larger than this are rejected before any allocation."""
    total_memory_mb: float | Literal["auto"] = "auto"
    """Frame memory of every stream's rings together. A stream whose slots would not fit is refused
    (`add_stream` answers with the numbers when its source knows its frame size up front, as synthetic
    ones do; otherwise it fails with an `error` event at its first frame); the others never notice.
    `auto`: a quarter of the machine's physical memory."""

    @field_validator("total_memory_mb")
    @classmethod
    def _positive(cls, v):
        if v != "auto" and not v > 0:
            raise ValueError(f"must be a number of MB > 0 or `auto`, got {v!r}")
        return v


class SourceConfig(_Strict):
    open_timeout_s: float = Field(5.0, gt=0)
    """Network sources: timeout to open (PyAV timeout=(open, read))."""
    stall_timeout_s: float = Field(5.0, gt=0)
    """Network sources: no packet for this long -> reconnecting. (PyAV's read timeout is set to half
    of it: measured here, PyAV notices a hung server after about twice its timeout.)"""
    reconnect_initial_s: float = Field(0.5, gt=0)
    """First reconnect delay after a network stream ends or fails."""
    reconnect_max_s: float = Field(30.0, gt=0)
    """Cap of the exponential reconnect backoff (jitter included)."""
    backoff_reset_after_s: float = Field(10.0, gt=0)
    """The backoff starts again from reconnect_initial_s only after a session delivered frames for this
    long; a server that accepts and closes at once backs off like one that refuses."""
    decode: Literal["auto", "cpu", "cuda"] = "auto"
    """Where video is decoded, for streams that do not say (`streams[].decode`): auto | cpu | cuda."""


class IngestConfig(_Strict):
    processes: Union[int, Literal["auto"]] = "auto"
    """Where streams are decoded: `auto` = in ingest processes, up to max(2, usable cores), a new one started only
    when every running one holds `streams_per_process` streams (so min(ceil(streams / streams_per_process),
    max(2, cores))); N = up to N ingest processes, streams spread over them (least loaded first); 0 = one thread
    per stream in the engine process (all streams share its GIL). The start log says the rule. Why up to one
    process per core and not one fewer: each process's streams share that process's GIL, and on 2 cores two
    processes published every frame of 48 x 240p60 where one shed a tenth (benchmarks/RESULTS.md). Frames cross
    by reference: slots in /dev/shm the engine owns, within ring.total_memory_mb. A stream feeding several pools
    is written once into its first pool's slot and copied into the others' rings by the engine. Streams that may
    decode with NVDEC (decode auto/cuda on a CUDA machine): see `gpu_transport`."""
    streams_per_process: int = Field(8, ge=1, le=256)
    """The most streams `auto` puts in one ingest process before starting another (a stated cap, not a hard one:
    beyond the process limit streams go to the least loaded process)."""
    start_timeout_s: float = Field(20.0, gt=0)
    """An ingest process that has not said it is ready within this long is killed and its streams placed again;
    a stream for which no process can be started (out of descriptors or processes) is retried with backoff for this
    long, then fails with the reason."""
    nice: int = Field(10, ge=0, le=19)
    """Added to the ingest processes' nice value: when the cores are short the engine process (the scheduler,
    workers and publisher, holding frames already decoded and copied) runs first, and the ingest falls behind and
    sheds instead. 0: the same priority. Measured on 2 cores at 48 x 720p60: 1,040-1,092 frames/s published with
    5 or 10 against 958 with 0 (benchmarks/RESULTS.md)."""
    live_credit: int = Field(2, ge=1, le=64)
    """The most frames of a live stream in the engine at once, waiting for the scheduler or being written (frames
    being computed not counted): a newer frame beyond it is dropped in its process before its copy (`ring_full`),
    where a copy would only be superseded. 2: the scheduler still takes the newer of two. Measured on 2 cores
    (benchmarks/RESULTS.md), 48 x 720p60: 1,162-1,316 frames/s published at 33-40 ms median latency, against
    1,022-1,054 at 450 ms with every free slot lent; 1 published more there but shed a tenth of 16 x 180p at 250 fps.
    While a stream's process is behind its (paced) source, its frames arriving in bursts, and more than a tenth of its
    copies are superseded, its credit is 1 until it keeps up again (engine/frames/ring.py, LEAN_ENTER): 1,318 and
    1,395 frames/s at 48 x 720p60, none superseded. Offline streams wait for a free slot instead (back-pressure)."""
    pixel_format: Literal["auto", "rgb24"] = "auto"
    """What an ingest process writes into the slots of a stream it decodes on the CPU (NVDEC's are NV12). auto: NV12
    as decoded (no colour conversion: 1.5 bytes a pixel) when the stream feeds one pool that converts NV12 in its
    batched preprocessing (classify or sam2 on a GPU with preprocess: fast) or reads no pixels (noop); RGB otherwise. rgb24: always RGB. Measured at 320x240 on
    2 cores: the RGB conversion cost more CPU than the decoding (streams/convert.py)."""
    gpu_transport: Literal["shm", "threads"] = "shm"
    """How a stream that may decode with NVDEC (decode auto/cuda on a CUDA machine) reaches its pool. shm: decoded in
    an ingest process like any other stream (no GIL shared with the engine), its NV12 frames copied from the GPU into
    the stream's shared-memory slots and uploaded again by the pool's batched preprocessing, as CPU-decoded frames
    are; the slot protocol every CPU test covers, for the price of two copies over PCIe a frame. Each ingest process
    that decodes on the GPU holds a CUDA context of its own (~300-500 MB of GPU memory expected, for its life): how
    many do is logged and is the gauge vidar_ingest_cuda_contexts. A stream feeding several pools stays a thread
    (the engine copies into the other pools' rings on the host). threads: one thread per such stream in the engine process, NV12 kept in GPU memory
    (zero copy, the engine's CUDA context only; all such streams share the engine's GIL). Neither has run on a GPU
    yet (docs/gpu.md); CUDA IPC slots between processes (zero copy without the GIL) are not built into the
    processes yet."""
    heartbeat_s: float = Field(0.25, gt=0, le=10)
    """How often an ingest process reports that it is alive, with its streams' states."""
    hang_after_s: float = Field(3.0, gt=0, le=600)
    """An ingest process whose heartbeat stopped for this long (stuck, or stopped) is killed and restarted."""
    max_restarts: int = Field(5, ge=0, le=1000)
    """A stream whose process dies more than this many times within restart_window_s is moved to a process of its
    own; if that one too dies more than this many times within the window, the stream fails alone with the
    reason (an `error` event and its eos)."""
    restart_window_s: float = Field(60.0, gt=0)
    """Window of max_restarts."""

    @field_validator("processes")
    @classmethod
    def _non_negative(cls, v):
        if v != "auto" and v < 0:
            raise ValueError(f"must be `auto` or an integer >= 0 (0: threads in the engine process), got {v!r}")
        return v

    @model_validator(mode="after")
    def _beats(self) -> "IngestConfig":
        if self.hang_after_s < 2 * self.heartbeat_s:
            raise ValueError(f"hang_after_s={self.hang_after_s:g} must be at least twice heartbeat_s="
                             f"{self.heartbeat_s:g}: a process would be killed between two heartbeats")
        return self


class FaultsConfig(_Strict):
    max_failures: int = Field(3, ge=1)
    """This many failed or hung batches in one pool within window_s -> engine dead (exit code 3)."""
    window_s: float = Field(60.0, gt=0)
    """Window of max_failures."""
    batch_timeout_s: float = Field(30.0, gt=0)
    """Watchdog: a batch running longer is declared hung, its frames fail and its worker is replaced."""


class SecurityConfig(_Strict):
    curve: bool = False
    """Encrypt and authenticate the publisher and the control socket with ZeroMQ CURVE."""
    allow_insecure_bind: bool = False
    """Let a socket listen on a network (non-loopback) address without its guard (CURVE for the publisher
    and the control socket, a token for the view and the metrics): refused at start otherwise, because
    anyone who reaches the control socket or the view can make the engine open any URL or local file.
    When true, every start logs a warning naming the open sockets. For a private network you trust."""
    server_key: Optional[str] = None
    """The server's secret certificate (server.key_secret from `vidar keys DIR`)."""
    authorized_clients: Optional[str] = None
    """Directory of allowed clients' public certificates (*.key); others receive nothing."""

    @model_validator(mode="after")
    def _complete(self) -> "SecurityConfig":
        if self.curve and not (self.server_key and self.authorized_clients):
            raise ValueError("security.curve: true needs security.server_key and security.authorized_clients "
                             "(create them with `vidar keys DIR`)")
        return self


class MetricsConfig(_Strict):
    enabled: bool = True
    """Serve Prometheus metrics."""
    host: str = "127.0.0.1"
    """Bind address of the metrics endpoint."""
    port: int = Field(9108, ge=0, le=65535)
    """Port of the metrics endpoint (/metrics). Left unset, a default another program holds (a second engine)
    moves to a free port, printed at start; set, it never moves: taken, the start fails naming this key."""
    token: Optional[str] = Field(None, min_length=16)
    """Bearer token scrapers must send (`Authorization: Bearer <token>`; Prometheus: `authorization:
    {credentials: ...}`); needed for any address but loopback. `auto`: a random one per run, printed at
    start (a token you set is never printed). None: no token (loopback only; requests must then name a
    loopback host, as the view's)."""

    _generated: bool = PrivateAttr(False)  # the token was `auto`: printed at start, as nobody knows it yet
    _token = field_validator("token", mode="before")(lambda cls, v: _auto_token(v))
    _strong = field_validator("token")(lambda cls, v: _strong_token(v))

    @model_validator(mode="wrap")
    @classmethod
    def _remember_auto(cls, data: Any, handler):
        out = handler(data)
        if isinstance(data, dict) and data.get("token") == "auto":
            out._generated = True
        return out

    @property
    def token_generated(self) -> bool:
        return self._generated


class ViewConfig(_Strict):
    enabled: bool = True
    """Serve the live view (a web page of the streams with their results, and a JSON API)."""
    host: str = "127.0.0.1"
    """Bind address. Any address but loopback needs `token` (refused at start otherwise)."""
    port: int = Field(8080, ge=0, le=65535)
    """Port of the live view (0: the OS picks one; the URL is printed at start). Left unset, a default another
    program holds (a second engine) moves to a free port, printed at start; set, it never moves: taken, the
    start fails naming this key."""
    token: Optional[str] = Field(None, min_length=16)
    """Access token: requests carry it as `Authorization: Bearer <token>` or as the cookie set by the
    login URL printed at start. `auto`: a random one per run. None: no token (loopback only)."""
    fps: float = Field(10.0, gt=0, le=60)
    """Frames per second sent to the page per watched stream (the tap skips the others)."""
    max_side: int = Field(640, ge=64, le=4096)
    """Frames are downscaled so their longer side is at most this many pixels before JPEG encoding (less
    when every page watching a stream shows it smaller: each page asks for the size it shows)."""
    jpeg_quality: int = Field(75, ge=10, le=100)
    """JPEG quality of the view's frames."""
    max_connections: int = Field(64, ge=1, le=10_000)
    """Connections the view holds at most (pages, their websockets, API clients); a connection beyond it
    is closed at once, counted, and logged in aggregate. Lowered at start to half the file descriptors
    free under the process's RLIMIT_NOFILE, so clients can never take the control socket's."""
    request_timeout_s: float = Field(10.0, gt=0, le=300)
    """A connection that has not sent a complete request header within this many seconds of opening
    (or of its last reply) is closed, and a request body must arrive within as long: slow or half-open
    clients cannot hold connections."""

    # a non-loopback host without a token is refused by EngineConfig (engine/binds.py: one rule for
    # every listening socket, with security.allow_insecure_bind as the explicit way out)
    _token = field_validator("token", mode="before")(lambda cls, v: _auto_token(v))
    _strong = field_validator("token")(lambda cls, v: _strong_token(v))


def _auto_token(v: Any) -> Any:
    if v == "auto":  # a fresh token per run (192 random bits), printed (view: with the login URL) at start
        import secrets
        return secrets.token_urlsafe(24)
    return v


def _strong_token(v: Optional[str]) -> Optional[str]:
    from engine.security.binds import token_problem
    why = token_problem(v) if v is not None else None
    if why:
        raise ValueError(why)
    return v


class ClusterPublishConfig(_Strict):
    endpoint: str = "tcp://127.0.0.1:5556"
    """The head's results endpoint (a ZeroMQ XSUB -> XPUB proxy over every engine): subscribers connect
    here as to a single engine, and keep receiving when streams move."""
    hwm: int = Field(100_000, ge=1)
    """The proxy's per-subscriber queue (messages); beyond it messages for that subscriber are dropped
    and counted (vidar_cluster_proxy_dropped_total)."""


class ClusterControlConfig(_Strict):
    endpoint: str = "tcp://127.0.0.1:5557"
    """The head's control socket: the single-node ops plus list_engines, move_stream, drain_node."""


class ClusterConfig(_Strict):
    """`vidar cluster run`: the same engine config across a Ray cluster (ignored by `vidar run`)."""

    address: Optional[str] = None
    """Ray address (HOST:PORT); None: RAY_ADDRESS, else the cluster started on this machine."""
    namespace: str = "vidar"
    """Ray namespace of the controller and the engines (one vidar cluster per namespace)."""
    engines_per_node: int = Field(1, ge=1, le=64)
    """Engines per node that has `engine_gpus` GPUs free (one per GPU node by default)."""
    engine_gpus: float = Field(1.0, ge=0)
    """GPUs each engine actor reserves (Ray's num_gpus)."""
    engine_cpus: float = Field(1.0, ge=0)
    """CPUs each engine actor reserves (Ray's num_cpus; its threads use what the node has)."""
    heartbeat_s: float = Field(0.5, gt=0)
    """The controller asks every engine for its report this often."""
    heartbeat_misses: int = Field(3, ge=1)
    """An engine that does not answer this many heartbeats in a row is fenced (killed) and its streams
    re-placed; an engine Ray reports dead is fenced at once."""
    stream_fps: float = Field(30.0, gt=0)
    """Frame rate a stream is costed at when placed while its real rate is unknown: a network stream until
    its engine's reports have measured its ingest rate, a file the head cannot probe (a file's container
    rate is read, synthetic://...&fps=N says it)."""
    max_load: float = Field(0.9, gt=0)
    """A stream goes only to an engine whose predicted busiest pool stays under this share (above 1:
    overcommit, the engines' own freshest-first and ladder absorb the excess)."""
    pin: dict[str, str] = Field(default_factory=dict)
    """Stream id -> node label `key=value` (Ray's `ray start --labels`): the stream runs only there."""
    publish: ClusterPublishConfig = Field(default_factory=ClusterPublishConfig)
    """Where subscribers connect."""
    control: ClusterControlConfig = Field(default_factory=ClusterControlConfig)
    """Where control clients connect."""

    @field_validator("pin")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for sid, label in v.items():
            if label.count("=") != 1 or not all(label.split("=")):
                raise ValueError(f"cluster.pin.{sid}: {label!r} is not a node label `key=value`")
        return v


class StatusConfig(_Strict):
    interval_s: float = Field(2.0, gt=0)
    """Seconds between status lines (live) or progress lines (offline)."""


class EngineConfig(_Strict):
    streams: list[StreamConfig] = Field(default_factory=list)
    """The streams to read (may be empty: streams can be added at run time over the control socket)."""
    max_streams: int = Field(64, ge=1, le=4096)
    """Admission limit: streams running at once; add_stream beyond it is refused."""
    max_ended: int = Field(64, ge=0, le=4096)
    """Streams added at run time that ended or failed by themselves stay listed (state, counters, metric
    series, view) until more than this many have ended (the oldest is forgotten first) or
    `ended_keep_s` has passed; then they are forgotten as a removed stream is, and their final state
    (id, url shown without credentials, mode, state, reason, counts, time) is kept in `list`'s
    `ended`, the last `max_ended` of them. 0: forgotten as soon as their eos is out, no history.
    The config's own streams are never forgotten (at most `max_streams`)."""
    ended_keep_s: float = Field(60.0, gt=0, le=86400)
    """How long a stream added at run time stays listed after it ended or failed (see max_ended)."""
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    """Latency budget and batching delay."""
    qos: QosConfig = Field(default_factory=QosConfig)
    """Quality of service under overload: the degradation ladder."""
    models: ModelsConfig = Field(default_factory=lambda: ModelsConfig(classify=ClassifyConfig()))
    """Model pools; only those named run (default, without this section: one classify pool)."""
    objects: list[ObjectConfig] = Field(default_factory=list)
    """Initial SAM 2 prompts; more can be added at run time through the control socket."""
    control: ControlConfig = Field(default_factory=ControlConfig)
    """Control socket."""
    publish: PublishConfig = Field(default_factory=PublishConfig)
    """Where and how results go out."""
    ring: RingConfig = Field(default_factory=RingConfig)
    """Per-stream frame rings."""
    source: SourceConfig = Field(default_factory=SourceConfig)
    """Timeouts and reconnect policy of sources."""
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    """Where streams are decoded: threads in the engine process (0, the default for now), or ingest processes
    (`auto`, what the demo runs)."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Prometheus endpoint."""
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    """ModelRunner failure handling."""
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    """CURVE encryption and client allow-list for the ZeroMQ sockets."""
    status: StatusConfig = Field(default_factory=StatusConfig)
    """Console status line."""
    view: ViewConfig = Field(default_factory=ViewConfig)
    """Live view in the browser and its JSON API."""
    cluster: Optional[ClusterConfig] = None
    """`vidar cluster run` only: placement across a Ray cluster (`vidar run` ignores it)."""
    shutdown_timeout_s: float = Field(5.0, gt=0)
    """On SIGINT/SIGTERM: drain in-flight work for at most this long, then abort."""
    malloc_arenas: int = Field(2, ge=0, le=1024)
    """glibc malloc arenas (M_ARENA_MAX), set for the whole process when `vidar run` / the engine
    starts; 0 keeps glibc's 8 x cores. Few arenas limit the heap fragmentation of threads that come
    and go (see engine/memory.py). MALLOC_ARENA_MAX or GLIBC_TUNABLES in the environment win."""
    on_cpu: dict[str, Any] = Field(default_factory=dict)
    """Dotted-key overrides applied when no CUDA GPU is found (e.g. a smaller model, a larger budget)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> "EngineConfig":
        ids = [s.id for s in self.streams]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate stream ids {dupes}: every streams[].id must be unique")
        if not ids and not self.control.enabled:
            raise ValueError("streams: no streams and control.enabled is false: nothing would ever run; "
                             "add a stream or enable the control socket")
        if len(ids) > self.max_streams:
            raise ValueError(f"{len(ids)} streams exceed max_streams={self.max_streams}: raise max_streams")
        pools = self.models.configured()
        if not pools:
            raise ValueError("models: configure models.classify, models.sam2 or both")
        for i, s in enumerate(self.streams):
            for name in s.pools or ():
                if name not in pools:
                    raise ValueError(f"streams.{i}.pools: pool {name!r} is not configured; configured: {sorted(pools)}")
        streams = {s.id: s for s in self.streams}
        for i, o in enumerate(self.objects):
            if o.stream not in streams:
                raise ValueError(f"objects.{i}.stream: unknown stream {o.stream!r}; streams: {sorted(streams)}")
            if "sam2" not in (streams[o.stream].pools or pools):
                raise ValueError(f"objects.{i}: objects are SAM 2 prompts: configure models.sam2 and let stream "
                                 f"{o.stream!r} feed it (streams[].pools)")
        from engine.security.binds import exposure_error, stream_exposure_error
        exposed = exposure_error(self)
        if exposed:
            raise ValueError(exposed)
        for i, s in enumerate(self.streams):
            why = stream_exposure_error(s.url, self.security.allow_insecure_bind)
            if why:
                raise ValueError(f"streams.{i}.url: {why}")
        if self.security.curve and self.view.enabled and not self.view.token:
            raise ValueError("security.curve is on but the live view has no token: the view would give anyone on "
                             "this machine the control CURVE guards; set view.token (or auto) or view.enabled: false")
        if self.security.curve and self.cluster is not None:
            raise ValueError("security.curve with a cluster: section is not supported yet (the results proxy "
                             "and the head's control socket have no CURVE); run the cluster on a private network "
                             "without it, or run single-node")
        if self.ring.min_slots > self.ring.max_slots:
            raise ValueError(
                f"ring.min_slots ({self.ring.min_slots}) > ring.max_slots ({self.ring.max_slots}): raise max_slots")
        return self


def ring_shortfalls(cfg: "EngineConfig", batches: dict[str, int]) -> list[str]:
    """Pools whose configured streams cannot offer a full batch at once, as warnings for the start log.
    `batches`: each pool's max_batch as the engine runs it (with `auto`, what the warm-up chose).

    A batch is formed across streams, and a stream offers at most `ring.max_slots - 1` frames at once
    (one slot stays free for its decoder): 48 streams feed a batch of 64 with 2 slots each. The old rule,
    max_slots > max_batch in EVERY ring, made a cross-stream batch of 64 cost 65 slots per stream. Too
    few slots is not an error: batches are then smaller (the scheduler dispatches what is ready after
    budget.max_batch_wait_ms), so this is said, not refused. Streams added at run time are not counted."""
    out = []
    for name, max_batch in batches.items():
        streams = _pool_streams(cfg, name)
        offer = len(streams) * (cfg.ring.max_slots - 1)
        if streams and offer < max_batch:
            out.append(f"pool {name}: its {len(streams)} stream(s) offer at most {offer} frames at once "
                       f"(ring.max_slots - 1 = {cfg.ring.max_slots - 1} each), under its max_batch "
                       f"({max_batch}): its batches will be smaller; raise ring.max_slots for full batches")
    return out


def ring_needs(cfg: "EngineConfig", batches: dict[str, int]) -> list[str]:
    """What each pool's chosen batch asks of the rings, as info lines for the start log (`vidar run` says what
    it chose and why; issue 23 item 6). Ring sizes are not derived from the model's curve: a ring holds up to
    `ring.max_slots` slots within `ring.memory_mb`, and what a stream needs at once follows from the batch
    (its share of a cross-stream batch, plus its decoder's slot) and, live, from the budget (a frame older than
    budget.latency_ms is dropped, so a 60 fps stream never holds more than the frames of that window)."""
    out = []
    live_frames = math.ceil(cfg.budget.latency_ms * 60 / 1000)
    for name, max_batch in batches.items():
        streams = _pool_streams(cfg, name)
        if not streams:
            continue
        share = math.ceil(max_batch / len(streams))
        out.append(f"pool {name}: rings of up to {cfg.ring.max_slots} slots per stream (ring.max_slots, within "
                   f"ring.memory_mb {cfg.ring.memory_mb:g} MB); a batch of {max_batch} across its {len(streams)} "
                   f"stream(s) takes {share} frame(s) of each at once, plus 1 slot for the decoder; a live 60 fps "
                   f"stream has {live_frames} frame(s) arriving within budget.latency_ms "
                   f"({cfg.budget.latency_ms:g} ms) to hold, plus the one being decoded")
    return out


def _pool_streams(cfg: "EngineConfig", pool: str) -> list:
    """The configured streams a pool serves (a stream without `pools` feeds every pool)."""
    return [s for s in cfg.streams if s.pools is None or pool in s.pools]


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set `a.b.0.c` in nested dicts/lists, creating dicts on the way."""
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {dotted}: {part!r} is not an index of a list of {len(node)}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[:i])} is not a mapping")
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]


def parse_override(text: str) -> tuple[str, Any]:
    """`models.classify.max_batch=4` -> ("models.classify.max_batch", 4); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. models.classify.max_batch=4")
    key, _, raw = text.partition("=")
    from engine.util.request_fields import text_error
    bad_text = text_error(text)  # argv bytes that are not UTF-8 come as lone surrogates (surrogateescape)
    if bad_text is not None:
        raise ConfigError(f"--set {key.strip()[:80].encode('ascii', 'backslashreplace').decode()}: "
                          f"{bad_text.removeprefix('the request: ')}")
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key.strip()[:80]!r}: the value is not valid YAML: {err}") from None


def _format_errors(err: ValidationError, source: str, tree: dict) -> str:
    lines = [f"{source}: invalid configuration:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(e["loc"][:-1])
            allowed = ", ".join(sorted(parent.model_fields)) if parent else "?"
            lines.append(f"  {loc}: unknown key; allowed here: {allowed}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # a cross-field check (a model validator) names its keys itself; its input is a whole section
            show_input = "input" in e and e["type"] not in ("missing", "value_error") \
                and not loc.endswith("token")  # a token's value is never echoed (logs, terminals, CI)
            lines.append(f"  {loc}: {msg} (got {e.get('input')!r})" if show_input else f"  {loc}: {msg}")
    return "\n".join(lines)


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The pydantic model class found at a location, to list the keys allowed there."""
    model: Any = EngineConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        ann = field.annotation
        for cand in (ann, *getattr(ann, "__args__", ())):
            inner = getattr(cand, "__args__", (cand,))
            found = next((c for c in (cand, *inner) if isinstance(c, type) and issubclass(c, BaseModel)), None)
            if found:
                model = found
                break
        else:
            return None
    return model


def build_config(tree: dict, *, source: str = "config", overrides: list[str] = (),
                 cuda_available: Optional[bool] = None) -> tuple[EngineConfig, list[str]]:
    """Validate a config tree after applying --set overrides and, without CUDA, `on_cpu`.

    Returns the config and the list of on_cpu overrides that were applied (for the start-up note).
    """
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with at least 'streams'")
    tree = copy.deepcopy(tree)
    applied: list[str] = []
    if cuda_available is None:
        import torch
        cuda_available = torch.cuda.is_available()
    # on_cpu first, so an explicit --set still wins on a CPU machine
    if not cuda_available and isinstance(tree.get("on_cpu"), dict):
        for key, value in tree["on_cpu"].items():
            set_dotted(tree, key, value)
            applied.append(f"{key}={value}")
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
    from engine.util.request_fields import text_error
    bad_text = text_error(tree)  # YAML's "\ud800", or undecodable bytes of a --set argument
    if bad_text is not None:
        raise ConfigError(f"{source}: invalid configuration:\n  {bad_text}")
    try:
        return EngineConfig.model_validate(tree), applied
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source, tree)) from None


def load_config(path: str | Path, overrides: list[str] = (), *,
                cuda_available: Optional[bool] = None) -> tuple[EngineConfig, list[str]]:
    """Read a YAML config file; see `build_config`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found; try configs/demo.yaml")
    try:
        tree = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not UTF-8 text (byte {err.start}): save the config as UTF-8") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    return build_config(tree, source=str(p), overrides=overrides, cuda_available=cuda_available)
