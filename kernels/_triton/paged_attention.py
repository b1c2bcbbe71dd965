"""Triton kernel: paged attention for mixed prefill + decode batches.

One program per (query block of one request, kv head). A query block packs BLOCK_Q
consecutive tokens of the request times the NUM_QUERIES_PER_KV query heads sharing the
kv head, so each K/V tile loaded through the block table serves the whole GQA group.
Keys are visited in tiles of BLOCK_N positions with an online (flash-attention) softmax.

The host helpers and `attend_key_range` are shared with the split-KV decode kernel
(`paged_attention_decode.py`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Launch parameters, checked by compiling each tile shape for sm_90 (H100/H200) with the
# ptxas shipped in the Triton wheel and reading registers, spills and shared memory:
# - 16-bit caches, 4 warps (one warpgroup): no spills up to head size 256 with the key
#   tiles below; a 64 x 64 tile at head 128 takes ~200 registers and 82 KB of shared
#   memory, so two programs fit on an SM.
# - fp32 (FMA "ieee" dots, no tensor cores) with 4 warps spills 0.3-2 KB per thread in
#   64-row tiles; with 8 warps no shape spills more than 24 bytes.
# - 3 stages: the K/V gathers become cp.async prefetches from 2 stages on; 3 keeps two
#   tiles in flight at about the same shared memory, and avoids the 0.7-2 KB spills that
#   2 stages cause in 64 x 32 fp32 tiles at head 128.
NUM_STAGES = 3


def num_warps_for(dtype: torch.dtype) -> int:
    """Warps of an attention program: 4 for 16-bit caches, 8 for fp32 (see above)."""
    return 8 if dtype == torch.float32 else 4


def head_size_padded(head_size: int) -> int:
    """Head dim of the register tiles: a power of two, at least tl.dot's minimum K of 16."""
    return max(16, triton.next_power_of_2(head_size))


def key_tile_size(head_size: int, dtype: torch.dtype) -> int:
    """Keys per tile: 64 for 16-bit caches up to head size 128; 32 for fp32, whose tiles
    take twice the registers, and above head size 128, where a 64-row x 64-key tile
    needs 164 KB of shared memory (one program per SM) and spills."""
    if dtype == torch.float32 or head_size_padded(head_size) > 128:
        return 32
    return 64


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """DOT_PRECISION / DOT_IN_FP32 constexprs of the attention kernels for `dtype`."""
    return {
        # fp32 inputs: full-precision dots, TF32 would miss the 1e-3 contract.
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # The interpreter multiplies bf16 operands as their raw uint16 bits.
        "DOT_IN_FP32": dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
    }


def check_kernel_args(query: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, block_table: torch.Tensor) -> None:
    """Layout the kernels rely on: unit stride in the last dim, one stride set for K and V."""
    for name, t in (("query", query), ("out", out), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("block_table", block_table)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key/value cache strides differ: {key_cache.stride()} vs "
                         f"{value_cache.stride()}")


def begin_launch(query: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, block_table: torch.Tensor, num_reqs: int,
                 num_actual_tokens: int) -> tuple[int, int, int] | None:
    """Checks the layout and zeroes the padding rows of out.

    Returns (num_heads, head_size, query heads per kv head), or None when there is
    nothing to attend.
    """
    check_kernel_args(query, out, key_cache, value_cache, block_table)
    out[num_actual_tokens:].zero_()
    if num_reqs == 0 or num_actual_tokens == 0:
        return None
    num_heads, head_size = query.shape[1:]
    return num_heads, head_size, num_heads // key_cache.shape[2]


