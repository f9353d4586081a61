# batchgate: the two commands are `make up` (run the stack) and `make test` (run the tests).
# Both create .venv and install what they need on first use. `make test-fast` runs the pure and
# in-memory tiers alone (no Redis, no torch import, seconds).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch: pinned to the release the project is tested with, from pip's usual index (works with or
# without a GPU). Optional, only where download.pytorch.org is reachable:
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the smaller CPU-only build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
# pip shows its progress on the first `make up` (minutes, mostly torch); `make test`/`lint` keep it quiet.
PIP_QUIET ?=
test test-cluster test-fast lint: PIP_QUIET = -q

# The fast tier: the unit tests and the in-memory half of the contract tests (the real-Redis half is
# marked `redis`; the tests that start Python processes, marked `spawns`, run in `make test`).
# BATCHGATE_FAST_TIER=1 makes the session fail if anything imported torch (tests/torch_guard.py); the
# unreachable test Redis makes any use of the real one fail loudly. Two processes (pytest-xdist): a third
# of its wall time is tests waiting on timers. The fuzzing plugins (schemathesis, hypothesis's reporting,
# anyio's) serve tests/integration alone, yet cost every test of the tier: a quarter of its time
# (hypothesis's own `@given` runs without its plugin).
FAST_TIERS := tests/unit $(wildcard tests/contract)
FAST_PLUGINS_OFF := -p no:schemathesis -p no:hypothesispytest -p no:anyio
# pytest rewrites every test module's asserts when it imports it, and keeps the result beside its bytecode:
# with PYTHONDONTWRITEBYTECODE set (as on these machines) it rewrote all of them on every run, 7 of the fast
# tier's 9 s of collection per process. Every target here writes bytecode, so a run after the first is that faster.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup up test test-cluster test-fast lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo "batchgate: first run: installing torch and the project into $(VENV) (a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install $(PIP_QUIET) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(BIN)/pip install $(PIP_QUIET) -e '.[worker,dev]'
	touch $@

up: setup
	$(BIN)/batchgate up

# `make test` also runs the suites that cross processes again on a Redis Cluster of 3 masters and 3 replicas
# started on loopback (`make test-cluster` alone). The two passes run side by side: each spends much of its time
# waiting (on the processes it starts, timers, Redis), so together they take little longer than the default pass
# alone, not the sum (the key prefixes, ports and temporary directories of each are its own). The cluster pass's
# report follows the default pass's; either failing fails `make test`. What is timed against a budget or saturates
# the machine (marked `alone`: the fast tier's 30 s, the benchmarks' smoke runs) runs first, by itself, on one Redis.
# A long test that needs no Redis (marked `beside`: the sweep over every decoder architecture) runs in the cluster
# pass instead of the default one, so the two passes end together (on CI the default pass ran 20 minutes longer).
CLUSTER_MARKS := (redis or faults) and not standalone and not alone
ON_CLUSTER = BATCHGATE_TEST_REDIS=cluster $(BIN)/python -m pytest -q tests/integration tests/contract tests/faults -m
CLUSTER_TESTS = $(ON_CLUSTER) "$(CLUSTER_MARKS)"
BESIDE_TESTS = $(ON_CLUSTER) "($(CLUSTER_MARKS)) or beside"
CLUSTER_LOG := .cluster-tests.log

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m alone
	@rm -f $(CLUSTER_LOG) $(CLUSTER_LOG).rc; ($(BESIDE_TESTS) > $(CLUSTER_LOG) 2>&1; echo $$? >> $(CLUSTER_LOG).rc) & \
	$(BIN)/python -m pytest -m "not alone and not beside"; rc=$$?; wait; \
	echo "== the suites that cross processes, on a Redis Cluster, and the tests marked beside (run beside the default pass) =="; \
	cat $(CLUSTER_LOG); crc=$$(cat $(CLUSTER_LOG).rc); rm -f $(CLUSTER_LOG) $(CLUSTER_LOG).rc; \
	exit $$(( rc || crc ))

test-cluster: setup
	$(CLUSTER_TESTS)

test-fast: setup
	BATCHGATE_FAST_TIER=1 BATCHGATE_TEST_REDIS_URL=redis://127.0.0.1:1/0 \
		$(BIN)/python -m pytest -q -n 2 $(FAST_PLUGINS_OFF) -m "not redis and not spawns" $(FAST_TIERS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
