# `make test` creates .venv if missing, installs the package with its dev extras and runs pytest.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test test-fast install quickstart lint

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[dev]"

test: install
	$(BIN)/python -m pytest

# Everything but the tests marked slow (child processes, SmolLM2, benchmark scripts): for the edit-test loop.
test-fast: install
	$(BIN)/python -m pytest -m "not slow"

quickstart: install
	$(BIN)/gradian quickstart

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
