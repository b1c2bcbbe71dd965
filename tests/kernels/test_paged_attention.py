"""paged_attention: reference vs a dense causal float64 attention, Triton vs reference."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from kernels import paged_attention, paged_attention_ref, paged_attention_triton
from kernels.paged_attention import PagedAttentionPlan, plan_paged_attention
from tests.cuda import needs_cuda

TRITON_ON_CPU = pytest.param(paged_attention_triton, marks=pytest.mark.triton_cpu)

# Ragged batches: (q_lens, seq_lens). seq_len >= q_len; context = seq_len - q_len.
DECODE_ONLY = ([1, 1, 1, 1], [1, 17, 40, 9])
PREFILL_ONLY = ([23, 5], [23, 5])
MIXED = ([1, 7, 1, 16, 3], [33, 7, 2, 45, 19])  # decodes, a fresh prefill, chunked prefills


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor           # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int

    def args(self, scale: float) -> tuple:
        return (self.query, self.kv_cache[0], self.kv_cache[1], self.block_table,
                self.query_start_loc, self.seq_lens, scale, self.seq_lens.numel(),
                self.num_actual_tokens, self.max_query_len, self.max_seq_len)


def make_batch(q_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int,
               num_kv_heads: int, head_size: int, dtype: torch.dtype = torch.float32,
               num_padding: int = 3, seed: int = 0) -> Batch:
    """Random cache whose blocks are handed out in a random order; unused slots hold garbage."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-s // block_size) for s in seq_lens]
    total_blocks = sum(num_blocks) + 4  # spare blocks that no request owns
    block_ids = torch.randperm(total_blocks - 1, generator=gen).to(torch.int32) + 1
    # Stale entries past a request's blocks (as a reused batch row may have).
    block_table = block_ids[torch.randint(0, total_blocks - 1, (len(q_lens) + 1, max(num_blocks) + 2),
                                          generator=gen)]
    start = 0
    for row, n in enumerate(num_blocks):
        block_table[row, :n] = block_ids[start : start + n]
        start += n
    kv_cache = torch.randn(2, total_blocks, block_size, num_kv_heads, head_size, generator=gen)
    num_actual_tokens = sum(q_lens)
    query = torch.randn(num_actual_tokens + num_padding, num_heads, head_size, generator=gen)
    query_start_loc = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return Batch(query.to(dtype), kv_cache.to(dtype), block_table, query_start_loc,
                 torch.tensor(seq_lens, dtype=torch.int32), num_actual_tokens, max(q_lens),
                 max(seq_lens))


