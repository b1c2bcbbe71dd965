"""The attention layer every model uses: cache write, then paged attention."""

from __future__ import annotations

import torch
from torch import nn

from kernels._dispatch import use_triton
from kernels.paged_attention import paged_attention
from kernels.paged_attention_cpu import (
    CpuAttentionPlan,
    decode_attention_with_kv_write,
    paged_attention_cpu,
    plan_paged_attention_cpu,
)
from kernels.reshape_and_cache import reshape_and_cache
from services.worker.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Causal multi-head (GQA) attention over a paged KV cache.

    ``forward`` first stores this step's key/value rows at
    ``attn_metadata.slot_mapping`` in ``kv_cache`` ([2, num_blocks, block_size,
    num_kv_heads, head_size]), then attends every query to its request's keys,
    history and new alike, all read through ``attn_metadata.block_table``:
    with the Triton kernels where they run (CUDA), else with the CPU path
    (``paged_attention_cpu``), whose decode queries read the cache in place.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, num_heads * head_size], key/value [T, num_kv_heads * head_size]
        (or already split into heads) -> [T, num_heads * head_size], written into
        ``out`` when given (a static buffer under CUDA graphs)."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache(key, value, key_cache, value_cache, attn_metadata.slot_mapping,
                          attn_metadata.num_actual_tokens)
        if out is not None:
            out = out.view(num_tokens, self.num_heads, self.head_size)
        args = (query, key_cache, value_cache, attn_metadata.block_table,
                attn_metadata.query_start_loc, attn_metadata.seq_lens, self.scale,
                attn_metadata.num_reqs, attn_metadata.num_actual_tokens,
                attn_metadata.max_query_len, attn_metadata.max_seq_len, out)
        if use_triton(query):
            output = paged_attention(*args)
        else:
            output = paged_attention_cpu(*args, plan=self.plan(attn_metadata, key_cache))
        return output.view(num_tokens, self.num_heads * self.head_size)

    def forward_decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """A decode-only step's attention (CPU), for a forward pass compiled whole.

        One query per request: query [num_reqs, num_heads * head_size], key/value
        [num_reqs, num_kv_heads * head_size] (or split into heads), slot_mapping
        [num_reqs] with no padding; ``block_table`` and ``seq_lens`` are the step
        plan's ``decode_block_table`` and ``decode_seq_lens`` (see ``plan``).
        Writes the cache, then attends; returns [num_reqs, num_heads * head_size].
        """
        num_reqs = query.shape[0]
        output = decode_attention_with_kv_write(
            query.view(num_reqs, self.num_heads, self.head_size),
            key.view(num_reqs, self.num_kv_heads, self.head_size),
            value.view(num_reqs, self.num_kv_heads, self.head_size),
            kv_cache, slot_mapping, block_table, seq_lens, self.scale,
        )
        return output.view(num_reqs, self.num_heads * self.head_size)

    def plan(self, attn_metadata: AttentionMetadata, key_cache: torch.Tensor) -> CpuAttentionPlan:
        """The step's CPU-path plan: built by the first layer, then shared, since
        every layer sees the same block table and lengths (30 layers, one index pass)."""
        plan = attn_metadata.paged_attention_plan
        if plan is None:
            plan = plan_paged_attention_cpu(
                attn_metadata.block_table, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                attn_metadata.num_reqs, attn_metadata.num_actual_tokens, key_cache.shape[1],
                self.num_kv_heads, self.head_size,
            )
            attn_metadata.paged_attention_plan = plan
        return plan

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}, scale={self.scale}")
