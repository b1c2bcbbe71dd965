"""A verification step's attention as decode rows, one per token (the CPU's fast path)."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata


def as_decode_rows(attn_metadata: AttentionMetadata, req_indices: np.ndarray,
                   positions: np.ndarray) -> AttentionMetadata:
    """A step of last tokens and their drafts as a decode step of one row per token:
    ``req_indices`` and ``positions`` are each token's request row and position.

    Each query attends to the keys up to its own position, which is what a
    decode row with that sequence length and its request's block table does;
    the decode path writes every token's K/V before any row attends, so a
    draft sees the tokens before it. A verification step then runs the CPU's
    compiled decode graph instead of the multi-query path (on the CPU, the
    latter cost half a step more). CPU only: on CUDA, FULL graphs captured the
    block table's buffer itself.
    """
    num_tokens = len(req_indices)
    seq_lens = torch.from_numpy((positions + 1).astype(np.int32))
    return AttentionMetadata(
        num_reqs=num_tokens,
        num_actual_tokens=num_tokens,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_table=attn_metadata.block_table[torch.from_numpy(req_indices)],
        slot_mapping=attn_metadata.slot_mapping,
    )
