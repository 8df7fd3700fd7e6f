"""vidar beside what a user would run instead, on the same RTSP cameras: Roboflow Inference (InferencePipeline)
and Ultralytics (LoadStreams), a model that does nothing, live streams from a real server (issue 42 item 1).

The cameras: Debian's GStreamer RTSP server (benchmarks/peers/rtsp_server.py, /usr/bin/python3) serving
pre-encoded H.264 clips as they are (benchmarks/peers/clips.py: testsrc2 with noise, keyint 60, zerolatency),
paced in real time, over RTSP/TCP; the same mounts for every system. Cases: 16 and 48 x 320x240@60, 8 x
1280x720@30 by default; `--cases` takes any `<N>x<res><fps>` (res: 180p, 240p, 360p, 720p, 1080p), e.g. the
no-collapse curve 8x240p60,16x240p60,32x240p60,48x240p60,64x240p60 (the server gets as many mounts per clip
as the largest case that reads it; a curve's delivered fps by stream count is checked for falls). Systems, one
at a time on the machine, interleaved (every system of a case back to back, the order reversed every other
repeat):
  vidar               `vidar run CONFIG`: one live stream per URL, `models: {noop: {per_frame_s: 0}}` (no model),
                      free ports, everything else default; results read by a subscriber process
                      (benchmarks/peers/vidar_sink.py) as a user would
  vidar_b500          the same with `budget.latency_ms: 500`
  inference_default   InferencePipeline.init_with_custom_logic, max_fps=None, the rest default
  inference_tuned     the same in its documented max-throughput mode for several live sources
                      (video_processing_mode="auto", VIDEO_SOURCE_ADAPTIVE_BACKPRESSURE=True)
  ultralytics         load_inference_source(list.streams), as model.predict(stream=True) builds it
The peers run in their own venv (.venv-peers: scripts/install-peers.sh), their pins differ from vidar's.

Each run: start the system; wait until every stream delivered a frame to its sink; warm up; then a window
between two marks. Per run and, medians over repeats, per cell:
  delivered fps       distinct frames the sink counted in the window / its length; and over N x fps offered
  latency p50/p99     vidar: subscriber receive - t_capture; Inference: sink time - frame_timestamp (taken before
                      grab()); Ultralytics: none travels with a frame (n/m)
  age p50/p99         vidar: a frame's age by the camera's clock, estimated from its pts (vidar_sink.py): what
                      latency would be if t_capture were the moment the server sent the frame
  CPU cores           the system's whole process tree (vidar: engine, ingest processes, multiprocessing's
                      helpers), user+system s / window; vidar's subscriber apart (shown as +x)
  CPU ms per frame    (tree + subscriber) / delivered frames
  intake fps          frames taken off the network, delivered or not (vidar's seq, Inference's frame_id)
  lag behind live     the bytes waiting in the RTSP connections (`ss`: reader Recv-Q + server Send-Q) over
                      the clip's byte rate = seconds of video not yet read, per stream, at the window's start
                      and end, and its growth per minute (also in MB); no system's own timestamps see this
                      backlog (vidar stamps t_capture when a packet leaves the demuxer), vidar's age does.
A run is verified when its window lasted what was asked (no machine-wide stall), every stream delivered frames in
the window, no frame came twice or out of order, and the system shut down cleanly. The JSON (rewritten after every run) keeps every run; the table is printed.

    python benchmarks/bench_peers.py                       # everything, ~45 min; needs a quiet machine
    python benchmarks/bench_peers.py --cases 16x240p60 --window-s 10 --warmup-s 3 --repeats 1   # a smoke run
    python benchmarks/bench_peers.py --cases 8x240p60,16x240p60,32x240p60,48x240p60,64x240p60 \
        --systems vidar,inference_default                 # no collapse as cameras are added
Not part of `make test`; `make bench` runs it (scripts/install-peers.sh first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from peers import measure  # noqa: E402
from peers.clips import ClipSpec, describe, make_clip  # noqa: E402
from peers.procs import Child, stop  # noqa: E402

from engine.testing.net import free_port  # noqa: E402

PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"
SERVER_PY = "/usr/bin/python3"  # Debian's: GStreamer's GI bindings exist only there
CLIP_DIR = ROOT / "bench-out" / "peers"
CLIP_SECONDS = 180


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="all",
                    help=f"comma-separated, of {', '.join(measure.CASES)} (default all) or any <N>x<res><fps> of "
                         f"{', '.join(measure.RESOLUTIONS)}, e.g. 64x240p60")
    ap.add_argument("--systems", default="all", help=f"comma-separated, of {', '.join(measure.SYSTEMS)} (default all)")
    ap.add_argument("--window-s", type=float, default=60.0, help="the measured window (default 60)")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="after every stream delivered, before the window")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the schedule (default 2)")
    ap.add_argument("--start-timeout-s", type=float, default=120.0,
                    help="longest wait for every stream's first frame (Inference opens 48 streams in ~35 s)")
    ap.add_argument("--pause-s", type=float, default=5.0, help="between runs: the server's media torn down")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_peers.json")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the cells into this PNG")
    ap.add_argument("--logs", type=Path, default=CLIP_DIR / "logs",
                    help="each run's logs, configs and URL lists (default bench-out/peers/logs, not in git)")
    ap.add_argument("--peers-python", type=Path, default=PEERS_PY, help="the peers' venv python")
    args = ap.parse_args(argv)
    try:
        args.cases = measure.parse_cases(args.cases)
        args.systems = measure.parse_choice(args.systems, measure.SYSTEMS, "systems")
    except ValueError as err:
        ap.error(str(err))
    if args.repeats < 1 or args.window_s <= 0 or args.warmup_s < 0:
        ap.error(f"--repeats >= 1, --window-s > 0, --warmup-s >= 0; got {args.repeats}, {args.window_s}, "
                 f"{args.warmup_s}")
    # the clips do not loop: a stream must not end inside the window (Inference opens streams one by one, so
    # its first stream's clip has run for the start-up already; 50 s of margin for it)
    if args.warmup_s + args.window_s > CLIP_SECONDS - 50:
        ap.error(f"--warmup-s + --window-s = {args.warmup_s + args.window_s:g} s: at most {CLIP_SECONDS - 50} "
                 f"(the clips last {CLIP_SECONDS} s)")
    return args


def vidar_config(urls: list[str], budget_ms: Optional[float], ports: dict[str, int]) -> dict[str, Any]:
    """One live stream per URL, the null pool without its default 10 ms sleep, free ports (a vidar already on
    the machine holds the defaults), everything else default."""
    cfg: dict[str, Any] = {
        "streams": [{"id": f"c{i}", "url": u, "mode": "live"} for i, u in enumerate(urls)],
        "models": {"noop": {"per_frame_s": 0}},
        "publish": {"endpoint": f"tcp://127.0.0.1:{ports['publish']}"},
        "control": {"endpoint": f"tcp://127.0.0.1:{ports['control']}"},
        "metrics": {"port": ports["metrics"]},
        "view": {"port": ports["view"]},
    }
    if len(urls) > 64:  # vidar's default max_streams: left alone up to it, raised only where a case needs more
        cfg["max_streams"] = len(urls)
    if budget_ms is not None:
        cfg["budget"] = {"latency_ms": budget_ms}
    return cfg


def server_argv(port: int, clips: dict[str, Path], cases: list[str]) -> list[str]:
    """The RTSP server's command line: for each clip, as many mounts as the largest case that reads it."""
    need: dict[str, int] = {}
    for name in cases:
        case = measure.case(name)
        need[case.prefix] = max(need.get(case.prefix, 0), case.streams)
    argv = [SERVER_PY, str(HERE / "peers" / "rtsp_server.py"), "--port", str(port)]
    for prefix, n in need.items():
        argv += ["--mount", f"{prefix}:{n}:{clips[prefix]}"]
    return argv


