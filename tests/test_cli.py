"""The `vidar` command as a user runs it, in subprocesses."""

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from engine.testing.clips import write_clip
from tests.support.net import free_port

VIDAR = [sys.executable, "-m", "engine.cli"]
JOBS = max(2, len(os.sched_getaffinity(0)))


def test_offline_run_exits_zero_and_subscribe_prints_results(tmp_path):
    clip = write_clip(tmp_path / "c.mp4", 30)
    port = free_port()
    cfg = {"streams": [{"id": "clip", "url": str(clip), "mode": "offline"}],
           "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 4}},
           "publish": {"endpoint": f"tcp://127.0.0.1:{port}", "min_subscribers": 1},
           "metrics": {"enabled": False}, "view": {"port": 0}, "status": {"interval_s": 0.5}, "control": {"enabled": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sub = subprocess.Popen(VIDAR + ["subscribe", f"tcp://127.0.0.1:{port}", "--count", "31", "--timeout", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = subprocess.run(VIDAR + ["run", str(path)], capture_output=True, text=True, timeout=120)
    out, err = sub.communicate(timeout=30)
    assert run.returncode == 0, run.stderr
    assert "RANDOM weights" in run.stderr
    assert "30/30 frames" in run.stdout  # the progress line of the finished stream
    lines = out.splitlines()
    assert sub.returncode == 0 and len(lines) == 31, err
    assert lines[0].startswith("event.clip started")
    assert lines[1].startswith("classify.clip seq=") and "[random weights]" in lines[1]


def test_config_typo_exits_2_and_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("streams:\n  - id: cam1\n    url: synthetic://shapes\n    moed: live\n")
    run = subprocess.run(VIDAR + ["run", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "streams.0.moed: unknown key; allowed here: decode, id, loop, max_interval, mode, pools, url" in run.stderr


def test_demo_runs_until_ctrl_c_and_prints_status():
    """`make run`'s command, on the shipped demo config, stopped with SIGINT."""
    port = free_port()
    p = subprocess.Popen(VIDAR + ["run", "configs/demo.yaml", "--set", f"publish.endpoint=tcp://127.0.0.1:{port}",
                                  "--set", "metrics.enabled=false", "--set", "status.interval_s=1", "--set", f"control.endpoint=tcp://127.0.0.1:{free_port()}",
                                  "--set", "view.port=0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status, view = [], []
    t_end = time.monotonic() + 90
    # until a line shows published results: on a loaded machine the demo's 150 ms budget drops its first
    # frames, until the degradation ladder samples the stream down to what fits
    while not (len(status) >= 2 and "p50" in status[-1]) and time.monotonic() < t_end:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("[classify] demo"):
            status.append(line)
        if line.startswith("vidar: live view on http://127.0.0.1:"):
            view.append(line)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert len(status) >= 2 and len(view) == 1, (status, err)  # make run says where to watch
    assert "out" in status[-1] and "p50" in status[-1] and "dropped:" in status[-1], status
    assert "max_batch auto -> " in out + err, err  # the demo's batch size is chosen at start, and said


def _start_error_cases(tmp_path):
    """(case id, config patch, env, the key the one line must name) for errors found while starting."""
    import socket

    import torch
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    other = tmp_path / "other.pth"
    torch.save({"weight": torch.zeros(3)}, other)
    sam = {"config": "sam2.1_hiera_t", "image_size": 256, "checkpoint": "random"}
    cases = [
        ("unknown model", {"models": {"classify": {"name": "vit_hyuge_patch16"}}}, {}, "models.classify.name"),
        ("unknown sam2 config", {"models": {"sam2": dict(sam, config="sam2.1_hiera_xl")}}, {}, "models.sam2.config"),
        ("missing weights", {"models": {"classify": {"weights": str(tmp_path / "nope.pth")}}}, {},
         "models.classify.weights"),
        ("mismatched weights", {"models": {"classify": {"weights": str(other)}}}, {}, "models.classify.weights"),
        ("sam2 pretrained offline", {"models": {"sam2": dict(sam, checkpoint="pretrained")}},
         {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}, "models.sam2.checkpoint"),
        ("busy publish port", {"publish": {"endpoint": f"tcp://127.0.0.1:{busy_port}"}}, {}, "publish.endpoint"),
        ("busy metrics port", {"metrics": {"enabled": True, "port": busy_port}}, {}, "metrics.port"),
        ("busy control port", {"control": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{busy_port}"}}, {},
         "control.endpoint"),
        ("missing curve key", {"security": {"curve": True, "server_key": str(tmp_path / "none.key_secret"),
                                            "authorized_clients": str(tmp_path)}, "view": {"token": "auto"}}, {},
         "security.server_key"),
        ("busy view port", {"view": {"port": busy_port}}, {}, "view.port"),
    ]
    if not torch.cuda.is_available():
        cases.append(("cuda without a gpu", {"models": {"classify": {"device": "cuda"}}}, {}, "models.classify.device"))
    return busy, cases


def test_every_start_error_exits_2_with_one_line_naming_the_key(tmp_path):
    """Errors found while starting are configuration errors: exit 2 and one line that names the key and
    says what to do, never exit 3 (engine dead) as the first engine did for a bad model or weights file."""
    import os
    busy, cases = _start_error_cases(tmp_path)
    procs = []
    try:
        for i, (case, patch, env, key) in enumerate(cases):
            cfg = {"streams": [{"id": "s", "url": "synthetic://shapes?size=64x64&fps=10"}],
                   "models": {"classify": {"name": "test_vit", "weights": "random", "device": "cpu"}},
                   "publish": {"endpoint": f"tcp://127.0.0.1:{free_port()}"},
                   "metrics": {"enabled": False}, "view": {"port": 0}, "control": {"enabled": False}}
            for section, value in patch.items():
                if section == "models":
                    cfg["models"] = {k: ({**cfg["models"].get(k, {}), **v} if k in cfg["models"] else v)
                                     for k, v in {**({} if "sam2" in value else cfg["models"]), **value}.items()}
                else:
                    cfg[section] = value
            path = tmp_path / f"c{i}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            # as many at a time as there are cores: each one is a core's work (torch's import, a model); more
            # side by side only slow each other down
            while sum(p.poll() is None for _, _, p in procs) >= JOBS:
                time.sleep(0.05)
            procs.append((case, key, subprocess.Popen(VIDAR + ["run", str(path)], stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE, text=True, env={**os.environ, **env})))
        for case, key, p in procs:
            out, err = p.communicate(timeout=240)
            lines = [line for line in err.splitlines() if line.startswith("vidar: ")]
            assert p.returncode == 2, (case, p.returncode, err[-2000:])
            assert len(lines) == 1 and lines[0].startswith(f"vidar: {key}"), (case, err[-2000:])
    finally:
        busy.close()
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.timeout(420)
def test_gpu_check_dry_run_passes_on_the_cpu(tmp_path):
    """Every part of benchmarks/gpu_check.py run CPU-sized (tiny model, small clip), each in its own time-boxed
    subprocess as on the device, so a device session does not spend its minutes on a script that fails
    before the first CUDA call. It proves nothing about the GPU paths."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--dry-run"], cwd=root,
                       capture_output=True, text=True, timeout=400, env=dict(os.environ, OUT=str(tmp_path)))
    assert r.returncode == 0 and "gpu_check --dry-run: every part ran on the CPU" in r.stdout, \
        (r.stdout[-2000:], r.stderr[-2000:])
    lines = [json.loads(x) for x in (tmp_path / "gpu_check_dry.jsonl").read_text().splitlines()]
    done = {x["name"]: x["rc"] for x in lines if x["part"] == "part_done"}
    assert done == {"probe": 0, "tests": 0, "vit": 0, "nvdec": 0, "preprocess": 0, "live": 0, "offline": 0, "sam2": 0,
                    "ingest_gpu": 0}
    # issue 33 item 8 (CUDA IPC slots, not run on a GPU): threads and the fake CUDA; every offered frame is counted
    # once, no event is made per frame (3 per slot: 2 x 2 streams x 4 slots), and no GPU figure is claimed
    ing = next(x for x in lines if x["part"] == "ingest_gpu")
    assert ing["done"] > 0 and ing["offered"] >= ing["done"] + ing["shed_at_source"] + ing["superseded"], ing
    assert ing["events_created"] == 3 * 2 * 2 * 4 and ing["contexts"].startswith("no GPU"), ing
    # issue 43 item 1: the children's code ran (in threads), its pools opened from the CudaSlots bytes the device's
    # processes get (wire.encode, then wire.decode there), and each child's memory report reached the result
    assert ing["mem_reports"] == 2, ing
    assert lines[1]["part"] == "probe"  # first: the open questions (issue 32 item 7)
    probe = {x["question"]: x for x in lines if x["part"] == "probe"}
    ipc = {"ipc_record_seen", "ipc_dead_recorder", "ipc_consumer_death_leak", "context_memory",
           "busy_contexts_latency", "event_create_48_threads", "nvdec_torn_frames"}
    assert set(probe) == {"setup", "caps", "params", "oversize", "event_wait", "syncs_classify", "syncs_sam2",
                          "stream"} | ipc, probe
    assert not any(x["gpu"] or "error" in x for x in probe.values()), probe
    # issue 43 item 5: the seven device questions, each through its own process and time box, with stand-ins on the
    # CPU: said, and no answer that reads as a GPU figure (every answer field dry_*)
    for q in ipc:
        answers = set(probe[q]) - {"part", "t", "question", "gpu", "s", "note"}
        assert probe[q]["note"].startswith("no GPU") and answers and all(a.startswith("dry_") for a in answers), \
            probe[q]
    assert probe["ipc_record_seen"]["dry_premise_holds"] is True, probe["ipc_record_seen"]
    assert probe["nvdec_torn_frames"]["dry_mismatched"] == 0 < probe["nvdec_torn_frames"]["dry_frames"], \
        probe["nvdec_torn_frames"]
    # no GPU: said; the NVDEC questions' code ran against the fake decoder, the GPU-only ones were skipped
    assert probe["caps"]["note"].startswith("no GPU") and set(probe["caps"]["caps"]) == {
        "H264", "HEVC", "AV1", "VP8", "VP9", "MPEG2"}, probe["caps"]
    assert probe["params"]["frames_without_params"] == 0 < probe["params"]["frames_params_before_first_slice"]
    assert probe["oversize"]["create"] == "ok" and "Resolution not supported" in probe["oversize"]["decode"]
    assert probe["stream"]["echoes_tickets"] is True
    assert all(probe[q]["skipped"].startswith("no GPU") for q in ("event_wait", "syncs_classify", "syncs_sam2"))
    live = next(x for x in lines if x["part"] == "live")
    assert live["published"] > 0 and live["decode"]["device"] == "cpu" and live["process"] == "engine"
    # the same live run with the streams in ingest processes (ingest.gpu_transport shm), side by side
    shm = next(x for x in lines if x["part"] == "live" and x["transport"] == "shm")
    assert shm["published"] > 0 and shm["process"].startswith("ingest-"), shm
    # max_batch auto, said with the estimate it chose on
    assert f"batch {live['max_batch']}'s estimate is" in live["why"] and "1" in live["warmup_ms"]
    sam2 = {x["part"]: x for x in lines if x["part"].startswith("sam2_")}
    assert set(sam2) == {"sam2_render", "sam2_encoder", "sam2_attention", "sam2_meta", "sam2_fidelity",
                         "sam2_profile", "sam2_offline", "sam2_live", "sam2_capacity"}
    # the masks' two encoders agree (on the CPU: the torch ops a GPU runs, and pycocotools)
    assert sam2["sam2_render"]["equal"] is True, sam2["sam2_render"]
    assert sam2["sam2_render"]["device_rle_ms"] > 0 and sam2["sam2_render"]["host_rle_ms"] > 0, sam2["sam2_render"]
    # the profile says where a step's time goes: each timed sub-stage and one tracking call per step
    assert {"memory_attention", "mask_decoder", "memory_encoder"} <= set(sam2["sam2_profile"]["stage_ms"]), \
        sam2["sam2_profile"]
    assert sam2["sam2_profile"]["tracking_calls"], sam2["sam2_profile"]
    # float32 on the CPU, `exact` preprocessing as Meta's loader: vidar's masks are Meta's (1.0 seen)
    fid = {x["preprocess"]: x for x in lines if x["part"] == "sam2_fidelity"}
    assert fid["exact"]["pairs"] == 12 and fid["exact"]["iou_min"] >= 0.99 and fid["exact"]["meets_target"], fid
    assert fid["fast"]["pairs"] == 12 and fid["fast"]["meets_target"] is None, fid
    # the encoder alone at batch 1, 2, 4, graphed and eager (both eager on the CPU: no graphs there)
    enc = sam2["sam2_encoder"]
    assert enc["graph_sizes"] == [] and set(enc["graph_ms"]) == set(enc["eager_ms"]) == {"1", "2", "4"}, enc
    # the padded, masked memory attention equals one sam2 call per bank layout (float32 on the CPU)
    att = sam2["sam2_attention"]
    assert att["filling_layouts"] == 4 and att["max_abs_diff"] <= 1e-4, att
    assert all(att[k] > 0 for k in ("full_ms", "filling_masked_ms", "filling_grouped_ms", "all_masked_ms")), att
    # live at 30 FPS (the device adds 60: the same code), followed by what it served; percentiles of the window's
    # results only
    live = [x for x in lines if x["part"] == "sam2_live"]
    assert [x["fps"] for x in live] == [30] and all(x["published"] > 0 for x in live), live
    assert all(x["p99_ms"] >= x["p50_ms"] > 0 for x in live), live
    cap = [x for x in lines if x["part"] == "sam2_capacity"]
    assert [(x["fps"], list(x["goodput_at"])) for x in cap] == [(30, ["1"])], cap
    # the many-stream offline run with the tracking stage's graphs on and off; no graph replays on the CPU.
    # (Two streams of 6 frames on the CPU may not overlap long enough for a common window: only 1 x 2 has
    # to give a number.)
    offline = [x for x in lines if x["part"] == "sam2_offline"]
    assert [(x["streams"], x["tracking_graphs"], x["max_batch"]) for x in offline] == \
        [(1, True, 4), (2, False, 2)], offline  # the device runs 8 streams four ways; the dry run each knob once
    assert offline[0]["ms_per_stream_frame"] > 0 and all(x["graphed_steps"] == 0 for x in offline)
