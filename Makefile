# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned to the CPU wheel on this disk; installed first so nothing resolves a CUDA build.
TORCH  := torch==2.13.0

.PHONY: install test test-faults test-slow test-torchtitan demo demo-picture bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q $(TORCH) -e '.[dev,torchtitan]'
	touch $(STAMP)

# three pytest workers (pytest-xdist) that steal work at the end: most tests wait on processes they
# start, so the 2 cores have room (one worker: 30 min on 2 cores; two: 16.6 min, cores 80% busy;
# TEST_WORKERS=0 runs in this process)
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist worksteal -m "not faults and not slow" tests

test-faults: $(STAMP)
	$(PY) -m pytest -q -m faults tests

# more layouts of routes `make test` already covers (transformers.Trainer under FSDP1/FSDP2/DeepSpeed,
# pipeline stages and experts on 4 and 8 processes, the 8-process metadata check of bench_planner's
# layout, the elastic runs of the Accelerate and Lightning scripts, ZeRO-1/2 and bf16 variants)
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# torchtitan's real Trainer on gloo processes with ByteCheckpointManager (~12 min; .ci/run runs it after
# make test; make test runs the manager's fast tests): docs/torchtitan.md
test-torchtitan: $(STAMP)
	$(PY) -m pytest -q --durations=10 -m torchtitan tests/torchtitan

# the demo's table, runs/demo/results.json and runs/demo/demo.png (runs/ is gitignored: the checkout stays clean)
demo: $(STAMP)
	$(PY) examples/demo.py

# the README's picture, docs/demo.png (committed), redrawn only here: from the last `make demo`'s results
# (the demo runs first if there are none)
demo-picture: $(STAMP)
	test -f runs/demo/results.json || $(PY) examples/demo.py
	$(PY) examples/demo.py --replot runs/demo/results.json --plot docs/demo.png

BENCH := $(VENV)/.bench
$(BENCH): $(STAMP)
	$(PY) -m pip install -q $(TORCH) -e '.[dev,bench]'
	touch $(BENCH)

# the paper authors' release (PyPI bytecheckpoint==0.0.2, the same import name as ours): a venv of its
# own, the peer of benchmarks/bench_paper_release.py
PAPER_VENV ?= .venv-paper-release
$(PAPER_VENV)/.installed:
	bash benchmarks/paper_release_venv.sh $(PAPER_VENV)
	touch $@

bench: $(BENCH) $(PAPER_VENV)/.installed
	BCP_RELEASE_PYTHON=$(PAPER_VENV)/bin/python $(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(PAPER_VENV) .venv-torch-* build *.egg-info

# ---- the frameworks' own checkpoint suites, with the plugin injected (not part of `make test`) -----
# Lightning 2.6.5's and Accelerate 1.15's checkpoint tests from ../shared/framework_suites, each
# run as shipped and with ByteCheckpointIO / attach() injected; by-design differences are listed in
# tests/frameworks/ (and the suite's own by_design.txt). Fetches nothing at run time: the suites'
# test-only packages are the [frameworks] extra, installed here. ~15 min on 2 cores. Counts:
# docs/lightning.md, docs/accelerate.md.
LIGHTNING_SUITE ?= ../shared/framework_suites/lightning
ACCELERATE_SUITE ?= ../shared/framework_suites/accelerate
FRAMEWORKS := $(VENV)/.frameworks
.PHONY: test-frameworks test-frameworks-lightning test-frameworks-accelerate test-frameworks-transformers

$(FRAMEWORKS): $(STAMP)
	$(PY) -m pip install -q $(TORCH) -e '.[dev,frameworks]'
	touch $(FRAMEWORKS)

test-frameworks: test-frameworks-lightning test-frameworks-accelerate test-frameworks-transformers

test-frameworks-lightning: $(FRAMEWORKS)
	BCP_LIGHTNING_ALL=1 $(PY) -m pytest -q tests/integration/test_lightning_fabric.py tests/integration/test_lightning_model_parallel.py
	LIGHTNING_SUITE=$(LIGHTNING_SUITE) tests/frameworks/run_lightning.sh

test-frameworks-accelerate: $(FRAMEWORKS)
	$(PY) tests/frameworks/run_accelerate.py --suite $(ACCELERATE_SUITE)

# transformers 5.24's test_trainer_checkpointing.py / test_trainer_resume.py with attach(trainer)
# injected, with the checkpoint/... metrics logged and with BCP_LOG_METRICS=0 (~3.5 min); the suite's
# files are not in this repository: tests/frameworks/transformers/ORIGIN.md
TRANSFORMERS_SUITE ?= ../shared/framework_suites/transformers
test-frameworks-transformers: $(FRAMEWORKS)
	$(PY) tests/frameworks/run_transformers.py --suite $(TRANSFORMERS_SUITE)

# ---- the supported version ranges (not part of `make test`) --------------------------------------
# The adapters' tests on the newest supported Lightning/Accelerate (the main venv) and on the
# oldest (a second venv, same CPU torch); the core's tests on both ends of the supported torch
# range, 2.11.0 and 2.15.0 (from the registry: CUDA builds of several GB that run on the CPU,
# each in its own venv; this machine's pip constraint file caps torch at 2.14.1, so these installs
# read no pip config: PIP_CONFIG_FILE=/dev/null).
COMPAT_VENV ?= .venv-compat
OLDEST      := lightning==2.4.0 accelerate==1.6.0
ADAPTER_TESTS := tests/integration/test_lightning.py tests/integration/test_lightning_contracts.py \
                 tests/integration/test_accelerate.py tests/integration/test_accelerate_attach.py
# DeepSpeed: only its newest supported release (0.19.8) is tested (the [deepspeed] extra's range)
DEEPSPEED_TESTS := tests/dist/test_deepspeed.py
TORCH_ENDS  := 2.11.0 2.15.0
.PHONY: test-compat test-compat-torch

test-compat: $(STAMP)
	@echo "== newest: lightning/accelerate/deepspeed $$($(PY) -c 'import lightning, accelerate, deepspeed; print(lightning.__version__, accelerate.__version__, deepspeed.__version__)')"
	$(PY) -m pytest -q $(ADAPTER_TESTS) $(DEEPSPEED_TESTS)
	@echo "== oldest: $(OLDEST)"
	test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q $(TORCH)
	$(COMPAT_VENV)/bin/pip install -q $(TORCH) -e '.[dev]' $(OLDEST)
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(ADAPTER_TESTS)

# the core (unit + multi-rank tests) on each end of the torch range, one venv per release
test-compat-torch:
	failed=; for v in $(TORCH_ENDS); do \
	  venv=.venv-torch-$$v; \
	  test -x $$venv/bin/python || python3 -m venv $$venv; \
	  PIP_CONFIG_FILE=/dev/null $$venv/bin/pip install -q torch==$$v && \
	  PIP_CONFIG_FILE=/dev/null $$venv/bin/pip install -q torch==$$v -e '.[dev]' && \
	  $$venv/bin/python -c "import torch; assert torch.__version__.startswith('$$v'), torch.__version__" && \
	  echo "== torch $$v" && \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider tests/unit tests/dist || failed="$$failed $$v"; \
	done; test -z "$$failed" || { echo "failed on torch$$failed"; exit 1; }
