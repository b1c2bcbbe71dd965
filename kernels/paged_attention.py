"""Causal attention of a mixed prefill/decode batch over the paged KV cache.

K/V of the new tokens are already in the cache (reshape_and_cache ran first); every
key, history and new, is read through the block table. Query token j of request r
(q_len = qsl[r+1] - qsl[r]) sits at position `seq_lens[r] - q_len + j` and attends to
key positions <= that one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._dispatch import use_triton

# Upper bound on gathered key elements (requests x keys x kv heads x head size) in one
# SDPA call of the reference; the value gather is the same size again. 2^22 float32
# elements = 16 MiB stays under glibc's largest mmap threshold (32 MiB), so chunk buffers
# are recycled from the heap instead of page-faulting fresh memory on every layer, which
# measured 3-4x slower than the gather itself for a 128 x 1k-context decode batch.
_MAX_GATHERED_ELEMENTS = 1 << 22


def _make_out(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        # Contiguous even when query is a strided slice of a fused qkv projection.
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} must equal query shape {tuple(query.shape)}")
    return out


def _check_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape != value_cache.shape or key_cache.shape[3] != head_size:
        raise ValueError(
            f"caches {tuple(key_cache.shape)}/{tuple(value_cache.shape)} must be "
            f"[num_blocks, block_size, num_kv_heads, {head_size}]"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")


def _attend_chunk(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_table: torch.Tensor, req_ids: torch.Tensor, q_starts: torch.Tensor,
                  q_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  out: torch.Tensor) -> None:
    """Attention of the requests `req_ids` (CPU int64), padded to their longest query and context."""
    device = query.device
    max_q, max_k = int(q_lens.max()), int(seq_lens.max())
    req_ids, q_starts, q_lens, seq_lens = (t.to(device) for t in (req_ids, q_starts, q_lens, seq_lens))
    num_chunk_reqs, block_size = req_ids.shape[0], key_cache.shape[1]
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype

    # Key slots per request. Positions past seq_len re-read position 0 so that stale (or
    # never written) cache slots are never touched; the mask hides them anyway.
    key_pos = torch.arange(max_k, device=device)
    key_valid = key_pos[None, :] < seq_lens[:, None]
    safe_pos = torch.where(key_valid, key_pos[None, :], 0)
    block_ids = block_table[req_ids[:, None], safe_pos // block_size].to(torch.int64)
    slots = (block_ids * block_size + safe_pos % block_size).flatten()
    kv_shape = (num_chunk_reqs, max_k) + tuple(key_cache.shape[2:])
    # Rows of kv_heads * head_size: index_select on 2-D rows is ~1.5x faster than on 3-D.
    row_size = key_cache.shape[2] * key_cache.shape[3]
    k = key_cache.reshape(-1, row_size).index_select(0, slots).view(kv_shape).to(compute_dtype)
    v = value_cache.reshape(-1, row_size).index_select(0, slots).view(kv_shape).to(compute_dtype)

    q_offsets = torch.arange(max_q, device=device)
    q_valid = q_offsets[None, :] < q_lens[:, None]
    token_ids = q_starts[:, None] + torch.where(q_valid, q_offsets[None, :], 0)
    q = query.index_select(0, token_ids.flatten()).view((num_chunk_reqs, max_q) + query.shape[1:])

    # Causal mask offset by the context length, intersected with the key length.
    q_pos = (seq_lens - q_lens)[:, None] + q_offsets[None, :]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :]
    o = F.scaled_dot_product_attention(
        q.to(compute_dtype).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    ).transpose(1, 2)
    out[token_ids[q_valid]] = o[q_valid].to(out.dtype)


def _chunks(req_ids: torch.Tensor, seq_lens: torch.Tensor, elements_per_key: int):
    """Split requests (sorted by context length) into chunks whose padded K gather fits the budget."""
    if req_ids.numel() == 0:
        return
    order = torch.argsort(seq_lens[req_ids])
    req_ids = req_ids[order]
    # Sorted ascending, so a chunk ending at request i pads every member to seq_lens[i].
    padded = seq_lens[req_ids] * elements_per_key
    start = 0
    while start < req_ids.numel():
        # n * padded[start + n - 1] grows with n: take the largest n within budget, >= 1.
        n_range = torch.arange(1, req_ids.numel() - start + 1)
        n = max(1, int((n_range * padded[start:] <= _MAX_GATHERED_ELEMENTS).sum()))
        yield req_ids[start : start + n]
        start += n


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, num_reqs: int,
                        num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of `paged_attention` (same contract); the CPU path of the model.

    Requests are split into a decode group (q_len == 1, no query padding) and the rest,
    each sorted by context length and cut into chunks bounded by `_MAX_GATHERED_ELEMENTS`;
    a chunk gathers its K/V through the block table into a padded
    [reqs, max_k, kv_heads, head_size] tensor and runs one SDPA call with an explicit mask.
    fp16/bf16 inputs are computed in float32. max_query_len/max_seq_len are not needed here.
    """
    _check_shapes(query, key_cache, value_cache)
    out = _make_out(query, out)
    out[num_actual_tokens:].zero_()
    if num_reqs == 0:
        return out
    qsl = query_start_loc[: num_reqs + 1].to("cpu", torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens_cpu = seq_lens[:num_reqs].to("cpu", torch.int64)
    elements_per_key = key_cache.shape[2] * key_cache.shape[3]
    is_decode = q_lens == 1
    for group in (torch.nonzero(is_decode)[:, 0], torch.nonzero(~is_decode & (q_lens > 0))[:, 0]):
        for req_ids in _chunks(group, seq_lens_cpu, elements_per_key):
            _attend_chunk(query, key_cache, value_cache, block_table, req_ids, qsl[req_ids],
                          q_lens[req_ids], seq_lens_cpu[req_ids], scale, out)
    return out


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, num_reqs: int,
                           num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `paged_attention` (see there for the contract)."""
    from kernels._triton.paged_attention import launch_paged_attention

    _check_shapes(query, key_cache, value_cache)
    out = _make_out(query, out)
    launch_paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                           scale, num_reqs, num_actual_tokens, max_query_len, out)
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, num_reqs: int,
                    num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention for a flat batch of prefill, chunked-prefill and decode tokens.

    Args:
        query: [num_tokens, num_heads, head_size]; num_tokens may include padding.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], already
            holding the K/V of this step's tokens; num_heads % num_kv_heads == 0 (GQA).
        block_table: int32 [>= num_reqs, max_num_blocks_per_req].
        query_start_loc: int32 [num_reqs + 1]; seq_lens: int32 [num_reqs], context + new tokens.
        scale: softmax scale (usually head_size ** -0.5).
        num_reqs, num_actual_tokens: real requests and tokens (without padding).
        max_query_len, max_seq_len: maxima of q_len and seq_lens over the batch.
        out: optional [num_tokens, num_heads, head_size] output buffer.

    Returns:
        [num_tokens, num_heads, head_size] in query's dtype; rows >= num_actual_tokens are zero.
        Cache slots past a request's seq_len are never read.
    """
    fn = paged_attention_triton if use_triton(query) else paged_attention_ref
    return fn(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
              num_reqs, num_actual_tokens, max_query_len, max_seq_len, out)
