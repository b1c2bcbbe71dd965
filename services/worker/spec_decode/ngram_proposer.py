"""Prompt lookup: the tokens that followed the earliest earlier occurrence of a
request's latest n-gram (vLLM's NgramProposer, llama.cpp's prompt-lookup decoding)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``token_ids`` (prompt then output).

    For n from ``max_n`` down to ``min_n``: if the last n tokens occurred
    earlier, the draft is what followed their earliest occurrence (vLLM's
    choice: on input-grounded work that is the source text). [] when no
    n-gram matches or ``k`` < 1.
    """
    num_tokens = token_ids.shape[0]
    if k < 1:
        return []
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # Windows that end before the last token, so each has a continuation.
        windows = sliding_window_view(token_ids[: num_tokens - 1], n)
        matches = np.flatnonzero((windows == token_ids[num_tokens - n :]).all(axis=1))
        if matches.size:
            start = int(matches[0]) + n
            return token_ids[start : start + k].tolist()
    return []
