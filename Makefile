# Two commands on a fresh machine: `make demo` and `make test` (each installs what it needs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch_npu carries torchair; installed off every import path (see tests/torchair_offline.py)
TORCH_NPU_DIR := .cache/torch_npu

.PHONY: demo test bench

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(TORCH_NPU_DIR)/.fetched: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(TORCH_NPU_DIR) torch_npu==2.13.0
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/npu-fuse demo

test: $(VENV)/.installed $(TORCH_NPU_DIR)/.fetched
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/fallback_runtime.py
	$(PY) benchmarks/compile_overhead.py
