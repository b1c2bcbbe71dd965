"""Which kernel multiplies a bfloat16 weight, per number of rows: measured on this machine.

kvmesh's bfloat16 kernel (``kernels/bf16_linear_cpu.py``) and oneDNN's prepacked
linear trade places with the CPU (oneDNN's products grow fast with AVX512-BF16 or
AMX, slowly without), the weight's shape and the threads, so the worker measures
rather than assumes. For each weight shape, once: the fastest of a few calls of
each kernel at 1, 2, 4, ..., 256 rows (ours in its fastest row-group prefetch
mode), the kernels called in turn on copies of the weight that together exceed
the last-level cache, so that calls read their weight from memory as a decode
step does. The choice (``choose_max_rows``): the largest row count up to which
ours won or tied (within 10%) at every count measured, 0 where it lost at one row,
``UNBOUNDED_ROWS`` where it won at 256 too (both are compute-bound by then and
scale alike with rows, so a prefill's thousands of rows go to the winner at 256).

Measured on the benchmark machine (Xeon, Cascade Lake: AVX-512 and VNNI, no
AVX512-BF16 or AMX; 2 threads): ours won at every row count for every shape of
SmolLM2-135M: 0.55-0.7x oneDNN's time at one row, 0.25-0.5x at 2 to 256 rows
(``benchmarks/cpu_kernels.py --choice-only`` prints the table). On a Xeon with
AMX and AVX512-BF16 (2 threads) ours won at 1 and 2 rows (0.55-0.8x oneDNN's
prepacked time at one) and oneDNN from 4 or 8 rows on.

A machine's tables are cached under the kvmesh cache directory, keyed by the CPU
(model name and flags), the threads, torch's version and the kernel's source, so
a restart does not measure again; a file that cannot be read or does not hold a
table is measured anew and replaced. Editing a file's ``max_rows`` (0: oneDNN
only) overrides the choice on that machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.cpu_extension import BUILD_INPUTS
from kernels.row_groups import PREFETCH_MODES, row_group_prefetch, set_row_group_prefetch
from services.common.model_files import cache_root
from services.worker.layers.bf16_linear import UNBOUNDED_ROWS, can_use_bf16_kernel
from services.worker.layers.packed_linear import can_pack

logger = logging.getLogger(__name__)

NUM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OURS, ONEDNN, ONEDNN_PLAIN = "kvmesh", "oneDNN prepacked", "oneDNN plain"
# Weights taller than this are measured on this many rows of theirs (the LM head's
# 49,152): per weight row both kernels do the same work, and the whole head at 256
# rows would take seconds of the worker's start.
MAX_MEASURED_OUT_FEATURES = 2048
MAX_COPIES = 64  # of a small weight (a tiny test model's), whatever the cache
MAX_PACKED_COPIES = 8
TIE = 1.1  # ours within 10% of theirs: a tie, ours (``_ours_lost``)
_CACHE_VERSION = 3  # 2: our bfloat16 kernel timed in its fastest prefetch mode; 3: GGUF layouts too


@dataclasses.dataclass(slots=True)
class WeightCopies:
    """Copies of one random bfloat16 weight: plain ones that together fill the
    last-level cache, and up to ``MAX_PACKED_COPIES`` prepacked for oneDNN.

    ``next_index`` walks them round-robin, so that a plain copy comes back to our
    kernel only after twice the cache has been read: from memory, as in a decode
    step. oneDNN's copies are fewer, as each costs a reorder (0.7 ms here on a
    quiet machine, 3.5 ms on a busy one: oneDNN plans the layout anew every time):
    its calls read from the cache more often than ours, which leans the
    measurement its way.
    """

    plain: list[torch.Tensor]
    packed: list[torch.Tensor]
    cursor: int = 0

    @classmethod
    def make(cls, out_features: int, in_features: int) -> WeightCopies:
        gen = torch.Generator().manual_seed(0)
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
        num_bytes = weight.numel() * weight.element_size()
        num_copies = min(MAX_COPIES, max(1, round(last_level_cache_bytes() / num_bytes)))
        plain = list(weight.expand(num_copies, out_features, in_features).contiguous())
        packed = ([torch.ops.mkldnn._reorder_linear_weight(w) for w in plain[:MAX_PACKED_COPIES]]
                  if can_pack(torch.bfloat16, weight.device) else [])
        return cls(plain, packed)

    def next_index(self) -> int:
        self.cursor += 1
        return self.cursor


# Kernel name -> call(x, copies, index). The worker weighs the first two; the
# benchmark adds oneDNN on the plain weight, what Bf16Linear runs above max_rows.
KERNELS: dict[str, Callable[[torch.Tensor, WeightCopies, int], torch.Tensor]] = {
    OURS: lambda x, w, i: torch.ops.kvmesh.bf16_linear_cpu(x, w.plain[i % len(w.plain)]),
    ONEDNN: lambda x, w, i: torch.ops.mkldnn._linear_pointwise(x, w.packed[i % len(w.packed)],
                                                               None, "none", [], ""),
    ONEDNN_PLAIN: lambda x, w, i: F.linear(x, w.plain[i % len(w.plain)]),
}


def rival() -> str:
    """What our kernel is measured against, and what ``Bf16Linear`` runs above its
    ``max_rows``: oneDNN's prepacked linear where oneDNN has native bfloat16, else
    ``F.linear`` on the plain weight (AVX2-only CPUs, where ours won 3-5x from 8
    rows on and tied at one)."""
    return ONEDNN if can_pack(torch.bfloat16, torch.device("cpu")) else ONEDNN_PLAIN


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (Linux's sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if size[:-1].isdigit() and size[-1] in "KM":
            sizes.append(int(size[:-1]) << (10 if size[-1] == "K" else 20))
    return max(sizes, default=32 << 20)


def fastest_call_s(calls: Mapping[str, Callable[[int], object]], min_calls: int = 3,
                   max_calls: int = 15, budget_s: float = 0.02) -> dict[str, float]:
    """Seconds of each call's fastest run: the calls in turn, each given the round's
    index, ``min_calls`` rounds and then on while under ``budget_s``, up to
    ``max_calls``. The fastest call, not the median: on a shared machine a call is
    only ever slowed, and its other work stalled whole stretches of calls by a
    scheduler slice (~4 ms, 30x a one-row call), enough to flip a median of a few
    calls and with it a choice that is then cached."""
    fastest_s = dict.fromkeys(calls, float("inf"))
    start = time.perf_counter()
    for i in range(max_calls):
        if i >= min_calls and time.perf_counter() - start > budget_s:
            break
        for name, call in calls.items():
            call_start = time.perf_counter()
            call(i)
            fastest_s[name] = min(fastest_s[name], time.perf_counter() - call_start)
    return fastest_s


def fastest_in_best_mode(calls: Mapping[str, Callable[[int], object]], prefetching: Iterable[str],
                         min_calls: int = 3, max_calls: int = 15,
                         budget_s: float = 0.02) -> dict[str, float]:
    """``fastest_call_s`` of ``calls``, those named in ``prefetching`` (kvmesh's kernels,
    which read their weights as the row-group prefetch mode says) made in each mode,
    their fastest counting; the mode in force is put back.

    The worker picks the mode later, on its own decode step (``prefetch_choice``),
    and a kernel timed in the default one only can mislead: on a Xeon with AMX our
    bfloat16 kernel at one row took twice as long prefetching whole groups as in
    any other mode, and lost to oneDNN where it won in the others; the GGUF layouts
    swapped places (benchmarks/RESULTS.md).
    """
    moded = set(prefetching)
    by_mode: dict[str, Callable[[int], object]] = {}
    for name, call in calls.items():
        if name not in moded:
            by_mode[name] = call
            continue
        for mode in PREFETCH_MODES:
            def in_mode(i: int, call=call, mode=mode) -> object:
                set_row_group_prefetch(mode)
                return call(i)
            by_mode[f"{name} ({mode})"] = in_mode
    mode_in_force = row_group_prefetch()
    try:
        fastest = fastest_call_s(by_mode, min_calls, max_calls, budget_s)
    finally:
        set_row_group_prefetch(mode_in_force)
    return {name: (min(fastest[f"{name} ({mode})"] for mode in PREFETCH_MODES)
                   if name in moded else fastest[name]) for name in calls}


def time_rows(copies: WeightCopies, num_rows: int, kernels: Iterable[str], min_calls: int = 3,
              max_calls: int = 15, budget_s: float = 0.02) -> dict[str, float]:
    """Seconds of each kernel's fastest call (``fastest_call_s``) at ``num_rows`` rows
    of bfloat16 x, each call on its next copy. oneDNN's first call at a shape,
    which builds its primitive, is one of the calls (not the fastest) rather than
    an untimed warm-up that would cost the large products a call each.

    Ours is timed in its fastest row-group prefetch mode (``fastest_in_best_mode``).
    """
    x = torch.randn(num_rows, copies.plain[0].shape[1]).bfloat16()
    calls = {name: (lambda i, kernel=KERNELS[name]: kernel(x, copies, copies.next_index()))
             for name in kernels}
    return fastest_in_best_mode(calls, {OURS} & set(kernels), min_calls, max_calls, budget_s)


def measure_rows(num_rows: Iterable[int], time_at: Callable[[int], dict[str, float]],
                 ours: str = OURS, theirs: str = ONEDNN,
                 stop_at_first_loss: bool = True) -> dict[int, dict[str, float]]:
    """rows -> name -> seconds, ``time_at(rows)`` for each count of ``num_rows``. A
    count at which ``ours`` lost to ``theirs`` is timed once more (the faster of
    the two counts), so that a stretch of stalls does not decide; then, unless
    told otherwise, it stops (``choose_max_rows`` reads no further)."""
    timings: dict[int, dict[str, float]] = {}
    for rows in num_rows:
        timings[rows] = time_at(rows)
        if _ours_lost(timings[rows], ours, theirs):
            again = time_at(rows)
            timings[rows] = {name: min(s, again[name]) for name, s in timings[rows].items()}
            if stop_at_first_loss and _ours_lost(timings[rows], ours, theirs):
                break
    return timings


def measure_row_timings(out_features: int, in_features: int, num_rows: Iterable[int] = NUM_ROWS,
                        kernels: Iterable[str] | None = None, theirs: str | None = None,
                        stop_at_first_loss: bool = True) -> dict[int, dict[str, float]]:
    """rows -> kernel -> seconds of its fastest call (``time_rows``) for an
    [out_features, in_features] bfloat16 weight (at most
    ``MAX_MEASURED_OUT_FEATURES`` rows of it), with the threads torch has now,
    measured as ``measure_rows`` says against ``theirs`` (default: ``rival()``);
    ``kernels`` defaults to ours and theirs."""
    theirs = theirs or rival()
    kernels = tuple(kernels or (OURS, theirs))
    with torch.no_grad():
        copies = WeightCopies.make(min(out_features, MAX_MEASURED_OUT_FEATURES), in_features)
        return measure_rows(num_rows, lambda rows: time_rows(copies, rows, kernels),
                            theirs=theirs, stop_at_first_loss=stop_at_first_loss)


def _ours_lost(timings: Mapping[str, float], ours: str = OURS, theirs: str = ONEDNN) -> bool:
    """Lost by more than a tie: within ``TIE`` of theirs counts as a win. A one-row
    call is memory-bound either way, and which of two such calls is faster is the
    machine's noise; but a loss there sends every count to theirs. On the AVX2-only
    EPYC a tie at one row (184 against 169 us) did, for a weight on which ours
    was 5x faster from 8 rows on."""
    return timings[ours] > timings[theirs] * TIE


def choose_max_rows(timings: Mapping[int, Mapping[str, float]], ours: str = OURS,
                    theirs: str = ONEDNN) -> int:
    """The largest row count up to which ``ours`` (by default kvmesh's kernel) was
    faster than ``theirs`` (oneDNN's prepacked linear), or tied, at every count
    measured: 0 where it lost at the smallest, ``UNBOUNDED_ROWS`` where it won at
    every count, the largest included."""
    max_rows = 0
    for rows in sorted(timings):
        if _ours_lost(timings[rows], ours, theirs):
            return max_rows
        max_rows = rows
    return UNBOUNDED_ROWS


def cache_dir(kind: str = "bf16") -> Path:
    """This machine's tables of ``kind``, one file per weight shape (or model), in a
    directory per CPU (model name and flags), threads, torch version and C++ kernel
    library, since each changes the timings."""
    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            cpu.setdefault(name.strip(), value.strip())  # the first processor's
    except OSError:  # not Linux: what Python knows of the machine
        cpu["model name"] = os.uname().machine
    key = hashlib.sha256()
    key.update(f"{cpu.get('model name')}|{cpu.get('flags')}|{torch.get_num_threads()}|"
               f"{torch.__version__}|{_CACHE_VERSION}|".encode())
    for source in BUILD_INPUTS:
        key.update(source.read_bytes())
    return cache_root() / "linear_choice" / f"{kind}_{key.hexdigest()[:16]}"


def _cache_file(directory: Path, shape: tuple[int, int]) -> Path:
    return directory / f"{shape[0]}x{shape[1]}.json"


def load_choice(path: Path, key: str, valid: Callable[[object], bool]) -> Any:
    """The ``key`` stored in ``path`` where ``valid``; None where the file is missing,
    unreadable or holds no valid such value (then the choice is measured anew)."""
    try:
        value = json.loads(path.read_text())[key]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("event=linear_choice_cache_unreadable path=%s error=%r", path, e)
        return None
    if not valid(value):
        logger.warning("event=linear_choice_cache_unreadable path=%s %s=%r", path, key, value)
        return None
    return value


def store_choice(path: Path, record: Mapping[str, object]) -> None:
    """Writes ``record`` (a choice and, for whoever reads the file, the timings it
    came from) to a temporary file renamed over ``path``: a concurrent reader sees
    the old file or the new one. Where it cannot be written (a read-only cache),
    logs why: the worker still starts, and measures again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(record, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("event=linear_choice_cache_unwritable path=%s error=%r", path, e)


def load_max_rows(path: Path) -> int | None:
    """The ``max_rows`` stored in ``path`` (``load_choice``): a count of rows."""
    return load_choice(path, "max_rows", lambda v: type(v) is int and v >= 0)


def store_max_rows(path: Path, max_rows: int, timings: Mapping[int, Mapping[str, float]]) -> None:
    """``store_choice`` of ``max_rows`` and its timings, in us."""
    timings_us = {rows: {name: round(s * 1e6, 1) for name, s in by_kernel.items()}
                  for rows, by_kernel in timings.items()}
    store_choice(path, {"max_rows": max_rows, "timings_us": timings_us})


def bf16_max_rows_by_shape(weights: Iterable[torch.Tensor]) -> dict[tuple[int, int], int]:
    """Shape -> ``max_rows`` for each distinct shape among ``weights`` that
    ``Bf16Linear`` can serve (others are left out: all of them without the C++
    kernels).

    Read from this machine's cache; a shape not in it is measured (SmolLM2-135M's
    five took ~1 s on the benchmark machine) and stored.
    """
    shapes = sorted({tuple(w.shape) for w in weights if can_use_bf16_kernel(w)})
    if not shapes:
        return {}
    directory = cache_dir()
    theirs = rival()
    table = {}
    for shape in shapes:
        path = _cache_file(directory, shape)
        max_rows = load_max_rows(path)
        if max_rows is None:
            start = time.perf_counter()
            timings = measure_row_timings(*shape, theirs=theirs)
            max_rows = choose_max_rows(timings, theirs=theirs)
            store_max_rows(path, max_rows, timings)
            logger.info("event=linear_choice_measured shape=%s max_rows=%d seconds=%.2f path=%s",
                        shape, max_rows, time.perf_counter() - start, path)
        table[shape] = max_rows
    return table
