"""The forward context: what every CUDA graph wrapper of a forward pass reads.

The model runner decides, once per step, the runtime mode (NONE, PIECEWISE or
FULL) and the padded batch's `BatchDescriptor` (the CudagraphDispatcher's
answer), and sets them in its `ForwardContext` for the duration of the forward
pass. Wrappers trust it: they never decide on their own whether a graph exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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


class ForwardContext:
    """The runtime mode and batch key of the forward pass in progress.

    One per model runner, handed to each of its wrappers: the runner sets it
    around every forward pass, the wrappers read it. Outside ``set`` the mode
    is NONE (eager) with no key.
    """

    __slots__ = ("cudagraph_runtime_mode", "batch_descriptor")

    def __init__(self) -> None:
        self.cudagraph_runtime_mode = CUDAGraphMode.NONE
        self.batch_descriptor: BatchDescriptor | None = None

    @contextmanager
    def set(self, cudagraph_runtime_mode: CUDAGraphMode,
            batch_descriptor: BatchDescriptor | None) -> Iterator[None]:
        """Sets the mode and key for the forward pass run inside the ``with`` block."""
        if cudagraph_runtime_mode is not CUDAGraphMode.NONE and batch_descriptor is None:
            raise ValueError(f"runtime mode {cudagraph_runtime_mode.name} needs a batch_descriptor")
        previous = self.cudagraph_runtime_mode, self.batch_descriptor
        self.cudagraph_runtime_mode, self.batch_descriptor = cudagraph_runtime_mode, batch_descriptor
        try:
            yield
        finally:
            self.cudagraph_runtime_mode, self.batch_descriptor = previous
