"""Debian's GStreamer RTSP server for tests (tests/support/rtsp_server.py, run by the system Python, which
has the GObject bindings): where it is, and skip-or-fail when it is not installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parent / "rtsp_server.py"
SYSTEM_PY = "/usr/bin/python3"


def _server_available() -> bool:
    probe = "import gi; gi.require_version('GstRtspServer','1.0'); from gi.repository import GstRtspServer"
    return os.path.exists(SYSTEM_PY) and subprocess.run([SYSTEM_PY, "-c", probe], capture_output=True).returncode == 0


def require_server() -> None:
    """Skip without the server; fail instead under `make test` (VIDAR_REQUIRE_RTSP=1)."""
    if not _server_available():
        if os.environ.get("VIDAR_REQUIRE_RTSP") == "1":
            pytest.fail("GStreamer RTSP server missing: run scripts/install-rtsp-deps.sh (make test does)")
        pytest.skip("GStreamer RTSP server not installed (scripts/install-rtsp-deps.sh)")
