"""The CUDA-graph dispatcher and the classify runner's graphed path.

On the CPU a fake backend stands in for torch.cuda.CUDAGraph: it "captures" by remembering the function
and "replays" by calling it on the static input and writing the result into the static outputs, so
padding, bucket choice, buffer reuse, output slicing, the eager fallback and warm-up timing are all
checked here. The `gpu` tests capture real graphs; they have NOT run on the CPU-only machines.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from engine.config import ClassifyConfig
from engine.models import classify
from engine.models.classify import ClassifierRunner
from engine.models.graphs import GraphDispatcher, HostCopy, default_sizes
from tests.support.fake_graphs import FakeBackend
from tests.support.models import MODEL, rel_err, seeded_model

pytestmark = pytest.mark.timeout(120)
KEY = "models.classify"


def row_fn(x):
    """Each output row depends on its input row alone (as a classifier's do)."""
    return x.flatten(1).sum(1, keepdim=True) * 2 + 1, None


def dispatcher(sizes=(1, 2, 4, 8), backend=None, item=(3, 2, 2)):
    d = GraphDispatcher(row_fn, sizes, backend=backend or FakeBackend(), key=KEY)
    d.capture(item, torch.float32, torch.device("cpu"))
    return d


# -- the dispatch table ------------------------------------------------------------------------------
@pytest.mark.parametrize("max_batch, sizes", [(1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]),
                                              (256, [1, 2, 4, 8, 16, 32, 64, 128, 256])])
def test_default_sizes(max_batch, sizes):
    assert default_sizes(max_batch) == sizes


@pytest.mark.parametrize("n, size", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8), (9, None), (100, None)])
def test_dispatch_pads_up_to_the_next_captured_size_and_eager_over_the_largest(n, size):
    assert dispatcher().dispatch(n) == size


def test_dispatch_before_capture_is_eager_and_bad_sizes_are_refused():
    d = GraphDispatcher(row_fn, [4, 1, 4], backend=FakeBackend(), key=KEY)
    assert d.wanted == (1, 4) and d.sizes == () and d.dispatch(1) is None
    with pytest.raises(ValueError, match="models.classify: a batch needs at least 1 input, got 0"):
        dispatcher().dispatch(0)
    with pytest.raises(ValueError, match=r"models.classify.graph_batch_sizes: need batch sizes >= 1, got \[0, 2\]"):
        GraphDispatcher(row_fn, [0, 2], backend=FakeBackend(), key=KEY)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        default_sizes(0)


def test_capture_largest_first_into_one_pool_and_one_input_buffer():
    fake = FakeBackend()
    d = dispatcher(backend=fake)
    assert d.sizes == (1, 2, 4, 8)
    assert [b for b, _, _ in fake.captures] == [8, 4, 2, 1]
    assert len({ptr for _, ptr, _ in fake.captures}) == 1  # every size reads the first rows of one buffer
    assert len({id(pool) for _, _, pool in fake.captures}) == 1
    assert d.capture((3, 2, 2), torch.float32, torch.device("cpu")) is True and len(fake.captures) == 4  # once


# -- replay: padding, slicing, the output contract ------------------------------------------------------
def test_padding_rows_are_zero_and_outputs_sliced_to_the_batch():
    fake = FakeBackend()
    d = dispatcher(backend=fake)
    x7, x3 = torch.rand(7, 3, 2, 2) + 1, torch.rand(3, 3, 2, 2) + 1
    out7, _ = d.run(x7)
    assert out7.shape == (7, 1) and torch.equal(out7, row_fn(x7)[0])
    out3, _ = d.run(x3)
    assert out3.shape == (3, 1) and torch.equal(out3, row_fn(x3)[0])
    (b7, seen7), (b3, seen3) = fake.replays
    assert (b7, b3) == (8, 4)
    assert torch.equal(seen7[:7], x7) and not seen7[7:].any()
    # the 7-row batch left rows 3..6 behind: the 3-row batch in the graph of 4 sees zeros there
    assert torch.equal(seen3[:3], x3) and not seen3[3:].any()


def test_outputs_are_views_the_next_run_overwrites():
    """The contract: read a result before the next run (infer turns it into lists at once)."""
    d = dispatcher()
    first, _ = d.run(torch.ones(2, 3, 2, 2))
    kept = first.clone()
    d.run(torch.full((2, 3, 2, 2), 5.0))
    assert not torch.equal(first, kept) and torch.equal(first, row_fn(torch.full((2, 3, 2, 2), 5.0))[0])


