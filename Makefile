# Two commands set everything up from nothing: `make train` and `make test`.
# GPU users: `make train TORCH_SPEC="torch"` (or a CUDA wheel spec) to take a CUDA build instead.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=
# Test workers (pytest-xdist): each imports torch once (~0.6 GB); the SLURM module stays on one. Three on 2 cores
# were no faster (14.9 min against 13.6) and one run in three lost a SLURM job to a rank aborting at exit.
PYTEST_WORKERS ?= 2

BIN := $(VENV)/bin
STAMP := $(VENV)/.multiloss-installed

.PHONY: setup train test test-slurm lint clean

setup: $(STAMP)

# Torch first: with it already satisfied, pip does not pull a multi-GB CUDA build for `torch>=2.4`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The SLURM tests alone: a real one-node cluster (installed with apt-get when missing, as root).
test-slurm: $(STAMP)
	$(BIN)/python -m pytest -m slurm -n 0 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) outputs multirun
