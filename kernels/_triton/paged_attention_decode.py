"""Triton kernels: split-KV (flash-decoding) paged attention for decode-only batches.

A decode batch has one query token per request, so the one-pass kernel runs only
num_reqs x num_kv_heads programs: at small batch that leaves most SMs idle while each
program walks the whole context alone. Here every (request, kv head) is cut into
`num_splits` contiguous key ranges, one program each:

1. `_split_kv_decode_kernel` attends the GQA group of the kv head over its range and
   writes the normalized partial output and the range's log-sum-exp (base 2) to fp32
   scratch buffers. The range is computed in the kernel from seq_lens, so the launch
   never needs the context lengths on the host.
2. `_reduce_splits_kernel` merges the splits of one (request, query head):
   out = sum_s 2^(lse_s - max lse) * partial_s / sum_s 2^(lse_s - max lse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton.paged_attention import (
    LOG2E,
    NUM_STAGES,
    attend_key_range,
    begin_launch,
    dot_options,
    head_size_padded,
    key_tile_size,
    num_warps_for,
)

MAX_NUM_SPLITS = 32
# Programs per SM the automatic split aims for: decode streams K/V from HBM, and one
# 4-warp program per SM keeps too few loads in flight to saturate bandwidth.
_PROGRAMS_PER_SM = 2
# SM count assumed off-GPU, where the interpreter runs programs one after another: small,
# so that small test batches still take the split path, with a few splits, not 32.
_INTERPRETER_NUM_SMS = 8


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (`_INTERPRETER_NUM_SMS` off CUDA)."""
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, num_sms: int) -> int:
    """KV splits per (request, kv head) for a launch: 1 means the one-pass kernel.

    Splits only decode-only batches (max_query_len == 1) whose num_reqs x num_kv_heads
    programs would not even give every SM one program; then enough splits to reach
    `_PROGRAMS_PER_SM` programs per SM, at most MAX_NUM_SPLITS. Depends on host ints
    only (never on context lengths): a CUDA graph bakes the result in. Short contexts
    are not penalized much: a split starts on a whole key tile, so at most
    cdiv(seq_len, BLOCK_N) splits get keys and the others exit at once.
    """
    num_programs = num_reqs * num_kv_heads
    if max_query_len != 1 or num_programs == 0 or num_programs >= num_sms:
        return 1
    return min(MAX_NUM_SPLITS, triton.cdiv(_PROGRAMS_PER_SM * num_sms, num_programs))


