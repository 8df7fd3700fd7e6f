"""benchmarks/bench_peers.py's pure parts, on canned numbers: its arguments, the interleaved schedule, what two
marks and two samples come to (fps, CPU per frame, the lag from the TCP backlog), the medians and the
vidar/Inference ratios, any <N>x<res><fps> case and the no-collapse curve over them, a frame's age by the
camera's clock, the RTSP server's mounts and launch line, and a vidar config vidar itself accepts.
No peer is installed or run here, no server started (the benchmark is `make bench`'s, not `make test`'s)."""

from __future__ import annotations

import argparse

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bp():
    added = str(ROOT / "benchmarks") not in sys.path
    mod = _load("bench_peers", ROOT / "benchmarks" / "bench_peers.py")  # puts benchmarks/ on sys.path
    yield mod
    if added:
        sys.path.remove(str(ROOT / "benchmarks"))
    for name in [n for n in sys.modules if n == "peers" or n.startswith("peers.")]:
        sys.modules.pop(name)


@pytest.fixture(scope="module")
def m(bp):
    return bp.measure


def test_defaults_are_the_full_benchmark(bp):
    a = bp.parse_args([])
    assert a.cases == ["16x240p60", "48x240p60", "8x720p30"]
    assert a.systems == ["vidar", "vidar_b500", "inference_default", "inference_tuned", "ultralytics"]
    assert (a.window_s, a.warmup_s, a.repeats) == (60.0, 10.0, 2)
    assert a.out == ROOT / "benchmarks" / "results" / "bench_peers.json"
    assert a.logs == ROOT / "bench-out" / "peers" / "logs" and a.plot is None  # logs stay out of git


@pytest.mark.parametrize("argv, message", [
    (["--cases", "16x240p60,12x4kp60"], r"--cases: unknown \['12x4kp60'\]; choose from 16x240p60, 48x240p60"),
    (["--systems", "vidar,deepstream"], r"--systems: unknown \['deepstream'\]"),
    (["--systems", ","], r"--systems: unknown"),
    (["--repeats", "0"], r"--repeats >= 1"),
    (["--window-s", "120", "--warmup-s", "20"], r"--warmup-s \+ --window-s = 140 s: at most 130"),
])
def test_bad_arguments_are_refused_naming_the_choices(bp, capsys, argv, message):
    with pytest.raises(SystemExit):
        bp.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_any_count_of_a_known_resolution_is_a_case(bp, m):
    """The issue's no-collapse curve runs as cases of their own; a name is made canonical before duplicates go."""
    a = bp.parse_args(["--cases", "8x240p60,16x240p60,32x240p60,48x240p60,64x240p60,08x240p60",
                       "--systems", "vidar,inference_default"])
    assert a.cases == ["8x240p60", "16x240p60", "32x240p60", "48x240p60", "64x240p60"]
    c = m.case("64x240p60")
    assert (c.streams, c.width, c.height, c.fps, c.offered_fps) == (64, 320, 240, 60, 3840)
    assert c.prefix == m.CASES["48x240p60"].prefix  # one clip and one set of mounts for the whole curve
    assert (m.case("4x1080p25").width, m.case("4x1080p25").height) == (1920, 1080)
    assert m.case("16x240p60") is m.CASES["16x240p60"]


@pytest.mark.parametrize("name", ["0x240p60", "300x240p60", "8x240p0", "8x240p500", "8x241p60", "8x240", "x240p60",
                                  "8 x240p60"])
def test_a_case_out_of_range_or_of_an_unknown_size_is_refused(bp, capsys, name):
    with pytest.raises(SystemExit):
        bp.parse_args(["--cases", name])
    assert re.search(r"--cases: unknown \[.*\]; .* or any <N>x<res><fps> of 180p, 240p", capsys.readouterr().err)


def test_the_server_gets_mounts_for_the_largest_case_of_the_curve(bp):
    argv = bp.server_argv(8554, {"s240p60": Path("/c/240.mp4")}, ["8x240p60", "64x240p60", "32x240p60"])
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"] == ["s240p60:64:/c/240.mp4"]


def test_a_short_run_names_its_cases_and_systems_once_in_order(bp):
    a = bp.parse_args(["--cases", "8x720p30,16x240p60,8x720p30", "--systems", "ultralytics,vidar",
                       "--window-s", "10", "--warmup-s", "3", "--repeats", "1"])
    assert a.cases == ["8x720p30", "16x240p60"] and a.systems == ["ultralytics", "vidar"]


