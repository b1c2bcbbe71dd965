"""Causal attention of a mixed prefill/decode batch over the paged KV cache.

K/V of the new tokens are already in the cache (reshape_and_cache ran first); every
key, history and new, is read through the block table. Query token j of request r
(q_len = qsl[r+1] - qsl[r]) sits at position `seq_lens[r] - q_len + j` and attends to
key positions <= that one.

The reference splits its work in two: `plan_paged_attention` does the index work that
depends only on the step's metadata (which cache rows to gather, which query rows go
where, the masks), and `paged_attention_ref` gathers and attends. Every layer of a step
shares the metadata, so the model builds the plan once per step and passes it to all
layers instead of redoing the index work per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._dispatch import use_triton

# Upper bound on gathered key elements (requests x keys x kv heads x head size) in one
# SDPA call of the reference; the value gather is the same size again. 2^22 float32
# elements = 16 MiB stays under glibc's largest mmap threshold (32 MiB), so chunk buffers
# are recycled from the heap instead of page-faulting fresh memory on every layer, which
# measured 3-4x slower than the gather itself for a 128 x 1k-context decode batch.
_MAX_GATHERED_ELEMENTS = 1 << 22


@dataclass(slots=True)
class _DecodeChunk:
    """One SDPA call over `num_reqs` decode requests (one query each), padded to `max_k` keys.

    K/V are gathered whole blocks at a time (one memcpy of block_size rows per index,
    much faster than a row gather) into the plan's `kv_buffers`.

    key_blocks: int64 [num_reqs * blocks_per_req], each request's blocks; entries past a
        request's last block repeat its first block, so stale table entries are never used.
    pad_rows: int64 rows of the gathered [num_reqs * blocks_per_req * block_size] keys that
        lie at or past their request's seq_len (the unwritten tail of a last block, spare
        blocks) and below max_k; zeroed after the gather so that garbage there (NaN) never
        reaches the output through masked-out, zero-weighted products. None if no such row.
    query_rows: int64 [num_reqs] rows of `query`, or None when they are the slice
        `first_row .. first_row + num_reqs` (a decode-only batch).
    mask: bool [num_reqs, 1, 1, max_k] key validity, or None when all seq_lens equal max_k.
    """

    num_reqs: int
    max_k: int
    blocks_per_req: int
    key_blocks: torch.Tensor
    pad_rows: torch.Tensor | None
    query_rows: torch.Tensor | None
    first_row: int
    mask: torch.Tensor | None


@dataclass(slots=True)
class _PrefillChunk:
    """One SDPA call over requests with several queries, padded to `max_q` and `max_k`.

    key_slots: int64 [num_reqs * max_k], the cache row of every (request, key position);
        positions past a request's seq_len re-read its position 0, so stale or never
        written slots are never touched (the mask hides them).
    query_rows: int64 [num_reqs * max_q] rows of `query` (padded queries re-read the
        request's first row); out_rows: the rows of the valid queries, in the order of
        `q_valid` (bool [num_reqs, max_q]).
    mask: bool [num_reqs, 1, max_q, max_k], causal and within seq_len.
    """

    num_reqs: int
    max_q: int
    max_k: int
    key_slots: torch.Tensor
    query_rows: torch.Tensor
    out_rows: torch.Tensor
    q_valid: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class PagedAttentionPlan:
    """The metadata-only index work of `paged_attention_ref` for one step.

    Built by `plan_paged_attention`; valid for the block table, query_start_loc and
    seq_lens it was built from (the same for every layer of a step), whatever the
    layer's query and caches. Decode requests (q_len == 1) and the rest form separate
    chunks, each bounded by `_MAX_GATHERED_ELEMENTS`. `kv_buffers` (K, V) receive the
    decode chunks' block gathers, one chunk at a time: allocated by the first layer,
    then reused by every other instead of page-faulting fresh memory per layer.
    """

    num_reqs: int
    num_actual_tokens: int
    block_size: int
    chunks: list[_DecodeChunk | _PrefillChunk]
    kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None


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


def _chunks(req_ids: torch.Tensor, seq_lens: torch.Tensor, elements_per_key: int) -> Iterator[torch.Tensor]:
    """Split requests into chunks whose padded K gather fits the budget.

    A group that fits whole stays in batch order (a decode batch then reads its query
    rows as one slice); otherwise requests are sorted by context length, so that a
    chunk ending at request i pads every member to seq_lens[i], and cut greedily.
    """
    if req_ids.numel() == 0:
        return
    lens = seq_lens[req_ids]
    if req_ids.numel() * int(lens.max()) * elements_per_key <= _MAX_GATHERED_ELEMENTS:
        yield req_ids
        return
    order = torch.argsort(lens, stable=True)
    req_ids = req_ids[order]
    padded = lens[order] * elements_per_key
    start = 0
    while start < req_ids.numel():
        # n * padded[start + n - 1] grows with n: take the largest n within budget, >= 1.
        n_range = torch.arange(1, req_ids.numel() - start + 1)
        n = max(1, int((n_range * padded[start:] <= _MAX_GATHERED_ELEMENTS).sum()))
        yield req_ids[start : start + n]
        start += n


def _plan_decode_chunk(block_table: torch.Tensor, req_ids: torch.Tensor, q_starts: torch.Tensor,
                       seq_lens: torch.Tensor, block_size: int) -> _DecodeChunk:
    """Index tensors (on CPU) of a decode chunk; `block_table` is the CPU copy."""
    num_reqs, max_k = req_ids.numel(), int(seq_lens.max())
    blocks_per_req = -(-max_k // block_size)
    num_blocks = (seq_lens + block_size - 1) // block_size
    block_idx = torch.arange(blocks_per_req)
    block_idx = torch.where(block_idx[None, :] < num_blocks[:, None], block_idx[None, :], 0)
    key_blocks = block_table[req_ids[:, None], block_idx].to(torch.int64).flatten()
    key_pos = torch.arange(max_k)
    key_valid = key_pos[None, :] < seq_lens[:, None]
    all_valid = bool(key_valid.all())
    pad_rows = None
    if not all_valid:
        rows = torch.arange(num_reqs)[:, None] * (blocks_per_req * block_size) + key_pos[None, :]
        pad_rows = rows[~key_valid]
    first_row = int(q_starts[0])
    contiguous = torch.equal(q_starts, torch.arange(first_row, first_row + num_reqs))
    # A decode query sits at the last position: it sees exactly its valid keys.
    mask = None if all_valid else key_valid[:, None, None, :]
    return _DecodeChunk(num_reqs, max_k, blocks_per_req, key_blocks, pad_rows,
                        None if contiguous else q_starts, first_row, mask)


def _plan_prefill_chunk(block_table: torch.Tensor, req_ids: torch.Tensor, q_starts: torch.Tensor,
                        q_lens: torch.Tensor, seq_lens: torch.Tensor,
                        block_size: int) -> _PrefillChunk:
    """Index tensors (on CPU) of a chunk of multi-query requests."""
    max_q, max_k = int(q_lens.max()), int(seq_lens.max())
    key_pos = torch.arange(max_k)
    key_valid = key_pos[None, :] < seq_lens[:, None]
    safe_pos = torch.where(key_valid, key_pos[None, :], 0)
    block_ids = block_table[req_ids[:, None], safe_pos // block_size].to(torch.int64)
    key_slots = (block_ids * block_size + safe_pos % block_size).flatten()
    q_offsets = torch.arange(max_q)
    q_valid = q_offsets[None, :] < q_lens[:, None]
    token_ids = q_starts[:, None] + torch.where(q_valid, q_offsets[None, :], 0)
    # Causal mask offset by the context length, intersected with the key length.
    q_pos = (seq_lens - q_lens)[:, None] + q_offsets[None, :]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :]
    return _PrefillChunk(req_ids.numel(), max_q, max_k, key_slots, token_ids.flatten(),
                         token_ids[q_valid], q_valid, mask[:, None])


def _to_device(chunk: _DecodeChunk | _PrefillChunk, device: torch.device) -> _DecodeChunk | _PrefillChunk:
    for name in chunk.__slots__:
        value = getattr(chunk, name)
        if isinstance(value, torch.Tensor):
            setattr(chunk, name, value.to(device))
    return chunk


def plan_paged_attention(block_table: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, num_reqs: int, num_actual_tokens: int,
                         block_size: int, num_kv_heads: int, head_size: int) -> PagedAttentionPlan:
    """Index work of `paged_attention_ref` for one step (arguments as in `paged_attention`).

    The result depends only on the metadata and the cache geometry, so every layer of a
    step can reuse it. Index tensors live on `block_table`'s device.
    """
    qsl = query_start_loc[: num_reqs + 1].to("cpu", torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens_cpu = seq_lens[:num_reqs].to("cpu", torch.int64)
    block_table_cpu = block_table[:num_reqs].cpu()
    elements_per_key = num_kv_heads * head_size
    is_decode = q_lens == 1
    chunks: list[_DecodeChunk | _PrefillChunk] = []
    for req_ids in _chunks(torch.nonzero(is_decode)[:, 0], seq_lens_cpu, elements_per_key):
        chunk = _plan_decode_chunk(block_table_cpu, req_ids, qsl[req_ids], seq_lens_cpu[req_ids],
                                   block_size)
        chunks.append(_to_device(chunk, block_table.device))
    prefill = torch.nonzero(~is_decode & (q_lens > 0))[:, 0]
    for req_ids in _chunks(prefill, seq_lens_cpu, elements_per_key):
        chunk = _plan_prefill_chunk(block_table_cpu, req_ids, qsl[req_ids], q_lens[req_ids],
                                    seq_lens_cpu[req_ids], block_size)
        chunks.append(_to_device(chunk, block_table.device))
    return PagedAttentionPlan(num_reqs, num_actual_tokens, block_size, chunks)


def _decode_buffers(plan: PagedAttentionPlan, key_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's (K, V) gather buffers, [most blocks of a decode chunk, block elements]."""
    buffers = plan.kv_buffers
    if buffers is None or buffers[0].dtype != key_cache.dtype or buffers[0].device != key_cache.device:
        num_rows = max(c.key_blocks.numel() for c in plan.chunks if isinstance(c, _DecodeChunk))
        shape = (num_rows, key_cache[0].numel())
        buffers = (torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device),
                   torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device))
        plan.kv_buffers = buffers
    return buffers


