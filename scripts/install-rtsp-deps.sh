#!/usr/bin/env bash
# Install the system GStreamer/RTSP packages needed by tests/rtsp_server.py
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

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
  SUDO=(sudo -n)
else
  echo "install-rtsp-deps: need root (or passwordless sudo) to install:" >&2
  echo "  apt-get install ${PKGS[*]}" >&2
  exit 1
fi

if ! { "${SUDO[@]}" apt-get update -qq &&
       "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -qq --no-install-recommends "${PKGS[@]}"; }; then
  echo "install-rtsp-deps: apt-get failed; please install: ${PKGS[*]}" >&2
  exit 1
fi

if ! have_deps; then
  echo "install-rtsp-deps: installed, but GstRtspServer/x264enc still unavailable; check: ${PKGS[*]}" >&2
  exit 1
fi
