"""Linear kernels for a decode step on the CPU, per number of rows, on SmolLM2-135M's shapes.

For each weight shape the worker runs (q/k/v and gate/up fused) and M rows of
activations: microseconds per call and GB/s of weight read (the weight's bytes /
time) for kvmesh's GGUF kernel (Q4_0, Q4_1, Q8_0; on the file's rows and on rows
packed by eight, each on its AVX512-VNNI path where the CPU has one and on its AVX2
path), kvmesh's bfloat16 kernel and its AMX kernel (CPUs with AMX only), torch's
``F.linear`` in bfloat16 and float32 (oneDNN), kvmesh's weight-only int8 kernel and
its w8a8 kernel (int8 weights, activations quantized per token; VNNI and AVX2
paths). The table is what a dispatch
choice (rows x instruction set -> kernel) reads.

Decode streams the weights from memory (the model's blocks are bigger than the
last-level cache), so every call reads a different copy of the weight, cycling
through copies that together exceed the L3 cache; every call is timed over a few
passes and the median call is quoted (the machine is shared). The first line is the
machine's read bandwidth: ``Tensor.sum()`` over float32 twice the L3's size (at least
256 MiB) with the same threads, median of its repeats. Both sizes follow the L3
(``linear_choice.last_level_cache_bytes``): 36 MiB on one Xeon, 300 MiB on another.

Then the bfloat16 choice table (issue 24): for each bfloat16 weight shape the
worker runs (q/k/v and gate/up fused), the time of kvmesh's kernel, oneDNN's
prepacked linear (what ``Bf16Linear`` runs above its threshold) and oneDNN on the
plain weight (what it runs there where oneDNN has no native bfloat16) at 1 to 256
rows, measured as the worker measures them at start
(``services/worker/layers/linear_choice.py``: fastest call, weights from memory,
tall weights on 2,048 of their rows), the kernel chosen per row count and the
threshold (``max_rows``). Then the layout the worker keeps GGUF weights in, per
block type (``services/worker/layers/gguf_layout.py``: the file's rows or packed by
eight, whichever was faster at one row). Then, for the default model quantized each
way (int8, w8a8, gguf) in float32, the whole model's step of linear layers at 1 to 512
rows through the layers' kernels and through dequantize-then-GEMM, and the row
count the worker would choose (``services/worker/layers/quantized_choice.py``).
``--choice-only`` prints just those. Then batched decode: the w8a8 kernel (VNNI)
against oneDNN's prepacked bfloat16 linear at 16 to 256 rows of bfloat16 activations.
Every table so far runs the kernels' default prefetch mode, the whole next group
(``kernels/row_groups.py``). Then each of kvmesh's kernels at one row, its weights
on huge pages, in each prefetch mode, against ``Tensor.sum`` on huge pages: the
one-row read rate in the mode the worker would choose. Last, the bfloat16 decode
step at one row as the worker's fused op runs it (``kvmesh::llama_decode_cpu``, all
30 layers in one call) against the same weights' 120 linears called one by one:
the weights' read rate in a whole step; then the op with its weights on huge pages
in each prefetch mode the worker chooses from.

    .venv/bin/python -m benchmarks.cpu_kernels --threads 2 [--choice-only]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import gguf_quants
from kernels.bf16_amx_linear_cpu import amx_pack, can_use_amx
from kernels.cpu_extension import has_cpu_kernel
from kernels.gguf_linear_cpu import PACK_ROWS, pack_rows
from kernels.gguf_quants import GGMLQuantizationType
from kernels.int8_dynamic_linear_cpu import weight_sums
from kernels.row_groups import PREFETCH_MODES, set_row_group_prefetch
from services.worker.huge_pages import move_to_huge_pages_
from services.worker.layers import gguf_layout, linear_choice, quantized_choice
from services.worker.layers.bf16_linear import UNBOUNDED_ROWS
from services.worker.layers.packed_linear import can_pack
from services.worker.model_loader import load_model

NUM_ROWS = (1, 2, 4, 8, 16, 32)
BATCH_ROWS = (16, 32, 64, 128, 256)  # w8a8 against bfloat16 at batched-decode sizes
# Each call's weight copy was last read twice the L3's size ago: it comes from memory.
COPIES_BYTES = max(96 << 20, 2 * linear_choice.last_level_cache_bytes())
BANDWIDTH_BYTES = max(256 << 20, COPIES_BYTES)  # what the read bandwidth is measured over
# SmolLM2-135M's weights (hidden 576, intermediate 1536, 9 heads x 64, 3 KV heads,
# vocab 49152) as the worker holds them in every dtype and quantization: q/k/v and
# gate/up fused, so no call reads k_proj's 192 rows alone.
WORKER_SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
                 "down_proj": (576, 1536), "lm_head": (49152, 576)}


def cpu_line() -> str:
    """lscpu's model name, L3, and which of the flags that move the choice it has."""
    fields = dict(line.split(":", 1) for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    has = {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
           "vnni": any("vnni" in f for f in flags), "avx512_bf16": "avx512_bf16" in flags,
           "amx": any(f.startswith("amx") for f in flags)}
    return (f"CPU: {fields.get('Model name', '?').strip()}; "
            + ", ".join(f"{name} {'yes' if v else 'no'}" for name, v in has.items())
            + f"; L3 {fields.get('L3 cache', '?').strip()}")


def median_call_s(call: Callable[[int], object], num_copies: int, repeats: int) -> float:
    """Median of every call's time over ``repeats`` passes over the copies (a median
    of calls, not of passes: on a shared machine a pass often holds a stall)."""
    call(0)
    times = []
    for _ in range(repeats):
        for i in range(num_copies):
            start = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternating_medians(calls: dict[str, Callable[[int], object]], num_copies: int,
                        num_rounds: int) -> dict[str, float]:
    """Median seconds of each call, the calls alternated one by one over ``num_rounds``
    rounds after a round that warms up: the guest's memory speed drifts within
    minutes, so every call sees the same drift. Each round makes the calls in a new
    order (seeded), so that no call always follows the same one: a kernel called
    right after a ``Tensor.sum`` of 256 MiB took 3x as long as after another kernel
    call (0.13-0.15 against 0.04-0.05 ms on o_proj; a Zen 3). The calls, in the
    order made, are given the copies in turn (``0..num_copies-1``, again and again):
    where there are several (the L3 holds one), each copy was last read
    ``num_copies`` calls ago."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    shuffle = random.Random(0).shuffle
    for n in range(num_rounds + 1):
        shuffle(names)
        for j, name in enumerate(names):
            start = time.perf_counter()
            calls[name]((n * len(names) + j) % num_copies)
            if n:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def read_bandwidth_gb_s(repeats: int) -> float:
    data = torch.ones(BANDWIDTH_BYTES // 4)
    return data.numel() * 4 / median_call_s(lambda i: data.sum(), 1, repeats) / 1e9


def random_weight(out_features: int, in_features: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(out_features, in_features, generator=gen) * 0.05


def copies(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Enough copies of the tensors that cycling through them reads from memory."""
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return [tuple(t.clone() for t in tensors) for _ in range(max(1, COPIES_BYTES // num_bytes))]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel int8 (qweight, scales), as the int8 and w8a8 layers quantize."""
    scales = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scales[:, None]).to(torch.int8), scales


def candidates(out_features: int, in_features: int) -> dict[str, tuple[list, Callable]]:
    """Kernel name -> (weight copies, call(x_float32, copy) -> out); x's dtype is the
    kernel's own (bfloat16 for bfloat16's F.linear)."""
    weight = random_weight(out_features, in_features)
    kernels = {}
    if has_cpu_kernel("gguf_linear_cpu"):
        for quant_type in GGMLQuantizationType:
            qweight = copies(gguf_quants.quantize(weight, quant_type))
            for path, use_vnni in (("vnni", True), ("avx2", False)):
                kernels[f"{quant_type.name} {path}"] = (
                    qweight, lambda x, w, t=int(quant_type), v=use_vnni:
                    torch.ops.kvmesh.gguf_linear_cpu(x, w[0], t, v))
            if has_cpu_kernel("gguf_linear_packed_cpu") and out_features % PACK_ROWS == 0:
                packed = [(pack_rows(w, quant_type),) for (w,) in qweight]
                for path, use_vnni in (("vnni", True), ("avx2", False)):
                    kernels[f"{quant_type.name} packed {path}"] = (
                        packed, lambda x, w, t=int(quant_type), v=use_vnni:
                        torch.ops.kvmesh.gguf_linear_packed_cpu(x, w[0], t, v))
    if has_cpu_kernel("bf16_linear_cpu"):
        kernels["bf16 kvmesh"] = (copies(weight.bfloat16()),
                                  lambda x, w: torch.ops.kvmesh.bf16_linear_cpu(x.bfloat16(), w[0]))
    if can_use_amx(weight.bfloat16()):
        kernels["bf16 kvmesh AMX"] = (copies(amx_pack(weight.bfloat16())), lambda x, w:
                                      torch.ops.kvmesh.bf16_amx_linear_cpu(x.bfloat16(), w[0]))
    kernels["bf16 F.linear"] = (copies(weight.bfloat16()),
                                lambda x, w: F.linear(x.bfloat16(), w[0]))
    kernels["f32 F.linear"] = (copies(weight), lambda x, w: F.linear(x, w[0]))
    qweight, scales = quantize_int8(weight)
    if has_cpu_kernel("int8_linear_cpu"):  # AVX-512 builds only
        kernels["int8"] = (copies(qweight, scales),
                           lambda x, w: torch.ops.kvmesh.int8_linear_cpu(x, w[0], w[1]))
    if has_cpu_kernel("int8_dynamic_linear_cpu"):  # w8a8: activations per token too
        sums = weight_sums(qweight)
        for path, use_vnni in (("vnni", True), ("avx2", False)):
            kernels[f"w8a8 {path}"] = (
                copies(qweight, scales, sums), lambda x, w, v=use_vnni:
                torch.ops.kvmesh.int8_dynamic_linear_cpu(x, w[0], w[1], w[2], v))
    return kernels


def print_w8a8_against_bf16(repeats: int) -> None:
    """Batched decode: kvmesh's w8a8 kernel on its VNNI path (a GEMM from 16 rows)
    against oneDNN's prepacked bfloat16 linear, both on bfloat16 activations."""
    if not (has_cpu_kernel("int8_dynamic_linear_cpu")
            and can_pack(torch.bfloat16, torch.device("cpu"))):
        return
    print(f"\nw8a8 (VNNI) against oneDNN prepacked bfloat16, {torch.get_num_threads()} threads, "
          "bfloat16 x: us per call, weights from memory (w8a8 / oneDNN = ratio)")
    print(f"{'M':>4} " + "".join(f"{name:>26}" for name in WORKER_SHAPES))
    gen = torch.Generator().manual_seed(0)
    operands = {}
    for name, shape in WORKER_SHAPES.items():
        weight = random_weight(*shape)
        qweight, scales = quantize_int8(weight)
        operands[name] = (copies(qweight, scales, weight_sums(qweight)),
                          [(torch.ops.mkldnn._reorder_linear_weight(w),)
                           for (w,) in copies(weight.bfloat16())])
    for rows in BATCH_ROWS:
        cells = []
        for name, (_, in_features) in WORKER_SHAPES.items():
            x = torch.randn(rows, in_features, generator=gen).bfloat16()
            int8, packed = operands[name]
            w8a8 = median_call_s(lambda i: torch.ops.kvmesh.int8_dynamic_linear_cpu(
                x, *int8[i], True), len(int8), repeats)
            onednn = median_call_s(lambda i: torch.ops.mkldnn._linear_pointwise(
                x, packed[i][0], None, "none", [], ""), len(packed), repeats)
            cells.append(f"{w8a8 * 1e6:.0f} / {onednn * 1e6:.0f} = {w8a8 / onednn:.2f}")
        print(f"{rows:>4} " + "".join(f"{c:>26}" for c in cells), flush=True)


def print_bf16_choice() -> None:
    """Per worker shape: us per call of each kernel at each row count, the kernel
    chosen there, and the threshold the worker would store."""
    theirs = linear_choice.rival()
    # Without native bfloat16 oneDNN packs no bfloat16 weight: plain is all it has.
    kernels = (linear_choice.OURS, linear_choice.ONEDNN_PLAIN)
    if theirs == linear_choice.ONEDNN:
        kernels = (linear_choice.OURS, linear_choice.ONEDNN, linear_choice.ONEDNN_PLAIN)
    print(f"\nbfloat16 choice, {torch.get_num_threads()} threads: us per call (fastest of "
          f"a few, weights from memory), chosen = {linear_choice.OURS} up to max_rows")
    for name, (out_features, in_features) in WORKER_SHAPES.items():
        timings = linear_choice.measure_row_timings(out_features, in_features, kernels=kernels,
                                                    theirs=theirs, stop_at_first_loss=False)
        max_rows = linear_choice.choose_max_rows(timings, theirs=theirs)
        rows_text = "any" if max_rows == UNBOUNDED_ROWS else str(max_rows)
        measured = min(out_features, linear_choice.MAX_MEASURED_OUT_FEATURES)
        print(f"\n{name} [{out_features} x {in_features}] (measured on {measured} rows): "
              f"max_rows {rows_text}")
        print(f"{'M':>4} " + "".join(f"{k:>18}" for k in kernels) + f"{'chosen':>18}")
        # Above max_rows oneDNN runs on a prepacked weight where it can (a
        # Bf16Linear's packed copy, or a PackedLinear), else on the plain one.
        for rows, by_kernel in timings.items():
            chosen = linear_choice.OURS if rows <= max_rows else theirs
            print(f"{rows:>4} " + "".join(f"{by_kernel[k] * 1e6:18.1f}" for k in kernels)
                  + f"{chosen:>18}", flush=True)


def print_gguf_layout() -> None:
    """Per GGUF block type: the one-row call on the file's rows and on the rows
    packed by eight, as the worker measures them at load, and the layout it keeps."""
    print(f"\nGGUF layout, {torch.get_num_threads()} threads: us per one-row call on "
          f"{gguf_layout.MEASURED_SHAPE[0]} x {gguf_layout.MEASURED_SHAPE[1]} (fastest, "
          f"weights from memory)")
    print(f"{'type':>5} {gguf_layout.PLAIN:>14} {gguf_layout.PACKED:>16} {'kept':>16}")
    for quant_type in GGMLQuantizationType:
        timings = gguf_layout.measure_layouts(int(quant_type))
        kept = min(timings, key=timings.get)
        print(f"{quant_type.name:>5} {timings[gguf_layout.PLAIN] * 1e6:14.1f} "
              f"{timings[gguf_layout.PACKED] * 1e6:16.1f} {kept:>16}", flush=True)


def print_quantized_choice() -> None:
    """Per quantized mode of the default model: ms per step of its linear layers
    each way at each row count, and the row count the worker would choose."""
    kernel, dequantize = quantized_choice.KERNEL, quantized_choice.DEQUANTIZE
    for quantization in ("int8", "w8a8", "gguf"):
        model, config = load_model(None, "float32", "cpu", quantization=quantization)
        timings = quantized_choice.measure_model_rows(
            quantized_choice.quantized_layers(model), config.dtype, stop_at_first_loss=False)
        max_rows = linear_choice.choose_max_rows(timings, kernel, dequantize)
        rows_text = "any" if max_rows == UNBOUNDED_ROWS else str(max_rows)
        print(f"\n{quantization} (float32 activations), {torch.get_num_threads()} threads: ms "
              f"per step of every linear layer (fastest call per shape), kernel up to "
              f"max_rows {rows_text}")
        print(f"{'M':>4} {kernel:>10} {dequantize:>22} {'ratio':>7}")
        for rows, by_way in timings.items():
            print(f"{rows:>4} {by_way[kernel] * 1e3:10.2f} {by_way[dequantize] * 1e3:22.2f} "
                  f"{by_way[kernel] / by_way[dequantize]:7.2f}", flush=True)


def print_one_row_by_prefetch(repeats: int) -> None:
    """Each of kvmesh's kernels at one row (a one-stream decode step), its weight
    copies on huge pages as the worker keeps a step's weights, in each prefetch
    mode (``kernels/row_groups.py``), the modes alternated call by call: GB/s of
    weight read, its share of ``Tensor.sum``'s on huge pages (the mean of its
    medians just before and just after the kernel: the guest's memory speed drifts;
    not between its calls, where it would slow the call after it:
    ``alternating_medians``), and the fastest mode. The worker runs one mode for the
    process, the one its own step was fastest in
    (``services/worker/layers/prefetch_choice.py``). Only the paths this CPU runs
    (no VNNI rows without AVX512-VNNI)."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    pages = "huge pages" if move_to_huge_pages_([data]) else "plain pages (no huge pages offered)"
    print(f"\nOne row, weights on {pages}, each prefetch mode, {torch.get_num_threads()} "
          "threads: GB/s of weight read (share of Tensor.sum's on them, around each kernel)")
    has_vnni = torch.cpu._is_vnni_supported()
    for name, (out_features, in_features) in WORKER_SHAPES.items():
        kernels = {k: v for k, v in candidates(out_features, in_features).items()
                   if "F.linear" not in k and ("vnni" not in k or has_vnni)}
        move_to_huge_pages_([t for weight_copies, _ in kernels.values()
                             for tensors in weight_copies for t in tensors])
        x = torch.randn(1, in_features)
        print(f"\n{name} [{out_features} x {in_features}]")
        print(f"{'kernel':>18} {'Tensor.sum':>11}" + "".join(f"{m:>14}" for m in PREFETCH_MODES)
              + f"{'fastest':>14}")
        for kernel, (weight_copies, call) in kernels.items():
            def in_mode(mode: str) -> Callable[[int], object]:
                def one_call(i: int) -> object:
                    set_row_group_prefetch(mode)
                    return call(x, weight_copies[i])
                return one_call
            before = median_call_s(lambda i: data.sum(), 1, repeats)
            seconds = alternating_medians({m: in_mode(m) for m in PREFETCH_MODES},
                                          len(weight_copies), repeats * len(weight_copies))
            after = median_call_s(lambda i: data.sum(), 1, repeats)
            bandwidth = data.numel() * 4 / ((before + after) / 2) / 1e9
            num_bytes = sum(t.numel() * t.element_size() for t in weight_copies[0])
            rates = {m: num_bytes / s / 1e9 for m, s in seconds.items()}
            print(f"{kernel:>18} {bandwidth:11.1f}"
                  + "".join(f"{f'{r:.1f} ({r / bandwidth:.0%})':>14}" for r in rates.values())
                  + f"{min(seconds, key=seconds.get):>14}", flush=True)
        del kernels  # before the next shape's copies (see main)
    set_row_group_prefetch(PREFETCH_MODES[0])


def fused_step_operands(num_layers: int = 30, history: int = 64) -> tuple[list, dict]:
    """SmolLM2-135M's decode step at one row for ``kvmesh::llama_decode_cpu``: random
    bfloat16 weights (copies, so that each call reads its weights from memory) and the
    other operands, a ``history``-token context in 16-token blocks."""
    hidden, inter, heads, kv_heads, head = 576, 1536, 9, 3, 64
    shapes = [(hidden,), ((heads + 2 * kv_heads) * head, hidden), (hidden, heads * head),
              (hidden,), (2 * inter, hidden), (hidden, inter)]
    layer_bytes = sum(2 * torch.Size(shape).numel() for shape in shapes)
    weight_sets = [[(random_weight(*shape) if len(shape) == 2 else torch.ones(shape)).bfloat16()
                    for _ in range(num_layers) for shape in shapes]
                   for _ in range(max(1, -(-COPIES_BYTES // (layer_bytes * num_layers))))]
    num_blocks = history // 16 + 1
    operands = dict(
        hidden=torch.randn(1, hidden).bfloat16(), positions=torch.tensor([history - 1]),
        cos_sin_cache=torch.randn(history, head).bfloat16(),
        kv_caches=[torch.randn(2, num_blocks, 16, kv_heads, head).bfloat16()
                   for _ in range(num_layers)],
        slot_mapping=torch.tensor([history - 1]),
        block_table=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([history], dtype=torch.int32))
    return weight_sets, operands


def print_fused_step(repeats: int) -> None:
    """The bfloat16 decode step at one row as one op (``kvmesh::llama_decode_cpu``, the
    worker's fused step) against its 120 linears called one after another
    (``kvmesh::bf16_linear_cpu``), on the same weights, and the read bandwidth measured
    between their calls: ms per call, GB/s read, and that as a share of the bandwidth.
    Those on plain pages prefetch each next group of rows whole (the kernels' default).
    The op and ``Tensor.sum`` again with their data on huge pages, as the worker keeps
    the fused step's weights (``services/worker/huge_pages.py``), where the kernel
    offers them, the op in each prefetch mode the worker chooses from
    (``kernels/row_groups.py``); the share is of the higher of the two bandwidths."""
    weight_sets, op = fused_step_operands()
    matrices = [[w for w in weights if w.dim() == 2] for weights in weight_sets]
    step_bytes = sum(w.numel() * 2 for w in matrices[0])
    xs = {w.shape[1]: torch.randn(1, w.shape[1]).bfloat16() for w in matrices[0]}
    data = torch.ones(BANDWIDTH_BYTES // 4)
    huge_sets = [[w.clone() for w in weights] for weights in weight_sets]
    huge_data = data.clone()
    on_huge_pages = all(move_to_huge_pages_(t) for t in [*huge_sets, [huge_data]])

    def step_on(sets: list[list[torch.Tensor]], mode: str) -> Callable[[int], object]:
        def step(i: int) -> object:
            set_row_group_prefetch(mode)
            return torch.ops.kvmesh.llama_decode_cpu(
                op["hidden"], op["positions"], op["cos_sin_cache"], sets[i], sets[i][0],
                op["kv_caches"], op["slot_mapping"], op["block_table"], op["seq_lens"], 9, 3,
                1e-5, 0.125)
        return step

    def linears(i: int) -> object:
        set_row_group_prefetch("whole_group")
        return [torch.ops.kvmesh.bf16_linear_cpu(xs[w.shape[1]], w) for w in matrices[i]]

    calls = {"fused step (llama_decode_cpu)": (step_on(weight_sets, "whole_group"), step_bytes),
             "its 120 linears, one call each": (linears, step_bytes),
             "Tensor.sum (read bandwidth)": (lambda i: data.sum(), data.numel() * 4)}
    if on_huge_pages:
        for mode in PREFETCH_MODES:
            calls[f"fused step, huge pages, {mode}"] = (step_on(huge_sets, mode), step_bytes)
        calls["Tensor.sum, huge pages"] = (lambda i: huge_data.sum(), data.numel() * 4)
    seconds = alternating_medians({name: call for name, (call, _) in calls.items()},
                                  len(weight_sets), 4 * repeats * len(weight_sets))
    rates = {name: calls[name][1] / s / 1e9 for name, s in seconds.items()}
    bandwidth = max(rates["Tensor.sum (read bandwidth)"], rates.get("Tensor.sum, huge pages", 0.0))
    print(f"\nbfloat16 decode step at one row, SmolLM2-135M's 30 layers ({step_bytes / 1e6:.0f} MB "
          "of weights), alternating: ms per call (GB/s read; share of read bandwidth):")
    for name, s in seconds.items():
        print(f"  {name:<40} {s * 1e3:6.2f} ({rates[name]:4.1f}; {rates[name] / bandwidth:.0%})",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--choice-only", action="store_true",
                        help="only the choice tables (bfloat16: kvmesh's kernel against "
                        "oneDNN; quantized models: their kernels against dequantize-then-GEMM)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    if has_cpu_kernel("bf16_linear_cpu"):
        print_bf16_choice()
    if has_cpu_kernel("gguf_linear_packed_cpu"):
        print_gguf_layout()
    print_quantized_choice()
    if args.choice_only:
        return
    print(f"threads {args.threads}; read bandwidth (Tensor.sum over {BANDWIDTH_BYTES >> 20} "
          f"MiB float32): {read_bandwidth_gb_s(args.repeats):.1f} GB/s; "
          "x float32 (bfloat16 for bf16 F.linear)")
    for name, (out_features, in_features) in WORKER_SHAPES.items():
        kernels = candidates(out_features, in_features)
        print(f"\n{name} [{out_features} x {in_features}]: us per call (GB/s of weight read)")
        print(f"{'M':>3} " + "".join(f"{k:>18}" for k in kernels))
        for num_rows in NUM_ROWS:
            x = torch.randn(num_rows, in_features)
            cells = []
            for copies, call in kernels.values():
                seconds = median_call_s(lambda i: call(x, copies[i]), len(copies), args.repeats)
                num_bytes = sum(t.numel() * t.element_size() for t in copies[0])
                cells.append(f"{seconds * 1e6:10.1f} ({num_bytes / seconds / 1e9:4.1f})")
            print(f"{num_rows:>3} " + "".join(f"{c:>18}" for c in cells), flush=True)
        # Each kernel's copies are twice the L3 (960 MiB each on a 480 MiB one): let
        # this shape's go before the next shape's are made, or the two together
        # outgrow a 24 GB machine.
        del kernels
    print_w8a8_against_bf16(args.repeats)
    if has_cpu_kernel("set_row_group_prefetch"):
        print_one_row_by_prefetch(args.repeats)
    if has_cpu_kernel("llama_decode_cpu"):
        print_fused_step(args.repeats)


if __name__ == "__main__":
    main()