def test_the_schedule_interleaves_and_reverses_every_other_repeat(m):
    plan = m.schedule(["16x240p60", "8x720p30"], ["vidar", "inference_tuned", "ultralytics"], 2)
    assert plan[:3] == [(1, "16x240p60", "vidar"), (1, "16x240p60", "inference_tuned"),
                        (1, "16x240p60", "ultralytics")]
    assert [s for r, c, s in plan if r == 2 and c == "8x720p30"] == ["ultralytics", "inference_tuned", "vidar"]
    assert len(plan) == 12 and len(set(plan)) == 12


def _mark(t, counts, last_id=None, lat=(None, None), not_newer=0):
    return {"t": t, "count": counts, "last_id": last_id or {}, "lat_p50_ms": lat[0], "lat_p99_ms": lat[1],
            "not_newer": not_newer}


def _sample(t, tree, busy, recvq, sendq=0, sub=None, server=None, metrics=None):
    s = {"t": t, "tree": tree, "server": server or {9: 0.0}, "busy_s": busy,
         "backlog": {"client_recvq_bytes": recvq, "server_sendq_bytes": sendq, "conns": 2}}
    if sub is not None:
        s["sub"] = sub
    if metrics is not None:
        s["metrics"] = metrics
    return s


def test_a_window_comes_to_fps_cpu_per_frame_and_lag(m):
    """2 streams of 240p60 for 10 s: 1,100 frames delivered (55/s of 120 offered), the tree's CPU 12 s (an
    ingest process started in the window counts from 0) plus the subscriber's 0.5 s; the backlog grows from
    0.1 MB to 1.6 MB, at 50 kB/s per stream of clip: 1 s -> 16 s behind per stream, 90 s more per minute."""
    case = m.CASES["16x240p60"]
    case2 = type(case)(2, 320, 240, 60)
    m1 = _mark(100.0, {"c0": 1000, "c1": 2000}, {"c0": 1010, "c1": 2010})
    m2 = _mark(110.0, {"c0": 1600, "c1": 2500}, {"c0": 1610, "c1": 2610}, lat=(5.0, 15.0))
    s1 = _sample(100.0, {1: 10.0, 2: 5.0}, busy=50.0, recvq=50_000, sendq=50_000, sub={7: 1.0},
                 metrics={"vidar_frames_published_total": 3000.0, "vidar_qos_level": 0.0})
    s2 = _sample(110.0, {1: 15.0, 2: 11.0, 3: 1.0}, busy=66.0, recvq=1_500_000, sendq=100_000, sub={7: 1.5},
                 server={9: 0.4}, metrics={"vidar_frames_published_total": 4100.0, "vidar_qos_level": 1.0})
    out = m.summarize_window(case2, m1, m2, s1, s2, clip_bytes_per_s=50_000)
    assert out["delivered_fps"] == 110.0 and out["fraction_of_offered"] == pytest.approx(110 / 120, abs=1e-3)
    assert out["per_stream_fps_min_med_max"] == [50.0, 55.0, 60.0]
    assert out["intake_fps"] == 120.0  # numbered frames advanced 600 + 600: taken in, delivered or not
    assert out["cpu_cores"] == pytest.approx(1.2) and out["subscriber_cpu_cores"] == pytest.approx(0.05)
    assert out["cpu_ms_per_frame"] == pytest.approx((12.0 + 0.5) / 10 / 110 * 1e3, abs=1e-3)
    assert out["rtsp_server_cpu_cores"] == pytest.approx(0.04)
    assert out["other_load_cores"] == pytest.approx((16.0 - 12.0 - 0.5 - 0.4) / 10)
    assert out["lag_s"] == [1.0, 16.0] and out["lag_end_s"] == 16.0
    assert out["lag_growth_s_per_min"] == pytest.approx(90.0)
    assert out["backlog_mb"] == [0.1, 1.6] and out["backlog_growth_mb_per_min"] == pytest.approx(9.0)
    assert out["vidar_counters_fps"] == {"vidar_frames_published_total": 110.0}
    assert out["vidar_qos_level_end"] == 1.0
    assert out["lat_p50_ms"] == 5.0 and out["tree_processes_exited"] == []


