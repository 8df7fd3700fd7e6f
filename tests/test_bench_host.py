"""benchmarks/bench_host.py's accounting (issue 33 item 9): CPU per published frame by role (ingest threads, or
ingest processes summed), the crossing probe, the GIL share read from py-spy's output, the targets and the
no-collapse curve, and the processes mode skipped (not crashed on) in a tree without it. One test runs the
benchmark's real scenario child (an engine with the null pool and a subscriber process) for about a second; two
run the h264 source (issue 42 item 2: a libx264 clip in memory, looped through PyAV's demux, decode and RGB
conversion), its raw decode and its `--quick` path on 2 streams."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bh():
    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "benchmarks" / "bench_host.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_host"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_host", None)


@pytest.mark.parametrize("name, role", [("source-cam1", "ingest"), ("engine-core", "core"),
                                        ("worker-noop-0", "workers"), ("output-noop", "output"),
                                        ("publisher", "publisher"), ("ingest-io", "ingest_io"), (None, "native"),
                                        ("MainThread", "main"), ("metrics-http", "other")])
def test_threads_get_their_role(bh, name, role):
    assert bh.thread_group(name) == role


@pytest.mark.parametrize("cmd, parent_is_engine, role", [
    ("python -c from multiprocessing.resource_tracker import main;main(7)", True, "aux"),
    ("python -c from multiprocessing.forkserver import main; main(9, 10)", True, "aux"),
    # a process the forkserver forked carries its command line, one level lower: an ingest process
    ("python -c from multiprocessing.forkserver import main; main(9, 10)", False, "ingest"),
    ("python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5) --multiprocessing-fork", True,
     "ingest")])
def test_processes_below_the_engine_get_their_role(bh, cmd, parent_is_engine, role):
    assert bh.process_role(cmd, parent_is_engine) == role


@pytest.mark.parametrize("comm, role", [("av:h264:df0", "ingest"), ("av:h264:sw1", "ingest"),
                                        ("ZMQbg/IO/0", "native"), ("python", "native"), ("", "native")])
def test_threads_python_did_not_start_go_by_their_kernel_name(bh, comm, role):
    """FFmpeg's decoder threads (threads mode, h264 source) are the ingest's work, not ZeroMQ's."""
    assert bh.native_group(comm) == role


def _sample(t, cpu_s, groups, procs, ingested, published):
    return {"t": t, "sample_s": 0.0, "cpu_s": cpu_s, "groups": Counter(groups), "procs": procs,
            "ingested": ingested, "published": published, "dropped": Counter(), "failed": Counter(), "batches": 0,
            "batched": 0, "machine_busy_s": t, "load1": 0.0, "sub": {"received": published, "cpu_s": 0.0,
                                                                      "p50_ms": 1.0, "p99_ms": 2.0}}


def test_ingest_processes_cpu_is_summed_per_published_frame(bh):
    """Two ingest processes (one started inside the window), the resource tracker (aux: not the engine's
    work), one that exited (listed, its CPU lost); the engine process's threads by role."""
    proc = lambda role, cpu: {"role": role, "cpu_s": cpu, "cmd": "x"}  # noqa: E731
    a = _sample(10.0, 5.0, {"core": 1.0, "publisher": 0.5}, {11: proc("ingest", 2.0), 12: proc("aux", 0.1),
                                                               13: proc("ingest", 1.0)}, 1000, 900)
    b = _sample(12.0, 6.0, {"core": 1.5, "publisher": 0.7}, {11: proc("ingest", 2.6), 12: proc("aux", 0.4),
                                                               14: proc("ingest", 0.2)}, 2000, 1900)
    out = bh.window_stats(a, b, {"kind": "live", "streams": 8, "fps": 60})
    us = out["role_cpu_us_per_published"]
    assert us["ingest"] == pytest.approx((0.6 + 0.2) / 1000 * 1e6)
    assert us["core"] == pytest.approx(500.0) and us["publisher"] == pytest.approx(200.0)
    assert us["aux"] == pytest.approx(300.0)
    assert out["cpu_cores"] == pytest.approx((1.0 + 0.8) / 2)  # the engine process + ingest, aux left out
    assert out["core_process_cores"] == pytest.approx(0.5)
    assert {"pid": 13, "role": "ingest", "exited": True} in out["processes"]
    assert out["published_over_ingested"] == pytest.approx(1.0)
    assert out["published_over_offered"] == pytest.approx(500 / 480)
    assert out["published_over_admitted"] == pytest.approx(1.0)  # a tree without FrameRing.at_source: all admitted


