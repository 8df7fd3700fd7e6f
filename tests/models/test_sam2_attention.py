"""One batched tracking step for objects whose memory banks differ in length (engine/models/sam2_attention.py):
padded to one layout with a key mask, equal to one call per object. hiera-t at 256 px, random biased
checkpoint, CPU float32."""

import pytest
import torch

from engine.models.sam2_attention import memory_attention
from engine.models.sam2_gather import gather, plan_memory
from engine.models.sam2_tracker import NUM_FRAMES, TrackingStage, Prompt
from engine.testing.sam2_ref import SIZE
from tests.support.sam2_layout import biased_model, gather_one, pad_memories, random_features

STARTS = {1: 0, 2: 4, 3: 9}  # prompt frame per object: banks of 3 lengths for the first frames after each
BOXES = {o: [20 + 12 * o, 20, 130 + 12 * o, 120] for o in STARTS}
T = 13
TOL = 1e-4  # the tolerance; measured here ~1e-6 (float32 summation order)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return biased_model(tmp_path_factory.mktemp("sam2att"))


@pytest.fixture(scope="module")
def feats(model):
    return random_features(model, T + 1, seed=1)


def run(model, feats, objects):
    """A stage with `objects` (ids of STARTS) prompted at their frames, stepped to frame T - 1."""
    stage = TrackingStage(model)
    stage.add_stream("s")
    out = []
    for t in range(T):
        for o in objects:
            if STARTS[o] == t:
                stage.add_object("s", Prompt(o, box=BOXES[o]))
        out.append({r["id"]: r for r in stage.step([("s", feats[t], (240, 320))])[0]})
    return stage, out


@pytest.fixture(scope="module")
def together(model, feats):
    return run(model, feats, list(STARTS))


