# Two entry points (see README): `make demo` and `make test`. Both create the virtual
# environment on first use; torch is pinned to the local CPU wheel. `make demo` installs
# only what running needs; `make test` adds the test dependencies.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
RUN    := $(VENV)/.k3-installed
TESTS  := $(VENV)/.k3-test-installed

.PHONY: setup demo test test-all bench clean

setup: $(RUN)

$(RUN): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	touch $(RUN)

$(TESTS): $(RUN)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(TESTS)

demo: $(RUN)
	$(BIN)/k3 demo

# one pytest-xdist worker per core; a module's tests share a worker (tests/conftest.py)
XDIST  := -n auto --dist loadfile

test: $(TESTS)
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST)

test-all: $(TESTS)
	$(BIN)/python -m pytest -q $(XDIST)

bench: $(RUN)
	$(BIN)/python benchmarks/bench_kernels.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
