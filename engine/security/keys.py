"""ZeroMQ CURVE for the publisher and the control socket, with an allow-list of client keys.

`vidar keys DIR` writes a server and a client certificate pair (pyzmq's `zmq.auth`). The engine
loads the server's secret certificate, and pyzmq's ZAP authenticator admits only clients whose
public certificate is in `security.authorized_clients`. Unknown keys and plaintext clients fail
the handshake and receive nothing. Keys are never logged: only file names are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from engine.errors import ConfigError

log = logging.getLogger("vidar.security")


def _load(path: str, key: str, secret: bool) -> tuple[bytes, Optional[bytes]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}: {path!r} not found; create keys with `vidar keys DIR`")
    try:
        public, secret_key = zmq.auth.load_certificate(str(p))
    except Exception as err:  # pyzmq raises ValueError/OSError on a bad file
        raise ConfigError(f"{key}: {path!r} is not a ZeroMQ certificate ({type(err).__name__})") from None
    if secret and not secret_key:
        raise ConfigError(f"{key}: {path!r} holds no secret key; use the .key_secret file")
    return public, secret_key


class Curve:
    """Server side: an authenticator on the engine's context, and socket configuration."""

    def __init__(self, ctx: zmq.Context, server_key: str, authorized_clients: str):
        self.public, self.secret = _load(server_key, "security.server_key", secret=True)
        if not Path(authorized_clients).is_dir():
            raise ConfigError(f"security.authorized_clients: {authorized_clients!r} is not a directory of "
                              "client public certificates (*.key)")
        # pyzmq's authenticator logs each client's public key at DEBUG: keep keys out of every log.
        zap_log = logging.getLogger("vidar.zap")
        zap_log.setLevel(logging.WARNING)
        self.auth = ThreadAuthenticator(ctx, log=zap_log)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(Path(authorized_clients)))
        n = len(list(Path(authorized_clients).glob("*.key")))
        log.info("CURVE on: %d authorized client key(s) in %s", n, authorized_clients)

    def server_socket(self, sock: zmq.Socket) -> None:
        """Call before bind."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self.auth.stop()


def client_socket(sock: zmq.Socket, client_key: str, server_public_key: str) -> None:
    """Client side (Subscriber, control client): our certificate and the server's public key."""
    public, secret = _load(client_key, "client key", secret=True)
    server_public, _ = _load(server_public_key, "server public key", secret=False)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public


def create_keys(directory: str) -> list[str]:
    """Server and client certificate pairs in `directory` (for `vidar keys`)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(str(d), name)
        Path(secret).chmod(0o600)
        out += [public, secret]
    return out
