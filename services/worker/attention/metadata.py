"""Per-step attention metadata, built by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention_cpu import CpuAttentionPlan


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the flattened batch and in the paged KV cache.

    Requests are laid out back to back (no padding between them); request ``r``'s
    tokens are rows ``query_start_loc[r]:query_start_loc[r + 1]``. Rows from
    ``num_actual_tokens`` on are padding to a CUDA graph size: their slot is -1,
    so nothing is written for them, and no request attends from them. For a
    FULL graph the batch is also padded with empty requests (``query_start_loc``
    repeats its last value, ``seq_lens`` is 0) up to the graph's request count.

    Attributes:
        num_reqs: requests in the batch, empty padding requests included.
        num_actual_tokens: scheduled tokens, without padding.
        max_query_len: most tokens any request has in this step.
        max_seq_len: longest ``seq_lens`` entry.
        query_start_loc: int32 [num_reqs + 1], cumulative token counts from 0.
        seq_lens: int32 [num_reqs], context plus this step's tokens per request.
        block_table: int32 [num_reqs, max_num_blocks_per_req], physical block ids
            per logical block; read by attention to find every key and value.
        slot_mapping: int64 [num_tokens], the slot each token's K/V is written to
            (``block_id * block_size + position % block_size``), -1 for padding.
        paged_attention_plan: the CPU attention path's index work for this step
            (``plan_paged_attention_cpu``), built by the first layer and reused by the
            others; None until then, and always None on the Triton path.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    paged_attention_plan: CpuAttentionPlan | None = None
