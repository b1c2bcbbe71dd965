"""`CUDAGraphWrapper`: captures and replays one callable, bound to one runtime mode.

The model runner wraps the whole model once with a FULL wrapper and, for
PIECEWISE graphs, each piece of the model between attention calls with a
PIECEWISE wrapper. The forward context decides per step which of them is
active: at most one kind, so a full graph never contains a piecewise one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.cudagraph.mode import CUDAGraphMode
from services.worker.forward_context import BatchDescriptor, ForwardContext


@dataclass(slots=True)
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the tensor arguments the graph reads, at capture time
    output: Any  # what the callable returned, as views of the static output buffers


class CUDAGraphWrapper:
    """Calls ``runnable`` eagerly, or captures/replays it in a CUDA graph per batch key.

    When ``forward_context``'s runtime mode is this wrapper's, the first call
    with a key captures a graph (the runner warmed it up eagerly first) and
    later calls replay it; with any other mode it calls straight through.

    Contract for graph mode:
      * Tensor arguments (positional, or inside a list/tuple argument) are
        read at the addresses they had at capture; an argument at another
        address is first copied there. Callers pass static buffers (the
        runner's persistent inputs, outputs of the previous piece), so the
        copy never happens on the hot path. Anything else the callable reads
        (caches, attention metadata) must be static buffers too.
      * Outputs are a tensor or a tuple of tensors whose first dimension is the
        key's num_tokens. They live in static buffers owned by the wrapper,
        taken from its first (largest) capture; later captures write slices of
        them. So keys must be captured largest first, and the returned tensors
        are overwritten by the next replay.
      * All graphs share ``graph_pool``: they never run concurrently, so each
        one's temporaries may reuse the memory another's used.
    """

    def __init__(self, runnable: Callable[..., Any], runtime_mode: CUDAGraphMode,
                 graph_pool: Any, forward_context: ForwardContext) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a wrapper's runtime mode is FULL or PIECEWISE, not {runtime_mode.name}")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.graph_pool = graph_pool
        self.forward_context = forward_context
        self._entries: dict[BatchDescriptor, _Entry] = {}
        self._static_outputs: tuple[torch.Tensor, ...] | None = None

    def __call__(self, *args: Any) -> Any:
        context = self.forward_context
        if context.cudagraph_runtime_mode is not self.runtime_mode:
            return self.runnable(*args)
        key = context.batch_descriptor
        entry = self._entries.get(key)
        if entry is None:
            # Capture only records the work; the replay below computes this call's result.
            entry = self._entries[key] = self._capture(key, args)
        else:
            _copy_moved_inputs(entry.inputs, _tensor_args(args))
        entry.graph.replay()
        return entry.output

    @property
    def captured_keys(self) -> set[BatchDescriptor]:
        return set(self._entries)

    def _capture(self, key: BatchDescriptor, args: tuple[Any, ...]) -> _Entry:
        if self._static_outputs is not None and self._static_outputs[0].shape[0] < key.num_tokens:
            raise ValueError(f"key {key} captured after a smaller one "
                             f"({self._static_outputs[0].shape[0]} tokens): capture the largest key first")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            output = self._to_static_outputs(key, self.runnable(*args))
        return _Entry(graph, _tensor_args(args), output)

    def _to_static_outputs(self, key: BatchDescriptor, output: Any) -> Any:
        """Output as views of the static buffers; runs inside the capture."""
        tensors = output if isinstance(output, tuple) else (output,)
        if any(t.shape[0] != key.num_tokens for t in tensors):
            raise ValueError(f"outputs {[tuple(t.shape) for t in tensors]} must have "
                             f"{key.num_tokens} rows (the key's num_tokens)")
        if self._static_outputs is None:
            self._static_outputs = tensors  # the largest key: its outputs are the buffers
            return output
        static = [buffer[: key.num_tokens].copy_(tensor)
                  for buffer, tensor in zip(self._static_outputs, tensors, strict=True)]
        return tuple(static) if isinstance(output, tuple) else static[0]


def _tensor_args(args: tuple[Any, ...]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            tensors.append(arg)
        elif isinstance(arg, (list, tuple)):
            tensors.extend(a for a in arg if isinstance(a, torch.Tensor))
    return tensors


def _copy_moved_inputs(captured: list[torch.Tensor], current: list[torch.Tensor]) -> None:
    if len(captured) != len(current):
        raise ValueError(f"graph captured with {len(captured)} tensor arguments, called with {len(current)}")
    for static, tensor in zip(captured, current):
        if tensor.data_ptr() != static.data_ptr():
            static.copy_(tensor)
