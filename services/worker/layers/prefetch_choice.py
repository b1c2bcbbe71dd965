"""How the CPU linear kernels prefetch weight rows, measured at start on the model's step.

The kernels' row-group loop can prefetch the whole next group, its first lines or
nothing, or the one-row loops a fixed distance ahead as they read
(``kernels/row_groups.py``). On a Zen 3 guest, with the weights on huge pages, the
fused bfloat16 decode step at one row ran 1.21-1.22x faster with no software
prefetch than with the whole group (an engine step 1.23x), and the GGUF step was
level, where first lines lost 0.87x; ahead of the reads then ran both 1.07-1.13x
faster again. The w8a8 step there was fastest with the whole group until its AVX2
loop read ahead too (1.06-1.22x faster then). On the Zen 5 the whole group,
non-temporally, had gained 1.07x over a temporal one (benchmarks/RESULTS.md). So
rather than assume, the worker times its own decode step in each mode,
alternating, the weights evicted from the caches before every call as a step
finds them, and keeps the fastest for the process. Results are the same bits in
every mode, so the choice changes only speed.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from kernels.row_groups import PREFETCH_MODES, set_row_group_prefetch
from services.worker.layers.linear_choice import last_level_cache_bytes

logger = logging.getLogger(__name__)

# Each mode's step is timed this many times, in rounds whose order alternates: with
# four, "ahead" won 5 of 6 choices on the Zen 3 where it was 1.07x faster; with eight
# or more, every one (about half a second at start).
NUM_ROUNDS = 8


def choose_row_group_prefetch(step: Callable[[], object],
                              num_rounds: int = NUM_ROUNDS) -> dict[str, float]:
    """Times ``step`` (a decode step reading the model's weights) in each prefetch
    mode, sets the one with the least median for the process and returns every
    mode's median seconds."""
    # Read between calls: twice the last-level cache pushes the weights out of it.
    evict = torch.ones(max(64 << 20, 2 * last_level_cache_bytes()) // 4)
    step()  # a first call's one-off costs are no mode's
    times: dict[str, list[float]] = {mode: [] for mode in PREFETCH_MODES}
    for n in range(num_rounds):
        for mode in PREFETCH_MODES if n % 2 == 0 else PREFETCH_MODES[::-1]:
            set_row_group_prefetch(mode)
            evict.sum()
            start = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    chosen = min(medians, key=medians.__getitem__)
    set_row_group_prefetch(chosen)
    logger.info("event=row_group_prefetch chosen=%s %s", chosen,
                " ".join(f"{m}_ms={s * 1e3:.2f}" for m, s in medians.items()))
    return medians