def test_a_process_that_left_the_tree_is_listed_and_its_cpu_not_counted(m):
    case = type(m.CASES["16x240p60"])(1, 320, 240, 60)
    out = m.summarize_window(case, _mark(0.0, {"0": 0}), _mark(1.0, {"0": 60}),
                             _sample(0.0, {1: 1.0, 2: 3.0}, 0.0, 0), _sample(1.0, {1: 1.5}, 1.0, 0), 50_000)
    assert out["tree_processes_exited"] == [2] and out["cpu_cores"] == pytest.approx(0.5)
    assert "intake_fps" not in out and out["lat_p50_ms"] is None  # Ultralytics: nothing numbered, no timestamp


def _run(system, case, fps, ms, p50=None, verified=True):
    return {"system": system, "case": case, "verified": verified,
            "summary": {"delivered_fps": fps, "fraction_of_offered": fps / 960, "lat_p50_ms": p50,
                        "lat_p99_ms": None if p50 is None else 3 * p50, "cpu_cores": fps * ms / 1e3,
                        "cpu_ms_per_frame": ms, "subscriber_cpu_cores": 0.05 if system.startswith("vidar") else None}}


def test_cells_are_medians_of_verified_runs_and_the_ratios_pair_like_with_like(m):
    runs = [_run("vidar", "16x240p60", 900, 1.4, 5.0), _run("vidar", "16x240p60", 940, 1.2, 7.0),
            _run("vidar", "16x240p60", 10, 99.0, 1.0, verified=False),
            _run("inference_default", "16x240p60", 920, 0.6, 30.0),
            _run("inference_default", "16x240p60", 930, 0.6, 34.0),
            _run("vidar_b500", "16x240p60", 960, 1.3, 8.0), _run("inference_tuned", "16x240p60", 960, 0.65, 28.0),
            _run("ultralytics", "16x240p60", 850, 0.5)]
    cells = m.cells(runs)
    v = cells["16x240p60"]["vidar"]
    assert (v["n"], v["unverified"], v["delivered_fps"], v["cpu_ms_per_frame"]) == (2, 1, 920, pytest.approx(1.3))
    assert cells["16x240p60"]["ultralytics"]["lat_p50_ms"] is None
    r = m.ratios(cells)["16x240p60"]
    assert r["vidar/inference_default"] == {"delivered_fps": 0.99, "cpu_ms_per_frame": pytest.approx(2.17),
                                            "lat_p50_ms": pytest.approx(0.19), "lat_p99_ms": pytest.approx(0.19)}
    assert r["vidar_b500/inference_tuned"]["cpu_ms_per_frame"] == 2.0
    table = m.format_table(cells, m.ratios(cells))
    vidar = next(line for line in table.splitlines() if "vidar defaults" in line)
    assert "1.19+0.05" in vidar and vidar.endswith("(1 run(s) not verified)")  # cores: the tree + subscriber
    ultra = next(line for line in table.splitlines() if "Ultralytics" in line)
    assert ultra.split()[6:8] == ["n/m", "n/m"]  # no latency for a loader without timestamps


def test_a_window_that_overran_is_not_verified(bp):
    """A machine-wide stall (the driver slept ~1.9 s longer than asked, seen once): the server's frames stop with it
    and the sink's camera-clock age counts the stall as the system's, so the run is left out of the cells, said."""
    def rec(window_s):
        return {"summary": {"window_s": window_s, "per_stream_fps_min_med_max": [29.9, 30.0, 30.0],
                            "not_newer_in_window": 0, "tree_processes_exited": []},
                "window_asked_s": 20.0, "notes": [], "shutdown": {"exit": 0}}
    ok, stalled = rec(20.02), rec(21.91)
    assert bp.verify(ok) and not ok["notes"]
    assert not bp.verify(stalled) and "the machine stalled" in stalled["notes"][0]


def test_what_ran_is_read_without_a_peers_environment(bp, tmp_path):
    """A vidar-only run on a machine without .venv-peers: read before the RTSP server starts, and it must not raise
    (it did, and the server it had started outlived the benchmark)."""
    env = bp.environment(argparse.Namespace(peers_python=tmp_path / "no-such-python"))
    assert "missing" in env["peers"] and env["cpus"] >= 1


