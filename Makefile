# `make demo` and `make test` set everything up from nothing.
# On a machine whose python3 already has torch (a GPU box), the virtualenv sees the system
# packages and keeps that torch; elsewhere it installs the local CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.leangraph-stamp

.PHONY: setup demo test test-cuda lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -c "import pytest, hypothesis" 2>/dev/null || $(PY) -m pip install -q "pytest>=7" "hypothesis>=6"
	$(PY) -c "import setuptools" 2>/dev/null || $(PY) -m pip install -q setuptools
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: setup
	$(VENV)/bin/leangraph demo

test: setup
	$(PY) -m pytest -q

# On a GPU machine: the CUDA suite alone, verbose.
test-cuda: setup
	$(PY) -m pytest -q -m "cuda or multigpu" -rs

clean:
	rm -rf $(VENV) src/*.egg-info .pytest_cache