def test_frames_dropped_at_the_source_are_not_admitted(bh):
    a = _sample(10.0, 5.0, {"core": 1.0}, {}, 1000, 900)
    b = _sample(12.0, 6.0, {"core": 1.5}, {}, 2000, 1400)
    a["at_source"], b["at_source"] = 100, 600  # 500 of the 1,000 ingested in the window never copied
    out = bh.window_stats(a, b, {"kind": "live", "streams": 8, "fps": 60})
    assert out["published_over_ingested"] == pytest.approx(0.5)
    assert out["published_over_admitted"] == pytest.approx(1.0) and out["admitted_fps"] == pytest.approx(250.0)


def test_gil_share_counts_samples_with_a_holder_over_intervals(bh):
    raw = ("thread (1): engine-core;step (engine/core/loop.py:9) 120\n"
           "thread (2): publisher;_run (engine/publish/publisher.py:3) 30\n"
           "thread (3): source-s0;_pump (engine/frames/ingest.py:1) 50\n")
    assert bh.gil_share(raw, rate=100, seconds=4) == pytest.approx(0.5)
    assert bh.gil_share(raw, rate=100, seconds=4, errors=150) == pytest.approx(0.8)  # errors are not intervals
    prof = bh.summarize_profile(raw, "gil", 100, 4, frames=1000)
    assert prof["by_group"]["core"] == pytest.approx(1200.0)  # 120 samples of 10 ms over 1,000 frames, in us


def _row(name, mode, run, **kw):
    base = {"published_fps": 0.0, "ingested_fps": 1.0, "published_over_ingested": 1.0, "published_over_offered": 1.0,
            "cpu_cores": 1.0, "cpu_us_per_published": 100.0, "crossing_p50_ms": 0.1, "crossing_p99_ms": 1.0,
            "latency_p99_ms": 5.0, "role_cpu_us_per_published": {"core": 50.0}, "verified": True}
    return {"scenario": name, "mode": mode, "run": run, "pass": "timing", **base, **kw}


def test_targets_need_every_run_and_the_curve_finds_a_fall(bh):
    rows = [_row("live 48x240p@60", "processes", 1, published_fps=2700, published_over_ingested=0.99,
                 crossing_p99_ms=1.5, crossing_from="t_written"),
            _row("live 48x240p@60", "processes", 2, published_fps=2590, published_over_ingested=0.99,
                 crossing_p99_ms=1.9, crossing_from="t_written"),
            _row("live 48x240p@60", "threads", 1, published_fps=1200, published_over_ingested=0.5, crossing_p99_ms=30)]
    for mode, pub in (("threads", {8: 480, 16: 960, 32: 1500, 64: 700}), ("processes", {8: 480, 16: 950, 32: 1920,
                                                                                       64: 2600})):
        rows += [_row(f"live {n}x240p@60", mode, 1, published_fps=v) for n, v in pub.items()]
    record = {"rows": rows}
    bh.summarize(record)
    met = {(t["mode"], t["key"]): t["met"] for t in record["targets"]}
    assert met[("processes", "published_fps")] is False  # one run of two at 2,590
    assert met[("processes", "published_over_ingested")] and met[("processes", "crossing_p99_ms")]
    assert not met[("threads", "crossing_p99_ms")]
    assert record["comparison"]["live 48x240p@60"]["published_ratio"] == pytest.approx(2645 / 1200)
    assert record["curve"]["threads"]["falls_at"] == [48, 64]  # 1,200 and 700 after 1,500
    assert record["curve"]["processes"]["no_collapse"]  # 2,600 after 2,645: within the tolerance