def test_the_curve_finds_where_delivered_fps_falls_as_cameras_are_added(m):
    runs = [_run(s, f"{n}x240p60", fps, 1.0) for s, pts in (
        ("vidar", {8: 480, 16: 955, 32: 1900, 48: 1300, 64: 1500}),
        ("inference_default", {8: 480, 16: 960, 32: 1890, 48: 2700, 64: 2650})) for n, fps in pts.items()]
    runs.append(_run("vidar", "8x720p30", 240, 5.0))  # one count of a size: no curve for it
    runs[-1]["summary"]["lag_growth_s_per_min"] = 31.5
    cells = m.cells(runs)
    curve = m.curve(cells)
    assert list(curve) == ["240p60"]
    assert curve["240p60"]["vidar"]["falls_at"] == [48, 64]  # 1,500 at 64 is still below 1,900
    assert curve["240p60"]["inference_default"] == {"delivered_fps": {8: 480, 16: 960, 32: 1890, 48: 2700, 64: 2650},
                                                    "falls_at": [], "no_collapse": True}  # 1.9 % below: noise
    table = m.format_table(cells, m.ratios(cells), curve)
    vidar = next(line for line in table.splitlines() if line.startswith("240p60     vidar defaults"))
    assert vidar.endswith("8: 480, 16: 955, 32: 1,900, 48: 1,300, 64: 1,500  falls at [48, 64]")
    row = next(line for line in table.splitlines() if line.startswith("8x720p30"))
    assert row.split()[-2] == "31.5"  # the lag's growth per minute, the column before `other`


def test_the_table_shows_the_age_by_the_cameras_clock_beside_latency(m):
    run = _run("vidar", "48x240p60", 1200, 1.4, 40.0)
    run["summary"].update(age_p50_ms=9000.0, age_p99_ms=31000.0)
    table = m.format_table(m.cells([run]), {})
    head, _, row = table.splitlines()[:3]
    assert head.split()[6:10] == ["p50", "ms", "p99", "ms"] and head.split()[10:12] == ["age", "p99"]
    assert row.split()[6:9] == ["40.0", "120.0", "31000.0"]  # p50, p99, then the age


def test_the_age_by_the_cameras_clock_sees_a_backlog_latency_does_not(capsys):
    """A server sending from t=100 s: frames read at once are as old as their latency; frames that queued in
    the socket (read later and later, stamped on the way out so latency stays 5 ms) grow older; a new session
    (pts back to 0, or the stream's `connected` event) starts a new anchor."""
    sink = _load("bench_sink_clock", ROOT / "benchmarks" / "peers" / "sink.py")
    clock, start = sink.CameraClock(), 100.0
    assert clock.age("a", 0.0, 0.005, start + 0.0 + 0.005) == pytest.approx(0.005)
    assert clock.age("a", 1.0, 0.004, start + 1.0 + 0.004) == pytest.approx(0.004)  # the freshest yet: new anchor
    assert clock.age("a", 2.0, 0.005, start + 2.0 + 0.505) == pytest.approx(0.505)  # 0.5 s behind the live edge
    assert clock.age("a", 3.0, 0.005, start + 3.0 + 2.005) == pytest.approx(2.005)
    assert clock.age("b", 0.0, 0.003, start + 50.0) == pytest.approx(0.003)  # streams apart
    assert clock.age("a", 0.0, 0.006, start + 60.0) == pytest.approx(0.006)  # pts back: the clip started again
    clock.new_session("a")
    assert clock.age("a", 5.0, 0.007, start + 90.0) == pytest.approx(0.007)


def test_ss_lines_split_into_reader_and_server_backlog(m):
    text = ("0      0      127.0.0.1:45831 127.0.0.1:50974\n"
            "24576  0      127.0.0.1:50974 127.0.0.1:8554\n"       # a reader of our server: its Recv-Q
            "100    0      127.0.0.1:50975 127.0.0.1:8554\n"
            "0      3000   127.0.0.1:8554  127.0.0.1:50974\n"       # the server's side: its Send-Q
            "999    999    127.0.0.1:9000  127.0.0.1:85541\n")       # another port that only starts alike
    assert m.parse_ss(text, 8554) == {"client_recvq_bytes": 24676, "server_sendq_bytes": 3000, "conns": 2}


