# torchneox: `make demo` and `make test` work on a fresh machine with Python >= 3.10 and pip.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for `make test`, each taking whole test files (loadfile: a file's shared
# one-process baselines are trained once); on a 2-core machine 2 ran the multi-process layout
# files 1.26x faster than 1 (docs/benchmarks.md); the files are handed out slowest first
# (tests/conftest.py orders them by tests/durations.json; --no-loadscope-reorder keeps that order)
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchneox-installed

.PHONY: demo test lint format bench clean

# A torch that the base Python can already import (a GPU build, say) is used as it is:
# the venv then sees the system site-packages. Otherwise TORCH_SPEC is installed.
# (pip compiles every file at install; not with --no-compile: where PYTHONDONTWRITEBYTECODE is set, as here,
# torch would then be compiled again by every process that imports it: 11.6 s to
# import the trainer instead of 2.4 s)
$(STAMP): pyproject.toml
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "using the torch already installed for $(PYTHON)"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps "mup>=1.0"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m torchneox demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks tools
	$(BIN)/ruff check --fix src tests benchmarks tools

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