def _gather_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, chunk: _DecodeChunk,
                   buffers: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the chunk's blocks, [num_reqs, blocks_per_req * block_size, kv_heads, head]."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    kv_shape = (chunk.num_reqs, chunk.blocks_per_req * block_size, num_kv_heads, head_size)
    gathered = []
    for cache, buffer in zip((key_cache, value_cache), buffers):
        buffer = buffer[: chunk.key_blocks.numel()]
        torch.index_select(cache.reshape(num_blocks, -1), 0, chunk.key_blocks, out=buffer)
        if chunk.pad_rows is not None:
            buffer.view(-1, num_kv_heads * head_size).index_fill_(0, chunk.pad_rows, 0)
        gathered.append(buffer.view(kv_shape))
    return gathered[0], gathered[1]


def _attend_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   chunk: _DecodeChunk, buffers: tuple[torch.Tensor, torch.Tensor], scale: float,
                   compute_dtype: torch.dtype, out: torch.Tensor) -> None:
    """One query per request. The `group` query heads that share a KV head become
    `group` query rows of one SDPA head: GQA without repeating K/V or a causal mask."""
    num_reqs, max_k = chunk.num_reqs, chunk.max_k
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    k, v = _gather_blocks(key_cache, value_cache, chunk, buffers)
    # [reqs, max_k, kv_heads, head] -> [reqs, kv_heads, max_k, head], a strided view.
    k = k[:, :max_k].transpose(1, 2).to(compute_dtype)
    v = v[:, :max_k].transpose(1, 2).to(compute_dtype)
    if chunk.query_rows is None:
        q = query[chunk.first_row : chunk.first_row + num_reqs]
    else:
        q = query.index_select(0, chunk.query_rows)
    q = q.reshape(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_size).to(compute_dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale)
    o = o.reshape(num_reqs, num_heads, head_size).to(out.dtype)
    if chunk.query_rows is None:
        out[chunk.first_row : chunk.first_row + num_reqs] = o
    else:
        out.index_copy_(0, chunk.query_rows, o)


