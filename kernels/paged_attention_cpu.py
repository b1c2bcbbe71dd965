"""The CPU path of `paged_attention`: decode queries read K/V in place through the block table.

`paged_attention_ref` is the oracle: it gathers each request's whole history into a
padded buffer and attends in float32. On the CPU that copy, made on every layer of every
decode step, costs more than the attention itself. Here a decode query (q_len == 1)
reads each key and value through the block table where it lies in the cache, with a
float32 softmax: in kvmesh's C++ kernel (``kvmesh::decode_attention_cpu``, built at
run time by `kernels.cpu_extension`; 3-6x faster) where it serves the shapes, else
in `decode_attention`, a torch function compiled by inductor into one loop nest (an
indirect load fused into the dot products), which is also the C++ kernel's
reference. Requests with several queries (prefill, chunked prefill) gather
their keys as the reference does, since there the copy is small next to the
q_len x seq_len work, and attend with SDPA in the query's dtype (a request's whole
prompt in one step as plain causal attention, without a mask).

`plan_paged_attention_cpu` does the index work once per step; every layer reuses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_extension import has_cpu_kernel
from kernels.paged_attention import (
    PagedAttentionPlan,
    _check_shapes,
    _make_out,
    _PrefillChunk,
    plan_paged_attention,
)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per request against its keys, read through the block table.

    query [num_reqs, num_heads, head_size]; caches [num_blocks, block_size,
    num_kv_heads, head_size]; block_table int32 [num_reqs, >= ceil(max seq_len /
    block_size)]; seq_lens [num_reqs], each >= 1. Returns [num_reqs, num_heads,
    head_size] in query's dtype; scores, softmax and sums are float32. Entries of
    the block table past a request's last block and cache slots past its seq_len
    are never read into the result (not even a NaN there).

    Written for inductor: every tensor below except the result is fused away.
    """
    num_reqs, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    max_k = block_table.shape[1] * block_size
    key_pos = torch.arange(max_k, device=query.device)
    valid = key_pos[None, :] < seq_lens[:, None]  # [reqs, max_k]
    block_ids = block_table.long()[:, key_pos // block_size]
    slots = torch.where(valid, block_ids * block_size + key_pos % block_size, 0)
    keys = key_cache.view(num_blocks * block_size, num_kv_heads, head_size)[slots]
    values = value_cache.view(num_blocks * block_size, num_kv_heads, head_size)[slots]
    # [reqs, 1, kv_heads, group, head] x [reqs, max_k, kv_heads, 1, head]: GQA without repeats.
    q = query.view(num_reqs, 1, num_kv_heads, group, head_size).float()
    scores = (q * keys.float()[:, :, :, None, :]).sum(-1) * scale  # [reqs, max_k, kv_heads, group]
    valid = valid[:, :, None, None]
    scores = torch.where(valid, scores, float("-inf"))
    probs = torch.exp(scores - scores.amax(1, keepdim=True))
    probs = torch.where(valid, probs, 0.0)
    weighted = torch.where(valid[..., None], probs[..., None] * values.float()[:, :, :, None, :], 0.0)
    out = weighted.sum(1) / probs.sum(1)[..., None]  # [reqs, kv_heads, group, head]
    return out.view(num_reqs, num_heads, head_size).to(query.dtype)


def decode_attention_with_kv_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                   kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                   block_table: torch.Tensor, seq_lens: torch.Tensor,
                                   scale: float) -> torch.Tensor:
    """One layer of a decode-only step, for a caller traced whole by torch.compile.

    Stores key/value [num_reqs, num_kv_heads, head_size] (one new token per
    request) at ``slot_mapping`` [num_reqs] of ``kv_cache`` [2, num_blocks,
    block_size, num_kv_heads, head_size], in place and cast to its dtype, then
    returns `decode_attention` over the updated cache (kvmesh's C++ kernel where
    `uses_cpu_kernel`, else the torch function). Every slot must be real
    (no -1 padding) and no two requests may share one.
    """
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # index_put_ on the graph's input itself: inductor does it in place, whereas a
    # write through a view of the input (kv_cache[0].view(...)) is functionalized
    # into a copy of the whole cache on every call.
    kv_cache.index_put_((torch.zeros_like(blocks), blocks, offsets), key.to(kv_cache.dtype))
    kv_cache.index_put_((torch.ones_like(blocks), blocks, offsets), value.to(kv_cache.dtype))
    attend = (torch.ops.kvmesh.decode_attention_cpu if uses_cpu_kernel(query, kv_cache[0])
              else decode_attention)
    return attend(query, kv_cache[0], kv_cache[1], block_table, seq_lens, scale)


