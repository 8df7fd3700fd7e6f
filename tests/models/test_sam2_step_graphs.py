"""The tracking stage's steady-state step as CUDA graphs (engine/models/sam2_step.py), driven on the CPU with the
fake capture of tests/support/fake_graphs.py (it replays by calling the recorded function on the static input,
so the packing, the padding to the next object count, the full-bank rule and the copies out of the static
outputs are what runs here; a real capture is tests/models/test_sam2_gpu.py's, not run yet). hiera-t at 256
px, random biased checkpoint, CPU float32."""

import pytest
import torch

from engine.models.sam2 import Sam2PostProcessor
from engine.models.sam2_tracker import Prompt, TrackingStage
from engine.testing.sam2_ref import SIZE
from tests.support.fake_graphs import FakeBackend
from tests.support.sam2_layout import biased_model, random_features

FRAMES = 24
BOXES = {1: [20, 20, 120, 110], 2: [60, 40, 200, 150], 3: [100, 90, 230, 200]}
TOL = 1e-5  # the same float32 ops; the padded batch may round differently (seen: 0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return biased_model(tmp_path_factory.mktemp("sam2graph"))


@pytest.fixture(scope="module")
def feats(model):
    return random_features(model, FRAMES, seed=3)


def run(model, feats, backend=None):
    """Objects 1 and 2 from frame 0, 3 from frame 2; object 2 removed at frame 20. Returns the stage and
    {frame: {id: result}}."""
    stage = TrackingStage(model, max_objects=4, graphs=backend is not None, graph_backend=backend)
    stage.warmup()
    stage.add_stream("s")
    out = {}
    for t, f in enumerate(feats):
        if t == 0:
            stage.add_object("s", Prompt(1, box=BOXES[1]))
            stage.add_object("s", Prompt(2, box=BOXES[2]))
        if t == 2:
            stage.add_object("s", Prompt(3, box=BOXES[3]))
        if t == 20:
            stage.remove_object("s", 2)
        out[t] = {r["id"]: r for r in stage.step([("s", f, (240, 320))])[0]}
    return stage, out


@pytest.fixture(scope="module")
def eager(model, feats):
    return run(model, feats)


@pytest.mark.timeout(600)
def test_full_banks_replay_a_graph_and_equal_the_eager_step(model, feats, eager):
    backend = FakeBackend()
    stage, out = run(model, feats, backend)
    graphs = stage.graphs[SIZE]
    assert graphs.captured == (1, 2, 4) and sorted(b for b, _, _ in backend.captures) == [1, 2, 4]
    # the pointers fill last: the prompt frame's and 15 more (max_obj_ptrs_in_encoder 16), so the banks of
    # objects 1 and 2 are full from frame 16 and object 3's from 18: at 16 and 17, 1 and 2 replay while 3
    # runs eager in a call of its own; from 18 on every step replays
    replayed = [b for b, _ in backend.replays]
    # 2 objects (frames 16, 17), 3 padded to 4 (18, 19), then 2 (20-23)
    assert replayed == [2] * 2 + [4] * 2 + [2] * 4, replayed
    assert graphs.replays == 8 and len(stage.stage_s["graphed_step"]) == 8  # replays, not eager fallbacks
    ref = eager[1]
    for t in out:
        assert out[t].keys() == ref[t].keys(), t
        for o, r in out[t].items():
            assert (r["logits"] - ref[t][o]["logits"]).abs().max().item() <= TOL, (t, o)
            assert (r["score"] - ref[t][o]["score"]).abs().max().item() <= TOL, (t, o)
    for o, bank in stage._streams["s"].objects.items():  # the banks hold copies, not views of the graph's buffers
        other = dict(eager[0]._streams["s"].objects[o].maskmems)
        for t, mem in bank.maskmems:
            # stored in bf16: a float32 difference of ~1e-7 may round to the neighbouring bf16 value
            assert torch.allclose(mem.maskmem.float(), other[t].maskmem.float(), rtol=2 ** -7, atol=1e-6), (o, t)
            assert (mem.obj_ptr - other[t].obj_ptr).abs().max().item() <= TOL, (o, t)


