"""Engines in tests: a config with test defaults (tiny ViT on the CPU, no control socket, no view, no
metrics), and an engine run until its offline streams finish."""

from __future__ import annotations

from engine.config import build_config
from engine.core.engine import Engine
from engine.testing.wait import wait_for


def engine_config(streams: list[dict], endpoint: str, **sections):
    tree = {"streams": streams,
            "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 4, "device": "cpu"}},
            "publish": {"endpoint": endpoint}, "metrics": {"enabled": False}, "status": {"interval_s": 1},
            "control": {"enabled": False},  # engines in tests run without the runtime's control socket
            "view": {"enabled": False},     # nor its live view (tests/view/ turns it on)
            # In-process engines in tests decode on threads (ingest.processes: 0): tests patch sources in this
            # process and read an IngestThread's state. The ingest processes (the product's default) are tested in
            # tests/ingest/ and by every test that runs `vidar run`.
            "ingest": {"processes": 0}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(tree[key].get(k), dict):
                    tree[key][k].update(v)
                else:
                    tree[key][k] = v
        else:
            tree[key] = value
    cfg, _ = build_config(tree, cuda_available=True)
    return cfg


def run_engine(cfg, models=None, timeout=60):
    eng = Engine(cfg, models=models)
    eng.start()
    wait_for(eng.finished, timeout)
    finished = eng.finished()
    eng.stop()
    return eng, finished