@pytest.mark.parametrize("commit_p99, capture_p99, met", [(1.0, 1.5, True), (1.0, 3.0, None), (2.5, 3.0, False)])
def test_a_crossing_measured_from_the_cores_commit_is_only_a_bound(bh, commit_p99, capture_p99, met):
    """Without the ingest's write stamp the crossing (from the core's commit) leaves the socket hop out: met
    only when capture -> scheduler (an upper bound) meets 2 ms, missed when even the lower bound does."""
    rows = [_row("live 48x240p@60", "processes", 1, crossing_p99_ms=commit_p99, crossing_from="t_decoded",
                 capture_to_scheduler_p99_ms=capture_p99)]
    got = [t for t in bh.targets(rows) if t["key"] == "crossing_p99_ms"]
    assert [t["met"] for t in got] == [met] and got[0]["bound"] == "lower"


def _args(tmp_path, **kw):
    base = dict(quick=True, profile=False, modes="threads,processes", processes="auto", gil=False, repeats=1,
                warmup=1.0, window=1.5, max_batch=8, budget_ms=5000.0, rate=100, box=30.0,
                out=str(tmp_path / "bh.json"), only="no scenario has this name", source="synthetic", clip_s=2)
    return argparse.Namespace(**{**base, **kw})


def test_processes_mode_is_skipped_with_a_reason_where_the_tree_lacks_it(bh, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bh, "ingest_key_supported", lambda: False)
    monkeypatch.setattr(bh, "engine_info", lambda: {"engine_file": "x", "commit": None, "cpus": 2, "cpu_model": "y"})
    bh.main_bench(_args(tmp_path))
    record = json.loads((tmp_path / "bh.json").read_text())
    assert record["modes"] == ["threads"] and "ingest" in record["skipped_modes"]["processes"]
    assert "processes mode: not in this tree" in capsys.readouterr().out
    # and a tree with the key gets `ingest.processes` set per mode (0: threads)
    sc = {"kind": "live", "streams": 2, "size": "240p", "fps": 60, "max_batch": 8}
    assert bh.engine_tree(bh.with_mode(sc, "processes", 3, True), "tcp://x:1")["ingest"] == {"processes": 3}
    assert bh.engine_tree(bh.with_mode(sc, "threads", "auto", True), "tcp://x:1")["ingest"] == {"processes": 0}
    assert "ingest" not in bh.engine_tree(bh.with_mode(sc, "threads", "auto", False), "tcp://x:1")


def _modes():
    spec = importlib.util.spec_from_file_location("_bh_modes", ROOT / "benchmarks" / "bench_host.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return ["threads"] + (["processes"] if mod.ingest_key_supported() else [])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", _modes())
def test_a_real_scenario_reports_every_role_and_the_crossing(bh, mode):
    """The benchmark's own child run on a real engine (null pool, 2 x 240p60, a subscriber process): the
    ingest role is the source threads' CPU with threads, the ingest processes' with processes (no source
    thread left in the engine), the core's is there, frames crossed and were counted, nothing leaked."""
    sc = bh.with_mode({"kind": "live", "streams": 2, "size": "240p", "fps": 60, "max_batch": 8, "warmup_s": 0.5,
                       "window_s": 1.0}, mode, 1, bh.ingest_key_supported())
    res = bh.run_child(sc, timeout_s=90)  # its own process, as the benchmark runs it: its children are its own
    assert res["verified"] and res["published_fps"] > 0, res
    roles = res["role_cpu_us_per_published"]
    assert roles["ingest"] > 0 and roles["core"] > 0, roles
    assert res["crossing_frames"] > 0 and math.isfinite(res["crossing_p99_ms"]) and res["crossing_p50_ms"] >= 0
    in_process = res["thread_cpu_cores"].get("ingest", 0.0)
    if mode == "threads":
        assert in_process > 0 and not [p for p in res["processes"] if p["role"] == "ingest"]
    else:
        assert in_process == 0 and [p for p in res["processes"] if p["role"] == "ingest"]


