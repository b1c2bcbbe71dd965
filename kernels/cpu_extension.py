"""Builds and loads kvmesh's C++ CPU kernels (``kernels/csrc``) at run time.

Built once per machine with the C++ compiler inductor uses, into torch's extension
directory (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), under
a name that hashes the source, the torch version and the compiler flags; later
processes load the library they find there. The vector instruction set is the one
torch reports for the CPU (``torch.backends.cpu.get_cpu_capability``), and it
selects ATen's vector types the way torch's own kernels do. ``python -m
kernels.cpu_extension`` builds every instruction set's library ahead (the
Dockerfile does, for its image).

Where nothing can be built (no compiler, an unsupported CPU), ``load_cpu_kernels``
returns False once, logs why, and callers keep their PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

logger = logging.getLogger(__name__)
# Every C++ source in csrc, in one library; with the headers they share, what the
# library is built from (its name hashes them).
SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp")))
BUILD_INPUTS = SOURCES + tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
# torch's capability -> compiler flags for ATen's vector types (as inductor's VecISA).
_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
               "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


def _compile_command(compiler: str, isa: str, source: Path, output: Path) -> list[str]:
    """Compiles one source into an object file."""
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [compiler, str(source), "-c", "-o", str(output), "-fPIC", "-O3", "-std=c++17",
            "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *_ISA_FLAGS[isa], *includes]


def _link_command(compiler: str, objects: list[Path], output: Path) -> list[str]:
    """Links the object files into the library torch loads."""
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return [compiler, *map(str, objects), "-o", str(output), "-shared", "-fopenmp", *libs,
            "-lc10", "-ltorch", "-ltorch_cpu"]


def _library_path(compiler: str, isa: str) -> Path:
    key = hashlib.sha256()
    for source in BUILD_INPUTS:
        key.update(source.read_bytes())
    key.update(f"{torch.__version__} {compiler} {_ISA_FLAGS[isa]}".encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    return root / "kvmesh" / f"kvmesh_cpu_kernels_{isa.lower()}_{key.hexdigest()[:16]}.so"


def _build(compiler: str, isa: str, library: Path) -> None:
    """Compiles each source on its own core (the sources take 8-25 s each, ~2.5 minutes
    one after another on a Zen 3 core), links them in a temporary directory and
    renames the library into place, so that a process never loads a library another
    is still writing."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        commands = [_compile_command(compiler, isa, source, obj)
                    for source, obj in zip(SOURCES, objects)]
        with ThreadPoolExecutor(min(len(commands), len(os.sched_getaffinity(0)))) as pool:
            list(pool.map(_run, commands))  # raises the first failure
        partial = Path(tmp) / library.name
        _run(_link_command(compiler, objects, partial))
        os.replace(partial, library)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def build_cpu_kernels(isa: str) -> tuple[Path, bool]:
    """The library for ``isa`` (a key of _ISA_FLAGS), built unless it is there already:
    its path, and whether it was built now. Any x86 CPU builds every ISA's library, so
    an image builds them all (the Dockerfile) and its containers, on whatever CPU,
    start without compiling them."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    library = _library_path(compiler, isa)
    if library.exists():
        return library, False
    _build(compiler, isa, library)
    return library, True


@functools.cache
def load_cpu_kernels() -> bool:
    """Loads the ``kvmesh::*_cpu`` ops (building them first if needed); returns whether
    they are available. Called once per process; never raises."""
    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in _ISA_FLAGS:
        logger.info("event=cpu_kernels_unavailable reason=%r", f"CPU capability {isa}")
        return False
    try:
        library, built = build_cpu_kernels(isa)
        torch.ops.load_library(str(library))
    except Exception as e:  # no compiler, a failed build or load: the PyTorch path serves
        detail = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) else repr(e)
        logger.warning("event=cpu_kernels_unavailable error=%s", detail)
        return False
    _register_fake_kernels()
    logger.info("event=cpu_kernels_loaded isa=%s built=%s library=%s", isa, built, library)
    return True


@torch.compiler.assume_constant_result
def has_cpu_kernel(name: str) -> bool:
    """Whether ``torch.ops.kvmesh.<name>`` is loaded (building the kernels first if
    needed). A constant to torch.compile: evaluated eagerly while tracing, so a graph
    calls the C++ op or its torch fallback, never both."""
    return load_cpu_kernels() and hasattr(torch.ops.kvmesh, name)


@functools.cache  # once per process, even if the library is loaded again
def _register_fake_kernels() -> None:
    """Output shapes for torch.compile's tracing of the C++ ops."""

    @torch.library.register_fake("kvmesh::decode_attention_cpu")
    def _decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, block_table: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return query.new_empty(query.shape)

    if hasattr(torch.ops.kvmesh, "int8_linear_cpu"):  # AVX-512 builds only

        @torch.library.register_fake("kvmesh::int8_linear_cpu")
        def _int8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor,
                             scales: torch.Tensor) -> torch.Tensor:
            return x.new_empty(x.shape[0], qweight.shape[0])

    if hasattr(torch.ops.kvmesh, "int8_dynamic_linear_cpu"):

        @torch.library.register_fake("kvmesh::int8_dynamic_linear_cpu")
        def _int8_dynamic_linear_cpu(x: torch.Tensor, qweight: torch.Tensor,
                                     scales: torch.Tensor, weight_sums: torch.Tensor,
                                     use_vnni: bool = True) -> torch.Tensor:
            return x.new_empty(x.shape[0], qweight.shape[0])

    @torch.library.register_fake("kvmesh::gguf_linear_cpu")
    def _gguf_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, quant_type: int,
                         use_vnni: bool = True) -> torch.Tensor:
        return x.new_empty(x.shape[0], qweight.shape[0])

    @torch.library.register_fake("kvmesh::gguf_linear_packed_cpu")
    def _gguf_linear_packed_cpu(x: torch.Tensor, packed: torch.Tensor, quant_type: int,
                                use_vnni: bool = True) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])


if __name__ == "__main__":
    # python -m kernels.cpu_extension [ISA ...]: builds the libraries (every ISA's by default).
    for name in sys.argv[1:] or _ISA_FLAGS:
        print(build_cpu_kernels(name)[0])
