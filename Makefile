# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned to the CPU wheel on this disk; installed first so nothing resolves a CUDA build.
TORCH  := torch==2.13.0

.PHONY: install test test-faults demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q $(TORCH) -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not faults" tests

test-faults: $(STAMP)
	$(PY) -m pytest -q -m faults tests

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info

# ---- lightning adapter (owner: lightning) ----------------------------------------------------
# Lightning's own checkpoint tests (tag 2.6.5, ../shared/framework_suites/lightning) with
# ByteCheckpointIO injected into every Trainer; ~10-20 min on 2 cores, so not part of `make test`.
# Fetches nothing: the suite's extra test packages must already be installed (the command to
# install them is printed if they are not). docs/lightning.md has the shipped vs injected counts.
# It first runs the adapter's heavy multi-process matrix (BCP_LIGHTNING_ALL=1: Fabric, TP).
LIGHTNING_SUITE ?= ../shared/framework_suites/lightning
.PHONY: test-frameworks-lightning
test-frameworks-lightning: $(STAMP)
	BCP_LIGHTNING_ALL=1 $(PY) -m pytest -q tests/integration/test_lightning_fabric.py tests/integration/test_lightning_model_parallel.py
	@$(PY) -c "import pytest_rerunfailures, omegaconf, jsonargparse, tensorboardX, pytest_timeout" 2>/dev/null || \
	  { echo "missing test packages; run: $(PY) -m pip install pytest-rerunfailures omegaconf jsonargparse tensorboardX pytest-timeout"; exit 2; }
	$(LIGHTNING_SUITE)/run.sh

# ---- accelerate adapter (accelerate engineer) ---------------------------------------------------
# Accelerate's own checkpoint tests (test_state_checkpointing.py, test_accelerator.py), as shipped
# and with attach() injected into every Accelerator; counts in docs/accelerate.md. Fetches nothing:
# the suite and its test dependencies must be present (the script says what is missing).
ACCELERATE_SUITE ?= ../shared/framework_suites/accelerate
.PHONY: test-frameworks-accelerate
test-frameworks-accelerate: $(STAMP)
	$(PY) tests/integration/accelerate_scripts/framework_suite.py --suite $(ACCELERATE_SUITE)
