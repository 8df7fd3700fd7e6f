"""The `vidar` command as a user runs it, in subprocesses."""

import signal
import subprocess
import sys
import time

import yaml

from tests.conftest import free_port, write_clip

VIDAR = [sys.executable, "-m", "engine.cli"]


def test_offline_run_exits_zero_and_subscribe_prints_results(tmp_path):
    clip = write_clip(tmp_path / "c.mp4", 30)
    port = free_port()
    cfg = {"streams": [{"id": "clip", "url": str(clip), "mode": "offline"}],
           "models": {"vit": {"name": "test_vit", "weights": "random", "max_batch": 4}},
           "publish": {"endpoint": f"tcp://127.0.0.1:{port}", "min_subscribers": 1},
           "metrics": {"enabled": False}, "status": {"interval_s": 0.5}, "control": {"enabled": False}}
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
    assert "streams.0.moed: unknown key; allowed here: id, loop, mode, pools, url" in run.stderr


def test_demo_runs_until_ctrl_c_and_prints_status():
    """`make run`'s command, on the shipped demo config, stopped with SIGINT."""
    port = free_port()
    p = subprocess.Popen(VIDAR + ["run", "configs/demo.yaml", "--set", f"publish.endpoint=tcp://127.0.0.1:{port}",
                                  "--set", "metrics.enabled=false", "--set", "status.interval_s=1", "--set", f"control.endpoint=tcp://127.0.0.1:{free_port()}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = []
    t_end = time.monotonic() + 90
    while len(status) < 2 and time.monotonic() < t_end:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("[classify] demo"):
            status.append(line)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert len(status) == 2, (status, err)
    assert "out" in status[1] and "p50" in status[1] and "dropped:" in status[1]
