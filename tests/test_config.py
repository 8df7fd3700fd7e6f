import pytest

from engine.config import build_config, load_config, parse_override
from engine.errors import ConfigError

GOOD = {"streams": [{"id": "cam1", "url": "synthetic://shapes"}]}


def tree(**patch):
    import copy
    t = copy.deepcopy(GOOD)
    for dotted, value in patch.items():
        node = t
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
        node[last] = value
    return t


@pytest.mark.parametrize("patch, message", [
    ({"streams__0__urll": "x"}, r"streams\.0\.urll: unknown key; allowed here: decode, id, loop, max_interval, mode, pools, url"),
    ({"models__classify__nam": "x"}, r"models\.classify\.nam: unknown key; allowed here: .*max_batch.*name"),
    ({"budgett": {}}, r"budgett: unknown key"),
    ({"streams__0__mode": "realtime"}, r"streams\.0\.mode: Input should be 'live' or 'offline'"),
    ({"models__classify__max_batch": 0}, r"models\.classify\.max_batch: must be an integer batch size in \[1, 256\] or `auto`, got 0"),
    ({"models__classify__max_batch": "eight"}, r"models\.classify\.max_batch: must be an integer .* or `auto`, got 'eight'"),
    ({"models__classify__max_batch": "auto", "models__classify__graph_batch_sizes": [1, 128]},
     r"graph_batch_sizes \[1, 128\] has a size over max_batch \(auto, at most 64\)"),
    ({"budget__latency_ms": -5}, r"budget\.latency_ms: must be a number of ms > 0 or `auto`, got -5"),
    ({"budget__latency_ms": "fast"}, r"budget\.latency_ms: must be a number of ms > 0 or `auto`, got 'fast'"),
    ({"source__stall_timeout_s": -1}, r"source\.stall_timeout_s: Input should be greater than 0"),
    ({"source__open_timeout_s": 0}, r"source\.open_timeout_s: Input should be greater than 0"),
    ({"shutdown_timeout_s": -2}, r"shutdown_timeout_s: Input should be greater than 0"),
    ({"malloc_arenas": -1}, r"malloc_arenas: Input should be greater than or equal to 0"),
    ({"streams__0__loop": "sometimes"}, r"streams\.0\.loop: Input should be a valid boolean"),
    ({"streams__0__id": "cam 1"}, r"streams\.0\.id: .*must match"),
    ({"models__classify__preprocess": "pil"}, r"models\.classify\.preprocess: Input should be 'fast' or 'exact'"),
    ({"streams": [], "control": {"enabled": False}}, r"no streams and control\.enabled is false"),
    ({"streams__0__pools": ["sam2"]}, r"streams\.0\.pools: pool 'sam2' is not configured; configured: \['classify'\]"),
    ({"streams__0__pools": []}, r"streams\.0\.pools: List should have at least 1 item"),
    ({"max_streams": 0}, r"max_streams: Input should be greater than or equal to 1"),
    ({"source__backoff_reset_after_s": 0}, r"source\.backoff_reset_after_s: Input should be greater than 0"),
    ({"security": {"curve": True, "server_key": "k", "authorized_clients": "d"}},
     r"security\.curve is on but the live view has no token"),
    ({"security": {"curve": True, "server_key": "k", "authorized_clients": "d"}, "view": {"enabled": False},
      "cluster": {}}, r"security\.curve with a cluster: section is not supported yet"),
    ({"cluster": {"pin": {"cam1": "zone"}}}, r"cluster\.pin\.cam1: 'zone' is not a node label"),
    ({"view": {"host": "0.0.0.0"}}, r"without a guard: view\.host='0\.0\.0\.0' \(set view\.token"),
], ids=lambda v: str(v)[:40])
def test_config_errors_name_the_key(patch, message):
    with pytest.raises(ConfigError, match=message):
        build_config(tree(**patch), cuda_available=True)


