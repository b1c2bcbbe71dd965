"""The forward context: what every CUDA graph wrapper of a forward pass reads.

The model runner decides, once per step, the runtime mode (NONE, PIECEWISE or
FULL) and the padded batch's `BatchDescriptor` (the CudagraphDispatcher's
answer), and sets them here for the duration of the forward pass. Wrappers
trust it: they never decide on their own whether a graph exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from services.worker.cudagraph.mode import CUDAGraphMode


class BatchDescriptor(NamedTuple):
    """The dispatch key of a (padded) batch: one key, one CUDA graph per wrapper.

    num_tokens: tokens after padding to a capture size.
    num_reqs: requests the graph is built for: for a uniform batch, exactly
        ``num_tokens // query_len``; otherwise the most a batch of num_tokens
        may hold (``min(num_tokens, max_num_reqs)``). A batch with fewer
        requests is padded with empty ones.
    uniform: every request has the same query length (decode, or 1 +
        speculative tokens); the rest are mixed batches.
    """

    num_tokens: int
    num_reqs: int
    uniform: bool = False


@dataclass(frozen=True, slots=True)
class ForwardContext:
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None


_NO_CONTEXT = ForwardContext()
_forward_context = _NO_CONTEXT


def get_forward_context() -> ForwardContext:
    """The current forward pass's context; outside one, eager (NONE) with no key."""
    return _forward_context


@contextmanager
def set_forward_context(
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
) -> Iterator[ForwardContext]:
    """Sets the context for the forward pass run inside the ``with`` block."""
    global _forward_context
    if cudagraph_runtime_mode is not CUDAGraphMode.NONE and batch_descriptor is None:
        raise ValueError(f"runtime mode {cudagraph_runtime_mode.name} needs a batch_descriptor")
    previous = _forward_context
    _forward_context = ForwardContext(cudagraph_runtime_mode, batch_descriptor)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
