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
