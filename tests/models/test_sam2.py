"""SAM 2 streaming tracker against Meta's offline SAM2VideoPredictor, bounded memory, batching,
deadlines, and bad input. hiera-t at 256 px with a random (biased) checkpoint: CPU-fast."""

import logging
import time

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils

from engine.errors import ConfigError, WeightsError
from engine.models.sam2_model import build_sam2_model, preprocess
from engine.models.sam2_tracker import TrackingStage, Prompt, PromptError, encode, render
from engine.core.engine import Engine
from engine.testing.clips import decode_all, write_clip
from engine.testing.sam2_ref import CONFIG, SIZE, iou, make_checkpoint, reference_masks
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.engines import engine_config, run_engine
from tests.support.models import rel_err

PROMPTS = {1: {"box": [40, 30, 160, 150]}, 2: {"points": [[250, 180, 1], [60, 200, 0]]}}
N = 21  # 3 x num_maskmem


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sam2") / "sam2_random_biased.pt")


@pytest.fixture(scope="module")
def model(ckpt):
    return build_sam2_model(CONFIG, str(ckpt), SIZE, torch.device("cpu"))[0]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("sam2clips")
    return [write_clip(d / f"c{seed}.mp4", N, size=(320, 240), seed=seed) for seed in (0, 5)]


@pytest.fixture(scope="module")
def ref0(ckpt, clips, tmp_path_factory):
    """Meta's masks for clips[0] with PROMPTS from frame 0: three tests compare against it; one run of the
    offline predictor is ~20 s quiet and minutes on a loaded 2-core machine, so it is computed once."""
    return reference_masks(ckpt, decode_all(clips[0]), PROMPTS, tmp_path_factory.mktemp("ref0"))


def prompt(obj_id, p):
    return Prompt(obj_id, box=p.get("box"), points=p.get("points"))


def stream_masks(model, frames_by_stream, prompts_at, stage=None):
    """Run the tracking stage over streams in lockstep; prompts_at: {(stream, frame): {obj: prompt}}."""
    stage = stage or TrackingStage(model)
    for s in frames_by_stream:
        stage.add_stream(s)
    n = max(len(f) for f in frames_by_stream.values())
    out = {s: {} for s in frames_by_stream}
    for i in range(n):
        batch = []
        for s, frames in frames_by_stream.items():
            for obj_id, p in prompts_at.get((s, i), {}).items():
                stage.add_object(s, prompt(obj_id, p))
            batch.append((s, frames[i]))
        x = preprocess([torch.from_numpy(f) for _, f in batch], SIZE, "exact", torch.device("cpu"))
        feats = encode(model, x)
        res = stage.step([(s, ft, f.shape[:2]) for (s, f), ft in zip(batch, feats)])
        for (s, f), objs in zip(batch, res):
            out[s][i] = {o["id"]: mask_utils.decode(render(o, *f.shape[:2])["mask"]).astype(bool) for o in objs}
    return out, stage


def assert_equal_to_reference(ours, ref, first=0):
    assert sorted(ref) == list(range(first, N))
    worst = min(iou(ours[i][o], ref[i][o]) for i in ref for o in ref[i])
    assert worst >= 0.99, worst
    areas = [ref[i][o].mean() for i in ref for o in ref[i]]
    assert 0.005 < min(areas) and max(areas) < 0.995, "masks must be non-trivial for the comparison to mean anything"
    assert any(not np.array_equal(ref[first][o], ref[N - 1][o]) for o in ref[first]), "masks must move"


def test_two_objects_equal_the_offline_predictor(model, clips, ref0):
    ours, stage = stream_masks(model, {"a": decode_all(clips[0])}, {("a", 0): PROMPTS})
    assert_equal_to_reference(ours["a"], ref0)
    assert stage.calls[-1] == 2  # both objects in one batched mask-decoder call


@pytest.mark.timeout(300)
def test_bf16_autocast_as_meta_runs_it_on_a_gpu_stays_close_to_float32(ckpt, clips, ref0):
    """models.sam2.dtype bfloat16 (what `auto` picks on a GPU): the encoder and the tracking stage run under
    bf16 autocast, results stay float32. On the CPU: masks within IoU 0.97 of Meta's float32 predictor, and not
    all equal to them (the autocast is on). The GPU target, IoU >= 0.99 against Meta's predictor under the same
    autocast, is gpu_check's sam2 part."""
    from engine.config import Sam2Config
    from engine.models.sam2 import build_pool
    base = {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE, "device": "cpu", "threads": 2,
            "tracking_threads": 1}
    fp32, bf16 = build_pool(Sam2Config(**base)), build_pool(Sam2Config(**base, dtype="bfloat16"))
    assert fp32.models[0].dtype == fp32.processor.stage.dtype == torch.float32  # auto on the CPU
    assert bf16.models[0].dtype == bf16.processor.stage.dtype == torch.bfloat16
    frames = decode_all(clips[0])

    def run(spec):
        enc, stage = spec.models[0], spec.processor.stage
        stage.add_stream("a")
        for obj_id, p in PROMPTS.items():
            stage.add_object("a", prompt(obj_id, p))
        logits, masks = [], {}
        for i, f in enumerate(frames):
            feats = enc.infer(enc.prepare([_View("a", f)]))[0]["_features"]
            objs = stage.step([("a", feats, f.shape[:2])])[0]
            logits += [o["logits"] for o in objs]
            masks[i] = {o["id"]: mask_utils.decode(render(o, *f.shape[:2])["mask"]).astype(bool) for o in objs}
        return logits, masks
    (l32, _), (l16, ours) = run(fp32), run(bf16)
    assert all(x.dtype == torch.float32 for x in l16)
    # the autocast is on: bf16 rounding moves the logits (seen: 7.7e-3; with it off, 0.0: the runs are identical)
    assert max((a - b).abs().max().item() for a, b in zip(l32, l16)) > 1e-4
    ious = [iou(ours[i][o], ref0[i][o]) for i in ref0 for o in ref0[i]]
    assert min(ious) >= 0.97, ious