def dense_causal_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Per request, softmax(Q K^T) V in float64 over the keys gathered slot by slot."""
    query, key_cache, value_cache = batch.query.double(), batch.kv_cache[0].double(), batch.kv_cache[1].double()
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    out = torch.zeros_like(query)
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = batch.query_start_loc[row].item(), batch.query_start_loc[row + 1].item()
        key_pos = torch.arange(seq_len)
        blocks = batch.block_table[row, key_pos // block_size].long()
        keys = key_cache[blocks, key_pos % block_size].repeat_interleave(group, dim=1)
        values = value_cache[blocks, key_pos % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end], keys) * scale
        query_pos = seq_len - (end - start) + torch.arange(end - start)
        scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


def _nan_out(batch: Batch) -> torch.Tensor:
    return torch.full_like(batch.query, float("nan"))


@pytest.mark.parametrize("lens", [DECODE_ONLY, PREFILL_ONLY, MIXED], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 32), (9, 3, 64), (8, 2, 32)])
def test_reference_matches_dense_causal(lens, block_size, num_heads, num_kv_heads, head_size):
    batch = make_batch(*lens, block_size, num_heads, num_kv_heads, head_size, seed=block_size)
    scale = head_size ** -0.5
    out = paged_attention_ref(*batch.args(scale), out=_nan_out(batch))
    n = batch.num_actual_tokens
    assert max_rel_error(out[:n], dense_causal_attention(batch, scale)[:n]) < 1e-3
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # padding rows written with zeros


def test_reference_chunking_is_invisible(monkeypatch):
    # A budget of one key forces one request per chunk; the result must not change.
    batch = make_batch(*MIXED, 16, 9, 3, 64, seed=4)
    expected = paged_attention_ref(*batch.args(0.125))
    module = sys.modules["kernels.paged_attention"]
    monkeypatch.setattr(module, "_MAX_GATHERED_ELEMENTS", 1)
    assert torch.allclose(paged_attention_ref(*batch.args(0.125)), expected, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_half_precision(dtype):
    batch = make_batch(*MIXED, 16, 9, 3, 64, dtype=dtype, seed=2)
    out = paged_attention_ref(*batch.args(0.125))
    assert out.dtype == dtype
    n = batch.num_actual_tokens
    assert max_rel_error(out[:n], dense_causal_attention(batch, 0.125)[:n]) < 1e-2


@pytest.mark.parametrize("impl", [paged_attention_ref, TRITON_ON_CPU])
def test_slots_past_seq_len_are_never_read(impl):
    # NaN in every slot a request does not own must not reach the output.
    batch = make_batch(*MIXED, 8, 4, 2, 32, seed=6)
    expected = impl(*batch.args(0.2))
    owned = torch.zeros(batch.kv_cache.shape[1:3], dtype=torch.bool)
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        owned[batch.block_table[row, pos // 8].long(), pos % 8] = True
    batch.kv_cache[:, ~owned] = float("nan")
    assert torch.equal(impl(*batch.args(0.2)), expected)


@pytest.mark.parametrize("impl", [paged_attention_ref, TRITON_ON_CPU])
def test_query_sliced_from_fused_qkv(impl):
    # The model splits one qkv projection: query rows are strided, not contiguous.
    batch = make_batch(*MIXED, 16, 4, 2, 32, seed=8)
    expected = impl(*batch.args(0.2))
    num_tokens = batch.query.shape[0]
    qkv = torch.cat([batch.query.view(num_tokens, -1), torch.randn(num_tokens, 2 * 2 * 32)], dim=1)
    batch.query = qkv[:, : 4 * 32].view(num_tokens, 4, 32)
    out = impl(*batch.args(0.2))
    assert out.is_contiguous() and torch.equal(out, expected)


# Triton (interpreted on CPU): small shapes, the interpreter runs every program in numpy.
TRITON_CASES = [
    (DECODE_ONLY, 16, 4, 4, 32),
    (PREFILL_ONLY, 8, 9, 3, 64),
    (MIXED, 32, 8, 2, 32),
    (MIXED, 16, 9, 3, 64),
    (([1, 40], [130, 150]), 16, 8, 2, 32),  # long contexts: several query blocks and key tiles
]


@pytest.mark.triton_cpu
@pytest.mark.parametrize("lens,block_size,num_heads,num_kv_heads,head_size", TRITON_CASES)
def test_triton_matches_reference(lens, block_size, num_heads, num_kv_heads, head_size):
    batch = make_batch(*lens, block_size, num_heads, num_kv_heads, head_size, seed=block_size + 1)
    scale = head_size ** -0.5
    out = paged_attention_triton(*batch.args(scale), out=_nan_out(batch))
    assert not out.isnan().any()
    n = batch.num_actual_tokens
    assert max_rel_error(out[:n], paged_attention_ref(*batch.args(scale))[:n]) < 1e-3
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@pytest.mark.triton_cpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(dtype):
    batch = make_batch(*MIXED, 16, 9, 3, 64, dtype=dtype, seed=3)
    out = paged_attention_triton(*batch.args(0.125))
    assert out.dtype == dtype
    n = batch.num_actual_tokens
    assert max_rel_error(out[:n], dense_causal_attention(batch, 0.125)[:n]) < 2e-2


@pytest.mark.triton_cpu
def test_dispatch_force_triton(monkeypatch):
    batch = make_batch(*DECODE_ONLY, 8, 4, 2, 32, seed=9)
    monkeypatch.setenv("KVMESH_FORCE_TRITON", "1")
    forced = paged_attention(*batch.args(0.3))
    monkeypatch.setenv("KVMESH_FORCE_TRITON", "0")
    reference = paged_attention(*batch.args(0.3))
    assert max_rel_error(forced, reference) < 1e-3


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [DECODE_ONLY, PREFILL_ONLY, MIXED], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_matches_dense(dtype, lens, block_size):
    batch = make_batch(*lens, block_size, 9, 3, 64, dtype=dtype, seed=11)
    cuda_args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in batch.args(0.125))
    out = paged_attention(*cuda_args, out=torch.full_like(cuda_args[0], float("nan")))
    assert out.is_cuda and not out.isnan().any()
    n = batch.num_actual_tokens
    tolerance = 1e-3 if dtype == torch.float32 else 2e-2
    assert max_rel_error(out[:n].cpu(), dense_causal_attention(batch, 0.125)[:n]) < tolerance
    assert torch.equal(out[n:].cpu(), torch.zeros_like(out[n:].cpu()))


# The plan: index work done once per step and shared by every layer (CPU path).
UNIFORM_DECODE = ([1, 1, 1], [32, 32, 32])      # whole blocks, no mask, no padded rows
UNIFORM_DECODE_TAIL = ([1, 1], [20, 20])        # no mask; the last block's tail is cut off
PLAN_CASES = [DECODE_ONLY, UNIFORM_DECODE, UNIFORM_DECODE_TAIL, MIXED]
PLAN_IDS = ["decode", "uniform", "uniform-tail", "mixed"]


def _plan_for(batch: Batch) -> PagedAttentionPlan:
    _, block_size, num_kv_heads, head_size = batch.kv_cache.shape[1:]
    return plan_paged_attention(batch.block_table, batch.query_start_loc, batch.seq_lens,
                                batch.seq_lens.numel(), batch.num_actual_tokens, block_size,
                                num_kv_heads, head_size)


@pytest.mark.parametrize("lens", PLAN_CASES, ids=PLAN_IDS)
def test_plan_matches_dense_causal(lens):
    batch = make_batch(*lens, 16, 9, 3, 64, seed=12)
    out = paged_attention_ref(*batch.args(0.125), out=_nan_out(batch), plan=_plan_for(batch))
    n = batch.num_actual_tokens
    assert max_rel_error(out[:n], dense_causal_attention(batch, 0.125)[:n]) < 1e-3
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@pytest.mark.parametrize("lens", PLAN_CASES, ids=PLAN_IDS)
def test_plan_shared_by_layers(lens):
    # Two "layers": different queries and caches, one plan (and its reused gather
    # buffers); each result must equal a call that builds its own plan.
    first = make_batch(*lens, 16, 9, 3, 64, seed=13)
    second = make_batch(*lens, 16, 9, 3, 64, seed=13)
    gen = torch.Generator().manual_seed(14)
    second.query = torch.randn(second.query.shape, generator=gen)
    second.kv_cache = torch.randn(second.kv_cache.shape, generator=gen)
    plan = _plan_for(first)
    for batch in (first, second, first):
        expected = paged_attention_ref(*batch.args(0.125))
        assert torch.equal(paged_attention_ref(*batch.args(0.125), plan=plan), expected)


def test_plan_decode_shapes():
    # Uniform decode: one chunk, rows read as a slice, no mask, no rows to zero.
    batch = make_batch(*UNIFORM_DECODE, 16, 9, 3, 64)
    (chunk,) = _plan_for(batch).chunks
    assert (chunk.num_reqs, chunk.max_k, chunk.blocks_per_req) == (3, 32, 2)
    assert chunk.query_rows is None and chunk.mask is None and chunk.pad_rows is None
    assert chunk.key_blocks.tolist() == batch.block_table[:3, :2].flatten().tolist()
    # Ragged decode: blocks past a request's last one repeat its first block, and the
    # rows past seq_len (below max_k = 40) are the ones zeroed.
    batch = make_batch(*DECODE_ONLY, 16, 9, 3, 64)
    (chunk,) = _plan_for(batch).chunks
    table = batch.block_table
    assert chunk.key_blocks.view(4, 3).tolist() == [
        [table[0, 0], table[0, 0], table[0, 0]], [table[1, 0], table[1, 1], table[1, 0]],
        table[2, :3].tolist(), [table[3, 0], table[3, 0], table[3, 0]],
    ]
    expected_pad = ([r for r in range(1, 40)] + [48 + r for r in range(17, 40)]
                    + [144 + r for r in range(9, 40)])
    assert chunk.pad_rows.tolist() == expected_pad
    assert chunk.mask.shape == (4, 1, 1, 40)


@pytest.mark.parametrize("lens", [DECODE_ONLY, UNIFORM_DECODE_TAIL], ids=["decode", "uniform-tail"])
def test_plan_decode_ignores_nan_past_seq_len(lens):
    # Decode copies whole blocks: NaN in the unwritten tail must still not leak.
    batch = make_batch(*lens, 8, 4, 2, 32, seed=15)
    expected = paged_attention_ref(*batch.args(0.2))
    owned = torch.zeros(batch.kv_cache.shape[1:3], dtype=torch.bool)
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        owned[batch.block_table[row, pos // 8].long(), pos % 8] = True
    batch.kv_cache[:, ~owned] = float("nan")
    assert torch.equal(paged_attention_ref(*batch.args(0.2), plan=_plan_for(batch)), expected)


def test_plan_from_other_metadata_is_rejected():
    batch = make_batch(*MIXED, 16, 9, 3, 64)
    plan = _plan_for(make_batch(*DECODE_ONLY, 16, 9, 3, 64))
    with pytest.raises(ValueError, match="plan for"):
        paged_attention_ref(*batch.args(0.125), plan=plan)
