# vidar: every target creates .venv and installs what it needs on first use.
#   make run    the demo (built-in synthetic stream -> classification pool -> ZeroMQ)
#   make test   the whole test suite (installs the RTSP test server's and the browser tests' Debian
#               packages if missing: GStreamer, chromium, chromium-driver)
#   make bench  benchmarks (not part of make test); results in benchmarks/RESULTS.md
#               (bench_host.py: ingest threads vs processes side by side, the GIL share with py-spy, installed by it;
#               bench_peers.py: vidar beside Roboflow Inference and Ultralytics on the same RTSP cameras, ~45 min,
#               the peers in .venv-peers by scripts/install-peers.sh)
#   make soak   SOAK_MINUTES (default 30) of 4 streams under faults; fails if RSS/fds/threads trend up
#   make docs   the documentation site into site/ (regenerates the config reference and the benchmark plots;
#               SCREENSHOT=1 also refreshes the live view's screenshot, see make screenshot)
#   make screenshot  docs/img/live-view.png: the demo in Debian's chromium (~1 minute; not part of make test)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The torch build that installs from local disk on our machines; override on others.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: run test bench soak docs screenshot clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e .
	touch $@

# docs: make test builds the site strictly (tests/test_docs.py), so the test stamp installs it too
$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test,cluster,docs]"
	touch $@

$(VENV)/.docs: $(VENV)/.base
	$(PY) -m pip install -q -e ".[docs]"
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
	$(PY) benchmarks/bench_host.py --gil
	bash scripts/install-peers.sh && $(PY) benchmarks/bench_peers.py --plot docs/img/bench_peers.png

soak: $(VENV)/.test
	bash scripts/install-rtsp-deps.sh
	$(PY) benchmarks/soak.py --minutes $${SOAK_MINUTES:-30}

docs: $(VENV)/.docs
	$(PY) scripts/gen_config_docs.py
	$(PY) scripts/plot_benchmarks.py
	if [ "$(SCREENSHOT)" = 1 ]; then $(MAKE) screenshot; fi
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "docs: site/index.html (or: $(VENV)/bin/mkdocs serve)"

screenshot: $(VENV)/.test
	bash scripts/install-browser-deps.sh
	$(PY) scripts/screenshot_view.py

clean:
	rm -rf $(VENV) build site *.egg-info
