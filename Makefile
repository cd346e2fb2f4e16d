# attnlab: `make demo` sets up and trains the demo; `make test` sets up and runs the tests.
# The virtual environment sees the system's packages, so a machine that already has torch (a GPU
# build, say) keeps it; otherwise the CPU build torch==2.13.0 is installed first, before anything
# could pull a multi-GB CUDA build from an unpinned requirement.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 2

.PHONY: setup demo test lint bench-quick clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]"
	touch $@

demo: setup
	$(VENV)/bin/attnlab train

lint: setup
	$(PY) -m ruff check src tests bench

# Tests run as TEST_WORKERS processes of one thread each, a test file per worker at a time (a file's
# module fixtures, such as the distributed tests' single-process runs, are made once).
TEST_WORKERS ?= 2

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