def _attend_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    chunk: _PrefillChunk, scale: float, compute_dtype: torch.dtype,
                    out: torch.Tensor) -> None:
    """Requests with several queries, padded to the chunk's longest query and context."""
    num_reqs, max_q, max_k = chunk.num_reqs, chunk.max_q, chunk.max_k
    num_kv_heads = key_cache.shape[2]
    kv_shape = (num_reqs, max_k, num_kv_heads, query.shape[2])
    # Rows of kv_heads * head_size: index_select on 2-D rows is ~1.5x faster than on 3-D.
    key_rows = key_cache.reshape(-1, num_kv_heads * query.shape[2])
    value_rows = value_cache.reshape(-1, num_kv_heads * query.shape[2])
    k = key_rows.index_select(0, chunk.key_slots).view(kv_shape).to(compute_dtype)
    v = value_rows.index_select(0, chunk.key_slots).view(kv_shape).to(compute_dtype)
    q = query.index_select(0, chunk.query_rows).view((num_reqs, max_q) + query.shape[1:])
    o = F.scaled_dot_product_attention(
        q.to(compute_dtype).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=chunk.mask, scale=scale, enable_gqa=q.shape[2] != num_kv_heads,
    ).transpose(1, 2)
    out.index_copy_(0, chunk.out_rows, o[chunk.q_valid].to(out.dtype))


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, num_reqs: int,
                        num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                        out: torch.Tensor | None = None,
                        plan: PagedAttentionPlan | None = None) -> torch.Tensor:
    """PyTorch reference of `paged_attention` (same contract); the CPU path of the model.

    Requests are split into a decode group (q_len == 1, no query padding) and the rest,
    each cut into chunks bounded by `_MAX_GATHERED_ELEMENTS`; a chunk gathers its K/V
    through the block table into a padded [reqs, max_k, kv_heads, head_size] tensor
    (decode chunks whole blocks at a time, into buffers the plan keeps) and runs one SDPA
    call; decode folds GQA into the query axis instead of repeating K/V. `plan` (from
    `plan_paged_attention` on the same metadata) skips the index work and the buffer
    allocation; without it the plan is built here. fp16/bf16 inputs are computed in
    float32. max_query_len/max_seq_len are not needed here.
    """
    _check_shapes(query, key_cache, value_cache)
    out = _make_out(query, out)
    out[num_actual_tokens:].zero_()
    if num_reqs == 0:
        return out
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    if plan is None:
        plan = plan_paged_attention(block_table, query_start_loc, seq_lens, num_reqs,
                                    num_actual_tokens, block_size, num_kv_heads, head_size)
    else:
        planned = (plan.num_reqs, plan.num_actual_tokens, plan.block_size)
        if planned != (num_reqs, num_actual_tokens, block_size):
            raise ValueError(
                f"plan for (num_reqs, num_actual_tokens, block_size) = {planned} used with "
                f"{(num_reqs, num_actual_tokens, block_size)}"
            )
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    for chunk in plan.chunks:
        if isinstance(chunk, _DecodeChunk):
            buffers = _decode_buffers(plan, key_cache)
            _attend_decode(query, key_cache, value_cache, chunk, buffers, scale, compute_dtype, out)
        else:
            _attend_prefill(query, key_cache, value_cache, chunk, scale, compute_dtype, out)
    return out


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, num_reqs: int,
                           num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                           out: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton version of `paged_attention` (see there for the contract).

    Two kernels: a one-pass kernel for any batch, and, for decode-only batches
    (max_query_len == 1) too small to fill the GPU, a split-KV kernel that cuts each
    request's keys into `num_splits` ranges attended in parallel, then merges them.
    `num_splits`: None picks automatically (`choose_num_splits`: split only when
    num_reqs x num_kv_heads < the SM count); 1 forces the one-pass kernel; > 1 forces
    split-KV with that many splits (needs max_query_len == 1, at most MAX_NUM_SPLITS).

    CUDA graphs: every host-side choice (which kernel, number of splits, tiles, grid,
    num_warps / num_stages) depends only on shapes, dtypes, the device's SM count and the
    host ints num_reqs, num_actual_tokens, max_query_len; never on max_seq_len or on
    tensor contents, and nothing syncs with the device. A FULL graph captured for a
    padded (num_reqs, num_tokens) therefore replays correctly for any batch padded to it:
    padding requests (q_len 0, seq_len 0) write nothing, rows >= num_actual_tokens are
    zeroed, and rows below it that no request covers are left as they were.
    """
    from kernels._triton.paged_attention import launch_paged_attention
    from kernels._triton.paged_attention_decode import (
        choose_num_splits,
        device_num_sms,
        launch_paged_attention_decode,
    )

    _check_shapes(query, key_cache, value_cache)
    out = _make_out(query, out)
    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, key_cache.shape[2], max_query_len,
                                       device_num_sms(query.device))
    if num_splits == 1:
        launch_paged_attention(query, key_cache, value_cache, block_table, query_start_loc,
                               seq_lens, scale, num_reqs, num_actual_tokens, max_query_len, out)
    else:
        launch_paged_attention_decode(query, key_cache, value_cache, block_table, query_start_loc,
                                      seq_lens, scale, num_reqs, num_actual_tokens, max_query_len,
                                      num_splits, out)
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, num_reqs: int,
                    num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                    out: torch.Tensor | None = None,
                    plan: PagedAttentionPlan | None = None) -> torch.Tensor:
    """Causal paged attention for a flat batch of prefill, chunked-prefill and decode tokens.

    Args:
        query: [num_tokens, num_heads, head_size]; num_tokens may include padding.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], already
            holding the K/V of this step's tokens; num_heads % num_kv_heads == 0 (GQA).
        block_table: int32 [>= num_reqs, max_num_blocks_per_req].
        query_start_loc: int32 [num_reqs + 1]; seq_lens: int32 [num_reqs], context + new tokens.
        scale: softmax scale (usually head_size ** -0.5).
        num_reqs, num_actual_tokens: real requests and tokens (without padding).
        max_query_len, max_seq_len: maxima of q_len and seq_lens over the batch. Neither
            kernel reads max_seq_len (a CUDA graph replays one value for every batch).
        out: optional [num_tokens, num_heads, head_size] output buffer.
        plan: optional `plan_paged_attention` result for this metadata, which the
            reference path reuses across layers; the Triton kernel ignores it.

    Returns:
        [num_tokens, num_heads, head_size] in query's dtype; rows >= num_actual_tokens are zero.
        Cache slots past a request's seq_len never affect the result, even when they hold
        NaN: the reference copies the unwritten tail of a decode request's last block
        with the block, then zeroes it before use.
    """
    args = (query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
            num_reqs, num_actual_tokens, max_query_len, max_seq_len, out)
    if use_triton(query):
        return paged_attention_triton(*args)
    return paged_attention_ref(*args, plan=plan)
