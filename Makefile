# overmind-lab: `make demo` (cold vs warm, the main job) and `make test` (every test).
# Both create .venv/ at the repository root and install into it, from scratch if needed.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
JLPM := $(VENV)/bin/jlpm
# The tested versions; pyproject.toml states ranges. torch==2.13.0 is the CPU wheel on
# local disk: a bare `torch` requirement would pull a multi-GB CUDA build.
CONSTRAINTS := constraints.txt
INSTALLED := $(VENV)/.installed
# The editable install maps each module to its file when it is built: a module added, moved
# or removed needs a reinstall. This list changes only then, and $(INSTALLED) depends on it.
MODULE_LIST := $(VENV)/.modules
$(shell mkdir -p $(VENV) && find overmind_lab -name '*.py' -not -path '*/labextension/*' | sort \
	> $(MODULE_LIST).new && { cmp -s $(MODULE_LIST).new $(MODULE_LIST) \
	&& rm $(MODULE_LIST).new || mv $(MODULE_LIST).new $(MODULE_LIST); })
BUILD_INPUTS := pyproject.toml $(CONSTRAINTS) $(MODULE_LIST) CMakeLists.txt $(wildcard native/*) \
	package.json yarn.lock tsconfig.json $(shell find labextension/src labextension/style \
	labextension/schema jupyter-config -type f 2>/dev/null)

.PHONY: install demo test test-python test-js test-ui ui-deps lint clean images images-bench dist bench

install: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(INSTALLED): $(PY) $(BUILD_INPUTS)
	$(PIP) install --quiet -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -c $(CONSTRAINTS) -e '.[dev]'
	@# An editable install runs the package from its sources, which pip does not byte-compile
	@# (it does for a wheel): with PYTHONDONTWRITEBYTECODE set, every process would compile
	@# our modules again (47 ms of a script's first load, 50 ms of a daemon's start).
	$(PY) -m compileall -q -j0 overmind_lab > /dev/null
	touch $@

# The warm kernelspec goes into the venv, so that `jupyter lab` from it offers the kernel the
# example notebook asks for (restarts forked from a zygote with torch and diffusers imported).
demo: install
	$(PY) -m overmind_lab kernel install --sys-prefix
	$(PY) examples/demo.py

# The benchmark suite (benchmarks/: a checkout's, not in the wheel): every case, plain vs
# first vs warm loads of random-weight SD 1.5 and Llama models in fresh processes, PSS, the
# kernel-restart loop, REST, decoding and warm kernels through a real Jupyter server (hours
# on 2 shared cores), on a private daemon. Results in $(BENCH_OUT)/results.{json,md,png};
# BENCH_ARGS adds options (BENCH_ARGS="--quick --only unet-fp16": python -m benchmarks --help).
# The models are built once under ~/.cache/overmind-lab-bench/models.
BENCH_OUT ?= bench-results
BENCH_ARGS ?=
bench: install
	nice $(PY) -m benchmarks --out $(BENCH_OUT) $(BENCH_ARGS)

# The README's benchmark chart, docs/images/bench.svg, from a benchmark run of the cases in
# BENCH_ONLY (default: the warm-kernel case and the SD 1.5 fp16 UNet and pipeline loads, about
# 30 minutes on 2 shared cores; BENCH_ONLY=all runs every case, hours).
BENCH_ONLY ?= warm-kernel,unet-fp16,pipeline-fp16
images-bench: install
	nice $(PY) -m benchmarks --out $(BENCH_OUT) \
		$(if $(filter all,$(BENCH_ONLY)),,--only $(BENCH_ONLY))
	$(PY) -m benchmarks._chart $(BENCH_OUT)/results.json docs/images/bench.svg \
		$(if $(filter all,$(BENCH_ONLY)),,--note "Only these cases were run: make images-bench \
		BENCH_ONLY=all runs every case.")

# Browser-test prerequisites: Debian's chromium and Playwright (which must not download
# a browser of its own).
ui-deps:
	@command -v chromium >/dev/null || { apt-get update && apt-get install -y chromium; }
	cd ui-tests && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 ../$(JLPM) install --immutable

test: pythons install lint ui-deps test-js test-python

test-js: install
	$(JLPM) install --immutable
	$(JLPM) test

test-python: install ui-deps pythons
	OVERMIND_LAB_REQUIRE_UI=1 $(PY) -m pytest

# The development loop, about 3 minutes on 2 cores: every test not marked `slow` (the
# marker is registered in pyproject.toml): the unit tests and a few real-process smoke
# tests (a cold and a warm load through a real daemon in fresh processes, a daemon killed
# under a load, a warm kernel forked from a zygote). No lint, Jest or browser. `make test`
# runs everything, as CI does.
.PHONY: test-fast
test-fast: install
	$(PY) -m pytest -q -m "not slow"

# The README's pictures, in docs/images/, regenerated together: bench.svg (images-bench,
# above) and sidebar.png: the sidebar with a cached entry and the warm-kernel zygote, as the
# browser test (a real Lab, daemon, kernels and zygote) screenshots it in the light theme
# (its readme-sidebar.png).
UI_ARTIFACTS := ui-tests/artifacts
images: install ui-deps images-bench
	rm -rf $(UI_ARTIFACTS)
	OVERMIND_LAB_REQUIRE_UI=1 OVERMIND_UI_ARTIFACTS=$(CURDIR)/$(UI_ARTIFACTS) \
		$(PY) -m pytest -q tests/test_ui.py
	mkdir -p docs/images
	cp $(UI_ARTIFACTS)/readme-sidebar.png docs/images/sidebar.png

# What a package index gets, in dist/: the sdist (with the prebuilt JupyterLab extension,
# so that installing it needs no Node.js) and, for each CPython in DIST_PYTHONS, a wheel built
# from that sdist and repaired by auditwheel to $(DIST_PLAT): the native module needs glibc
# 2.14 and libstdc++ of GCC 6 (Note [Portable native module] in native/portable.cpp). The
# sdist is built without isolation from .venv; each wheel by its own Python, in a build venv
# (build/dist-env/<version>/, kept) holding the build requirements of pyproject.toml from the
# package index, pinned by constraints.txt; jupyterlab, which is there only for `jlpm`, is left
# out: an sdist carries the extension built. tests/test_install.py runs `make dist-files` into
# a folder of its own and installs every wheel into fresh venvs.
DIST_PLAT ?= manylinux_2_24_x86_64
DIST_DIR ?= dist
DIST_WORK ?= build/dist
DIST_ENV := build/dist-env
# The supported CPythons, stated once: pyproject.toml's "Programming Language :: Python ::
# 3.X" classifiers (requires-python gives the oldest; tests/test_install.py checks they agree).
DIST_PYTHONS ?= $(shell sed -n 's/^ *"Programming Language :: Python :: \(3\.[0-9]*\)",$$/\1/p' \
	pyproject.toml)
# The interpreter of version V: DIST_PYTHON_V if set (make dist DIST_PYTHON_3.12=/usr/bin/python3.12),
# else pythonV on PATH if it runs (a pyenv shim of a version that is not selected does not),
# else the newest $(PYENV_ROOT)/versions/V.*/bin/pythonV.
PYENV_ROOT ?= $(HOME)/.pyenv
find_python = $(or $(DIST_PYTHON_$(1)),$(shell python$(1) -c 'import sys; print(sys.executable)' \
	2>/dev/null || ls -dv $(PYENV_ROOT)/versions/$(1).*/bin/python$(1) 2>/dev/null | tail -n 1))

# Each supported version and its interpreter; a missing one is an error that says how to get it
# (`make test` needs them all: CI must not skip a wheel).
.PHONY: pythons dist-files
pythons:
	@missing=0; $(foreach v,$(DIST_PYTHONS),p='$(call find_python,$(v))'; \
	if [ -n "$$p" ] && [ -x "$$p" ]; then echo "$(v) $$p"; else missing=1; \
	echo "make: Python $(v) is missing: $(if $(DIST_PYTHON_$(v)),DIST_PYTHON_$(v)=$$p is not \
	an executable,no python$(v) on PATH or in $(PYENV_ROOT)/versions); install it (pyenv install \
	$(v), or your system's python$(v) package) or name it: make $(or $(MAKECMDGOALS),pythons) \
	DIST_PYTHON_$(v)=/path/to/python$(v)" >&2; fi;) exit $$missing

$(DIST_ENV)/%/.ready: pyproject.toml $(CONSTRAINTS)
	rm -rf $(@D)
	$(call find_python,$*) -m venv $(@D)
	$(@D)/bin/python -m pip install --quiet --upgrade pip
	$(@D)/bin/python -m pip install --quiet -c $(CONSTRAINTS) $$($(PY) -c 'import tomllib; \
		print(*(r for r in tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"] \
		if not r.startswith("jupyterlab")))')
	touch $@

dist: install
	$(MAKE) --no-print-directory dist-files

dist-files: pythons $(foreach v,$(DIST_PYTHONS),$(DIST_ENV)/$(v)/.ready)
	rm -rf $(DIST_DIR) $(DIST_WORK) && mkdir -p $(DIST_WORK)
	$(PY) -m build --sdist --no-isolation --outdir $(DIST_DIR) .
	tar -xzf $(DIST_DIR)/overmind_lab-*.tar.gz -C $(DIST_WORK)
	@$(foreach v,$(DIST_PYTHONS),echo "building the wheel for Python $(v) (log: \
		$(DIST_WORK)/wheel-$(v).log)" && nice $(DIST_ENV)/$(v)/bin/python -m pip wheel -v \
		--no-deps --no-build-isolation -w $(DIST_WORK)/raw -C build-dir=$(DIST_WORK)/cmake-$(v) \
		$(DIST_WORK)/overmind_lab-*/ > $(DIST_WORK)/wheel-$(v).log 2>&1 \
		|| { tail -n 30 $(DIST_WORK)/wheel-$(v).log; exit 1; } &&) true
	set -o pipefail; PATH="$(abspath $(dir $(PY))):$$PATH" $(dir $(PY))auditwheel repair \
		--plat $(DIST_PLAT) -w $(DIST_DIR) $(DIST_WORK)/raw/overmind_lab-*.whl 2>&1 | grep -v '^INFO:'
	@ls -l $(DIST_DIR)

lint: install
	$(VENV)/bin/ruff check overmind_lab tests examples benchmarks
	$(VENV)/bin/mypy overmind_lab benchmarks

# The differential fuzzer (tests/test_fuzz.py; 2 minutes in `make test`) for FUZZ_SECONDS of
# generated examples, at most FUZZ_EXAMPLES, with the same fixed seed; it prints how many ran.
.PHONY: fuzz
FUZZ_SECONDS ?= 1200
FUZZ_EXAMPLES ?= 100000
fuzz: install
	OVERMIND_FUZZ_SECONDS=$(FUZZ_SECONDS) OVERMIND_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) \
		$(PY) -m pytest -q --timeout=0 tests/test_fuzz.py

