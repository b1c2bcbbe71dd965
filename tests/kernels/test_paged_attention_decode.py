"""Split-KV decode: both Triton paths vs the reference, empty splits, padding, launch choices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import paged_attention_ref, paged_attention_triton
from kernels._triton.paged_attention_decode import MAX_NUM_SPLITS, choose_num_splits, device_num_sms
from tests.cuda import needs_cuda
from tests.kernels.test_paged_attention import Batch, make_batch, max_rel_error

# Decode batches: (q_lens, seq_lens). Long contexts span several 64-key tiles per split.
LONG_DECODE = ([1, 1, 1], [517, 300, 129])
# A request with one key, one shorter than a tile: most of their splits get no keys.
SHORT_DECODE = ([1, 1, 1], [1, 70, 3])
# CUDA-graph padding: trailing requests with q_len 0 and seq_len 0.
PADDED_DECODE = ([1, 1, 1, 0, 0], [300, 45, 129, 0, 0])

# Relative error to the reference (which computes half precision in fp32), by dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (block_size, num_heads, num_kv_heads, num_splits): GQA 3:1 and 4:1, head size 64;
# 5 splits is not a power of two (masked lanes in the reduction).
GEOMETRIES = [(16, 9, 3, 4), (32, 8, 2, 5)]


def _run(batch: Batch, scale: float, num_splits: int | None, num_actual_tokens: int | None = None,
         max_seq_len: int | None = None) -> torch.Tensor:
    """paged_attention_triton into an out buffer full of NaN (unwritten rows stay NaN)."""
    args = list(batch.args(scale))
    if num_actual_tokens is not None:
        args[8] = num_actual_tokens
    if max_seq_len is not None:
        args[10] = max_seq_len
    out = torch.full_like(batch.query, float("nan"))
    return paged_attention_triton(*args, out=out, num_splits=num_splits)


def _check(out: torch.Tensor, batch: Batch, scale: float, tolerance: float) -> None:
    """Real rows match the reference and are all written; padding rows are zero."""
    n = batch.num_actual_tokens
    assert not out[:n].isnan().any()
    assert max_rel_error(out[:n], paged_attention_ref(*batch.args(scale))[:n]) < tolerance
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@pytest.mark.triton_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,num_splits", GEOMETRIES)
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-kv"])
def test_long_decode_matches_reference(dtype, block_size, num_heads, num_kv_heads, num_splits,
                                       split):
    batch = make_batch(*LONG_DECODE, block_size, num_heads, num_kv_heads, 64, dtype=dtype,
                       seed=block_size + num_splits)
    out = _run(batch, 0.125, num_splits if split else 1)
    assert out.dtype == dtype
    _check(out, batch, 0.125, TOLERANCE[dtype])


@pytest.mark.triton_cpu
@pytest.mark.parametrize("num_splits", [2, 7, MAX_NUM_SPLITS])
def test_empty_splits_are_harmless(num_splits):
    # Splits start on whole 64-key tiles: a 1-key and a 3-key request get one split with
    # keys and num_splits - 1 without, whose LSE is -inf and weight 0.
    batch = make_batch(*SHORT_DECODE, 16, 8, 2, 64, seed=num_splits)
    _check(_run(batch, 0.125, num_splits), batch, 0.125, TOLERANCE[torch.float32])


@pytest.mark.triton_cpu
@pytest.mark.parametrize("num_splits", [1, 4, None], ids=["one-pass", "split-kv", "auto"])
def test_padding_requests_write_nothing(num_splits):
    # num_actual_tokens = the real tokens: rows past them are zeroed, the rest match.
    # One kv head: 5 requests (padding included) take 4 automatic splits off-GPU.
    batch = make_batch(*PADDED_DECODE, 16, 4, 1, 64, seed=21)
    out = _run(batch, 0.125, num_splits)
    _check(out, batch, 0.125, TOLERANCE[torch.float32])
    # As a CUDA graph replays it: num_actual_tokens covers the padded rows too. Rows no
    # request owns may stay unwritten (NaN here); the real rows must not change.
    padded = _run(batch, 0.125, num_splits, num_actual_tokens=batch.query.shape[0])
    n = batch.num_actual_tokens
    assert torch.equal(padded[:n], out[:n])


@pytest.mark.triton_cpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_slots_past_seq_len_are_never_read(num_splits):
    batch = make_batch(*PADDED_DECODE, 16, 8, 2, 64, seed=22)
    expected = _run(batch, 0.2, num_splits)
    owned = torch.zeros(batch.kv_cache.shape[1:3], dtype=torch.bool)
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        owned[batch.block_table[row, pos // 16].long(), pos % 16] = True
    batch.kv_cache[:, ~owned] = float("nan")
    assert torch.equal(_run(batch, 0.2, num_splits), expected)


@pytest.mark.triton_cpu
def test_launch_ignores_max_seq_len():
    # A CUDA graph replays the max_seq_len of its capture for every batch: a wrong one
    # must change nothing, the automatic split included.
    batch = make_batch(*LONG_DECODE, 16, 8, 2, 64, seed=23)
    assert torch.equal(_run(batch, 0.125, None, max_seq_len=1), _run(batch, 0.125, None))


@pytest.mark.triton_cpu
def test_auto_splits_small_decode_batch():
    # 3 requests x 2 kv heads = 6 programs on the 8 SMs assumed off-GPU: 3 splits reach
    # 2 programs per SM.
    batch = make_batch(*LONG_DECODE, 32, 8, 2, 64, seed=24)
    assert device_num_sms(batch.query.device) == 8
    assert choose_num_splits(3, 2, 1, 8) == 3
    assert torch.equal(_run(batch, 0.125, None), _run(batch, 0.125, 3))


@pytest.mark.parametrize("num_reqs,num_kv_heads,max_query_len,num_sms,expected", [
    (1, 8, 1, 132, 32),    # 8 programs: 33 splits reach 2 per SM, capped at 32
    (8, 8, 1, 132, 5),     # 64 programs -> 320
    (32, 3, 1, 132, 3),    # SmolLM2 at batch 32: 96 programs -> 288
    (44, 3, 1, 132, 1),    # 132 programs: every SM busy already
    (4, 8, 1, 114, 8),     # H100 PCIe: 32 programs -> 256
    (3, 2, 1, 132, 32),    # 6 programs: 44 splits wanted, 32 taken
    (1, 3, 2, 132, 1),     # a prefill or mixed batch never splits
    (0, 3, 1, 132, 1),     # empty batch
])
def test_choose_num_splits(num_reqs, num_kv_heads, max_query_len, num_sms, expected):
    assert choose_num_splits(num_reqs, num_kv_heads, max_query_len, num_sms) == expected


@pytest.mark.parametrize("lens,num_splits,match", [
    (([1, 7], [30, 7]), 2, "max_query_len == 1"),
    (LONG_DECODE, 0, r"num_splits=0 must be in \[1, 32\]"),
    (LONG_DECODE, MAX_NUM_SPLITS + 1, r"num_splits=33 must be in \[1, 32\]"),
])
def test_invalid_num_splits(lens, num_splits, match):
    batch = make_batch(*lens, 16, 4, 2, 32)
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(*batch.args(0.2), num_splits=num_splits)


def _to(batch: Batch, device: str) -> Batch:
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                         for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4, None], ids=["one-pass", "split-kv", "auto"])
@pytest.mark.parametrize("lens", [LONG_DECODE, PADDED_DECODE], ids=["long", "padded"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_bf16_decode_matches_reference(num_splits, lens, block_size):
    batch = make_batch(*lens, block_size, 9, 3, 64, dtype=torch.bfloat16, seed=25)
    cuda_batch = _to(batch, "cuda")
    out = paged_attention_triton(*cuda_batch.args(0.125), num_splits=num_splits,
                                 out=torch.full_like(cuda_batch.query, float("nan")))
    _check(out.cpu(), batch, 0.125, TOLERANCE[torch.bfloat16])


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, None], ids=["one-pass", "auto"])
def test_cuda_graph_replays_new_seq_lens(num_splits):
    # Capture on one batch, then replay with other context lengths and queries written
    # into the captured tensors: the split ranges must follow the new seq_lens.
    batch = _to(make_batch(*PADDED_DECODE, 16, 9, 3, 64, dtype=torch.bfloat16, seed=26), "cuda")
    out = torch.empty_like(batch.query)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles the kernels outside the capture
        paged_attention_triton(*batch.args(0.125), out=out, num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(*batch.args(0.125), out=out, num_splits=num_splits)
    batch.seq_lens.copy_(torch.tensor([33, 300, 1, 0, 0], dtype=torch.int32))
    batch.query.copy_(torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(27)))
    graph.replay()
    torch.cuda.synchronize()
    _check(out.cpu(), _to(batch, "cpu"), 0.125, TOLERANCE[torch.bfloat16])
