"""`vidar cluster up / run / status / down` as a user types them, on this machine: a head that declares
one GPU (the engine runs on the CPU), an offline stream run to its end through the cluster, exit 0.

`vidar cluster down` runs `ray stop`, which stops every Ray process of this machine: this module runs
after tests/test_cluster.py (file order), whose cluster is gone by then."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.support.net import free_port

pytestmark = pytest.mark.timeout(900)  # Ray's processes start slowly on a busy 2-core machine

VIDAR = [sys.executable, "-m", "engine.cli"]


@pytest.fixture
def head(tmp_path):
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("VIDAR_REQUIRE_RAY") == "1":
            pytest.fail("VIDAR_REQUIRE_RAY=1 but Ray is not installed (pip install -e '.[cluster]')", pytrace=False)
        pytest.skip("needs Ray (pip install -e '.[cluster]')")
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "RAY_TMPDIR": tmp}
    port = free_port()
    up = subprocess.run(VIDAR + ["cluster", "up", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
                                 "--num-gpus", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert up.returncode == 0, up.stderr[-2000:]
    assert "RAY_health_check_period_ms=500" in up.stdout  # the fast failure detection is what `up` adds
    yield f"127.0.0.1:{port}", env
    subprocess.run(VIDAR + ["cluster", "down", "--address", f"127.0.0.1:{port}"], capture_output=True, text=True,
                   timeout=300, env=env)
    shutil.rmtree(tmp, ignore_errors=True)


def test_up_run_status_down(head, tmp_path):
    address, env = head
    r = subprocess.run(VIDAR + ["cluster", "status", "--address", address], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "no vidar cluster runs" in r.stderr  # nothing runs yet: said, not a traceback
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "streams: [{id: clip, url: 'synthetic://shapes?size=64x48&fps=30&frames=40', mode: offline}]\n"
        "models: {classify: {name: test_vit, weights: random, max_batch: 2, device: cpu}}\n"
        "metrics: {enabled: false}\nstatus: {interval_s: 1}\n"
        # two engines asked of a node with one GPU: the second is reported, never waited for
        f"cluster: {{engines_per_node: 2, publish: {{endpoint: 'tcp://127.0.0.1:{free_port()}'}}, "
        f"control: {{endpoint: 'tcp://127.0.0.1:{free_port()}'}}}}\n")
    r = subprocess.run(VIDAR + ["cluster", "run", str(cfg), "--address", address], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "cluster results on tcp://127.0.0.1:" in r.stdout
    assert "[cluster] clip" in r.stdout  # status lines name the stream and its engine
    assert "-1: not started: the node has 1 GPU, 1 engine(s) of 1 GPU fit" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(VIDAR + ["cluster", "drain", "nope", "--address", address], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "no vidar cluster runs" in r.stderr  # `run` ended: it stopped what it started
    # the head gone (here: stopped): status says it cannot reach it, and where the limit is written down
    r = subprocess.run(VIDAR + ["cluster", "down", "--address", address], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(VIDAR + ["cluster", "status", "--address", address], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "cannot reach the Ray head" in r.stderr and "known limits" in r.stderr, r.stderr[-2000:]
