# tradeloop — two commands on a fresh machine: `make up` runs the loop, `make test` passes the tests.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
EPOCHS  ?= 5
DATASET ?= synthetic
DEVICE  ?= cpu

.PHONY: setup up test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: on these machines it is a local CPU wheel; any torch>=2.11 satisfies the package.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.11"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

up: $(STAMP)
	$(BIN)/tradeloop up --epochs $(EPOCHS) --dataset $(DATASET) --device $(DEVICE)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not e2e and not browser"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