@pytest.mark.timeout(300)
def test_the_tracking_stage_warms_up_at_start_and_leaves_nothing_behind(model, clips, ref0, monkeypatch):
    """The pool warms its tracking stage at start (a blank frame, two objects prompted a step apart, so the
    prompt, the batched step and the padded step all run at every input size), so the first camera frame pays
    no one-time cost; nothing of it stays."""
    stage = TrackingStage(model)
    stage.events.append(("cam", "info", "an event from before"))
    seen = []
    batch = TrackingStage._track_batch

    def spy(self, items, plans):  # the warm-up must reach the batched step, and the padded one
        seen.append((len(items), len({(len(p.frames), len(p.ptrs)) for p in plans}) > 1))
        return batch(self, items, plans)
    monkeypatch.setattr(TrackingStage, "_track_batch", spy)
    assert stage.warmup() > 0
    assert seen == [(1, False), (2, True)], seen
    assert stage.list() == {} and list(stage.events) == [("cam", "info", "an event from before")]
    assert not stage.calls and stage.padded_calls == 0
    assert not stage.object_failures and all(not v for v in stage.stage_s.values())
    stage.events.clear()
    ours, _ = stream_masks(model, {"a": decode_all(clips[0])}, {("a", 0): PROMPTS}, stage=stage)
    assert_equal_to_reference(ours["a"], ref0)


@pytest.mark.timeout(120)
def test_a_stage_admitting_one_object_warms_up_with_one(model, monkeypatch):
    """max_objects: 1 is a valid config; the warm-up's second object would be refused and stop the start."""
    seen = []
    batch = TrackingStage._track_batch

    def spy(self, items, plans):
        seen.append(len(items))
        return batch(self, items, plans)
    monkeypatch.setattr(TrackingStage, "_track_batch", spy)
    stage = TrackingStage(model, max_objects=1)
    assert stage.warmup() > 0
    assert seen == [1, 1] and stage.list() == {}, seen


def test_two_streams_batched_each_equal_its_own_run(model, ckpt, clips, ref0, tmp_path):
    fa, fb = decode_all(clips[0]), decode_all(clips[1])
    ref_b = reference_masks(ckpt, fb, PROMPTS, tmp_path)
    ours, stage = stream_masks(model, {"a": fa, "b": fb}, {("a", 0): PROMPTS, ("b", 0): PROMPTS})
    assert_equal_to_reference(ours["b"], ref_b)
    assert_equal_to_reference(ours["a"], ref0)
    # steady state: one mask-decoder call per step for all 2 streams x 2 objects
    assert list(stage.calls)[-10:] == [4] * 10


def test_object_added_mid_stream(model, ckpt, clips, tmp_path):
    frames = decode_all(clips[0])
    k = 5
    ref = reference_masks(ckpt, frames, {3: PROMPTS[1]}, tmp_path, start=k)
    ours, _ = stream_masks(model, {"a": frames}, {("a", 0): {2: PROMPTS[2]}, ("a", k): {3: PROMPTS[1]}})
    assert all(3 not in ours["a"][i] for i in range(k))
    assert_equal_to_reference({i: ours["a"][i] for i in range(k, N)}, ref, first=k)


def test_memory_bank_is_bounded(model, clips):
    frames = decode_all(clips[0])
    feats = [feats_of(model, f) for f in frames]  # encoded once, played 3 times (63 steps): the bank is the stage's
    stage = TrackingStage(model)
    stage.add_stream("a")
    stage.add_object("a", prompt(1, PROMPTS[1]))
    sizes = []
    for i in range(3 * len(frames)):
        stage.step([("a", feats[i % len(frames)], frames[0].shape[:2])])
        sizes.append(stage.bank_entries()[("a", 1)])
    bank = stage._streams["a"].objects[1]
    bound = 1 + (model.num_maskmem - 1) + (model.max_obj_ptrs_in_encoder - 1)
    assert bank.bound() == bound == 22
    assert max(sizes) == bound and sizes[-30:] == [bound] * 30


def test_engine_publishes_sam2_results_equal_to_reference(ckpt, clips, ref0, endpoint, caplog):
    ref = ref0
    cfg = engine_config([{"id": "cam1", "url": str(clips[0]), "mode": "offline"}], endpoint,
                        models={"classify": None, "sam2": {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE,
                                                      "preprocess": "exact", "max_batch": 2}},
                        objects=[{"stream": "cam1", "id": 1, "box": PROMPTS[1]["box"]},
                                 {"stream": "cam1", "id": 2, "points": PROMPTS[2]["points"]}],
                        publish={"min_subscribers": 1})
    col = Collector(endpoint, ["cam1"])
    col.sub._sock.setsockopt(__import__("zmq").SUBSCRIBE, b"sam2.")
    with caplog.at_level(logging.INFO, logger="vidar.sam2"):
        eng, finished = run_engine(cfg, timeout=120)
    assert any("tracking stage warmed up at input size(s) [256]" in r.getMessage() for r in caplog.records)
    msgs = [m for m in col.wait() if m["type"] == "sam2"]
    assert finished and sorted(m["seq"] for m in msgs) == list(range(N))
    for m in msgs:
        assert m["weights"] == "sam2_random_biased.pt" and [o["id"] for o in m["objects"]] == [1, 2]
        for o in m["objects"]:
            mask = mask_utils.decode(o["mask"]).astype(bool)
            assert o["mask"]["size"] == [240, 320]
            assert iou(mask, ref[m["seq"]][o["id"]]) >= 0.99
            ys, xs = np.nonzero(mask)
            assert o["bbox"] == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            assert 0 <= o["score"] <= 1