@triton.jit
def _split_kv_decode_kernel(
    partial_out_ptr,                     # fp32 [num_reqs, num_heads, num_splits, head_size]
    lse_ptr,                             # fp32 [num_reqs, num_heads, num_splits], base 2
    query_ptr,                           # [num_tokens, num_heads, head_size]
    key_cache_ptr, value_cache_ptr,      # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,                     # int32 [>= num_reqs, max_num_blocks_per_req]
    query_start_loc_ptr,                 # int32 [num_reqs + 1]
    seq_lens_ptr,                        # int32 [num_reqs]
    scale_log2,                          # softmax scale * log2(e): exp2 instead of exp
    query_stride_token, query_stride_head,
    cache_stride_block, cache_stride_offset, cache_stride_head,
    block_table_stride,
    BLOCK_SIZE: tl.constexpr,            # tokens per cache block
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,               # rows: power of two >= max(16, NUM_QUERIES_PER_KV)
    BLOCK_N: tl.constexpr,               # keys per tile
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,           # interpreter only: its tl.dot cannot multiply bf16
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:  # padding request (q_len 0)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    # Whole key tiles per split, so that no tile straddles two splits.
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, seq_len)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows
    num_heads = tl.num_programs(1) * NUM_QUERIES_PER_KV
    scratch_row = (req.to(tl.int64) * num_heads + head) * num_splits + split
    if split_start >= split_end:
        # No keys: weight 2^-inf = 0 in the reduction, which never reads the partial output.
        tl.store(lse_ptr + scratch_row, tl.full([BLOCK_M], float("-inf"), tl.float32),
                 mask=row_valid)
        return

    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + q_start.to(tl.int64) * query_stride_token
                + head[:, None] * query_stride_head + dims[None, :], mask=io_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    # The query is the request's last position: every key below seq_len is visible, and
    # every row (padding rows score 0) sees the split's first key, so m_i stays finite.
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)
    acc, m_i, l_i = attend_key_range(
        q, q_pos, split_start, split_end, key_cache_ptr + kv_head * cache_stride_head,
        value_cache_ptr + kv_head * cache_stride_head,
        block_table_ptr + req.to(tl.int64) * block_table_stride, dims, dim_valid,
        cache_stride_block, cache_stride_offset, scale_log2,
        BLOCK_M, BLOCK_N, HEAD_SIZE_PADDED, BLOCK_SIZE, DOT_PRECISION, DOT_IN_FP32,
    )
    tl.store(partial_out_ptr + scratch_row[:, None] * HEAD_SIZE + dims[None, :],
             acc / l_i[:, None], mask=io_mask)
    tl.store(lse_ptr + scratch_row, m_i + tl.log2(l_i), mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,                             # [num_tokens, num_heads, head_size]
    partial_out_ptr,                     # fp32 [num_reqs, num_heads, num_splits, head_size]
    lse_ptr,                             # fp32 [num_reqs, num_heads, num_splits], base 2
    query_start_loc_ptr,                 # int32 [num_reqs + 1]
    num_splits,
    out_stride_token, out_stride_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,         # power of two >= num_splits
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:  # padding request (q_len 0)
        return
    splits = tl.arange(0, SPLITS_PADDED)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    scratch_row = (req.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(lse_ptr + scratch_row, mask=splits < num_splits, other=float("-inf"))
    used = lse > float("-inf")
    # seq_len 0 leaves every split empty: weights 0 and an output of 0 instead of NaN.
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    weights = tl.where(used, tl.exp2(lse - lse_max), 0.0)
    partial = tl.load(partial_out_ptr + scratch_row[:, None] * HEAD_SIZE + dims[None, :],
                      mask=used[:, None] & dim_valid[None, :], other=0.0)
    total = tl.sum(weights, 0)
    acc = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + q_start.to(tl.int64) * out_stride_token + head * out_stride_head + dims,
             acc.to(out_ptr.dtype.element_ty), mask=dim_valid)


def launch_paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor,
                                  value_cache: torch.Tensor, block_table: torch.Tensor,
                                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                  scale: float, num_reqs: int, num_actual_tokens: int,
                                  max_query_len: int, num_splits: int, out: torch.Tensor) -> None:
    """Split-KV attention of a decode-only batch into out; zero rows >= num_actual_tokens.

    Needs max_query_len == 1 (each request has q_len 1, or 0 for a padding request, which
    writes nothing) and 1 <= num_splits <= MAX_NUM_SPLITS. Grid, tiles and launch
    parameters depend only on shapes, dtypes and host ints, never on seq_lens' values,
    so the launch can be captured in a CUDA graph; the fp32 scratch buffers are then
    allocated once, from the graph's memory pool.

    Tiles: BLOCK_M = the GQA group padded to a power of two >= 16 (tl.dot's minimum),
    BLOCK_N and warps/stages as the one-pass kernel (`key_tile_size`, `num_warps_for`,
    NUM_STAGES): on sm_90 a 16-row program takes about 40 KB of shared memory at head 128,
    so several stay resident per SM and keep K/V loads in flight. The reduction is one
    program per (request, query head) over a [splits, head_size] fp32 tile with no loop;
    4 warps keep it at ~32 registers even at 32 splits x head 256 (1 warp spills there).
    """
    if max_query_len != 1:
        raise ValueError(f"split-KV decode needs max_query_len == 1, got {max_query_len}")
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be in [1, {MAX_NUM_SPLITS}]")
    shape = begin_launch(query, out, key_cache, value_cache, block_table, num_reqs, num_actual_tokens)
    if shape is None:
        return
    num_heads, head_size, num_queries_per_kv = shape
    num_kv_heads = key_cache.shape[2]
    partial_out = torch.empty((num_reqs, num_heads, num_splits, head_size),
                              dtype=torch.float32, device=query.device)
    lse = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _split_kv_decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        partial_out, lse, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0),
        BLOCK_SIZE=key_cache.shape[1], NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded(head_size),
        BLOCK_M=max(16, triton.next_power_of_2(num_queries_per_kv)),
        BLOCK_N=key_tile_size(head_size, query.dtype),
        num_warps=num_warps_for(query.dtype), num_stages=NUM_STAGES,
        **dot_options(query.dtype),
    )
    _reduce_splits_kernel[(num_reqs, num_heads)](
        out, partial_out, lse, query_start_loc, num_splits, out.stride(0), out.stride(1),
        HEAD_SIZE=head_size, HEAD_SIZE_PADDED=head_size_padded(head_size),
        SPLITS_PADDED=triton.next_power_of_2(num_splits),
        num_warps=4, num_stages=1,
    )
