"""torch.compile of the model's pieces, with an on-disk cache of what it builds.

The CPU counterpart of piecewise CUDA graphs: the three piece functions between
attention calls (first, middle, last) are compiled once each by inductor, which
fuses the elementwise work (RMSNorm with its residual add, rotary, SiLU-and-mul)
into a few C++ loops around the matmuls (on CUDA, a few Triton kernels, which the
graphs then capture). Shapes are dynamic, so one graph serves every batch size
(torch specializes a batch of one token). Inductor writes its generated code and
FX graphs under a cache directory; a restarted worker finds them there and skips
both the build and the C++ compile.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental import _config as fx_config

from services.common.model_files import cache_root

logger = logging.getLogger(__name__)
# Inductor reads its cache location from this variable whenever it looks it up.
_INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_compile_cache_dir() -> Path:
    """``<kvmesh cache>/inductor`` (``KVMESH_CACHE_DIR`` moves the kvmesh cache)."""
    return cache_root() / "inductor"


def use_compile_cache(cache_dir: str | os.PathLike | None) -> Path:
    """Points inductor's cache at ``cache_dir`` (None: the default), unless the user
    already set ``TORCHINDUCTOR_CACHE_DIR``; returns the directory in use.

    Process-wide by nature: inductor has one cache directory per process.
    """
    if _INDUCTOR_CACHE_ENV in os.environ and cache_dir is None:
        return Path(os.environ[_INDUCTOR_CACHE_ENV])
    path = Path(cache_dir) if cache_dir is not None else default_compile_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ[_INDUCTOR_CACHE_ENV] = str(path)
    return path


@functools.cache
def cpp_compiler_available() -> bool:
    """Whether inductor finds a C++ compiler (it needs one to compile for the CPU)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # RuntimeError when none is found; anything else is as bad
        logger.warning("event=no_cpp_compiler error=%r: the CPU worker runs eagerly", e)
        return False
    return True


def private_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own: torch keeps what it compiled for a
    function (dynamo's variants, a nested compile region's reusable subgraphs, and
    their limits) per code object, so a copy keeps one model's apart from another's."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


# torch keeps the compiler settings a program makes per thread (in context
# variables): made where the worker was built, they would not hold on the step
# pipeline's thread, which traces whatever variant warm-up did not build.
_configured: contextvars.ContextVar[bool] = contextvars.ContextVar("kvmesh_compiler_configured",
                                                                   default=False)


def _configure_compiler() -> None:
    """Applies kvmesh's compiler settings in the calling context, once per context."""
    if _configured.get():
        return
    # Dynamo ties dynamic sizes that happen to be equal when it traces ("duck
    # shaping"): a decode of 3 requests whose block table had 3 columns gave a
    # graph that only ran while the two matched. No sizes here are equal by
    # design, so none are tied.
    fx_config.use_duck_shape = False
    # Python floats (a layer's scale, its norm's epsilon) are constants of the model.
    # Traced as symbols, they make dynamo compile a graph, throw it away (uncached)
    # and trace again with them specialized (40 s per start for a decode step), and
    # inside a nested compile region inductor fails on them.
    torch._dynamo.config.specialize_float = True
    _configured.set(True)


def compile_piece(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by inductor for dynamic shapes, with compiled variants of its own.

    Dynamo keeps the compiled variants of a function, and its limit of 8 of them,
    per code object. Compiling a private copy of ``fn``'s code gives each model its
    own variants (batch of one, larger batches), instead of every model in the
    process (another dtype, int8) failing the others' guards and recompiling.
    Identical graphs still come from inductor's cache. Each call first applies
    kvmesh's compiler settings on its thread (a context-variable read once set).
    """
    # No guards on the modules passed in (a decode step's ran to ~1.3 ms per call
    # over 30 layers): a model is never changed once compiled, and every layer
    # a shared middle piece runs has the same structure. Tensor arguments and
    # their shapes are still guarded. That is safe only for the private copy:
    # fullgraph, so that dynamo raises rather than falling back to compiling the
    # modules' own forward methods, whose code every model in the process shares.
    # Nor does inductor assert every input's size and strides on each call (~1,000
    # asserts over a decode step's 30 layers took 2.8 ms of a 13 ms one-stream step
    # on a Zen 3): dynamo's guards check the step's own tensors, and the modules'
    # (the weights) are fixed once the model is loaded, as above.
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
               "size_asserts": False}
    compiled = torch.compile(private_copy(fn), dynamic=True, fullgraph=True, options=options)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        _configure_compiler()
        return compiled(*args, **kwargs)
    return run
