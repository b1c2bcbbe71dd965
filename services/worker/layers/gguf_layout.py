"""Which layout a GGUF weight is kept in on this machine: measured once per block type.

A GGUF layer's kernel reads either the file's own rows (``gguf_linear_cpu``) or the
same bytes repacked at load by eight rows (``gguf_linear_packed_cpu``); both run
AVX512-VNNI where the CPU has it, else AVX2 (``kernels/gguf_linear_cpu.py``). On the
AVX2-only EPYC (Zen 3, 2 threads) the packed kernel took 0.5-0.85x the time at one
row and four; on a Xeon with AMX the two tied for Q8_0 until the packed kernel
had a VNNI path (since: file's rows 58.7, packed 54.0 µs). So the worker measures
rather than assumes: per block type, the fastest call of each at one row (a decode
step), on copies of a decode-sized weight that together exceed the last-level
cache, as ``linear_choice`` measures.

Cached beside ``linear_choice``'s tables (same keys: CPU, threads, torch, kernel
sources), one file per block type; editing its ``packed`` overrides the choice.
"""

from __future__ import annotations

import functools
import itertools
import logging

import torch

from kernels import gguf_quants
from kernels.cpu_extension import has_cpu_kernel
from kernels.gguf_linear_cpu import PACK_ROWS, pack_rows
from services.worker.layers.linear_choice import (cache_dir, fastest_in_best_mode,
                                                  last_level_cache_bytes, load_choice,
                                                  store_choice)

logger = logging.getLogger(__name__)

PLAIN, PACKED = "file's rows", "packed by eight"
# SmolLM2-135M's gate/up shard: a weight of the size a decode step streams.
MEASURED_SHAPE = (1536, 576)
MAX_COPIES = 256


def measure_layouts(quant_type: int, shape: tuple[int, int] = MEASURED_SHAPE) -> dict[str, float]:
    """Seconds of each layout's fastest one-row call, in its fastest prefetch mode
    (``linear_choice.fastest_in_best_mode``), each call on its next copy of a random
    weight of ``shape`` in ``quant_type``'s blocks."""
    gen = torch.Generator().manual_seed(0)
    qweight = gguf_quants.quantize(torch.randn(*shape, generator=gen) * 0.05, quant_type)
    # The two layouts' copies, called in turn, together twice the cache.
    num_copies = min(MAX_COPIES, max(2, last_level_cache_bytes() // qweight.numel()))
    plain = [qweight.clone() for _ in range(num_copies)]
    packed_once = pack_rows(qweight, quant_type)
    packed = [packed_once.clone() for _ in range(num_copies)]
    x = torch.randn(1, shape[1], generator=gen)
    # Each call on its layout's next copy (a call per prefetch mode each round).
    plain_index, packed_index = itertools.count(), itertools.count(num_copies // 2)
    calls = {PLAIN: lambda i: torch.ops.kvmesh.gguf_linear_cpu(
                 x, plain[next(plain_index) % num_copies], quant_type),
             PACKED: lambda i: torch.ops.kvmesh.gguf_linear_packed_cpu(
                 x, packed[next(packed_index) % num_copies], quant_type)}
    return fastest_in_best_mode(calls, prefetching=calls, min_calls=num_copies // 2,
                                max_calls=num_copies)


@functools.cache
def packed_layout_wins(quant_type: int) -> bool:
    """Whether weights of ``quant_type`` are kept packed by eight rows on this machine
    (cached per process and on disk; measured where neither knows)."""
    if not (has_cpu_kernel("gguf_linear_packed_cpu") and has_cpu_kernel("gguf_linear_cpu")):
        return False
    name = gguf_quants.GGMLQuantizationType(quant_type).name
    path = cache_dir("gguf_layout") / f"{name}.json"
    packed = load_choice(path, "packed", lambda v: isinstance(v, bool))
    if packed is None:
        with torch.no_grad():
            timings = measure_layouts(int(quant_type))
        packed = timings[PACKED] < timings[PLAIN]
        store_choice(path, {"packed": packed,
                            "timings_us": {k: round(s * 1e6, 1) for k, s in timings.items()}})
        logger.info("event=gguf_layout_measured quant_type=%s packed=%s plain_us=%.1f "
                    "packed_us=%.1f path=%s", name, packed, timings[PLAIN] * 1e6,
                    timings[PACKED] * 1e6, path)
    return packed


def serves_packed(quant_type: int, out_features: int) -> bool:
    """Whether a weight of ``out_features`` rows in ``quant_type`` is kept packed."""
    return out_features % PACK_ROWS == 0 and packed_layout_wins(quant_type)
