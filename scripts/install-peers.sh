#!/usr/bin/env bash
# The peers benchmarks/bench_peers.py runs vidar against, in a virtual environment of their own (their pins
# differ from vidar's: inference 1.8.3 pulls opencv 4.12 and its own numpy/supervision; ultralytics its own):
#   Roboflow inference 1.8.3 (InferencePipeline) and Ultralytics 8.4.190 (LoadStreams), with torch/torchvision
#   (TORCH_SPEC: the build that installs from local disk on our machines, as the Makefile's).
# Also the Debian GStreamer RTSP server the benchmark serves its clips from (scripts/install-rtsp-deps.sh).
# Idempotent: a stamp inside the venv names what was installed; a changed spec installs again.
#   bash scripts/install-peers.sh            # PEERS_VENV=.venv-peers PYTHON=python3 by default
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PEERS_VENV=${PEERS_VENV:-.venv-peers}
TORCH_SPEC=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
PEERS_SPEC=${PEERS_SPEC:-"inference==1.8.3 ultralytics==8.4.190"}
SPEC="$TORCH_SPEC $PEERS_SPEC"
STAMP="$PEERS_VENV/.peers-installed"

bash scripts/install-rtsp-deps.sh

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SPEC" ]; then
  exit 0
fi
t0=$(date +%s)
test -x "$PEERS_VENV/bin/python" || "$PYTHON" -m venv "$PEERS_VENV"
pip_install() {  # quiet; this machine's pip config names local indexes that lack most packages: not news
  "$PEERS_VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade pip
# torch first and alone: the peers' own requirements would otherwise pick a torch build from the index
# (the CPU 2.13 wheel with the index's torchvision fails at import: `operator torchvision::nms does not exist`)
# shellcheck disable=SC2086
pip_install $TORCH_SPEC
# shellcheck disable=SC2086
pip_install $PEERS_SPEC $TORCH_SPEC
# Both must import here, offline: the benchmark would otherwise fail a run's start, minutes later.
"$PEERS_VENV/bin/python" - <<'PY'
import importlib.metadata as md
import inference, ultralytics  # noqa: F401
from inference import InferencePipeline  # noqa: F401
from ultralytics.data.build import load_inference_source  # noqa: F401
import cv2
print("install-peers:", ", ".join(f"{p} {md.version(p)}" for p in ("inference", "ultralytics", "torch", "torchvision",
                                                                  "opencv-python", "numpy")), "; cv2", cv2.__version__)
PY
echo "$SPEC" > "$STAMP"
echo "install-peers: $PEERS_VENV ready in $(( $(date +%s) - t0 )) s ($(du -sh "$PEERS_VENV" | cut -f1))"
