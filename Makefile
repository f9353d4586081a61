# batchgate: the two commands are `make up` (run the stack) and `make test` (run the tests).
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch: pinned to the release the project is tested with. On a machine without a GPU, set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get the small CPU build instead of CUDA.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=

.PHONY: setup up test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[worker,dev]'
	touch $@

up: setup
	$(BIN)/batchgate up

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
