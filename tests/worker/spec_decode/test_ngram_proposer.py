"""Prompt lookup against a plain-Python search over random sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.spec_decode import propose_ngram


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix n-gram's earliest earlier occurrence, followed by k tokens."""
    if k < 1:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
       min_n=st.integers(1, 4), extra=st.integers(0, 3), k=st.integers(0, 6))
def test_matches_the_plain_search(tokens, min_n, extra, k):
    array = np.array(tokens, dtype=np.int64)
    assert propose_ngram(array, min_n, min_n + extra, k) == reference(tokens, min_n,
                                                                      min_n + extra, k)


def test_copies_what_followed_the_earliest_occurrence():
    tokens = np.array([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 4, 1, 2, 3])
    assert propose_ngram(tokens, 2, 3, 3) == [9, 9, 1]  # [1 2 3] first at 1
    assert propose_ngram(np.array([5, 6, 7]), 1, 2, 4) == []  # nothing repeats
    assert propose_ngram(np.array([5]), 1, 2, 4) == []