# What kvmesh::decode_attention_cpu serves: its dtypes, the head sizes it is compiled
# for, and the bounds of its stack buffers.
_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_CPU_KERNEL_HEAD_SIZES = (32, 64, 128, 256)
_CPU_KERNEL_MAX_HEADS, _CPU_KERNEL_MAX_BLOCK_SIZE = 128, 64


def uses_cpu_kernel(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether decode attention on ``query`` [num_reqs, num_heads, head_size] and a cache
    like ``key_cache`` runs kvmesh's C++ kernel (else `decode_attention`)."""
    num_heads, head_size = query.shape[1:]
    return (query.dtype in _CPU_KERNEL_DTYPES and key_cache.dtype in _CPU_KERNEL_DTYPES
            and num_heads <= _CPU_KERNEL_MAX_HEADS and head_size in _CPU_KERNEL_HEAD_SIZES
            and key_cache.shape[1] <= _CPU_KERNEL_MAX_BLOCK_SIZE
            and has_cpu_kernel("decode_attention_cpu"))


@functools.cache
def _compiled_decode_attention() -> Callable[..., torch.Tensor]:
    # Compiled lazily, on the first decode step; inductor's on-disk cache makes later
    # processes skip the build. Inductor needs a C++ compiler for the CPU: without
    # one the same function runs eagerly (correct, gathering as it goes).
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # RuntimeError when no compiler is found
        return decode_attention
    # Dynamic from the first trace: batch, block-table width and cache size all vary,
    # and a process may hold several caches (several workers or benchmarks).
    return torch.compile(decode_attention, dynamic=True)


def compiled_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, block_table: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` for an eager caller: kvmesh's C++ kernel where it serves
    (`uses_cpu_kernel`), else the torch function through inductor, one compiled
    variant per dtype for every batch size and context length (plus torch's
    batch-of-one specialization).

    Only the batch and block-count dimensions are dynamic: a dynamic cache shape
    would let torch tie it to an equal batch size, and recompile when they differ.
    """
    if uses_cpu_kernel(query, key_cache):
        return torch.ops.kvmesh.decode_attention_cpu(query, key_cache, value_cache, block_table,
                                                     seq_lens, scale)
    for tensor, dims in ((query, (0,)), (block_table, (0, 1)), (seq_lens, (0,))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return _compiled_decode_attention()(query, key_cache, value_cache, block_table, seq_lens,
                                        scale)


@dataclass(slots=True)
class CpuAttentionPlan:
    """The step's index work for `paged_attention_cpu`, shared by every layer.

    decode_rows: int64 rows of the decode queries, or None when they are rows
        ``[0, num_decodes)`` (a decode-only batch).
    decode_block_table: int32 [num_decodes, blocks of the longest decode].
    decode_seq_lens: int32 [num_decodes].
    prefill: the reference's plan for the multi-query requests (prefill chunks only),
        or None when there are none.
    """

    num_reqs: int
    num_actual_tokens: int
    num_decodes: int
    decode_rows: torch.Tensor | None
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill: PagedAttentionPlan | None


def plan_paged_attention_cpu(block_table: torch.Tensor, query_start_loc: torch.Tensor,
                             seq_lens: torch.Tensor, num_reqs: int, num_actual_tokens: int,
                             block_size: int, num_kv_heads: int,
                             head_size: int) -> CpuAttentionPlan:
    """Index work of `paged_attention_cpu` for one step (arguments as in `paged_attention`)."""
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = seq_lens[:num_reqs]
    is_decode = q_lens == 1
    num_decodes = int(is_decode.sum())
    decode_reqs = torch.nonzero(is_decode)[:, 0]
    decode_rows: torch.Tensor | None = qsl[decode_reqs]
    if num_decodes == num_reqs and num_actual_tokens == num_reqs:
        decode_rows, decode_reqs = None, None
    decode_seq_lens = seq_lens if decode_reqs is None else seq_lens[decode_reqs]
    # At least two block columns: torch specializes a dimension of size 1, and each
    # specialization is one more compiled variant of the kernel (dynamo keeps 8).
    max_blocks = max(-(-int(decode_seq_lens.max()) // block_size), 2) if num_decodes else 0
    decode_block_table = block_table[:num_reqs] if decode_reqs is None else block_table[decode_reqs]
    if decode_block_table.shape[1] < max_blocks:
        decode_block_table = F.pad(decode_block_table, (0, max_blocks - decode_block_table.shape[1]))
    prefill = None
    if num_decodes < num_reqs:
        prefill = plan_paged_attention(block_table, query_start_loc, seq_lens, num_reqs,
                                       num_actual_tokens, block_size, num_kv_heads, head_size)
        prefill.chunks = [c for c in prefill.chunks if isinstance(c, _PrefillChunk)]
    # Copies (small: ints per request), so that the kernel's inputs are always fresh
    # tensors: a view of the runner's buffers differs from one made here in what
    # torch.compile guards on (an inference-mode tensor or not), which would recompile.
    # Contiguous strides even for one request, whose row stride clone() would keep.
    return CpuAttentionPlan(num_reqs, num_actual_tokens, num_decodes, decode_rows,
                            decode_block_table[:, :max_blocks].clone(
                                memory_format=torch.contiguous_format),
                            decode_seq_lens.clone(), prefill)


def paged_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, num_reqs: int,
                        num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                        out: torch.Tensor | None = None,
                        plan: CpuAttentionPlan | None = None) -> torch.Tensor:
    """The CPU version of `paged_attention` (same contract; CPU tensors only).

    Decode queries attend in place through `compiled_decode_attention`; the
    others gather as `paged_attention_ref` does and run SDPA in the query's dtype
    (float32 when the caches have another dtype). `plan` (from
    `plan_paged_attention_cpu` on the same metadata) skips the index work.
    """
    _check_shapes(query, key_cache, value_cache)
    out = _make_out(query, out)
    out[num_actual_tokens:].zero_()
    if num_reqs == 0:
        return out
    if plan is None:
        plan = plan_paged_attention_cpu(block_table, query_start_loc, seq_lens, num_reqs,
                                        num_actual_tokens, *key_cache.shape[1:])
    elif (plan.num_reqs, plan.num_actual_tokens) != (num_reqs, num_actual_tokens):
        raise ValueError(f"plan for (num_reqs, num_actual_tokens) = "
                         f"{(plan.num_reqs, plan.num_actual_tokens)} used with "
                         f"{(num_reqs, num_actual_tokens)}")
    if plan.num_decodes:
        rows = plan.decode_rows
        q = query[: plan.num_decodes] if rows is None else query.index_select(0, rows)
        o = compiled_decode_attention(q, key_cache, value_cache, plan.decode_block_table,
                                      plan.decode_seq_lens, scale)
        if rows is None:
            out[: plan.num_decodes] = o
        else:
            out.index_copy_(0, rows, o)
    if plan.prefill is not None:
        same_dtype = query.dtype == key_cache.dtype
        compute_dtype = query.dtype if same_dtype else torch.float32
        for chunk in plan.prefill.chunks:
            if chunk.num_reqs == 1 and chunk.max_q == chunk.max_k:
                _attend_fresh_prompt(query, key_cache, value_cache, chunk, scale, compute_dtype, out)
            else:
                _attend_chunk(query, key_cache, value_cache, chunk, scale, compute_dtype, out)
    return out


def _attend_chunk(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  chunk: _PrefillChunk, scale: float, compute_dtype: torch.dtype,
                  out: torch.Tensor) -> None:
    """The reference's padded, masked chunk, with K/V heads repeated for their query
    heads (SDPA's ``enable_gqa`` takes the CPU's unfused math kernel)."""
    num_reqs, max_q, max_k = chunk.num_reqs, chunk.max_q, chunk.max_k
    _, _, num_kv_heads, head_size = key_cache.shape
    group = query.shape[1] // num_kv_heads
    k, v = (cache.reshape(-1, num_kv_heads * head_size).index_select(0, chunk.key_slots)
            .view(num_reqs, max_k, num_kv_heads, head_size).to(compute_dtype)
            .repeat_interleave(group, dim=2).transpose(1, 2)
            for cache in (key_cache, value_cache))
    q = query.index_select(0, chunk.query_rows).view((num_reqs, max_q) + query.shape[1:])
    o = F.scaled_dot_product_attention(q.to(compute_dtype).transpose(1, 2), k, v,
                                       attn_mask=chunk.mask, scale=scale).transpose(1, 2)
    out.index_copy_(0, chunk.out_rows, o[chunk.q_valid].to(out.dtype))


def _attend_fresh_prompt(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         chunk: _PrefillChunk, scale: float, compute_dtype: torch.dtype,
                         out: torch.Tensor) -> None:
    """One request's whole prompt in one chunk: plain causal attention over its own
    rows, which lets SDPA run its flash kernel instead of reading an explicit mask."""
    num_tokens, (_, _, num_kv_heads, head_size) = chunk.max_q, key_cache.shape
    first = int(chunk.query_rows[0])
    rows = slice(first, first + num_tokens)
    # 4-D inputs, K/V heads repeated for their query heads: otherwise (3-D, or
    # enable_gqa) the CPU SDPA falls back to its unfused math kernel, 3x slower on a
    # 1,000-token prompt.
    group = query.shape[1] // num_kv_heads
    k, v = (cache.reshape(-1, num_kv_heads, head_size).index_select(0, chunk.key_slots)
            .to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)[None]
            for cache in (key_cache, value_cache))
    q = query[rows].to(compute_dtype).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    out[rows] = o[0].transpose(0, 1)