def test_live_sam2_drops_before_encoding_and_keeps_tracking(model, ckpt, endpoint):
    """SAM 2 behind a 30 fps stream: frames are dropped (superseded by newer ones, or for their deadline)
    before any encoding, no result
    is late, and the tracker's frame count is exactly the processed frames. The budget is 4 steps of
    SAM 2 as measured here (machines of this kind differ 3x in speed; the suite also runs loaded)."""
    step_s = sam2_step_seconds(model)
    budget_ms = 4 * step_s * 1e3
    cfg = engine_config([{"id": "live", "url": "synthetic://shapes?size=320x240&fps=30&frames=60", "mode": "live"}],
                        endpoint, budget={"latency_ms": budget_ms},
                        models={"classify": None, "sam2": {"config": CONFIG, "checkpoint": str(ckpt),
                                                           "image_size": SIZE, "max_batch": 1}},
                        objects=[{"stream": "live", "id": 1, "box": [10, 10, 120, 100]}],
                        publish={"min_subscribers": 1})
    col = Collector(endpoint, ["live"])
    col.sub._sock.setsockopt(__import__("zmq").SUBSCRIBE, b"sam2.")
    eng, finished = run_engine(cfg, timeout=60)
    msgs = [m for m in col.wait() if m["type"] == "sam2"]
    s = eng.pools["sam2"].acct.snapshot("live")
    assert finished and s.ingested == 60 and s.in_flight == 0 and s.balanced()
    assert sum(s.dropped.get(r, 0) for r in ("deadline", "superseded", "ring_full", "interval")) > 0, (s, step_s)
    assert msgs and max(m["latency_ms"] for m in msgs) <= budget_ms + 1.0, (s, step_s)
    track = eng.pools["sam2"].spec.processor.stage.list()["live"]
    assert track["frame"] == s.published + s.dropped.get("late", 0)  # no holes: only processed frames count
    assert all(len(m["objects"]) == 1 for m in msgs)


def sam2_step_seconds(model, reps=3):
    """Median seconds of one whole SAM 2 step here: preprocess, encode, track one object."""
    frame = torch.from_numpy(decode_all_synthetic())
    stage = TrackingStage(model)
    stage.add_stream("w")
    stage.add_object("w", Prompt(1, box=[10, 10, 120, 100]))
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        feats = encode(model, preprocess([frame], SIZE, "fast", torch.device("cpu")))
        stage.step([("w", feats[0], (240, 320))])
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def decode_all_synthetic():
    from streams.synthetic import SyntheticSource
    return SyntheticSource("w", "synthetic://shapes?size=320x240").render(0)


@pytest.mark.parametrize("p, message", [
    (Prompt(1, box=[10, 10, 400, 100]), r"\(400, 100\) lies outside the 320x240 frame"),
    (Prompt(1, box=[50, 10, 40, 100]), "x0 < x1"),
    (Prompt(1, points=[[5, 5, 7]]), "label 1 \\(foreground\\) or 0"),
    (Prompt(1), "give a box or at least one point"),
])
def test_bad_prompts(model, p, message):
    stage = TrackingStage(model)
    stage.add_stream("a")
    stage._streams["a"].size = (240, 320)
    with pytest.raises(PromptError, match=message):
        stage.add_object("a", p)


def test_unknown_stream_and_object(model):
    stage = TrackingStage(model)
    with pytest.raises(PromptError, match=r"unknown stream 'nope'"):
        stage.add_object("nope", Prompt(1, box=[0, 0, 5, 5]))
    stage.add_stream("a")
    with pytest.raises(PromptError, match=r"stream 'a' has no object 9"):
        stage.remove_object("a", 9)


def test_checkpoint_errors(ckpt, tmp_path):
    sd = torch.load(ckpt, weights_only=True)["model"]
    sd.pop("no_mem_embed")
    sd["extra.weight"] = torch.zeros(1)
    bad = tmp_path / "bad.pt"
    torch.save({"model": sd}, bad)
    with pytest.raises(WeightsError, match=r"bad.pt does not fit this config: missing keys \['no_mem_embed'\], "
                                           r"unexpected keys \['extra.weight'\]"):
        build_sam2_model(CONFIG, str(bad), SIZE, torch.device("cpu"))
    torch.save(sd, bad)
    with pytest.raises(WeightsError, match="not in the official format"):
        build_sam2_model(CONFIG, str(bad), SIZE, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"'sam2.1_hiera_xl' is not a config of the installed sam2 package; "
                                          r"available: \[.*'sam2.1_hiera_t'"):
        build_sam2_model("sam2.1_hiera_xl", "random", SIZE, torch.device("cpu"))


def test_both_pools_on_one_stream(ckpt, endpoint):
    """A stream feeds the classifier and the tracker: each pool gets every frame, one eos after both."""
    from engine.models.noop import NoopRunner
    n = 8
    cfg = engine_config([{"id": "both", "url": f"synthetic://shapes?size=160x120&fps=30&frames={n}",
                          "mode": "offline"}], endpoint,
                        models={"sam2": {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE}},
                        objects=[{"stream": "both", "id": 1, "box": [10, 10, 80, 60]}],
                        publish={"min_subscribers": 1})
    col = Collector(endpoint, ["both"])
    col.sub._sock.setsockopt(__import__("zmq").SUBSCRIBE, b"sam2.")
    eng, finished = run_engine(cfg, models={"classify": NoopRunner()}, timeout=60)
    msgs = col.wait()
    assert finished
    for kind in ("classify", "sam2"):
        assert sorted(m["seq"] for m in msgs if m["type"] == kind) == list(range(n)), kind
    assert [m["kind"] for m in msgs if m["type"] == "event"] == ["started", "eos"] and msgs[-1]["kind"] == "eos"


