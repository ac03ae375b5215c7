# Two commands on a fresh machine: `make demo` and `make test` (each installs what it needs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch_npu carries torchair; installed off every import path (see tests/torchair_offline.py)
TORCH_NPU_DIR := .cache/torch_npu

# vLLM's CPU build (3.4 GB, transformers<5.20): a venv of its own, under the ignored .cache/
VLLM_VENV := .cache/vllm-venv
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: demo test bench test-vllm bench-vllm test-torch

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

# torchvision/torchaudio/torchcodec come as CUDA builds that break vLLM's imports on CPU: removed
$(VLLM_VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -e '.[vllm]' pytest torch==2.13.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# npu_fuse inside vLLM's compile (engines started for real), then the vLLM-op fusion and the pass
# against vLLM's kernel and pass classes
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm.py
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/test_rope_vllm.py tests/test_vllm_pass.py

bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) benchmarks/vllm_serving.py

bench: $(VENV)/.installed
	$(PY) benchmarks/fallback_runtime.py
	$(PY) benchmarks/compile_overhead.py

# The suite on another torch minor: a throwaway venv under .cache/ with PyPI's build of that torch (a
# CUDA build, a few GB; it runs on the CPU) and the torch_npu built for it. Out of `make test`'s path:
# `make test-torch TORCH=2.10.0`. A whole run records its row in docs/torch-versions.md; PYTEST_ARGS
# narrows a run, which then records nothing.
TORCH ?= 2.10.0
TORCH_NPU_FOR_2.10.0 := 2.10.0.post4
TORCH_NPU_FOR_2.11.0 := 2.11.0.post3
TORCH_NPU_FOR_2.12.0 := 2.12.0.post3
TORCH_NPU_FOR_2.13.0 := 2.13.0
TORCH_NPU_FOR_2.14.0 := 2.14.0
TORCH_NPU_FOR_2.14.1 := 2.14.0
TORCH_NPU ?= $(or $(TORCH_NPU_FOR_$(TORCH)),$(TORCH))
MINOR_DIR := .cache/torch-$(TORCH)
MINOR_PY := $(MINOR_DIR)/venv/bin/python
PYTEST_ARGS ?=

$(MINOR_DIR)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(MINOR_DIR)/venv
	$(MINOR_PY) -m pip install -q torch==$(TORCH)
	$(MINOR_PY) -m pip install -q -e '.[test]' torch==$(TORCH)
	$(MINOR_PY) -m pip install -q --no-deps --target $(MINOR_DIR)/torch_npu torch_npu==$(TORCH_NPU)
	touch $@

test-torch: $(MINOR_DIR)/.installed
	NPU_FUSE_TORCH_NPU_DIR=$(MINOR_DIR)/torch_npu $(MINOR_PY) -m pytest -q -p no:cacheprovider \
		--junitxml=$(MINOR_DIR)/junit.xml $(PYTEST_ARGS); status=$$?; \
	$(if $(PYTEST_ARGS),,$(MINOR_PY) scripts/torch_versions.py record --junit $(MINOR_DIR)/junit.xml \
		--torch-npu $(TORCH_NPU);) exit $$status
