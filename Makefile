# Entry points on a fresh machine (Python 3.11, pip, no GPU):
#   make reproduce   the main job    make test   the test suite    make lab   the notebooks in JupyterLab
#   make publish NODE=cpu|h100|h200|b200   regenerate reports/<node>[x<GPUs>]/ on that node (h3lab publish)
# Both create/refresh .venv themselves. torch 2.13.0 is installed first and explicitly: on these
# machines it is a CPU build already on disk, while an open range would fetch a multi-GB CUDA build.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
NODE ?= cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.h3lab-installed

.PHONY: reproduce publish test lint lab clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev,parity,notebooks,interpreter]"
	touch $(STAMP)

# the layout sweep through notebooks/reproduce.py (papermill) into runs/<id>/, the accuracy table, and the
# report published to reports/<node type>/report.html; parameters: make reproduce ARGS="-p rows 64 -p layouts tp2"
reproduce: $(STAMP)
	$(BIN)/h3lab workbench reproduce $(ARGS)

# sweeps through papermill, the benchmarks of h3lab.bench.registry, the report, swapped into reports/ when complete;
# e.g. make publish NODE=h200 ARGS="--gpus 1 --only sweep" (stages resume in runs/publish-<folder>/)
publish: $(STAMP)
	$(BIN)/h3lab publish --node $(NODE) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=30

lint: $(STAMP)
	$(BIN)/ruff check h3lab tests notebooks examples
	$(BIN)/ruff format --check h3lab tests notebooks examples

# JupyterLab on notebooks/ with this venv's kernel; *.py open as notebooks (jupytext), saved as .py + .ipynb
lab: $(STAMP)
	$(BIN)/python -c "from h3lab.workbench.notebooks import lab_settings; print('lab settings:', lab_settings())"
	H3LAB_RUNS=$(CURDIR)/runs $(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

clean-venv:
	rm -rf $(VENV)