_FEATS: dict = {}


def feats_of(model, frame):
    """The frame's image features, encoded once per module (several tests step the same clip's frames;
    the tracking stage only reads features)."""
    key = (id(model), frame.shape, frame.tobytes())
    if key not in _FEATS:
        _FEATS[key] = encode(model, preprocess([torch.from_numpy(frame)], SIZE, "fast", torch.device("cpu")))[0]
    return _FEATS[key]


def test_one_objects_failure_fails_only_that_object_and_leaves_its_bank(model, clips, monkeypatch):
    """A batched mask-decoder call that raises is retried object by object: only the failing object fails
    (its result says so, it is counted), its bank is left exactly as it was, the other stream's object is
    tracked; after max_attempts failures in a row the object is dropped with an event."""
    frames = decode_all(clips[0])
    stage = TrackingStage(model)
    for s in ("a", "b"):
        stage.add_stream(s)
        stage.add_object(s, prompt(1, PROMPTS[1]))
    for f in frames[:3]:
        stage.step([(s, feats_of(model, f), f.shape[:2]) for s in ("a", "b")])
    bank_b = stage._streams["b"].objects[1]
    before = (dict(bank_b.cond), list(bank_b.maskmems), list(bank_b.ptrs))
    real = TrackingStage._track_batch

    def broken_for_b(self, items, plans):
        if any(d.stream == "b" for d in items):
            raise RuntimeError("injected failure in b's object")
        return real(self, items, plans)
    monkeypatch.setattr(TrackingStage, "_track_batch", broken_for_b)
    f = frames[3]
    out = stage.step([(s, feats_of(model, f), f.shape[:2]) for s in ("a", "b")])
    assert "logits" in out[0][0] and out[1][0] == {"id": 1, "error": "RuntimeError: injected failure in b's object"}
    after = stage._streams["b"].objects[1]
    assert (dict(after.cond), list(after.maskmems), list(after.ptrs)) == before  # same entries, same tensors
    assert stage._streams["a"].objects[1].entries() == 1 + 3 + 3  # a went on: prompt + 4th memory pushed
    assert stage.object_failures == {"b": 1} and not stage.events
    for k, f in enumerate(frames[4:6], start=2):
        out = stage.step([(s, feats_of(model, f), f.shape[:2]) for s in ("a", "b")])
        assert out[1] == [{"id": 1, "error": "RuntimeError: injected failure in b's object"}]
        assert stage.object_failures == {"b": k} and (1 in stage._streams["b"].objects) == (k < 3)
    monkeypatch.setattr(TrackingStage, "_track_batch", real)  # b's object is gone, not merely failing
    f = frames[6]
    out = stage.step([(s, feats_of(model, f), f.shape[:2]) for s in ("a", "b")])
    assert [o["id"] for o in out[0]] == [1] and out[1] == [] and stage.object_failures == {"b": 3}
    assert [e[:2] for e in stage.events] == [("b", "error")] and "after 3 failed steps" in stage.events[0][2]
    assert all(bank.entries() >= 1 for st in stage._streams.values() for bank in st.objects.values())


def test_a_prompt_that_fails_to_start_never_leaves_an_empty_bank(model, clips, monkeypatch):
    frames = decode_all(clips[0])
    stage = TrackingStage(model)
    stage.add_stream("a")
    stage.add_object("a", prompt(1, PROMPTS[1]))
    monkeypatch.setattr(TrackingStage, "_init_object", lambda self, d, size: (_ for _ in ()).throw(RuntimeError("boom")))
    for k, f in enumerate(frames[:3]):
        out = stage.step([("a", feats_of(model, f), f.shape[:2])])
        assert out == [[{"id": 1, "error": "RuntimeError: boom"}]]
        assert stage._streams["a"].objects == {}  # no bank is made by a failed prompt step
        assert (1 in stage._streams["a"].pending) == (k < 2)
    assert "prompt rejected after 3 failed steps" in stage.events[-1][2]


def test_object_admission_limit(model):
    stage = TrackingStage(model, max_objects=2)
    stage.add_stream("a")
    stage.add_object("a", Prompt(1, box=[0, 0, 5, 5]))
    stage.add_object("a", Prompt(2, box=[0, 0, 5, 5]))
    stage.add_object("a", Prompt(2, box=[1, 1, 6, 6]))  # re-prompting an existing id is not a new object
    with pytest.raises(PromptError, match=r"models.sam2.max_objects=2 objects are tracked already"):
        stage.add_object("a", Prompt(3, box=[0, 0, 5, 5]))


