# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# nvcc on PATH may be a wrapper script: ask nvcc itself where its toolkit is.
CUDA_HOME ?= $(shell nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^\#\$$ _HERE_=\(.*\)\/bin$$/\1/p')
export CUDA_HOME
export CUDACXX ?= $(if $(wildcard $(CUDA_HOME)/bin/nvcc),$(CUDA_HOME)/bin/nvcc,)
TORCH_VERSION ?= 2.14.1

.PHONY: all venv build demo test bench device-check clean

all: build

# The venv is made once; the stamp records that every dependency is in.
$(VENV)/.deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q "scikit-build-core>=0.10" "cmake>=3.26" ninja numpy \
	    transformers safetensors tqdm pytest pytest-benchmark hypothesis matplotlib
	touch $@

venv: $(VENV)/.deps

# Several shells (or agents) may build at once: the lock keeps them from racing in build/.
build: venv
	flock .build.lock $(PY) -m pip install -q --no-build-isolation --no-deps -e .

demo: build
	$(PY) -m paged_ops.demo
	$(PY) -m engine demo

test: build
	$(PY) -m pytest -q tests

bench: build
	$(PY) -m pytest -q bench --benchmark-enable

# On a GPU machine (builds with the machine's own torch, no venv): tests, memcheck, benchmarks.
device-check:
	bash bench/device_check.sh

clean:
	rm -rf build $(VENV) paged_ops/_C*.so
