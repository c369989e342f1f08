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

.PHONY: install demo test test-python test-js test-ui ui-deps lint clean

install: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(INSTALLED): $(PY) $(BUILD_INPUTS)
	$(PIP) install --quiet -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

demo: install
	$(PY) examples/demo.py

# Browser-test prerequisites: Debian's chromium and Playwright (which must not download
# a browser of its own).
ui-deps:
	@command -v chromium >/dev/null || { apt-get update && apt-get install -y chromium; }
	cd ui-tests && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 ../$(JLPM) install --immutable

test: install lint ui-deps test-js test-python

test-js: install
	$(JLPM) install --immutable
	$(JLPM) test

test-python: install ui-deps
	OVERMIND_LAB_REQUIRE_UI=1 $(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check overmind_lab tests examples
	$(VENV)/bin/mypy overmind_lab

clean:
	rm -rf $(VENV) build overmind_lab/labextension labextension/lib node_modules \
		ui-tests/node_modules .models bench-results