def start_server(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=f, text=True, stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()  # READY <port>, or EOF when it failed
    if not line.startswith("READY"):
        stop(proc, signal.SIGTERM, 5)
        raise RuntimeError(f"the RTSP server did not start: {log.read_text()[-2000:]}")
    return proc


# -- one run ---------------------------------------------------------------------------------------
class Launched:
    """A system running: the process whose tree is measured, the sink that counts, vidar's subscriber."""

    def __init__(self, measured: subprocess.Popen, sink: Child, vidar_log: Optional[Any] = None) -> None:
        self.measured, self.sink, self.vidar_log = measured, sink, vidar_log
        self.metrics_port: Optional[int] = None

    @property
    def is_vidar(self) -> bool:
        return self.measured is not self.sink.proc


def launch(system: str, urls: list[str], base: Path, args: argparse.Namespace) -> Launched:
    if system.startswith("vidar"):
        ports = {k: free_port() for k in ("publish", "control", "metrics", "view")}
        cfg = vidar_config(urls, 500.0 if system == "vidar_b500" else None, ports)
        cfg_path = base.with_suffix(".vidar.yaml")
        cfg_path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
        ids = ",".join(s["id"] for s in cfg["streams"])
        sink = Child([sys.executable, str(HERE / "peers" / "vidar_sink.py"), cfg["publish"]["endpoint"], ids],
                     base.with_suffix(".sink.log"), cwd=ROOT)
        if sink.wait_event("started", 30) is None:
            sink.close()
            raise RuntimeError(f"vidar's subscriber did not start: {base.with_suffix('.sink.log')}")
        log = open(base.with_suffix(".vidar.log"), "w")
        try:
            vidar = subprocess.Popen([str(Path(sys.executable).with_name("vidar")), "run", str(cfg_path)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
        except OSError as err:
            sink.close()
            raise RuntimeError(f"cannot start vidar: {err}") from err
        out = Launched(vidar, sink, log)
        out.metrics_port = ports["metrics"]
        return out
    urls_path = base.with_suffix(".streams")
    urls_path.write_text("\n".join(urls) + "\n")
    script = "peer_ultralytics.py" if system == "ultralytics" else "peer_inference.py"
    argv = [str(args.peers_python), str(HERE / "peers" / script), str(urls_path)]
    if system.startswith("inference"):
        argv.append(system.removeprefix("inference_"))
    sink = Child(argv, base.with_suffix(".peer.log"), cwd=ROOT)
    return Launched(sink.proc, sink)


def sample(run: Launched, server_pid: int, rtsp_port: int) -> dict[str, Any]:
    """CPU of the measured tree, vidar's subscriber and the server; the machine; the TCP backlog; vidar's
    counters. Taken right after a mark, so both describe the same moment."""
    s: dict[str, Any] = {"t": time.time(), "tree": measure.tree_cpu(run.measured.pid),
                         "server": measure.tree_cpu(server_pid), "busy_s": measure.machine_busy_s(),
                         "backlog": measure.tcp_backlog(rtsp_port)}
    if run.is_vidar:
        s["sub"] = measure.tree_cpu(run.sink.pid)
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10).read()
            s["metrics"] = measure.parse_metrics(body.decode())
        except OSError as err:
            s["metrics_error"] = str(err)
    return s


def shut_down(run: Launched) -> dict[str, Any]:
    """vidar: SIGINT (it drains, then exits), then its subscriber. A peer: `stop` (it terminates its pipeline
    or closes its loader and exits)."""
    t0 = time.monotonic()
    if run.is_vidar:
        rc = stop(run.measured, signal.SIGINT, 40)
        stop_s = time.monotonic() - t0
        time.sleep(1.0)  # the streams' eos events are the last messages: let them reach the subscriber
        final = run.sink.command("stop", "final", 15)
        run.sink.close(15)
        run.vidar_log.close()
        return {"exit": rc, "stop_s": round(stop_s, 2), "final": final}
    final = run.sink.command("stop", "final", 30)
    stopped = run.sink.wait_event("stopped", 60)
    rc = run.sink.close(20)
    return {"exit": rc, "stop_s": round(time.monotonic() - t0, 2), "final": final, "stopped": stopped}


def run_one(system: str, case_name: str, rep: int, ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    case = measure.case(case_name)
    urls = [f"rtsp://127.0.0.1:{ctx['rtsp_port']}/{case.prefix}_{i}" for i in range(case.streams)]
    base = ctx["logs"] / f"{system}_{case_name}_r{rep}"
    rec: dict[str, Any] = {"system": system, "case": case_name, "rep": rep, "start": now_utc(), "notes": []}
    t0 = time.monotonic()
    try:
        run = launch(system, urls, base, args)
    except RuntimeError as err:  # this run is lost, not the schedule
        rec["error"] = str(err)
        return rec
    try:
        started = run.sink.wait_event("allseen", args.start_timeout_s)
        rec["startup_s"] = round(time.monotonic() - t0, 1)
        if started is None:
            raise RuntimeError(f"not every stream delivered a frame within {args.start_timeout_s:g} s "
                               f"(exit {run.measured.poll()}; logs {base}.*)")
        time.sleep(args.warmup_s)
        m1, s1 = run.sink.command("mark", "mark"), sample(run, ctx["server_pid"], ctx["rtsp_port"])
        time.sleep(args.window_s)
        m2, s2 = run.sink.command("mark", "mark"), sample(run, ctx["server_pid"], ctx["rtsp_port"])
        if m1 is None or m2 is None:
            raise RuntimeError(f"the sink did not answer a mark (exit {run.measured.poll()}; logs {base}.*)")
    except RuntimeError as err:
        rec["error"] = str(err)
    finally:  # also on Ctrl-C: nothing this run started outlives it
        rec["shutdown"] = shut_down(run)
    if "error" in rec:
        return rec
    rec["summary"] = measure.summarize_window(case, m1, m2, s1, s2, ctx["clip_bytes_per_s"][case.prefix])
    rec["window_asked_s"] = args.window_s
    final = rec["shutdown"].get("final") or m2  # the final report has vidar's eos events too
    rec["sink_extra"] = final.get("extra") or {}
    rec["verified"] = verify(rec)
    return rec


#: a window longer than asked by this factor is not verified (verify)
STALL_OVERRUN = 1.05


def verify(rec: dict[str, Any]) -> bool:
    """Outputs checked before the numbers count: frames from every stream in the window, none twice or out of
    order, every process of the tree there at both samples. A shutdown that was not clean is noted."""
    s, problems = rec["summary"], []
    if not s["per_stream_fps_min_med_max"] or s["per_stream_fps_min_med_max"][0] <= 0:
        problems.append("a stream delivered nothing in the window")
    if s["not_newer_in_window"]:
        problems.append(f"{s['not_newer_in_window']} frames not newer than their stream's last")
    if s["tree_processes_exited"]:
        problems.append(f"processes of the tree exited in the window (their CPU lost): {s['tree_processes_exited']}")
    asked = rec.get("window_asked_s")
    if asked and s["window_s"] > asked * STALL_OVERRUN:
        # the driver slept longer than it asked: the whole machine stopped (a VM's stolen time, seen here once for
        # ~1.9 s), the server's frames with it, and the sink's camera-clock age counts the stall as the system's
        problems.append(f"the window took {s['window_s']:g} s for {asked:g} s asked: the machine stalled")
    rec["notes"] += problems
    if rec["shutdown"]["exit"] != 0:  # noted, not a reason to distrust the window's numbers
        rec["notes"].append(f"did not shut down cleanly: exit {rec['shutdown']['exit']}")
    return not problems


# -- the whole benchmark ---------------------------------------------------------------------------
def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """What ran: the machine, vidar's commit, the peers' versions (read without importing them)."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "engine", "streams"], capture_output=True, text=True)
    if args.peers_python.exists():  # a vidar-only run needs no peers environment (check_ready)
        peers = subprocess.run([str(args.peers_python), "-c", "import importlib.metadata as m, json; print(json.dumps("
                                "{p: m.version(p) for p in ('inference', 'ultralytics', 'opencv-python', 'torch')}))"],
                               capture_output=True, text=True)
    else:
        peers = subprocess.CompletedProcess([], 1, "", f"{args.peers_python} missing")
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), None)
    return {"vidar_commit": commit, "engine_or_streams_modified": bool(dirty.stdout.strip()),
            "peers": json.loads(peers.stdout) if peers.returncode == 0 else peers.stderr[-500:],
            "python": platform.python_version(), "cpus": os.cpu_count(), "cpu_model": cpu_model,
            "load1_at_start": round(os.getloadavg()[0], 2)}


def check_ready(args: argparse.Namespace) -> None:
    """Fail now, not minutes into the schedule."""
    peers = [s for s in args.systems if not s.startswith("vidar")]
    if peers and not args.peers_python.exists():
        raise SystemExit(f"bench_peers: {args.peers_python} missing for {peers}: run bash scripts/install-peers.sh")
    gi = subprocess.run([SERVER_PY, "-c", "import gi; gi.require_version('GstRtspServer', '1.0')"],
                        capture_output=True, text=True)
    if gi.returncode:
        raise SystemExit(f"bench_peers: no GStreamer RTSP server for {SERVER_PY}: run bash scripts/install-rtsp-deps.sh"
                         f" ({gi.stderr.strip()[-300:]})")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    check_ready(args)
    logs = args.logs
    logs.mkdir(parents=True, exist_ok=True)
    cases = [measure.case(c) for c in args.cases]
    specs = {c.prefix: ClipSpec(c.width, c.height, c.fps, CLIP_SECONDS) for c in cases}
    clips = {prefix: make_clip(spec, CLIP_DIR) for prefix, spec in specs.items()}
    clip_info = {prefix: describe(path) for prefix, path in clips.items()}
    # what ran is read before the server starts: a failure there (a peers venv missing) leaves nothing running
    record: dict[str, Any] = {"date": now_utc(), "args": {k: str(v) if isinstance(v, Path) else v
                                                          for k, v in vars(args).items()},
                              **environment(args), "clips": clip_info, "runs": []}
    rtsp_port = free_port()
    server = start_server(server_argv(rtsp_port, clips, args.cases), logs / "rtsp_server.log")
    ctx = {"rtsp_port": rtsp_port, "server_pid": server.pid, "logs": logs,
           "clip_bytes_per_s": {p: c["bytes_per_s"] for p, c in clip_info.items()}}
    plan = measure.schedule(args.cases, args.systems, args.repeats)
    try:
        for i, (rep, case, system) in enumerate(plan):
            print(f"{datetime.now():%H:%M:%S} [{i + 1}/{len(plan)}] {system} {case} rep {rep}", flush=True)
            rec = run_one(system, case, rep, ctx, args)
            record["runs"].append(rec)
            print("  " + one_line(rec), flush=True)
            write(record, args.out)
            if i + 1 < len(plan):
                time.sleep(args.pause_s)
    finally:
        record["rtsp_server_exit"] = stop(server, signal.SIGTERM, 10)
    record["cells"] = measure.cells(record["runs"])
    record["ratios"] = measure.ratios(record["cells"])
    record["curve"] = measure.curve(record["cells"])
    write(record, args.out)
    print()
    print(measure.format_table(record["cells"], record["ratios"], record["curve"]))
    print(f"\nwrote {args.out}")
    if args.plot:
        from peers.plot import plot_cells
        print(f"wrote {plot_cells(record, args.plot)}")
    return 0


def one_line(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return f"ERROR {rec['error']}"
    s = rec["summary"]
    age = "" if s.get("age_p99_ms") is None else f", age p99 {s['age_p99_ms']:.1f} ms"
    return (f"{s['delivered_fps']:.0f} fps ({s['fraction_of_offered']:.2f}), p50/p99 "
            f"{measure.fmt(s['lat_p50_ms'], '.1f')}/{measure.fmt(s['lat_p99_ms'], '.1f')} ms{age}, "
            f"{s['cpu_cores']:.2f} cores, {measure.fmt(s['cpu_ms_per_frame'], '.2f')} ms/frame, "
            f"lag {s['lag_s'][0]:.2f} -> {s['lag_s'][1]:.2f} s ({s['lag_growth_s_per_min']:+.1f} s/min, "
            f"{s['backlog_growth_mb_per_min']:+.2f} MB/min), start-up {rec['startup_s']} s"
            + ("" if rec["verified"] else f"  NOT VERIFIED: {rec['notes']}"))


def write(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
