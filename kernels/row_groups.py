"""How kvmesh's CPU linear kernels prefetch weight rows, for the whole process.

Every linear kernel in ``kernels/csrc`` reads its weight in small groups of rows
(``row_groups.h``) and prefetches the next group while one computes: all of it
(``"whole_group"``, the default), its first few cache lines, leaving the rest to
the hardware prefetcher (``"first_lines"``), or nothing (``"none"``). Or no group
is prefetched and the one-row loops (a decode step's) of the packed GGUF kernel,
of the bfloat16 kernel (every path) and of the w8a8 kernel's AVX2 path (not
VNNI's) prefetch a fixed distance ahead of their reads, a line at a time
(``"ahead"``). Which is fastest depends on the CPU (benchmarks/RESULTS.md), so the
worker measures it at start (``services/worker/layers/prefetch_choice.py``).
Results are the same bits in every mode.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import has_cpu_kernel

PREFETCH_MODES = ("whole_group", "first_lines", "none", "ahead")  # row_groups.h's RowGroupPrefetch


def set_row_group_prefetch(mode: str) -> None:
    """Makes every kernel call from now on prefetch as ``mode`` says; ValueError for
    a mode not in ``PREFETCH_MODES``. Nothing to set where the kernels could not be built."""
    if mode not in PREFETCH_MODES:
        raise ValueError(f"row-group prefetch mode must be one of {', '.join(PREFETCH_MODES)}, "
                         f"got {mode!r}")
    if has_cpu_kernel("set_row_group_prefetch"):
        torch.ops.kvmesh.set_row_group_prefetch(PREFETCH_MODES.index(mode))


def row_group_prefetch() -> str:
    """The mode in force ("whole_group" where the kernels could not be built)."""
    if not has_cpu_kernel("row_group_prefetch"):
        return PREFETCH_MODES[0]
    return PREFETCH_MODES[torch.ops.kvmesh.row_group_prefetch()]
