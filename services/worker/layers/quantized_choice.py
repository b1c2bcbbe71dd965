"""Up to how many rows a quantized model's layers use their kernel: measured on this machine.

A quantized layer (``QuantizedLinear``: int8, w8a8, GGUF blocks) multiplies a
few rows with its kernel, which reads the packed weight once, and many rows by
dequantizing the weight and calling torch's GEMM, which pays the dequantization
at every call but multiplies at the GEMM's rate. Where the two cross depends on
the CPU (VNNI, AVX-512 or AVX2 only), the threads, the format and the dtype:
on the benchmark machine (Cascade Lake, 2 threads, float32) w8a8's kernel won
at every row count up to 512, weight-only int8's and gguf's up to 128. So the worker
measures, once per machine and model, on the model's own layers: at 1, 2, 4,
..., 512 rows, each distinct layer shape's fastest call of each way (the two in
turn, across the layers of that shape; a tall LM head on its first
``MAX_MEASURED_OUT_FEATURES`` channels, scaled up), summed over the model as a
step would call them. The choice is one row count for the whole model, the
largest up to which the kernels won at every count
(``linear_choice.choose_max_rows``; unbounded where they won at 512 too), so that a compiled
step has one narrow and one wide variant (``warmup``) rather than one per
layer boundary.

Cached as ``linear_choice``'s tables are (same keys: CPU, threads, torch,
kernel sources), one file per model layout; editing its ``max_rows`` overrides
the choice on that machine.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from services.worker.layers.bf16_linear import UNBOUNDED_ROWS
from services.worker.layers.linear_choice import (
    MAX_MEASURED_OUT_FEATURES,
    cache_dir,
    choose_max_rows,
    fastest_call_s,
    load_max_rows,
    measure_rows,
    store_max_rows,
)
from services.worker.layers.quantization import QuantizedLinear

logger = logging.getLogger(__name__)

NUM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
KERNEL, DEQUANTIZE = "kernel", "dequantize then GEMM"


def _group_key(layer: QuantizedLinear) -> str:
    """What makes two layers cost the same: class, weight format and shape."""
    return (f"{type(layer).__name__}:{layer.weight_format}:"
            f"{layer.out_features}x{layer.in_features}")


def layer_groups(layers: Iterable[QuantizedLinear]) -> dict[str, tuple[list[QuantizedLinear], float]]:
    """Layer key -> (the layers to time, how many full layers one timed call stands
    for). A layer taller than ``MAX_MEASURED_OUT_FEATURES`` is timed narrowed to
    that many channels, and counts for its height over that."""
    groups: dict[str, tuple[list[QuantizedLinear], float]] = {}
    for layer in layers:
        key = _group_key(layer)
        timed, count = groups.get(key, ([], 0.0))
        if layer.out_features > MAX_MEASURED_OUT_FEATURES:
            timed = timed or [layer.narrow(MAX_MEASURED_OUT_FEATURES)]
            count += layer.out_features / MAX_MEASURED_OUT_FEATURES
        else:
            timed, count = timed + [layer], count + 1
        groups[key] = (timed, count)
    return groups


def time_group(layers: Sequence[QuantizedLinear], num_rows: int, dtype: torch.dtype,
               min_calls: int = 3, max_calls: int = 10, budget_s: float = 0.02) -> dict[str, float]:
    """Seconds of the fastest call of each way at ``num_rows`` rows
    (``linear_choice.fastest_call_s``), each round on the group's next layer."""
    x = torch.randn(num_rows, layers[0].in_features).to(dtype)
    ways = {KERNEL: lambda i: layers[i % len(layers)].kernel_linear(x),
            DEQUANTIZE: lambda i: layers[i % len(layers)].dequantized_linear(x)}
    return fastest_call_s(ways, min_calls, max_calls, budget_s)


def measure_model_rows(layers: Sequence[QuantizedLinear], dtype: torch.dtype,
                       num_rows: Iterable[int] = NUM_ROWS,
                       stop_at_first_loss: bool = True) -> dict[int, dict[str, float]]:
    """rows -> way -> seconds a step's worth of ``layers`` takes that way (each
    group's fastest call times its count), measured as ``linear_choice.measure_rows``
    says: a count at which the kernels lost is timed once more, then it stops."""
    groups = layer_groups(layers)

    def step_s(rows: int) -> dict[str, float]:
        totals = dict.fromkeys((KERNEL, DEQUANTIZE), 0.0)
        for timed, count in groups.values():
            for name, seconds in time_group(timed, rows, dtype).items():
                totals[name] += seconds * count
        return totals

    with torch.no_grad():
        return measure_rows(num_rows, step_s, KERNEL, DEQUANTIZE, stop_at_first_loss)


def quantized_layers(model: nn.Module) -> list[QuantizedLinear]:
    """The layers of ``model`` (itself included) with a kernel to choose."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.has_kernel]


def set_kernel_max_rows_(model: nn.Module, dtype: torch.dtype) -> int | None:
    """Sets every quantized layer's ``kernel_max_rows`` to this machine's choice for
    ``model`` with activations in ``dtype`` (cached; measured where not), and
    returns it; None where ``model`` has no quantized layer with a kernel."""
    layers = quantized_layers(model)
    if not layers:
        return None
    groups = layer_groups(layers)
    layout = "|".join(f"{key}x{count:g}" for key, (_, count) in sorted(groups.items()))
    digest = hashlib.sha256(f"{layout}|{dtype}".encode()).hexdigest()[:16]
    path = cache_dir("quantized") / f"{digest}.json"
    max_rows = load_max_rows(path)
    if max_rows is None:
        start = time.perf_counter()
        timings = measure_model_rows(layers, dtype)
        max_rows = choose_max_rows(timings, KERNEL, DEQUANTIZE)
        store_max_rows(path, max_rows, timings)
        logger.info("event=quantized_choice_measured layout=%s max_rows=%d seconds=%.2f path=%s",
                    layout, max_rows, time.perf_counter() - start, path)
    for layer in layers:
        layer.kernel_max_rows = max_rows
    return max_rows


def wide_rows(model: nn.Module) -> int | None:
    """The fewest rows at which some quantized layer of ``model`` dequantizes
    (its ``kernel_max_rows`` + 1): where a compiled step's wide variant begins.
    None where no layer ever does."""
    max_rows = min((layer.kernel_max_rows for layer in quantized_layers(model)),
                   default=UNBOUNDED_ROWS)
    return None if max_rows >= UNBOUNDED_ROWS else max_rows + 1
