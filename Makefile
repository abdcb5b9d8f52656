# tradeloop — two commands on a fresh machine: `make up` runs the loop, `make test` passes the tests.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# `make up` passes these when set (the defaults are tradeloop up's own) and ARGS as they are:
#   make up EPOCHS=10 DATASET=sp500 DEVICE=cuda ARGS="--free-ports"      make up ARGS="--resume RUN_ID"
EPOCHS  ?=
DATASET ?=
DEVICE  ?=
ARGS    ?=
UP_ARGS := $(if $(EPOCHS),--epochs $(EPOCHS)) $(if $(DATASET),--dataset $(DATASET)) $(if $(DEVICE),--device $(DEVICE))
# The torch release tried first (on these machines a local CPU wheel; scripts/docker-ci.sh puts it in the image).
TORCH_PIN := torch==2.13.0

.PHONY: setup up test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# TORCH_PIN first; any torch>=2.11 satisfies the package.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_PIN)" || $(BIN)/pip install -q "torch>=2.11"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

# Triton (the compiler torch.compile uses on CUDA) beside the venv, not in it, for the kernels' tests: the fused C51,
# replay and attention kernels (services/trainer/) run under Triton's CPU interpreter, so a machine without a GPU
# checks them too.
# 3.6.0 is the version torch 2.11's CUDA build ships with.
TRITON_DIR   := .triton
TRITON_STAMP := $(TRITON_DIR)/.installed
$(TRITON_STAMP): $(BIN)/python
	$(BIN)/pip install -q --target $(TRITON_DIR) "triton==3.6.0"
	touch $(TRITON_STAMP)

setup: $(STAMP)

up: $(STAMP)
	$(BIN)/tradeloop up $(UP_ARGS) $(ARGS)

# Both cores: pytest-xdist, a test file per worker (a file's fixtures are built once). The interpreter pass runs only
# what it alone checks: the Triton kernels (the compiled-op test already ran in the first pass), spread test by test.
test: $(STAMP) $(TRITON_STAMP)
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadfile
	TRITON_INTERPRET=1 PYTHONPATH=$(TRITON_DIR) $(BIN)/python -m pytest -q -ra -n 2 --dist load \
		-k "not compiled_writes_in_place" tests/test_fused_c51.py tests/test_fused_greedy.py tests/test_replay_kernel.py \
		tests/test_fused_attention.py tests/test_run_batch.py

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not e2e and not browser"

clean:
	rm -rf $(VENV) $(TRITON_DIR) .pytest_cache build *.egg-info