@pytest.mark.timeout(300)
def test_a_padded_step_a_step_over_the_graphs_or_a_failed_capture_runs_eager(model, feats):
    backend = FakeBackend(fail_at=2)
    stage = TrackingStage(model, max_objects=4, graphs=True, graph_backend=backend)
    stage.warmup()
    assert stage.graphs[SIZE].captured == () and "capture failed" in stage.graphs[SIZE].dispatcher.eager_reason
    # said where an operator looks: the pool's fallbacks (its streams' `list` entries, vidar_gpu_fallback)
    assert Sam2PostProcessor(stage).fallbacks() == {"tracking_graphs": stage.graphs[SIZE].dispatcher.eager_reason}
    # without a graph the step is the eager one, and the stage goes on
    stage.add_stream("s")
    stage.add_object("s", Prompt(1, box=BOXES[1]))
    for f in feats[:3]:
        assert "logits" in stage.step([("s", f, (240, 320))])[0][0]
    assert stage.graphs[SIZE].replays == 0 and not backend.replays
    # a step that is not the steady state is not served: banks of different lengths, or not yet full
    g = TrackingStage(model, max_objects=4, graphs=True, graph_backend=FakeBackend()).graphs[SIZE]
    hw = (SIZE // 16) ** 2
    full = g.memory_length(hw)
    assert full == 7 * hw + 64  # num_maskmem frames; 16 pointers of 4 tokens
    assert not g.serves(1, full, 64, None)  # nothing captured yet
    captured = TrackingStage(model, max_objects=4, graphs=True, graph_backend=FakeBackend())
    captured.warmup()
    assert Sam2PostProcessor(captured).fallbacks() == {}
    g = captured.graphs[SIZE]
    assert g.serves(1, full, 64, None) and g.serves(3, full, 64, None)
    assert not g.serves(2, full, 64, torch.ones(2, full, dtype=torch.bool))  # padded banks: masked, eager
    assert not g.serves(1, full, 60, None) and not g.serves(1, full - hw, 64, None)  # not full yet
    assert not g.serves(5, full, 64, None)  # over the largest graph (4)
    # a degrade size has no graphs: its steps run eager
    assert set(captured.graphs) == {SIZE}
    captured.close()
    assert captured.graphs == {} and g.captured == ()


@pytest.mark.timeout(300)
def test_without_graphs_nothing_is_captured(model):
    assert TrackingStage(model).graphs == {}  # graphs off (the default)
    assert TrackingStage(model, graphs=True).graphs == {}  # on the CPU without a backend: nothing to capture


@pytest.mark.timeout(300)
def test_a_step_finding_the_graphs_busy_runs_eager(model, feats):
    """Two threads step at once only after a hung output thread was replaced (the old one may still run): the
    static buffers are one step's at a time; the other step runs eager, with the same results, and does not
    wait (waiting on a hung thread would hang it too)."""
    results = {}
    for busy in (True, False):
        stage = TrackingStage(model, max_objects=4, graphs=True, graph_backend=FakeBackend())
        stage.warmup()
        g = stage.graphs[SIZE]
        stage.add_stream("s")
        stage.add_object("s", Prompt(1, box=BOXES[1]))
        if busy:
            assert g._lock.acquire(blocking=False)  # as another thread inside run()
        out = [stage.step([("s", f, (240, 320))])[0][0] for f in feats[:-1]]
        results[busy] = (out, g.replays)
        assert g.busy == (len(out) - 16 if busy else 0), g.busy  # each step with a full bank (from frame 16)
        if busy:
            g._lock.release()
            stage.step([("s", feats[-1], (240, 320))])
            assert g.replays == 1  # free again: replayed
    (eager, none), (graphed, some) = results[True], results[False]
    assert none == 0 and some > 0, (none, some)
    for a, b in zip(eager, graphed):
        assert (a["logits"] - b["logits"]).abs().max().item() <= TOL
