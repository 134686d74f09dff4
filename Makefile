# `make test` creates .venv if missing, installs the package with its dev extras and runs pytest.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test install quickstart lint

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[dev]"

test: install
	$(BIN)/python -m pytest

quickstart: install
	$(BIN)/gradian quickstart

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