@triton.jit
def attend_key_range(q, q_pos, key_start, key_end, key_head_ptr, value_head_ptr,
                     block_table_row, dims, dim_valid, cache_stride_block, cache_stride_offset,
                     scale_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HEAD_SIZE_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """Online softmax of the `q` rows over keys [key_start, key_end), base-2 logits.

    Row i sees the keys at positions <= q_pos[i] (causal). Returns (acc, m_i, l_i): the
    unnormalized output, running max and sum. Only keys in the range are read through
    the block table, so cache slots outside it are never touched (they may hold NaN).
    Every row must see key_start, or exp2(-inf - -inf) turns the row into NaN.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    for tile_start in range(key_start, key_end, BLOCK_N):
        k_pos = tile_start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < key_end
        block_ids = tl.load(block_table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_offset = block_ids * cache_stride_block + (k_pos % BLOCK_SIZE) * cache_stride_offset
        k_t = tl.load(key_head_ptr + kv_offset[None, :] + dims[:, None],
                      mask=k_valid[None, :] & dim_valid[:, None], other=0.0)
        if DOT_IN_FP32:
            k_t = k_t.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_head_ptr + kv_offset[:, None] + dims[None, :],
                    mask=k_valid[:, None] & dim_valid[None, :], other=0.0)
        if DOT_IN_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Request owning global query block `q_block`.

    Request r's blocks start at `query_start_loc[r] // BLOCK_Q + r`, a strictly increasing
    bound that leaves room for cdiv(q_len, BLOCK_Q) blocks per request without a prefix sum.
    Returns the last r whose start is <= q_block.
    """
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr,                  # [num_tokens, num_heads, head_size]
    key_cache_ptr, value_cache_ptr,      # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,                     # int32 [>= num_reqs, max_num_blocks_per_req]
    query_start_loc_ptr,                 # int32 [num_reqs + 1]
    seq_lens_ptr,                        # int32 [num_reqs]
    scale_log2,                          # softmax scale * log2(e): exp2 instead of exp
    num_reqs,
    query_stride_token, query_stride_head,
    out_stride_token, out_stride_head,
    cache_stride_block, cache_stride_offset, cache_stride_head,
    block_table_stride,
    BLOCK_SIZE: tl.constexpr,            # tokens per cache block: // and % become shifts
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,               # query tokens per program
    BLOCK_M: tl.constexpr,               # rows: power of two >= BLOCK_Q * NUM_QUERIES_PER_KV
    BLOCK_N: tl.constexpr,               # keys per tile
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,           # interpreter only: its tl.dot cannot multiply bf16
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:  # spare program of the upper-bound grid, or q_len 0
        return
    context_len = tl.load(seq_lens_ptr + req) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_offset = local_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_offset < q_len)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    token = (q_start + q_offset).to(tl.int64)
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + token[:, None] * query_stride_token + head[:, None] * query_stride_head
                + dims[None, :], mask=io_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    q_pos = context_len + q_offset

    # Every row (padding rows too) may see key 0, so m_i is finite after the first tile.
    num_keys = context_len + tl.minimum(local_block * BLOCK_Q + BLOCK_Q, q_len)
    acc, m_i, l_i = attend_key_range(
        q, q_pos, 0, num_keys, key_cache_ptr + kv_head * cache_stride_head,
        value_cache_ptr + kv_head * cache_stride_head,
        block_table_ptr + req.to(tl.int64) * block_table_stride, dims, dim_valid,
        cache_stride_block, cache_stride_offset, scale_log2,
        BLOCK_M, BLOCK_N, HEAD_SIZE_PADDED, BLOCK_SIZE, DOT_PRECISION, DOT_IN_FP32,
    )
    acc = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * out_stride_token + head[:, None] * out_stride_head
             + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def _query_tile(num_queries_per_kv: int, max_query_len: int, head_size: int,
                dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per program and the query tokens they cover.

    16 rows when no request brings 64 query rows (decode-heavy batches, where larger
    tiles would be mostly padding), else 64 so that each K/V tile serves 64 rows. fp32
    above head size 128 keeps 16 rows: its 64-row tiles spill even with 8 warps.
    """
    wide = max_query_len * num_queries_per_kv >= 64
    if dtype == torch.float32 and head_size_padded(head_size) > 128:
        wide = False
    block_m = max(64 if wide else 16, triton.next_power_of_2(num_queries_per_kv))
    return block_m, block_m // num_queries_per_kv


def launch_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, num_reqs: int,
                           num_actual_tokens: int, max_query_len: int, out: torch.Tensor) -> None:
    """Write attention of the first num_actual_tokens rows into out, zero the padding rows.

    One pass over any batch (prefill, chunked prefill, decode, mixed). Every launch choice
    depends only on shapes, dtypes and the host ints num_reqs / num_actual_tokens /
    max_query_len (no device sync), so it can be captured in a CUDA graph. Requests with
    q_len 0 write nothing.
    """
    shape = begin_launch(query, out, key_cache, value_cache, block_table, num_reqs, num_actual_tokens)
    if shape is None:
        return
    _, head_size, num_queries_per_kv = shape
    num_kv_heads = key_cache.shape[2]
    block_m, block_q = _query_tile(num_queries_per_kv, max_query_len, head_size, query.dtype)
    # Upper bound on query blocks (see _find_request); spare programs exit at once.
    grid = (num_actual_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        scale * LOG2E, num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0),
        BLOCK_SIZE=key_cache.shape[1], NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded(head_size),
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=key_tile_size(head_size, query.dtype),
        num_warps=num_warps_for(query.dtype), num_stages=NUM_STAGES,
        **dot_options(query.dtype),
    )