clean:
	rm -rf $(VENV) build dist overmind_lab/labextension labextension/lib node_modules \
		ui-tests/node_modules .models bench-results

# Upstream tests, made to hit warm: transformers' common model tests (its sdist ships them)
# for Llama, GPT-2 and BERT (drivers in peer/), run once plain and once with peer/
# overmind_peer.py, which makes every from_pretrained call twice and gives the test the warm
# hit; the outcomes must be equal test by test. PEER_ARGS=--peer-verify adds verify mode.
PEER_VERSION := 5.24.0
PEER_DIR := .peer
PEER_SRC := $(PEER_DIR)/transformers-$(PEER_VERSION)
PEER_TESTS := peer/test_peer_llama.py peer/test_peer_gpt2.py peer/test_peer_bert.py
PEER_ARGS ?=
PEER_PYTEST := cd $(PEER_SRC) && HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/$(PEER_SRC):$(CURDIR)/peer \
	$(CURDIR)/$(PY) -m pytest -c $(CURDIR)/peer/pytest.ini -q -p no:randomly \
	$(addprefix $(CURDIR)/,$(PEER_TESTS))

.PHONY: peer-test peer-deps

$(PEER_SRC)/tests/test_modeling_common.py:
	mkdir -p $(PEER_DIR)
	$(PIP) download --quiet --no-deps --no-binary :all: -d $(PEER_DIR) \
		transformers==$(PEER_VERSION)
	tar -xzf $(PEER_DIR)/transformers-$(PEER_VERSION).tar.gz -C $(PEER_DIR)
	cp -r peer/shims/. $(PEER_SRC)/tests/
	touch $@

peer-deps: install
	$(PIP) install --quiet -c $(CONSTRAINTS) parameterized

peer-test: peer-deps $(PEER_SRC)/tests/test_modeling_common.py
	$(PEER_PYTEST) --junitxml=$(CURDIR)/$(PEER_DIR)/plain.xml || true
	export OVERMIND_PEER_STATS=$(CURDIR)/$(PEER_DIR)/stats.json && $(PEER_PYTEST) -p overmind_peer \
		$(PEER_ARGS) --junitxml=$(CURDIR)/$(PEER_DIR)/warm.xml || true
	$(PY) peer/compare.py $(PEER_DIR)/plain.xml $(PEER_DIR)/warm.xml $(PEER_DIR)/stats.json
