# Two entry points on a fresh machine (Python 3.11, pip, no GPU):
#   make reproduce   the main job    make test   the test suite
# Both create/refresh .venv themselves. torch 2.13.0 is installed first and explicitly: on these
# machines it is a CPU build already on disk, while an open range would fetch a multi-GB CUDA build.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.h3lab-installed

.PHONY: reproduce test lint lab clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev,parity,notebooks]"
	touch $(STAMP)

reproduce: $(STAMP)
	$(BIN)/h3lab reproduce

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check h3lab tests notebooks
	$(BIN)/ruff format --check h3lab tests notebooks

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/

clean-venv:
	rm -rf $(VENV)
