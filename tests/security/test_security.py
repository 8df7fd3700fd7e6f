"""G8: CURVE with an allow-list. An allow-listed client receives; an unknown key and a plaintext
client receive nothing; keys are never logged. Default binds are loopback."""

import logging
import shutil

import pytest

from engine.publish.client import Subscriber
from engine.config import EngineConfig, build_config
from engine.control.control_socket import request
from engine.core.engine import Engine
from engine.errors import ConfigError
from engine.security.keys import create_keys
from engine.models.noop import NoopRunner
from tests.support.control import ControlServer, with_control
from tests.support.engines import engine_config


@pytest.fixture
def keys(tmp_path):
    create_keys(str(tmp_path / "k"))
    create_keys(str(tmp_path / "intruder"))
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(tmp_path / "k" / "client.key", allowed / "client.key")
    return tmp_path


def test_curve_allow_list(keys, endpoint, caplog):
    k = keys / "k"
    cfg = engine_config([{"id": "cam1", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        budget={"latency_ms": 500},
                        security={"curve": True, "server_key": str(k / "server.key_secret"),
                                  "authorized_clients": str(keys / "allowed")})
    cfg, ctl = with_control(cfg)
    with caplog.at_level(logging.DEBUG):
        eng = Engine(cfg, models={"classify": NoopRunner()})
        eng.start()
        server = ControlServer(eng)
        try:
            good = Subscriber(endpoint, ["classify."], curve=(str(k / "client.key_secret"), str(k / "server.key")))
            bad = Subscriber(endpoint, ["classify."], curve=(str(keys / "intruder" / "client.key_secret"),
                                                         str(k / "server.key")))
            plain = Subscriber(endpoint, ["classify."])
            assert good.recv(5)["stream"] == "cam1"
            assert bad.recv(1.5) is None and plain.recv(0.5) is None
            assert request(ctl, {"op": "list"}, curve=(str(k / "client.key_secret"), str(k / "server.key")))["ok"]
            with pytest.raises(TimeoutError):
                request(ctl, {"op": "list"}, timeout=1.0)
            for s in (good, bad, plain):
                s.close()
        finally:
            server.close()
            eng.stop()
    secrets = [line.split('"')[1] for f in k.glob("*.key_secret") for line in f.read_text().splitlines()
               if "secret-key" in line or "public-key" in line]
    assert secrets and not any(sec in caplog.text for sec in secrets)


@pytest.mark.parametrize("security, message", [
    ({"curve": True}, "needs security.server_key and security.authorized_clients"),
])
def test_curve_config_errors(security, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"streams": [{"id": "a", "url": "x.mp4"}], "security": security}, cuda_available=True)


def test_missing_key_file_names_the_key(tmp_path, endpoint):
    cfg = engine_config([{"id": "a", "url": "synthetic://shapes"}], endpoint,
                        security={"curve": True, "server_key": str(tmp_path / "nope.key_secret"),
                                  "authorized_clients": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"security.server_key: '.*nope.key_secret' not found; create keys"):
        Engine(cfg, models={"classify": NoopRunner()}).start()


def test_default_binds_are_loopback():
    cfg = EngineConfig.model_validate({"streams": [{"id": "a", "url": "x.mp4"}]})
    for endpoint in (cfg.publish.endpoint, cfg.control.endpoint):
        assert endpoint.startswith("tcp://127.0.0.1:")
    assert cfg.metrics.host == "127.0.0.1"