@pytest.mark.parametrize("patch, message", [
    ({"objects": [{"stream": "nope", "id": 1, "box": [0, 0, 5, 5]}], "models": {"sam2": {}}},
     r"objects.0.stream: unknown stream 'nope'; streams: \['cam1'\]"),
    ({"objects": [{"stream": "cam1", "id": 1, "box": [0, 0, 5, 5]}]}, "objects are SAM 2 prompts: configure models.sam2"),
    ({"objects": [{"stream": "cam1", "id": 1}], "models": {"sam2": {}}}, "give a box or points"),
    ({"objects": [{"stream": "cam1", "id": 1, "box": [0, 0, 5]}], "models": {"sam2": {}}},
     "objects.0.box: List should have at least 4 items"),
    ({"models": {"sam2": {"image_size": 300}}}, r"models.sam2.image_size: Input should be a multiple of 32"),
    ({"models": {}}, "configure models.classify, models.sam2 or both"),
    ({"models": {"vit": {}, "classify": {}}}, "models.vit and models.classify are the same pool"),
    ({"models": {"sam2": {"max_objects": 0}}}, r"models.sam2.max_objects: Input should be greater than or equal to 1"),
    ({"models": {"sam2": {}, "classify": {}}, "streams": [{"id": "cam1", "url": "x", "pools": ["classify"]}],
      "objects": [{"stream": "cam1", "id": 1, "box": [0, 0, 5, 5]}]}, r"let stream 'cam1' feed it \(streams\[\]\.pools\)"),
])
def test_sam2_config_errors(patch, message):
    with pytest.raises(ConfigError, match=message):
        build_config(dict(GOOD, **patch), cuda_available=True)


def test_duplicate_stream_ids():
    t = {"streams": [{"id": "a", "url": "x.mp4"}, {"id": "a", "url": "y.mp4"}]}
    with pytest.raises(ConfigError, match=r"duplicate stream ids \['a'\]"):
        build_config(t, cuda_available=True)


def test_defaults_follow_the_contract():
    cfg, applied = build_config(GOOD, cuda_available=True)
    assert applied == []
    assert cfg.streams[0].mode == "live"
    assert cfg.budget.latency_ms == "auto"  # chosen at start for where the pools run (tests/sched/test_budget_auto.py)
    assert list(cfg.models.configured()) == ["classify"]  # no models section: one classify pool
    assert cfg.models.classify.name == "vit_large_patch16_224"
    assert cfg.models.classify.weights == "pretrained"
    assert (cfg.models.classify.max_batch, cfg.models.classify.topk, cfg.models.classify.embedding) == (8, 5, False)
    assert cfg.streams[0].pools is None  # every configured pool
    assert cfg.max_streams == 64
    assert cfg.publish.endpoint == "tcp://127.0.0.1:5556"
    assert (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", 9108)


@pytest.mark.timeout(10)
def test_the_noop_pool_costs_nothing_unless_a_sizing_cost_is_set():
    """A "no-op" pool that slept 10 ms a frame capped each worker at 100 frames/s, read as the engine's limit
    (issue 42): by default a frame costs nothing; per_frame_s is a sizing knob, set where a cost is wanted."""
    from engine.models.noop import build_pool
    cfg, _ = build_config(dict(GOOD, models={"noop": {}}), cuda_available=False)
    assert cfg.models.noop.per_frame_s == 0
    assert build_pool(cfg.models.noop).models[0].warmup([1, 4]) == {1: 0.0, 4: 0.0}
    sized, _ = build_config(dict(GOOD, models={"noop": {"per_frame_s": 0.05}}), cuda_available=False)
    assert build_pool(sized.models.noop).models[0].warmup([2]) == {2: 0.1}


def test_only_the_named_pools_run():
    cfg, _ = build_config(dict(GOOD, models={"sam2": {}}), cuda_available=True)
    assert list(cfg.models.configured()) == ["sam2"] and cfg.models.classify is None
    assert cfg.models.sam2.checkpoint == "pretrained" and cfg.models.sam2.max_objects == 32
    both, _ = build_config(dict(GOOD, models={"sam2": {}, "classify": {"name": "test_vit"}}), cuda_available=True)
    assert list(both.models.configured()) == ["classify", "sam2"]


def test_models_vit_still_loads_with_a_deprecation_warning(caplog):
    cfg, _ = build_config(dict(GOOD, models={"vit": {"name": "test_vit"}}), overrides=["models.vit.topk=3"],
                          cuda_available=True)
    assert cfg.models.classify.name == "test_vit" and cfg.models.classify.topk == 3
    assert "models.vit is deprecated: rename it to models.classify" in caplog.text


def test_set_overrides_and_on_cpu():
    t = dict(GOOD, on_cpu={"models.classify.name": "vit_tiny_patch16_224", "budget.latency_ms": 200})
    cfg, applied = build_config(t, overrides=["models.classify.max_batch=4", "streams.0.mode=offline"],
                                cuda_available=False)
    assert cfg.models.classify.max_batch == 4 and cfg.streams[0].mode == "offline"
    assert cfg.models.classify.name == "vit_tiny_patch16_224" and cfg.budget.latency_ms == 200
    assert applied == ["models.classify.name=vit_tiny_patch16_224", "budget.latency_ms=200"]
    cfg_gpu, applied_gpu = build_config(t, cuda_available=True)
    assert cfg_gpu.models.classify.name == "vit_large_patch16_224" and applied_gpu == []


@pytest.mark.parametrize("text, message", [
    ("models.classify.max_batch", "expected KEY=VALUE"),
    ("streams.3.mode=live", "not an index of a list of 1"),
    ("models.classify.max_batch=zero", r"models\.classify\.max_batch: must be an integer batch size .* got 'zero'"),
    ("models.classify.bogus=1", r"models\.classify\.bogus: unknown key"),
])
def test_bad_overrides(text, message):
    with pytest.raises(ConfigError, match=message):
        build_config(GOOD, overrides=[text], cuda_available=True)


def test_parse_override_yaml_values():
    assert parse_override("a.b=4") == ("a.b", 4)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=x.mp4") == ("a.b", "x.mp4")


def test_shipped_configs_are_valid():
    from pathlib import Path
    for path in sorted(Path("configs").glob("*.yaml")):
        for cuda in (True, False):
            cfg, _ = load_config(path, cuda_available=cuda)
            assert cfg.streams and cfg.models.configured()


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("streams: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("streams, max_slots, warned", [
    (1, 9, False),   # 8 frames of one stream fill a batch of 8
    (1, 4, True),    # 3 at once: batches of at most 3
    (8, 2, False),   # the cross-stream case the old rule refused: 8 streams x 1 frame fill a batch of 8
    (7, 2, True),
])
def test_a_ring_too_small_for_a_full_batch_is_said_at_start_not_refused(streams, max_slots, warned):
    """A batch is formed across streams: max_slots > max_batch in every ring (the old rule) made a batch of 64
    cost 65 slots per stream. Now too few slots for a full batch is a start-up warning (batches are smaller)."""
    from engine.config import ring_shortfalls
    cfg, _ = build_config({"streams": [{"id": f"s{i}", "url": "synthetic://shapes"} for i in range(streams)],
                           "models": {"classify": {"max_batch": 8}},
                           "ring": {"min_slots": 2, "max_slots": max_slots}})
    said = ring_shortfalls(cfg, {"classify": cfg.models.classify.max_batch})
    assert bool(said) == warned
    if warned:
        assert said == [f"pool classify: its {streams} stream(s) offer at most {streams * (max_slots - 1)} frames at "
                        f"once (ring.max_slots - 1 = {max_slots - 1} each), under its max_batch (8): its "
                        "batches will be smaller; raise ring.max_slots for full batches"]