def test_the_h264_source_loops_one_clip_per_stream_and_is_removed_afterwards(bh):
    """Every stream of an h264 scenario is the clip made for its size and rate, `loop: true`, live; the clips'
    folder is in memory where the machine has /dev/shm and is gone after the block, even when it raised."""
    scs = [{"kind": "live", "streams": 2, "size": "240p", "fps": 60, "max_batch": 8, "source": "h264"},
           {"kind": "raw", "streams": 1, "size": "240p", "fps": 60, "window_s": 0.2, "source": "h264"}]
    with pytest.raises(RuntimeError, match="inside"):
        with bh.h264_clips(scs, 1) as source:
            folder = Path(source["dir"])
            assert source["kind"] == "h264" and list(source["clips"]) == ["240p@60"]  # one clip for both
            assert scs[0]["clip"] == scs[1]["clip"] and Path(scs[0]["clip"]).parent == folder
            if Path("/dev/shm").is_dir():
                assert str(folder).startswith("/dev/shm/") and source["filesystem"] == "tmpfs"
            tree = bh.engine_tree(scs[0], "tcp://127.0.0.1:1")
            assert [(s["url"], s["mode"], s["loop"]) for s in tree["streams"]] == [(scs[0]["clip"], "live", True)] * 2
            raw = bh.run_raw(scs[1])  # the clip's demux + decode + RGB alone, then with the slot copies
            assert all(raw[k]["fps"] > 0 for k in ("render", "render_copy", "render_copy_x8")), raw
            raise RuntimeError("inside")
    assert not folder.exists()
    with bh.h264_clips([{**scs[0], "source": "synthetic"}], 1) as source:
        assert source == {"kind": "synthetic"}  # nothing made


@pytest.mark.timeout(90)
def test_the_quick_path_with_the_h264_source_splits_cpu_by_role(bh, tmp_path, monkeypatch, capsys):
    """`--quick --source h264` cut to one scenario of 2 x 240p60: the streams decode in ingest processes
    (where the tree has them) as RTSP streams do; the per-role split, published/offered and the source are in
    the JSON and printed; the clips' folder is gone afterwards. ~10 s on a quiet machine."""
    mode = "processes" if bh.ingest_key_supported() else "threads"
    monkeypatch.setattr(bh, "CURVE", (2, 64))  # --quick runs the curve's first count: 2 streams, not 8
    bh.main_bench(_args(tmp_path, source="h264", clip_s=2, modes=mode, only="live 2x240p@60"))
    record = json.loads((tmp_path / "bh.json").read_text())
    assert record["source"]["kind"] == "h264" and not Path(record["source"]["dir"]).exists()
    (row,) = record["rows"]
    assert row["spec"]["source"] == "h264" and row["verified"], row
    assert row["offered_fps"] == 120 and 0 < row["published_over_offered"] <= 1.05
    roles = row["role_cpu_us_per_published"]
    assert roles["ingest"] > 0 and roles["core"] > 0, roles
    ingest_procs = [p for p in row["processes"] if p["role"] == "ingest"]
    if mode == "processes":  # decoded there, not in the engine process
        assert ingest_procs and row["thread_cpu_cores"].get("ingest", 0.0) == 0
    entry = record["comparison"]["live 2x240p@60"][mode]
    assert entry["published_over_offered"] == row["published_over_offered"] and entry["role_cpu_us_per_published"]
    out = capsys.readouterr().out
    assert "source: h264 clips" in out and "pub/off" in out