def test_over_the_largest_graph_runs_eager():
    fake = FakeBackend()
    d = dispatcher(sizes=(1, 2), backend=fake)
    x = torch.rand(5, 3, 2, 2)
    out, _ = d.run(x)
    assert torch.equal(out, row_fn(x)[0]) and fake.replays == []


def test_an_input_unlike_the_captured_one_runs_eager_and_says_so_once(caplog):
    fake = FakeBackend()
    d = dispatcher(backend=fake)
    x = torch.rand(2, 3, 2, 2, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="vidar.graphs"):
        for _ in range(3):
            assert torch.equal(d.run(x)[0], row_fn(x)[0])
    assert fake.replays == []
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "models.classify: input (3, 2, 2) torch.float64 on cpu does not match the captured (3, 2, 2) "
        "torch.float32 on cpu: running eager"]


def test_a_failed_capture_leaves_no_graph_runs_eager_and_is_logged_once(caplog):
    fake = FakeBackend(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="vidar.graphs"):
        d = dispatcher(backend=fake)
        assert d.capture((3, 2, 2), torch.float32, torch.device("cpu")) is False  # not tried again
        for n in range(1, 10):
            x = torch.rand(n, 3, 2, 2)
            assert torch.equal(d.run(x)[0], row_fn(x)[0])
    assert d.sizes == () and fake.replays == []
    assert d.eager_reason == "capture failed: RuntimeError: operation not permitted when stream is capturing"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("models.classify: CUDA graphs off, every batch runs eager")


# -- the classify runner on the graphed path ------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return seeded_model()


def runner(model, backend=None, **cfg):
    cfg = {"name": MODEL, "weights": "random", "device": "cpu", "max_batch": 8, **cfg}
    return ClassifierRunner(ClassifyConfig(**cfg), model=model, weights_tag="random", graph_backend=backend)


def test_graphed_runner_equals_eager_on_a_timm_model(model):
    fake = FakeBackend()
    graphed, eager = runner(model, fake, embedding=True), runner(model, embedding=True)
    graphed.capture_graphs()
    assert graphed.graphs.sizes == (1, 2, 4, 8) and eager.graphs is None
    torch.manual_seed(1)
    for n in (1, 3, 5, 8):
        x = torch.randn(n, 3, 160, 160)
        (lg, eg), (le, ee) = graphed.forward(x), eager.forward(x)
        assert lg.shape == le.shape == (n, model.num_classes) and eg.shape == ee.shape
        assert rel_err(lg, le) <= 1e-6 and rel_err(eg, ee) <= 1e-6, n
        og, oe = graphed.infer(x), eager.infer(x)
        assert [[i for i, _, _ in r["topk"]] for r in og] == [[i for i, _, _ in r["topk"]] for r in oe]
        assert np.allclose([[p for *_, p in r["topk"]] for r in og], [[p for *_, p in r["topk"]] for r in oe],
                           rtol=1e-5, atol=1e-7)
    assert [b for b, _ in fake.replays] == [1, 1, 4, 4, 8, 8, 8, 8]  # forward and infer per batch, padded


def test_cuda_graphs_off_or_cpu_means_no_dispatcher(model):
    assert runner(model, FakeBackend(), cuda_graphs=False).graphs is None
    assert runner(model).graphs is None  # on the CPU the key is ignored


def test_warmup_reports_every_size_at_its_padded_cost(model):
    fake = FakeBackend()
    w = runner(model, fake)
    times = w.warmup([1, 8])
    assert sorted(times) == list(range(1, 9))
    assert times[3] == times[4] and times[5] == times[6] == times[7] == times[8]  # one measurement each
    assert sorted({b for b, _ in fake.replays}) == [1, 2, 4, 8] and all(t > 0 for t in times.values())


def test_warmup_over_the_largest_graph_and_without_graphs_times_what_was_asked(model):
    w = runner(model, FakeBackend(), graph_batch_sizes=[1, 2])
    times = w.warmup([1, 8])
    assert sorted(times) == [1, 2, 8]  # 8 is eager: measured as itself, the rest interpolated as before
    assert sorted(runner(model).warmup([1, 4])) == [1, 4]


