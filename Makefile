# `make demo` and `make test` set everything up from nothing.
# On a machine whose python3 already has torch (a GPU box), the virtualenv sees the system
# packages and keeps that torch; elsewhere it installs the local CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.leangraph-stamp

.PHONY: setup setup-extras demo test test-oldest test-cuda lint clean
LINT_TOOLS := ruff==0.17.6 mypy==2.4.1

setup: $(STAMP)

# The host python may itself be a virtualenv (GPU images often are); a venv made from it sees
# only the base interpreter's packages, so a .pth file hands it the host's site-packages too.
HOST_SITE = $(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))"
VENV_SITE = $(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))"

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	if $(PYTHON) -c "import torch" 2>/dev/null; then $(HOST_SITE) > "$$($(VENV_SITE))/_host_site.pth"; fi
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -c "import pytest, hypothesis" 2>/dev/null || $(PY) -m pip install -q "pytest>=7" "hypothesis>=6"
	$(PY) -c "import matplotlib, rich" 2>/dev/null || $(PY) -m pip install -q "matplotlib>=3.5" "rich>=12"
	# The editable install builds a wheel: setuptools >= 70.1 does that without the `wheel`
	# package; a new venv's bundled setuptools may be older (torch 2.13 pulls a new one).
	$(PY) -c "import setuptools.command.bdist_wheel" 2>/dev/null || $(PY) -m pip install -q "setuptools>=70.1"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Optional dependencies, as pyproject's extras (comma-separated, e.g. `make test EXTRAS=hf`):
# the integration tests that need one skip without it. Installed once per venv and set.
EXTRAS ?=
comma := ,
EXTRAS_STAMP := $(VENV)/.leangraph-extras-$(subst $(comma),-,$(strip $(EXTRAS)))

setup-extras: setup
ifneq ($(strip $(EXTRAS)),)
setup-extras: $(EXTRAS_STAMP)
$(EXTRAS_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-build-isolation -e ".[$(strip $(EXTRAS))]"
	touch $@
endif

demo: setup
	$(VENV)/bin/leangraph demo

test: setup-extras
	$(PY) -m pytest -q

# The oldest torch the package claims (pyproject: torch>=2.4), in a virtualenv of its own.
# PyPI's 2.4.1 wheel is a CUDA build: several GB, so CI does not run this.
OLDEST_TORCH ?= torch==2.4.1
test-oldest:
	$(MAKE) VENV=.venv-oldest TORCH_SPEC="$(OLDEST_TORCH)" PYTHON="$(PYTHON)" test

# On a GPU machine: the CUDA suite alone, verbose.
test-cuda: setup-extras
	$(PY) -m pytest -q -m "cuda or multigpu" -rs

# Quality gates: ruff (lint and format check) and mypy on the package.
lint: setup
	$(PY) -c "import ruff, mypy" 2>/dev/null || $(PY) -m pip install -q $(LINT_TOOLS)
	$(PY) -m ruff check src
	$(PY) -m ruff format --check src
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .venv-oldest src/*.egg-info .pytest_cache