def test_removing_and_readding_a_sam2_stream_never_fails_another(ckpt, endpoint):
    """Two SAM 2 streams with one object each; the second is removed and re-added 4 times while batches
    are in flight. The first engine failed frames of the FIRST stream (and 3 such batches kill it)."""
    sam = {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE, "max_batch": 2}
    cfg = engine_config([{"id": "a", "url": "synthetic://shapes?size=160x120&fps=15"},
                         {"id": "b", "url": "synthetic://shapes?size=160x120&fps=15"}], endpoint,
                        budget={"latency_ms": 60_000}, models={"classify": None, "sam2": sam},
                        objects=[{"stream": "a", "id": 1, "box": [10, 10, 80, 60]},
                                 {"stream": "b", "id": 1, "box": [10, 10, 80, 60]}])
    eng = Engine(cfg)
    eng.start()
    assert list(eng.pools) == ["sam2"]  # a config that names only models.sam2 runs only SAM 2
    acct = eng.pools["sam2"].acct

    def busy_with_b():
        return acct.snapshot("b").held.get("workers", 0) + acct.snapshot("b").held.get("output", 0) > 0
    # it stops once quiet for 1 s after a's eos, which comes at shutdown: b's shutdown eos may come just after a's
    # (sent by the same stop, before col.wait below: already on its way)
    col = Collector(endpoint, ["a"], linger_s=1)
    col.sub._sock.setsockopt(__import__("zmq").SUBSCRIBE, b"sam2.b")
    added = []  # wall-clock time of each re-add: every frame of that incarnation is captured after it
    try:
        for _ in range(4):
            assert wait_for(busy_with_b, 30, 0.01), acct.snapshot("b")
            assert eng.control({"op": "remove_stream", "stream": "b"}, timeout=60) == {"ok": True}
            time.sleep(0.5)  # as between two `vidar control` calls (the first engine failed a's frames then)
            added.append(time.time())
            assert eng.control({"op": "add_stream", "stream": {"id": "b", "url": "synthetic://shapes?size=160x120&fps=15"}})["ok"]
            assert eng.control({"op": "add_object", "stream": "b", "id": 1, "box": [10, 10, 80, 60]})["ok"]
        published = acct.snapshot("a").published
        assert wait_for(lambda: acct.snapshot("a").published > published, 30, 0.01)
    finally:
        eng.stop()
    a = acct.snapshot("a")
    assert a.failed == {} and eng.check_dead() is None and a.balanced() and a.in_flight == 0
    assert eng.pools["sam2"].spec.processor.stage.object_failures == {}
    # each incarnation of b: its results, then its eos; a new incarnation holds only its own frames (the
    # first engine could hand an old incarnation's frames to the new one's tracker). Its first result
    # need not be seq 0: a live stream is served newest first, so under load its first frames may be
    # superseded; what tells incarnations apart is when their frames were captured.
    b = [m for m in col.wait(10) if m["stream"] == "b"]
    runs, current = [], []
    for m in b:
        if m["type"] == "event" and m["kind"] == "eos":
            runs.append(current)
            current = []
        elif m["type"] == "sam2":
            current.append((m["seq"], m["t_capture"]))
    assert len(runs) == 5 and current == []  # 4 removals, then the shutdown's eos; nothing after an eos
    assert all([q for q, _ in run] == sorted(q for q, _ in run) for run in runs)
    for t_add, run in zip(added, runs[1:]):
        assert all(t >= t_add for _, t in run), (t_add, run)


# -- threads, input-size levels, idle streams ------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_threads_intra_op_count_sticks_when_another_thread_sets_another():
    """torch re-applies the count last set by ANY thread on a thread's first op: the output thread's
    tracking_threads must survive an encoder thread setting its own count afterwards."""
    import threading
    from engine.util.threads import set_intra_op_threads
    seen, first_set, other_set = {}, threading.Event(), threading.Event()

    def tracking_thread():
        set_intra_op_threads(1)
        first_set.set()
        other_set.wait(10)
        torch.ones(64, 64) @ torch.ones(64, 64)
        seen["tracking"] = torch.get_num_threads()

    def encoder_thread():
        first_set.wait(10)
        set_intra_op_threads(2)
        seen["encoder"] = torch.get_num_threads()
        other_set.set()
    threads = [threading.Thread(target=tracking_thread), threading.Thread(target=encoder_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"tracking": 1, "encoder": 2}


@pytest.mark.timeout(120)
def test_thread_defaults_fill_only_unset_keys(ckpt):
    from engine.config import Sam2Config
    from engine.models.sam2 import build_pool, sam2_thread_defaults
    assert sam2_thread_defaults(8, "cuda") == {"encoders": 1, "threads": None, "tracking_threads": None}
    for cores in (1, 2, 4, 16):
        d = sam2_thread_defaults(cores, torch.device("cpu"))
        assert d["encoders"] >= 1 and d["threads"] >= 1 and d["tracking_threads"] >= 1
        assert d["encoders"] * d["threads"] <= max(cores, 1) and d["tracking_threads"] <= max(cores, 1)
    base = {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE, "device": "cpu"}
    import os
    chosen = sam2_thread_defaults(os.cpu_count(), torch.device("cpu"))
    spec = build_pool(Sam2Config(**base))
    assert (len(spec.models), spec.threads, spec.output_threads) == (chosen["encoders"], chosen["threads"],
                                                                         chosen["tracking_threads"])
    spec = build_pool(Sam2Config(**base, threads=3, tracking_threads=5))  # what the user set is kept
    assert (len(spec.models), spec.threads, spec.output_threads) == (chosen["encoders"], 3, 5)
    # the key's old name (before the tracking stage was named for what it does) still reads
    assert Sam2Config(**base, decoder_threads=4).tracking_threads == 4
    spec = build_pool(Sam2Config(**base, encoders=2))
    assert len(spec.models) == 2 and spec.models[1].model is spec.models[0].model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sizes, message", [
    ([128], None),
    ([192, 128], None),
    ([256], r"\[256\] must be strictly descending and each smaller than image_size=256"),
    ([128, 192], r"\[128, 192\] must be strictly descending"),
    ([130], r"130 must be a multiple of 32 and >= 128"),
    ([96], r"96 must be a multiple of 32 and >= 128"),
])
def test_degrade_sizes_validated(sizes, message):
    from engine.config import build_config
    tree = {"streams": [{"id": "a", "url": "x.mp4"}], "control": {"enabled": False},
            "models": {"sam2": {"image_size": SIZE, "degrade_sizes": sizes}}}
    if message is None:
        assert build_config(tree, cuda_available=True)[0].models.sam2.degrade_sizes == sizes
    else:
        with pytest.raises(ConfigError, match=r"models\.sam2\.degrade_sizes: " + message):
            build_config(tree, cuda_available=True)