def test_runner_capture_failure_is_eager_with_the_reason_logged_once(model, caplog):
    with caplog.at_level(logging.WARNING, logger="vidar.graphs"):
        w = runner(model, FakeBackend(fail_at=8))
        times = w.warmup([1, 8])
        x = torch.randn(3, 3, 160, 160)
        assert rel_err(w.forward(x)[0], runner(model).forward(x)[0]) == 0.0
    assert sorted(times) == [1, 8] and "RuntimeError" in w.graphs.eager_reason
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_build_pool_captures_every_instance_at_start_and_a_rebuilt_one_runs_eager(monkeypatch, caplog):
    """Capture happens at start only: torch.cuda.graph() synchronises the device on entry, so capturing for an
    instance rebuilt after a failure (on the core's thread, for the watchdog) could stall the engine."""
    class WithFake(classify.ClassifierRunner):
        def __init__(self, cfg, **kw):
            super().__init__(cfg, graph_backend=FakeBackend(), **kw)
    monkeypatch.setattr(classify, "ClassifierRunner", WithFake)
    monkeypatch.setattr(classify, "build_classifier", lambda name, weights: (seeded_model(), "random"))
    spec = classify.build_pool(ClassifyConfig(name=MODEL, weights="random", device="cpu", workers=2, max_batch=4))
    assert all(m.graphs.sizes == (1, 2, 4) for m in spec.models)  # every instance, at start
    caplog.set_level(logging.WARNING, "vidar.classify")
    again = spec.factory()
    assert again.model is spec.models[0].model
    assert again.graphs.sizes == () and "rebuilt after a failure" in again.graphs.eager_reason
    assert any("runs eager" in r.getMessage() for r in caplog.records)
    x = torch.randn(3, 3, 160, 160)
    assert rel_err(again.forward(x)[0], spec.models[0].forward(x)[0].clone()) <= 1e-6


# -- results to the host --------------------------------------------------------------------------------
def test_host_copy_reuses_its_buffers_and_grows_them():
    h = HostCopy(pin=False)
    p, i = torch.rand(4, 3), torch.arange(12).view(4, 3)
    hp, hi = h.copy([p, i])
    h.wait()
    assert torch.equal(hp, p) and torch.equal(hi, i) and hi.dtype == torch.int64
    ptr = hp.data_ptr()
    hp2, _ = h.copy([p[:2], i[:2]])
    assert hp2.data_ptr() == ptr and torch.equal(hp2, p[:2])  # a smaller batch reuses the buffer
    big = torch.rand(9, 3)
    hp3, hi3 = h.copy([big, big.to(torch.float16)])
    assert torch.equal(hp3, big) and hi3.dtype == torch.float16  # grown; a new dtype gets its own buffer


# -- on a GPU ---------------------------------------------------------------------------------------------
def cuda_runner(model, **cfg):
    cfg = {"name": MODEL, "weights": "random", "device": "cuda", "dtype": "bfloat16", "max_batch": 8, **cfg}
    return ClassifierRunner(ClassifyConfig(**cfg), model=model, weights_tag="random")


@pytest.mark.gpu
def test_cuda_graph_logits_match_eager_in_bf16():
    """bf16 tolerance 2e-2 relative to the largest logit: a padded batch may pick other GEMM tiles than
    the eager one (a few bf16 ulps, 2**-8 each); top-1 must agree where eager's top two are further apart
    than the two runs differ (random weights leave rows 1 ulp apart: a tie either may break)."""
    model = seeded_model()
    graphed, eager = cuda_runner(model, embedding=True), cuda_runner(model, cuda_graphs=False, embedding=True)
    times = graphed.warmup([1, 8])
    assert graphed.graphs.eager_reason is None and graphed.graphs.sizes == (1, 2, 4, 8)
    assert sorted(times) == list(range(1, 9)) and times[3] == times[4]
    torch.manual_seed(2)
    for n in (1, 3, 8):
        x = torch.randn(n, 3, 160, 160, device="cuda").to(torch.bfloat16)
        lg = graphed.forward(x)[0].clone()
        le = eager.forward(x)[0]
        lg, le = lg.float().cpu(), le.float().cpu()
        assert rel_err(lg, le) <= 2e-2, n
        top2 = le.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > (lg - le).abs().max()  # rows whose top-1 no rounding can flip
        assert clear.any(), (n, clear)  # the check below must cover a row at least
        assert torch.equal(lg.argmax(-1)[clear], le.argmax(-1)[clear]), n
        og, oe = graphed.infer(x), eager.infer(x)
        assert [r["topk"][0][0] for r, c in zip(og, clear) if c] == [r["topk"][0][0] for r, c in zip(oe, clear) if c]
        assert len(og[0]["embedding"]) == 2 * model.num_features
    graphed.close()


@pytest.mark.gpu
def test_cuda_capture_survives_another_thread_working_on_the_gpu():
    """thread_local capture: a decoder-like thread launching work on its own stream meanwhile is harmless."""
    stop = threading.Event()

    def busy():
        s = torch.cuda.Stream()
        a = torch.randn(256, 256, device="cuda")
        with torch.cuda.stream(s):
            while not stop.is_set():
                a = (a @ a).tanh()
        s.synchronize()
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        w = cuda_runner(seeded_model())
        w.capture_graphs()
    finally:
        stop.set()
        t.join(30)
    assert w.graphs.eager_reason is None and w.graphs.sizes == (1, 2, 4, 8)


