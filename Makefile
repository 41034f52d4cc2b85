# Two commands set everything up from nothing: `make train` and `make test`.
# GPU users: `make train TORCH_SPEC="torch"` (or a CUDA wheel spec) to take a CUDA build instead.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The exact versions (transitive included, torch aside) the suite passed with; `make constraints` regenerates it.
CONSTRAINTS ?= constraints.txt
ARGS ?=
PYTEST_ARGS ?=
# Test workers (pytest-xdist): each imports torch once (~0.6 GB); the SLURM module stays on one. Three on 2 cores
# were no faster (14.9 min against 13.6) and one run in three lost a SLURM job to a rank aborting at exit.
PYTEST_WORKERS ?= 2

BIN := $(VENV)/bin
STAMP := $(VENV)/.multiloss-installed

.PHONY: setup train test test-slurm lint clean constraints

setup: $(STAMP)

# Torch first: with it already satisfied, pip does not pull a multi-GB CUDA build for `torch>=2.4`. Every other
# package (pip included) at the version of $(CONSTRAINTS): what was tested is what installs, a year from now too.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS) --upgrade pip
	$(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS) -e ".[dev]"
	touch $@

# Resolve pyproject's ranges afresh in a scratch venv and pin what came: every package but multiloss and torch (its
# build is the user's TORCH_SPEC; its CUDA-only companions with it). Run the suite on the result before committing it.
constraints:
	rm -rf $(VENV).constraints
	$(PYTHON) -m venv $(VENV).constraints
	$(VENV).constraints/bin/python -m pip install --quiet --upgrade pip
	$(VENV).constraints/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VENV).constraints/bin/python -m pip install --quiet ".[dev]"
	{ echo "# The exact versions \`make test\` passed with (pip --constraint). Regenerate: make constraints; see README."; \
	  $(VENV).constraints/bin/python -m pip freeze --all --exclude multiloss \
	  | grep -v -i -E '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' | LC_ALL=C sort -f; } > $(CONSTRAINTS)
	rm -rf $(VENV).constraints build *.egg-info

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
