"""kvmesh::llama_decode_cpu (kernels/csrc) against its PyTorch reference
`llama_decode_ref` on random models (bfloat16, w8a8 and GGUF-block linear layers;
bfloat16 and float32 activations) and paged batches: the output, the K/V it writes,
every cache slot it must leave alone, and what it refuses."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
import torch

from kernels import cpu_extension, gguf_quants
from kernels.gguf_linear_cpu import pack_rows
from kernels.gguf_quants import GGMLQuantizationType
from kernels.int8_dynamic_linear_cpu import weight_sums
from kernels.llama_decode_cpu import gguf_format, llama_decode_cpu, llama_decode_ref, weights_per_layer
from services.worker.layers.quantization import quantize_per_channel_int8
from services.worker.layers.rotary_embedding import RotaryEmbedding
from tests.kernels.test_paged_attention import make_batch, max_rel_error
from tests.kernels.test_paged_attention_cpu import _poison_unowned_slots

pytestmark = pytest.mark.skipif(not cpu_extension.has_cpu_kernel("llama_decode_cpu"),
                                reason="kvmesh's C++ CPU kernels could not be built here")
# Relative to the reference, which sums each product in another order: a bfloat16
# value may round to its neighbour, and that passes on through the layers. float32
# differs by ~1e-6 (measured); its bound leaves room for an activation quantized to
# the neighbouring int8.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-3}
LINEARS = pytest.mark.parametrize("linear", ["bf16", "w8a8", "gguf"])
# A "gguf" model's linear layers take these (quant type, packed by eight) in turn, so
# that one model mixes every format, as a GGUF file may.
GGUF_FORMATS = [(GGMLQuantizationType.Q4_1, True), (GGMLQuantizationType.Q4_0, False),
                (GGMLQuantizationType.Q8_0, True), (GGMLQuantizationType.Q4_1, False),
                (GGMLQuantizationType.Q4_0, True), (GGMLQuantizationType.Q8_0, False)]


@dataclasses.dataclass
class Step:
    """The op's operands, as ``llama_decode_cpu`` takes them after ``hidden``."""

    hidden: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    weights: list[torch.Tensor]
    final_norm: torch.Tensor
    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    num_heads: int
    num_kv_heads: int
    linear: str = "bf16"
    eps: float = 1e-5

    def args(self, kv_caches: list[torch.Tensor]) -> tuple:
        head_size = self.cos_sin_cache.shape[1]
        return (self.hidden, self.positions, self.cos_sin_cache, self.weights, self.final_norm,
                kv_caches, self.slot_mapping, self.block_table, self.seq_lens, self.num_heads,
                self.num_kv_heads, self.eps, head_size ** -0.5, self.linear)


def _w8a8(weight: torch.Tensor) -> list[torch.Tensor]:
    """A weight as the w8a8 kernel takes it: int8 per output channel (as the worker
    quantizes), float32 scales, the int8 rows' sums."""
    qweight, scales = quantize_per_channel_int8(weight)
    return [qweight, scales, weight_sums(qweight)]