@pytest.mark.gpu
def test_host_copy_pinned_with_an_event():
    h = HostCopy()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.arange(10, device="cuda", dtype=torch.int64) * 3
        (host,) = h.copy([t], s)
    h.wait()
    assert host.is_pinned() and host.tolist() == list(range(0, 30, 3))


# -- the real backend's calls, with torch.cuda faked (its mechanics; NOT a GPU run) ---------------------
def test_cuda_backend_warms_up_on_a_side_stream_then_captures_there_thread_local(monkeypatch):
    from contextlib import contextmanager

    from engine.models.graphs import CudaGraphBackend, _graph_kwargs
    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(("wait", self.name, other.name))

    side, current = Stream("side"), Stream("current")

    class Graph:
        def replay(self):
            calls.append(("replay",))

    @contextmanager
    def on(stream):
        calls.append(("on", stream.name))
        yield

    @contextmanager
    def graph(g, **kw):
        calls.append(("capture", kw["pool"], kw["stream"].name, kw.get("capture_error_mode")))
        yield
    assert _graph_kwargs() == {"capture_error_mode": "thread_local"}  # from the real torch.cuda.graph signature
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: calls.append(("set", stream.name)))
    monkeypatch.setattr("engine.models.graphs._graph_kwargs", lambda: {"capture_error_mode": "thread_local"})
    backend = CudaGraphBackend(torch.device("cpu"))
    replay, out = backend.capture(lambda x: calls.append(("fn",)) or x * 2, torch.ones(2), "pool")
    replay()
    assert calls == [("wait", "side", "current"), ("on", "side"), ("fn",), ("fn",),
                     ("capture", "pool", "side", "thread_local"), ("fn",), ("set", "current"),
                     ("wait", "current", "side"), ("replay",)]
    assert torch.equal(out, torch.full((2,), 2.0))
    # a capture that fails (torch.cuda.graph's exit ends the capture before it restores the stream): the
    # thread is put back on its own stream, behind the side stream's work, and the error goes on
    calls.clear()

    def syncs(x):
        calls.append(("fn",))
        if sum(c == ("fn",) for c in calls) == 3:  # the captured run
            raise RuntimeError("operation not permitted when stream is capturing")
        return x
    with pytest.raises(RuntimeError, match="capturing"):
        backend.capture(syncs, torch.ones(2), "pool")
    assert calls[-2:] == [("set", "current"), ("wait", "current", "side")], calls


def test_max_batch_auto_captures_up_to_the_sweep_ceiling(model):
    """With `max_batch: auto` the warm-up may choose any size up to 64, so graphs are captured up to there
    (the pool's sweep then measures them, tests/sched/test_batch_size.py)."""
    w = runner(model, FakeBackend(), max_batch="auto")
    assert w.graphs.wanted == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.timeout(120)
def test_a_failed_capture_is_shown_per_pool_in_list_and_in_a_metric(model, endpoint):
    """Issue 43 item 4: the pool runs eager and says so where an operator looks: the stream's `list` entry names the
    pool's fallback with its reason, and vidar_gpu_fallback{pool, piece, reason} is 1; a pool whose graphs are
    captured shows neither."""
    from engine.core.engine import Engine
    from engine.testing.wait import wait_for
    from tests.support.engines import engine_config
    for backend, expect in ((FakeBackend(fail_at=8), True), (FakeBackend(), False)):
        cfg = engine_config([{"id": "s", "url": "synthetic://shapes?size=96x64&fps=30&frames=4", "mode": "offline"}],
                            endpoint)
        eng = Engine(cfg, models={"classify": runner(model, backend)})
        try:
            eng.start()
            assert wait_for(lambda: eng.describe().get("s", {}).get("pools"), 60)
            pool = eng.describe()["s"]["pools"]["classify"]
            value = eng.metrics.registry.get_sample_value(
                "vidar_gpu_fallback", {"pool": "classify", "piece": "cuda_graphs",
                                       "reason": (eng.pools["classify"].fallbacks() or {"": ""}).get("cuda_graphs", "")})
        finally:
            eng.stop()
        if expect:
            assert "RuntimeError" in pool["fallbacks"]["cuda_graphs"], pool
            assert value == 1
        else:
            assert "fallbacks" not in pool and value is None, pool