@pytest.mark.timeout(300)
def test_memory_attention_padded_and_masked_equals_one_call_per_object(model, feats, together):
    stage, _ = together
    banks = stage._streams["s"].objects
    with torch.inference_mode():
        gathered = [gather_one(stage, banks[o], T) for o in sorted(banks)]
        hw = feats[T].feat_sizes[-1][0] * feats[T].feat_sizes[-1][1]
        layouts = {((g[0].shape[0] - g[2]) // hw, g[2]) for g in gathered}  # (mask-memory frames, pointer tokens)
        assert len(layouts) == 3 and len({f for f, _ in layouts}) == 2, layouts  # the test means something
        f = feats[T]
        one = torch.cat([model.memory_attention(curr=[f.vision_feats[-1]], curr_pos=[f.vision_pos[-1]], memory=g[0],
                                                memory_pos=g[1], num_obj_ptr_tokens=g[2]) for g in gathered], dim=1)
        B = len(gathered)
        curr, pos = f.vision_feats[-1].expand(-1, B, -1).contiguous(), f.vision_pos[-1].expand(-1, B, -1).contiguous()
        memory, memory_pos, n_ptr, mask = pad_memories(gathered, hw)
        assert mask is not None and mask.shape == (B, memory.shape[0])
        batched = memory_attention(model.memory_attention, curr, pos, memory, memory_pos, n_ptr, mask)
    assert (batched - one).abs().max().item() <= TOL


@pytest.mark.timeout(300)
def test_an_all_true_mask_is_sams_own_call(model, feats, together):
    """Equal lengths: the masked copy of sam2's forward against sam2's module, so a change in sam2 that the
    copy misses shows here (identical up to float32 summation order)."""
    stage, _ = together
    bank = stage._streams["s"].objects[1]
    with torch.inference_mode():
        g = gather_one(stage, bank, T)
        f = feats[T]
        curr = f.vision_feats[-1].expand(-1, 2, -1).contiguous()
        pos = f.vision_pos[-1].expand(-1, 2, -1).contiguous()
        memory, memory_pos, n_ptr, mask = pad_memories([g, g], 0)  # same layout: concatenated, no mask
        assert mask is None
        stock = model.memory_attention(curr=[curr], curr_pos=[pos], memory=memory, memory_pos=memory_pos,
                                       num_obj_ptr_tokens=n_ptr)
        ones = torch.ones(2, memory.shape[0], dtype=torch.bool)
        masked = memory_attention(model.memory_attention, curr, pos, memory, memory_pos, n_ptr, ones)
    assert (masked - stock).abs().max().item() <= 1e-5


@pytest.mark.timeout(600)
def test_objects_of_different_ages_in_one_call_each_equal_its_own_stage(model, feats, together):
    """Three objects prompted at frames 0, 4 and 9 run in ONE batched call per frame (padded while their
    banks differ), and each equals a stage that tracks it alone: logits, scores and pointers within 1e-4,
    the stored bf16 memories within one bf16 step."""
    stage, out = together
    # one call per frame for every object past its prompt frame (a prompt frame starts the bank on its own):
    # frames 1-4 object 1, 5-9 objects 1 and 2, 10-12 all three; from frame 5 on the banks differ: padded
    assert list(stage.calls) == [1] * 4 + [2] * 5 + [3] * 3
    assert stage.padded_calls == 8
    for o in STARTS:
        alone, mine = run(model, feats, [o])
        for t in range(STARTS[o], T):
            a, b = out[t][o], mine[t][o]
            assert (a["logits"] - b["logits"]).abs().max().item() <= TOL, (o, t)
            assert (a["score"] - b["score"]).abs().max().item() <= TOL, (o, t)
        bank_a, bank_b = stage._streams["s"].objects[o], alone._streams["s"].objects[o]
        for t, mem in dict(bank_a.maskmems).items():
            other = dict(bank_b.maskmems)[t]
            assert torch.allclose(mem.maskmem.float(), other.maskmem.float(), rtol=2 ** -7, atol=1e-6), (o, t)
            assert (mem.obj_ptr - other.obj_ptr).abs().max().item() <= TOL, (o, t)


def _gathered(stage, objects, t=T):
    m = stage._model(SIZE)
    plans = [plan_memory(m, stage._streams["s"].objects[o], t, NUM_FRAMES) for o in objects]
    return gather(m, plans, stage._pos_enc[SIZE], NUM_FRAMES, stage._upload)


@pytest.mark.timeout(300)
def test_the_one_pass_gather_equals_the_object_by_object_one(feats, together):
    """engine/models/sam2_gather.py against the per-object gather in Meta's order, padded: the same tokens, the
    same positions and the same key mask, for banks of three layouts and for one object alone."""
    stage, _ = together
    banks = stage._streams["s"].objects
    hw = feats[T].feat_sizes[-1][0] * feats[T].feat_sizes[-1][1]
    with torch.inference_mode():
        for objects in ([1, 2, 3], [3, 1], [2]):
            ref = pad_memories([gather_one(stage, banks[o], T) for o in objects], hw)
            got = _gathered(stage, objects)
            assert got[2] == ref[2], objects  # pointer tokens
            assert (got[3] is None) == (ref[3] is None) == (len(objects) == 1), objects
            if ref[3] is not None:
                assert torch.equal(got[3], ref[3]), objects
            for a, b in zip(got[:2], ref[:2]):
                assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-6, objects


@pytest.mark.timeout(300)
def test_the_gather_costs_the_same_ops_for_one_object_or_many(together):
    """The point of the one-pass gather on a GPU whose host launches are the bottleneck: the tensor ops of a
    step do not grow with the objects or their banks (the per-object gather's grow with both)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    stage, _ = together
    counts = {}
    with torch.inference_mode():
        # one layout (no key mask) and mixed layouts (the mask costs a few ops more), few objects and more
        for objects in ((1,), (1, 1, 1), (2, 3), (1, 2, 3, 3, 2)):
            with Count() as c:
                _gathered(stage, list(objects))
            with Count() as r:
                for o in objects:
                    gather_one(stage, stage._streams["s"].objects[o], T)
            counts[objects] = (c.ops, r.ops)
    assert counts[(1,)][0] == counts[(1, 1, 1)][0] and counts[(2, 3)][0] == counts[(1, 2, 3, 3, 2)][0], counts
    assert counts[(1, 2, 3, 3, 2)][1] > 2 * counts[(2, 3)][1] > counts[(2, 3)][0], counts  # the reference grows