def _View(stream, pixels):
    """A frame of `stream` as the encoder worker gets it: a FrameRef (over a tensor in no ring)."""
    from engine.frames.ref import LooseFrames
    return LooseFrames([torch.from_numpy(pixels)]).refs(stream)[0]


@pytest.mark.timeout(120)
def test_on_a_gpu_the_encoder_orders_slots_by_events(ckpt, model, monkeypatch):
    """The GPU branch of the encoder's prepare / release_event / infer, with fakes of the encoder's CUDA
    stream and events (tensors stay on the CPU): its stream waits on each NV12 slot's write event before the
    batched op; NV12 slots are released on an event recorded on that stream after it (RGB host slots need
    none: read before prepare returns); infer runs on that stream and waits on its own batch's event, not on
    the stream or the device."""
    import contextlib
    from engine.config import Sam2Config
    from engine.frames.ref import LooseFrames
    from engine.models.sam2 import Sam2EncoderRunner

    class Event:
        def __init__(self, name="model"):
            self.name, self.recorded, self.synced = name, 0, 0

        def record(self, stream=None):
            assert stream is w.stream, "an event on another stream than the encoder's"
            self.recorded += 1

        def synchronize(self):
            self.synced += 1

    class Stream:
        def __init__(self):
            self.waited: list = []

        def wait_event(self, event):
            self.waited.append(event.name)

    stream, made = Stream(), []

    def event(**kwargs):
        made.append(Event())
        made[-1].kwargs = kwargs
        return made[-1]

    class Slots(LooseFrames):  # a ring's slots whose writes are ordered by events
        def ready_event(self, slot):
            return Event(f"write{slot}")
    entered = []

    def on(s):  # torch.cuda.stream(s): work queued inside runs on s
        entered.append(s)
        return contextlib.nullcontext()
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", event)
    w = Sam2EncoderRunner(Sam2Config(config=CONFIG, checkpoint=str(ckpt), image_size=SIZE, device="cpu",
                                     cuda_graphs=False), model=model, weights_tag="t")
    w.device, w.stream = torch.device("cuda"), stream  # the GPU branch; the tensors stay where they are
    rng = np.random.default_rng(0)
    nv12 = Slots([torch.from_numpy(rng.integers(0, 255, (72, 64), dtype=np.uint8)) for _ in range(2)]
                 ).refs("gpu-cam", pixel_format="nv12")
    rgb = Slots([torch.from_numpy(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))]).refs("cpu-cam")
    inputs = w.prepare([nv12[0], rgb[0], nv12[1]])
    assert stream.waited == ["write0", "write0", "write1"]  # every slot's write, before the batched op
    released = w.release_event()
    assert released is made[-1] and released.recorded == 1 and released.synced == 0  # no host wait
    out = w.infer(inputs)
    assert [o["_features"] is not None for o in out] == [True] * 3
    assert made[-1] is not released and made[-1].recorded == 1 and made[-1].synced == 1  # its own batch only
    assert made[-1].kwargs == {"blocking": True} and released.kwargs == {}  # host-waited: blocking; GPU-waited: not
    assert entered == [stream, stream]  # prepare and infer, on the encoder's stream
    w.prepare([rgb[0]])
    assert w.release_event() is None  # host RGB slots: read before prepare returned


@pytest.mark.timeout(120)
def test_the_encoder_reads_nv12_frames_and_mixed_batches(pool128):
    """On a GPU the encoder reads NVDEC's NV12 slots (accepts_nv12: cuda only) through the batched op: each
    frame's input in a batch mixing NV12 and RGB frames equals its own batch-of-one input, and an NV12 frame's
    input is within 2 levels of the input of its own RGB conversion (the contract's resize and normalisation
    applied alike; the conversion's own fidelity is tests/models/test_batch_preprocess.py's)."""
    import av

    from engine.frames.ref import LooseFrames
    from engine.models.colour import nv12_to_rgb
    w = pool128.models[0]
    assert w.accepts_nv12 is False  # on the CPU: streams feeding it decode on the CPU
    rng = np.random.default_rng(3)
    pics = [torch.from_numpy(av.VideoFrame.from_ndarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8),
                                                        format="rgb24").reformat(format="nv12").to_ndarray(format="nv12"))
            for _ in range(3)]
    nv12 = LooseFrames(pics).refs("gpu-cam", pixel_format="nv12")
    as_rgb = [nv12_to_rgb(p[None], *nv12[0].meta.colour)[0].permute(1, 2, 0).round().to(torch.uint8).contiguous()
              for p in pics]
    rgb = LooseFrames(as_rgb).refs("cpu-cam")
    alone = [w.prepare([r])[2] for r in nv12] + [w.prepare([r])[2] for r in rgb]
    mixed = [nv12[0], rgb[0], rgb[1], nv12[1], rgb[2], nv12[2]]
    keep, n, x = w.prepare(mixed)
    assert keep == list(range(6)) and n == 6 and x.shape == (6, 3, SIZE, SIZE)
    for i, j in enumerate([0, 3, 4, 1, 5, 2]):
        assert torch.allclose(x[i], alone[j][0], atol=1e-5), i
    std = torch.tensor(w.pre.data_config["std"]).view(3, 1, 1)
    for k in range(3):  # NV12 vs its own RGB conversion, in 8-bit levels
        assert ((alone[k][0] - alone[3 + k][0]).abs() * std * 255).max() <= 2.0
    assert w.release_event() is None  # on the CPU prepare has read the slots already