def test_vidar_metrics_are_summed_over_streams_by_reason(m):
    body = ('# HELP x\nvidar_frames_published_total{pool="noop",stream="c0"} 10\n'
            'vidar_frames_published_total{pool="noop",stream="c1"} 5\n'
            'vidar_frames_dropped_total{pool="noop",reason="deadline",stream="c0"} 3\n'
            'vidar_qos_level{pool="noop"} 2\nvidar_qos_level{pool="other"} 1\nvidar_other_total 7\n')
    assert m.parse_metrics(body) == {"vidar_frames_published_total": 15.0,
                                     "vidar_frames_dropped_total:deadline": 3.0, "vidar_qos_level": 2.0}


def test_the_server_serves_each_clip_unencoded_on_as_many_mounts_as_the_largest_case(bp, tmp_path):
    srv = _load("bench_rtsp_server", ROOT / "benchmarks" / "peers" / "rtsp_server.py")  # no GI needed to load
    clip = tmp_path / "c.mp4"
    line = srv.launch_line(str(clip))
    assert line == (f'( filesrc location="{clip}" ! qtdemux ! h264parse ! rtph264pay name=pay0 pt=96 '
                    f'config-interval=1 )')
    assert "enc" not in line  # no re-encode: the server's cost must stay out of the systems' way
    argv = bp.server_argv(8554, {"s240p60": Path("/c/240.mp4"), "s720p30": Path("/c/720.mp4")},
                          ["16x240p60", "48x240p60", "8x720p30"])
    assert argv[0] == "/usr/bin/python3" and argv[argv.index("--port") + 1] == "8554"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"] == ["s240p60:48:/c/240.mp4",
                                                                          "s720p30:8:/c/720.mp4"]
    assert srv.parse_mount("s240p60:48:/c/a:b.mp4") == ("s240p60", 48, "/c/a:b.mp4")
    with pytest.raises(ValueError, match="PREFIX:N:CLIP with N >= 1"):
        srv.parse_mount("s240p60:0:/c/240.mp4")


@pytest.mark.parametrize("budget_ms", [None, 500.0])
def test_the_vidar_config_is_one_vidar_accepts(bp, budget_ms):
    from engine.config import build_config
    ports = {"publish": 20001, "control": 20002, "metrics": 20003, "view": 20004}
    tree = bp.vidar_config([f"rtsp://127.0.0.1:8554/s240p60_{i}" for i in range(48)], budget_ms, ports)
    cfg, _ = build_config(json.loads(json.dumps(tree)), cuda_available=False)
    assert len(cfg.streams) == 48 and {s.mode for s in cfg.streams} == {"live"}
    assert cfg.models.noop.per_frame_s == 0 and cfg.models.classify is None
    default = type(cfg.budget).model_fields["latency_ms"].default  # whatever vidar's default is: the user's
    assert cfg.budget.latency_ms == (budget_ms or default)  # the default budget stays the default
    assert (cfg.publish.endpoint, cfg.metrics.port, cfg.view.port) == ("tcp://127.0.0.1:20001", 20003, 20004)


@pytest.mark.parametrize("n", [64, 80])
def test_max_streams_is_raised_only_where_a_case_needs_it(bp, n):
    from engine.config import build_config
    ports = {"publish": 20001, "control": 20002, "metrics": 20003, "view": 20004}
    tree = bp.vidar_config([f"rtsp://127.0.0.1:8554/s240p60_{i}" for i in range(n)], None, ports)
    assert tree.get("max_streams") == (None if n <= 64 else n)  # vidar's default (64) left alone up to it
    cfg, _ = build_config(json.loads(json.dumps(tree)), cuda_available=False)
    assert len(cfg.streams) == n


def test_the_sink_tally_counts_distinct_frames_and_says_allseen_once(capsys):
    sink = _load("bench_sink", ROOT / "benchmarks" / "peers" / "sink.py")
    t = sink.Tally(["a", "b"])
    t.add("a", 5, 10.0)
    t.add("a", 5, 11.0)  # not newer: counted apart, not delivered
    t.add("b", None, None)
    t.add("b", None, None)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(sink.PREFIX)]
    assert [json.loads(ln[len(sink.PREFIX):])["event"] for ln in lines] == ["allseen"]
    r = t.report()
    assert r["count"] == {"a": 1, "b": 2} and r["not_newer"] == 1 and r["last_id"] == {"a": 5}
    assert r["lat_p50_ms"] == 10.0 and r["lat_n"] == 1
    assert t.report()["lat_n"] == 0  # latencies are per window: a report starts the next
