"""A second engine on a machine starts with default config (issue 42): a port left at its default that is taken
moves to a free one, said at start with the key and the endpoint bound; a port the config sets that is taken is
still a configuration error naming the key (engine/security/ports.py)."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack

import pytest
import yaml

from engine.config import build_config
from engine.core.engine import Engine
from engine.errors import BindError
from engine.models.noop import NoopRunner
from engine.publish.client import Subscriber
from engine.view.server import ViewThread
from tests.support.control import ControlServer
from tests.support.net import free_port

DEFAULTS = {"publish.endpoint": "tcp://127.0.0.1:5556", "control.endpoint": "tcp://127.0.0.1:5557",
            "metrics.port": "http://127.0.0.1:9108/metrics", "view.port": "http://127.0.0.1:8080/"}
PORTS = {"publish.endpoint": 5556, "control.endpoint": 5557, "metrics.port": 9108, "view.port": 8080}


def _hold(port: int) -> socket.socket | None:
    """Take 127.0.0.1:port as another engine would; None when another program holds it already (taken either way)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    s.listen()
    return s


def _config(key: str, explicit: bool):
    """An engine whose `key` is left at its default (or set to it, `explicit`) and every other socket on a free
    port or off; no streams (the control socket keeps it running)."""
    tree = {"streams": [], "models": {"classify": None, "noop": {}}, "ingest": {"processes": 0},
            "publish": {"endpoint": f"tcp://127.0.0.1:{free_port()}"},
            "control": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
            "metrics": {"enabled": key == "metrics.port"}, "view": {"enabled": key == "view.port"}}
    section, field = key.split(".")
    tree[section].pop(field, None)
    if explicit:
        tree[section][field] = PORTS[key] if field == "port" else DEFAULTS[key]
    cfg, _ = build_config(tree, cuda_available=False)
    return cfg


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def _engine_beside_a_holder(stack: ExitStack, key: str, explicit: bool) -> Engine:
    """An engine (not started) whose `key` port another socket holds; both closed with `stack`."""
    held = _hold(PORTS[key])
    if held is not None:
        stack.callback(held.close)
    eng = Engine(_config(key, explicit=explicit), models={"noop": NoopRunner()})
    stack.callback(eng.stop)
    return eng


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", list(DEFAULTS))
def test_a_default_port_that_is_taken_moves_and_is_said(key, caplog):
    with ExitStack() as stack:
        eng = _engine_beside_a_holder(stack, key, explicit=False)
        with caplog.at_level(logging.WARNING):
            eng.start()
            view = ViewThread(eng) if key == "view.port" else None
        if view is not None:
            stack.callback(view.close)
        moved = view.server.moved if view is not None else eng.moved_ports[0]
        assert eng.moved_ports == ([] if view is not None else [moved])  # only the default that was taken moved
        bound = view.url if view is not None else eng.endpoints()[key]
        assert (moved.key, moved.wanted, moved.bound) == (key, DEFAULTS[key], bound)
        assert f":{PORTS[key]}" not in bound
        note = (f"{key}: its default {DEFAULTS[key]} is taken (another vidar on this machine?): listening on "
                f"{bound} instead (set {key} to choose)")
        assert note in [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if key == "control.endpoint":  # what a client passes reaches this engine
            srv = ControlServer(eng)
            stack.callback(srv.close)
            from engine.control.control_socket import request
            assert request(bound, {"op": "list"}, timeout=10)["ok"]
        elif key in ("metrics.port", "view.port"):
            assert _get(bound) == 200


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", list(DEFAULTS))
def test_a_port_the_config_sets_that_is_taken_fails_naming_the_key(key):
    """Set, even to the default's own number, a port is the user's: it never moves."""
    with ExitStack() as stack:
        eng = _engine_beside_a_holder(stack, key, explicit=True)
        with pytest.raises(BindError) as err:
            eng.start()
            if key == "view.port":
                stack.callback(ViewThread(eng).close)
    assert err.value.key == key and str(err.value).startswith(f"{key}: cannot ")
    assert f"set {key} to a free port" in str(err.value), str(err.value)


# -- two `vidar run` side by side -------------------------------------------------------------------
class _Run:
    """`vidar run CONFIG` with its stdout read on a thread (status lines never fill the pipe)."""

    def __init__(self, path, log):
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", str(path)], stdout=subprocess.PIPE,
                                     stderr=log, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_started(self, timeout: float) -> dict[str, str]:
        """The endpoints the banner says (key -> endpoint), once the live view's line is out."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end and self.proc.poll() is None:
            if any(line.startswith("vidar: live view on ") for line in self.lines):
                break
            time.sleep(0.1)
        text = "\n".join(self.lines)
        found = re.search(r"^vidar: results on (\S+), control on (\S+), metrics on (\S+)$", text, re.M)
        view = re.search(r"^vidar: live view on (\S+)$", text, re.M)
        assert found and view, text
        return dict(zip(DEFAULTS, [*found.groups(), view.group(1)]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.mark.timeout(180)
def test_two_engines_with_default_config_start_side_by_side(tmp_path):
    """The same config twice, its ports left at their defaults: the second engine starts, every port it found
    taken is said loudly with what clients pass, and a subscriber, a control client and a scraper reach it."""
    path = tmp_path / "default-ports.yaml"
    path.write_text(yaml.safe_dump({"streams": [{"id": "s", "url": "synthetic://shapes?size=64x48&fps=10"}],
                                    "models": {"noop": {}}, "ingest": {"processes": 0}}))
    with ExitStack() as stack:
        runs = []
        for name in ("first", "second"):
            log = stack.enter_context(open(tmp_path / f"{name}.log", "w"))
            run = _Run(path, log)
            stack.callback(run.stop)
            runs.append((run, run.wait_started(120)))
        (first, at1), (second, at2) = runs
        assert set(at1.values()).isdisjoint(at2.values()), (at1, at2)
        for run, at in runs:
            text = "\n".join(run.lines)
            assert re.search(r"^vidar: budget\.latency_ms: 150 ms \(auto, on the CPU: ", text, re.M), text
            for key, where in at.items():
                moved = re.search(rf"^vidar: PORT MOVED: {re.escape(key)}: its default {re.escape(DEFAULTS[key])} "
                                  rf"is taken .*: listening on {re.escape(where)} instead", text, re.M)
                # an endpoint is its default, or it moved and said so (another program may hold a default)
                assert (where == DEFAULTS[key]) != bool(moved), (key, where, text)
        for key, where in at1.items():
            if where == DEFAULTS[key]:
                assert at2[key] != where  # the first engine holds it: the second moved
        hints = {"publish.endpoint": f"vidar subscribe {at2['publish.endpoint']}",
                 "control.endpoint": f"vidar control list --endpoint {at2['control.endpoint']}"}
        for key, hint in hints.items():
            assert at2[key] == DEFAULTS[key] or hint in "\n".join(second.lines)
        # the second engine's clients, with what its start said
        with Subscriber(at2["publish.endpoint"], ["noop.s"]) as sub:
            assert sub.recv(timeout=30) is not None
        listed = subprocess.run([sys.executable, "-m", "engine.cli", "control", "list", "--endpoint",
                                 at2["control.endpoint"]], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "s" in json.loads(listed.stdout)["streams"], listed.stderr
        assert _get(at2["metrics.port"]) == 200 and _get(at2["view.port"]) == 200
        assert first.proc.poll() is None and second.proc.poll() is None
    for run, _ in runs:
        assert run.proc.returncode == 0, (tmp_path / "first.log").read_text()[-2000:]
