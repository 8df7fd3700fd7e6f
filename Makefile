# vidar: every target creates .venv and installs what it needs on first use.
#   make run    the demo (built-in synthetic stream -> classification pool -> ZeroMQ)
#   make test   the whole test suite (installs the RTSP test server's and the browser tests' Debian
#               packages if missing: GStreamer, chromium, chromium-driver)
#   make bench  benchmarks (not part of make test); results in benchmarks/RESULTS.md
#               (bench_host.py --profile needs py-spy: .venv/bin/pip install py-spy)
#   make soak   SOAK_MINUTES (default 30) of 4 streams under faults; fails if RSS/fds/threads trend up

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The torch build that installs from local disk on our machines; override on others.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: run test bench soak clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test,cluster]"
	touch $@

run: $(VENV)/.base
	$(VENV)/bin/vidar run configs/demo.yaml

test: $(VENV)/.test
	bash scripts/install-rtsp-deps.sh
	bash scripts/install-browser-deps.sh
	VIDAR_REQUIRE_RTSP=1 VIDAR_REQUIRE_BROWSER=1 VIDAR_REQUIRE_RAY=1 $(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.test
	bash scripts/install-bench-deps.sh
	$(PY) benchmarks/bench_vit.py
	$(PY) benchmarks/bench_sam2.py
	bash scripts/install-browser-deps.sh
	$(PY) benchmarks/bench_view.py
	$(PY) benchmarks/bench_cluster.py
	$(PY) benchmarks/bench_host.py

soak: $(VENV)/.test
	bash scripts/install-rtsp-deps.sh
	$(PY) benchmarks/soak.py --minutes $${SOAK_MINUTES:-30}

clean:
	rm -rf $(VENV) build *.egg-info
