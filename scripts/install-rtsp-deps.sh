#!/usr/bin/env bash
# Install the system GStreamer/RTSP packages needed by tests/support/rtsp_server.py
# (which runs under /usr/bin/python3, not the venv). No-op if already present.
set -euo pipefail

PKGS=(gstreamer1.0-rtsp gir1.2-gst-rtsp-server-1.0 python3-gi
      gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad
      gstreamer1.0-plugins-ugly gstreamer1.0-libav gir1.2-gstreamer-1.0
      gir1.2-gst-plugins-base-1.0 gstreamer1.0-tools)

have_deps() {
  /usr/bin/python3 -c "import gi; gi.require_version('GstRtspServer','1.0'); from gi.repository import GstRtspServer" \
    >/dev/null 2>&1 && gst-inspect-1.0 x264enc >/dev/null 2>&1
}

have_deps && exit 0

source "$(dirname "$0")/apt-install.sh"
apt_install install-rtsp-deps "${PKGS[@]}" || exit 1

if ! have_deps; then
  echo "install-rtsp-deps: installed, but GstRtspServer/x264enc still unavailable; check: ${PKGS[*]}" >&2
  exit 1
fi