def _gguf_formats() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Weights -> their GGUF blocks and ``gguf_format``, each call in the next format."""
    formats = itertools.cycle(GGUF_FORMATS)

    def gguf(weight: torch.Tensor) -> list[torch.Tensor]:
        quant_type, packed = next(formats)
        blocks = gguf_quants.quantize(weight.float(), quant_type)
        return [pack_rows(blocks, quant_type) if packed else blocks, gguf_format(quant_type, packed)]
    return gguf


def _weights(num_layers: int, hidden: int, num_heads: int, num_kv_heads: int, head_size: int,
             inter: int, linear: str, dtype: torch.dtype, gen: torch.Generator
             ) -> list[torch.Tensor]:
    as_linear = {"bf16": lambda weight: [weight], "w8a8": _w8a8, "gguf": _gguf_formats()}[linear]

    def rand(*shape: int, scale: float) -> list[torch.Tensor]:
        return as_linear((torch.randn(*shape, generator=gen) * scale).bfloat16())

    def norm() -> torch.Tensor:
        return (1 + torch.randn(hidden, generator=gen) * 0.1).to(dtype)

    qkv_rows, q_size = (num_heads + 2 * num_kv_heads) * head_size, num_heads * head_size
    weights = []
    for _ in range(num_layers):
        weights += [norm(), *rand(qkv_rows, hidden, scale=hidden ** -0.5),
                    *rand(hidden, q_size, scale=q_size ** -0.5), norm(),
                    *rand(2 * inter, hidden, scale=hidden ** -0.5),
                    *rand(hidden, inter, scale=inter ** -0.5)]
    return weights


def make_step(seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
              head_size: int, hidden: int = 128, inter: int = 256, num_layers: int = 2,
              linear: str = "bf16", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Step:
    """One new token per request, at position seq_len - 1; every cache slot no request
    owns is NaN, and so is the slot each new token goes to, until the op writes it."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size, num_heads, num_kv_heads,
                       head_size, num_padding=0, seed=seed)
    _poison_unowned_slots(batch, block_size)
    positions = batch.seq_lens.long() - 1
    table = batch.block_table[: len(seq_lens)]
    slots = table.gather(1, (positions // block_size)[:, None]).long()[:, 0] * block_size \
        + positions % block_size
    kv_caches = []
    for _ in range(num_layers):
        cache = batch.kv_cache.clone() * (0.5 + torch.rand(1, generator=gen))
        cache.view(2, -1, num_kv_heads, head_size)[:, slots] = float("nan")
        kv_caches.append(cache.to(dtype))
    rotary = RotaryEmbedding(head_size, max(seq_lens) + 8, 10000.0, None, dtype)
    return Step(torch.randn(len(seq_lens), hidden, generator=gen).to(dtype), positions,
                rotary.cos_sin_cache, _weights(num_layers, hidden, num_heads, num_kv_heads,
                                               head_size, inter, linear, dtype, gen),
                (1 + torch.randn(hidden, generator=gen) * 0.1).to(dtype), kv_caches, slots,
                table, batch.seq_lens, num_heads, num_kv_heads, linear)


def _run_both(step: Step) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    ours, theirs = [c.clone() for c in step.kv_caches], [c.clone() for c in step.kv_caches]
    return (llama_decode_cpu(*step.args(ours)), ours, llama_decode_ref(*step.args(theirs)), theirs)


def _check_against_reference(step: Step) -> None:
    """The output, the K/V each layer writes at each row's slot, and every other slot
    left as it was (NaN where no request owns it)."""
    num_kv_heads, head_size = step.num_kv_heads, step.cos_sin_cache.shape[1]
    out, caches, expected, expected_caches = _run_both(step)
    assert out.dtype == step.hidden.dtype and out.shape == step.hidden.shape
    tolerance = TOLERANCE[step.hidden.dtype]
    assert max_rel_error(out, expected) < tolerance
    for cache, expected_cache, original in zip(caches, expected_caches, step.kv_caches):
        written = cache.view(2, -1, num_kv_heads, head_size)[:, step.slot_mapping]
        assert not written.isnan().any()
        assert max_rel_error(written, expected_cache.view(2, -1, num_kv_heads, head_size)
                             [:, step.slot_mapping]) < tolerance
        untouched = torch.ones(cache.view(2, -1, num_kv_heads, head_size).shape[1], dtype=torch.bool)
        untouched[step.slot_mapping] = False
        torch.testing.assert_close(cache.view(2, -1, num_kv_heads, head_size)[:, untouched],
                                   original.view(2, -1, num_kv_heads, head_size)[:, untouched],
                                   rtol=0, atol=0, equal_nan=True)


@LINEARS
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_size"),
                         [(16, 4, 2, 32), (16, 9, 3, 64), (8, 4, 4, 64), (32, 8, 1, 32)])
@pytest.mark.parametrize("seq_lens", [[1], [40], [3, 17, 40, 9, 16], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_op_matches_reference(linear: str, block_size: int, num_heads: int, num_kv_heads: int,
                              head_size: int, seq_lens: list[int]) -> None:
    """Every kind of linear layer (GGUF's formats mixed in one model), one to eight
    rows, first tokens and long histories, GQA groups of 1 to 8, partial blocks."""
    _check_against_reference(make_step(seq_lens, block_size, num_heads, num_kv_heads, head_size,
                                       linear=linear, seed=block_size + head_size + len(seq_lens)))


@LINEARS
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_size"),
                         [(16, 9, 3, 64), (32, 8, 1, 32)])
@pytest.mark.parametrize("seq_lens", [[1], [3, 17, 40, 9, 16]])
def test_float32_activations_match_reference(linear: str, block_size: int, num_heads: int,
                                             num_kv_heads: int, head_size: int,
                                             seq_lens: list[int]) -> None:
    """float32 activations, caches and norms (a float32 model's), unrounded between ops."""
    _check_against_reference(make_step(seq_lens, block_size, num_heads, num_kv_heads, head_size,
                                       linear=linear, seed=len(seq_lens) + head_size,
                                       dtype=torch.float32))


@LINEARS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_many_rows(linear: str, dtype: torch.dtype) -> None:
    """40 requests (the worker fuses up to 64): the kernels' many-row paths (w8a8's
    GEMM from 16 rows, four activation rows per pass over the weights)."""
    seq_lens = [1 + (7 * i) % 50 for i in range(40)]
    _check_against_reference(make_step(seq_lens, 16, 9, 3, 64, linear=linear, seed=11,
                                       dtype=dtype))


@LINEARS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_larger_model_dims_and_many_layers(linear: str, dtype: torch.dtype) -> None:
    """SmolLM2-135M's widths (hidden 576, 9 heads of 64 over 3 KV heads, intermediate
    1536) over six layers: rounding differences stay within the tolerance."""
    step = make_step([5, 70], 16, 9, 3, 64, hidden=576, inter=1536, num_layers=6,
                     linear=linear, seed=7, dtype=dtype)
    out, _, expected, _ = _run_both(step)
    assert max_rel_error(out, expected) < TOLERANCE[dtype]


def _refused(step: Step, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        llama_decode_cpu(*step.args([c.clone() for c in step.kv_caches]))


def test_bad_operands_are_refused() -> None:
    """Every index the op follows into memory, and every shape and dtype, is checked
    before it writes anything."""
    step = make_step([3, 20], 16, 4, 2, 32, seed=3)
    per_layer = weights_per_layer("bf16")
    _refused(dataclasses.replace(step, weights=step.weights[:-1]),
             f"need {per_layer} weights per layer for 2 KV caches, got 11")
    bad = list(step.weights)
    bad[per_layer + 2] = bad[per_layer + 2].float()
    _refused(dataclasses.replace(step, weights=bad), "layer 1's o_proj must be contiguous BFloat16")
    _refused(dataclasses.replace(step, linear="int4"), "linear must be bf16, w8a8 or gguf, got 'int4'")
    _refused(dataclasses.replace(step, linear="w8a8"), "need 14 weights per layer")
    _refused(dataclasses.replace(step, hidden=step.hidden.half()),
             "hidden must be contiguous bfloat16 or float32")
    # float32 activations need float32 caches, norms and rotary table: they follow hidden.
    _refused(dataclasses.replace(step, hidden=step.hidden.float()),
             r"each KV cache must be contiguous Float \[2, ")
    _refused(dataclasses.replace(step, hidden=step.hidden.float(),
                                 kv_caches=[c.float() for c in step.kv_caches]),
             "layer 0's input norm must be contiguous Float")
    num_slots = step.kv_caches[0].shape[1] * step.kv_caches[0].shape[2]
    _refused(dataclasses.replace(step, slot_mapping=torch.tensor([0, num_slots])),
             rf"slot_mapping\[1\] = {num_slots} is outside \[0, {num_slots}\)")
    _refused(dataclasses.replace(step, positions=torch.tensor([-1, 0])),
             r"positions\[0\] = -1 is outside \[0, ")
    _refused(dataclasses.replace(step, slot_mapping=step.slot_mapping.int()),
             "slot_mapping must be int64")
    bad_table = step.block_table.clone()
    bad_table[1, 0] = step.kv_caches[0].shape[1]
    _refused(dataclasses.replace(step, block_table=bad_table), r"block_table\[1, 0\] = \d+ is outside")
    _refused(dataclasses.replace(step, kv_caches=[step.kv_caches[0], step.kv_caches[1][:, :4]]),
             "KV cache 1 must be like the first")


def test_bad_w8a8_weights_are_refused() -> None:
    step = make_step([3, 20], 16, 4, 2, 32, linear="w8a8", seed=4)
    bad = list(step.weights)
    bad[2] = bad[2].double()  # layer 0's qkv_proj scales
    _refused(dataclasses.replace(step, weights=bad), "scales must be a contiguous float32")
    bad = list(step.weights)
    bad[1] = bad[1][:, :64].contiguous()  # qkv_proj's int8 weight, too few columns
    _refused(dataclasses.replace(step, weights=bad), "layer 0's qkv_proj must be contiguous Char")


def test_bad_gguf_weights_are_refused() -> None:
    step = make_step([3, 20], 16, 4, 2, 32, linear="gguf", seed=5)
    qkv, o = 1, 3  # layer 0's qkv_proj blocks (Q4_1, packed) and o_proj's (Q4_0, file rows)

    def refused(index: int, tensor: torch.Tensor, match: str) -> None:
        bad = list(step.weights)
        bad[index] = tensor
        _refused(dataclasses.replace(step, weights=bad), match)

    refused(qkv + 1, torch.tensor([5, 1]), r"quant_type must be 2 \(Q4_0\), 3 \(Q4_1\) or 8")
    refused(qkv + 1, torch.tensor([3, 2]), "layer 0's qkv_proj format's packed must be 0 or 1, got 2")
    refused(qkv + 1, torch.tensor([3, 1], dtype=torch.int32), r"format must be int64 \[2\]")
    refused(qkv, step.weights[qkv][:-8], "layer 0's qkv_proj must have 256 rows of blocks")
    refused(o + 1, gguf_format(GGMLQuantizationType.Q8_0, False), "qweight has 72 bytes per row")
    refused(o, step.weights[o].char(), "qweight must be a contiguous uint8")