@pytest.mark.timeout(180)
def test_the_graphed_encoder_copies_each_frames_features_out_of_the_graphs_buffers(model, ckpt, clips):
    """models.sam2.cuda_graphs: the encoder at image_size replays a graph per batch size (a fake one here that
    overwrites its static outputs at each replay, as a real graph does); each frame's features are copied out,
    so a batch's features survive the next batch and equal the eager encoder's; a degrade size runs eager."""
    from engine.config import Sam2Config
    from engine.models.sam2 import Sam2EncoderRunner
    from tests.support.fake_graphs import FakeBackend
    cfg = Sam2Config(config=CONFIG, checkpoint=str(ckpt), image_size=SIZE, device="cpu", degrade_sizes=[128])
    fake = FakeBackend()
    graphed = Sam2EncoderRunner(cfg, model=model, weights_tag="t", graph_backend=fake)
    eager = Sam2EncoderRunner(cfg, model=model, weights_tag="t", sized=graphed.sized)
    assert eager.graphs is None  # on the CPU without a backend: no graphs
    graphed.capture_graphs()
    assert graphed.graphs.sizes == (1, 2, 4)
    frames = decode_all(clips[0])[:4]
    first = graphed.infer(graphed.prepare([_View("a", frames[0]), _View("b", frames[1])]))
    graphed.infer(graphed.prepare([_View("a", frames[2]), _View("b", frames[3])]))  # overwrites the buffers
    want = eager.infer(eager.prepare([_View("a", frames[0]), _View("b", frames[1])]))
    assert [b for b, _ in fake.replays] == [2, 2]
    for got, ref in zip(first, want):
        g, r = got["_features"], ref["_features"]
        for a, b in zip(g.vision_feats + g.vision_pos, r.vision_feats + r.vision_pos):
            assert rel_err(a, b) <= 1e-5
    graphed.set_level(1)  # 128 px: eager, no replay
    graphed.infer(graphed.prepare([_View("a", frames[0])]))
    assert len(fake.replays) == 2


@pytest.fixture(scope="module")
def pool128(ckpt):
    from engine.config import Sam2Config
    from engine.models.sam2 import build_pool
    return build_pool(Sam2Config(config=CONFIG, checkpoint=str(ckpt), image_size=SIZE, device="cpu",
                                 degrade_sizes=[128], threads=2, tracking_threads=2))