@pytest.mark.timeout(30)
def test_the_start_log_says_what_each_pools_batch_asks_of_the_rings():
    """`vidar run` says what it chose and why (issue 23 item 6): per pool, the rings' size, each stream's share
    of the chosen batch, and what a live 60 fps stream holds within the budget."""
    from engine.config import ring_needs
    cfg, _ = build_config({"streams": [{"id": f"s{i}", "url": "synthetic://shapes", "pools": ["classify"]}
                                       for i in range(3)] + [{"id": "x", "url": "synthetic://shapes", "pools": ["sam2"]}],
                           "models": {"classify": {"max_batch": 8}, "sam2": {"checkpoint": "random"}},
                           "budget": {"latency_ms": 17},
                           "ring": {"max_slots": 6}})
    said = ring_needs(cfg, {"classify": 8, "sam2": 4, "empty": 2})
    assert said[0] == ("pool classify: rings of up to 6 slots per stream (ring.max_slots, within ring.memory_mb 64 MB); "
                       "a batch of 8 across its 3 stream(s) takes 3 frame(s) of each at once, plus 1 slot for the "
                       "decoder; a live 60 fps stream has 2 frame(s) arriving within budget.latency_ms (17 ms) to hold, plus "
                       "the one being decoded")
    assert said[1].startswith("pool sam2: ") and "a batch of 4 across its 1 stream(s) takes 4 frame(s)" in said[1]
    assert len(said) == 2  # a pool with no configured stream says nothing