@pytest.mark.timeout(120)
def test_levels_share_the_weights(pool128):
    w = pool128.models[0]
    assert pool128.levels == ["image_size=256", "image_size=128"]
    small = w.models[128]
    assert small.image_size == 128 and w.model.image_size == 256
    params = list(zip(w.model.parameters(), small.parameters()))
    assert params and all(p.data_ptr() == q.data_ptr() for p, q in params)  # one copy of the weights
    assert pool128.processor.stage.models[128] is small  # the tracking stage steps with the same models
    frame = decode_all_synthetic()
    for level, size in ((1, 128), (0, 256)):
        w.set_level(level)
        out = w.infer(w.prepare([_View("a", frame)]))
        assert out[0]["_features"].image_size == size and out[0]["_features"].feat_sizes[-1] == (size // 16,) * 2
    with pytest.raises(ValueError, match=r"level 2 does not exist; levels 0..1 are image_size \[256, 128\]"):
        w.set_level(2)


@pytest.mark.timeout(240)
def test_stream_switched_to_a_smaller_size_keeps_its_objects(pool128, clips):
    """256 px for k frames, then 128 px: each object restarts at 128 from its last mask (same id, no gap),
    the banks are rebuilt at 128, and the masks go on overlapping the pre-switch ones."""
    w, stage = pool128.models[0], pool128.processor.stage
    frames = decode_all(clips[0])
    stage.add_stream("sw")
    for obj_id, p in PROMPTS.items():
        stage.add_object("sw", prompt(obj_id, p))
    k, masks = 8, []
    try:
        for i, f in enumerate(frames[:k + 6]):
            w.set_level(0 if i < k else 1)
            feats = w.infer(w.prepare([_View("sw", f)]))[0]["_features"]
            objs = stage.step([("sw", feats, f.shape[:2])])[0]
            assert [o["id"] for o in objs] == [1, 2] and all("logits" in o for o in objs), (i, objs)
            masks.append({o["id"]: mask_utils.decode(render(o, *f.shape[:2])["mask"]).astype(bool) for o in objs})
            if i == k - 1:
                assert {b.image_size for b in stage._streams["sw"].objects.values()} == {256}
        st = stage._streams["sw"]
        assert st.frame_idx == k + 6 and not stage.events and not stage.object_failures
        for bank in st.objects.values():
            assert bank.image_size == 128 and min(bank.cond) == k  # restarted at the switch
            assert bank.cond[k].maskmem.shape[-2:] == (8, 8) and bank.maskmems[-1][1].maskmem.shape[-2:] == (8, 8)
        for obj_id in PROMPTS:
            before = masks[k - 1][obj_id]
            assert before.mean() > 0.005
            assert iou(masks[k][obj_id], before) >= 0.8, "the switch frame carries the last mask over"
            assert all(m[obj_id].mean() > 0.005 for m in masks[k:])
            assert min(iou(m[obj_id], before) for m in masks[k:]) >= 0.3, [iou(m[obj_id], before) for m in masks[k:]]
    finally:
        stage.remove_stream("sw")
        w.set_level(0)


@pytest.mark.timeout(120)
def test_on_a_gpu_the_tracking_stage_runs_on_its_own_stream_and_keeps_the_features_it_reads(pool128, clips,
                                                                                            monkeypatch):
    """The GPU branch of the processor, with fakes of torch.cuda.stream and Tensor.record_stream (tensors stay
    on the CPU): a step runs on the stage's stream, not an encoder's, and every feature tensor it reads (made
    on the encoder's stream) is recorded as used by the stage's stream, so the allocator keeps it until the
    stage's queued work is done."""
    import contextlib
    w, proc = pool128.models[0], pool128.processor
    stage = proc.stage
    frame = decode_all(clips[0])[0]
    stage.add_stream("gs")
    stage.add_object("gs", prompt(1, PROMPTS[1]))
    view = _View("gs", frame)
    fields = w.infer(w.prepare([view]))
    feats = fields[0]["_features"]
    entered, recorded = [], []
    gpu = object()  # the stage's CUDA stream
    monkeypatch.setattr(torch.cuda, "stream", lambda s: entered.append(s) or contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((t.data_ptr(), s)))
    monkeypatch.setattr(stage, "cuda_stream", gpu)
    try:
        out, commit = proc.process([view], fields)
        commit()
        assert entered == [gpu]
        assert sorted(recorded) == sorted((t.data_ptr(), gpu) for t in feats.vision_feats + feats.vision_pos)
        assert [o["id"] for o in out[0]["objects"]] == [1]
    finally:
        stage.remove_stream("gs")


@pytest.mark.timeout(120)
def test_idle_stream_frames_are_not_encoded_and_a_prompt_starts_on_the_next_encoded_frame(pool128, monkeypatch):
    w, stage = pool128.models[0], pool128.processor.stage
    encoded = []
    real = w.models[256].forward_image
    monkeypatch.setattr(w.models[256], "forward_image", lambda x: encoded.append(x.shape[0]) or real(x))
    frame = decode_all_synthetic()
    stage.add_stream("busy")
    stage.add_stream("quiet")
    stage.add_object("busy", Prompt(1, box=[10, 10, 120, 100]))

    def step():
        feats = [o["_features"] for o in w.infer(w.prepare([_View("busy", frame), _View("quiet", frame)]))]
        return feats, stage.step([("busy", feats[0], (240, 320)), ("quiet", feats[1], (240, 320))])
    try:
        feats, out = step()  # the quiet stream's first frame is encoded: it has not been seen idle yet
        assert feats[1] is not None and out[1] == [] and encoded == [2]
        for _ in range(3):
            feats, out = step()
            assert feats[1] is None and out[1] == [] and [o["id"] for o in out[0]] == [1]
        assert encoded == [2, 1, 1, 1] and stage.list()["quiet"]["frame"] == 1 and stage.list()["busy"]["frame"] == 4
        stage.add_object("quiet", Prompt(7, box=[10, 10, 120, 100]))
        feats, out = step()
        assert feats[1] is not None and [o["id"] for o in out[1]] == [7] and "logits" in out[1][0]
        bank = stage._streams["quiet"].objects[7]
        assert list(bank.cond) == [1] and stage.list()["quiet"]["frame"] == 2  # frame index: encoded frames only
        # a frame skipped while an object got tracked (several encoders racing) says so, and changes nothing
        before = (stage.list()["quiet"]["frame"], bank.entries())
        out = stage.step([("quiet", None, (240, 320))])
        assert out == [[{"id": 7, "error": "frame not encoded: the stream had nothing to track when it was dispatched"}]]
        assert (stage.list()["quiet"]["frame"], stage._streams["quiet"].objects[7].entries()) == before
        assert not stage.object_failures
    finally:
        stage.remove_stream("busy")
        stage.remove_stream("quiet")


@pytest.mark.timeout(240)
def test_overloaded_sam2_pool_steps_down_to_a_smaller_input_size(model, ckpt, endpoint):
    """A live stream far faster than SAM 2 with `max_interval: 1` (no interval rung): the ladder's first
    rung is the smaller input size. The pool steps down, says so on the stream's events, and the
    objects go on being tracked at 128 px (the switch travels with the batches to the encoder and the
    tracking stage). The budget is 6 steps of SAM 2 as measured here."""
    from engine.publish.client import Subscriber
    budget_ms = 6 * sam2_step_seconds(model) * 1e3
    cfg = engine_config([{"id": "live", "url": "synthetic://shapes?size=320x240&fps=30", "max_interval": 1}],
                        endpoint, budget={"latency_ms": budget_ms}, qos={"degrade_after_s": 1.0},
                        models={"classify": None, "sam2": {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE,
                                                           "degrade_sizes": [128], "max_batch": 1}},
                        objects=[{"stream": "live", "id": 1, "box": [10, 10, 120, 100]}])
    sub = Subscriber(endpoint, ["sam2.live", "event.live"])
    eng = Engine(cfg)
    eng.start()
    pool = eng.pools["sam2"]
    stage = pool.spec.processor.stage
    try:
        t_end = time.monotonic() + 120
        while pool.qos.state()["level"] == 0 and time.monotonic() < t_end:
            time.sleep(0.1)
        assert pool.qos.state()["level"] == 1, pool.qos.state()
        got, degraded = [], []
        while len(got) < 3 and time.monotonic() < t_end:
            m = sub.recv(1)
            if m is None:
                continue
            if m["type"] == "event" and m["kind"] == "degraded":
                degraded.append(m)
            elif m["type"] == "sam2" and degraded:
                got.append(m)
        banks = {o: b.image_size for o, b in stage._streams["live"].objects.items()}
    finally:
        eng.stop()
        sub.close()
    assert degraded and degraded[0]["level"] == "image_size=128" and degraded[0]["pool"] == "sam2", degraded
    assert len(got) == 3 and all([o["id"] for o in m["objects"]] == [1] for m in got), got
    assert banks == {1: 128}
    assert max(m["latency_ms"] for m in got) <= budget_ms + 1.0
