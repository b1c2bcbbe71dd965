"""CudagraphDispatcher: key sets per mode, padding, and the FULL > PIECEWISE > NONE choice."""

from __future__ import annotations

import pytest

from services.worker.cudagraph import CUDAGraphMode as M
from services.worker.cudagraph import CudagraphDispatcher, default_capture_sizes
from services.worker.forward_context import BatchDescriptor as BD

SIZES = [1, 2, 4, 8, 16]


def test_default_capture_sizes():
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[sizes.index(248):sizes.index(248) + 4] == [248, 256, 272, 288]
    assert sizes[-1] == 512 and len(sizes) == 3 + 31 + 17
    with pytest.raises(ValueError, match="must be >= 1"):
        default_capture_sizes(0)


@pytest.mark.parametrize("mode, full, piecewise", [
    (M.NONE, set(), set()),
    (M.PIECEWISE, set(), {BD(s, min(s, 8)) for s in SIZES}),
    (M.FULL, {BD(s, min(s, 8)) for s in SIZES}, set()),
    (M.FULL_DECODE_ONLY, {BD(s, s, True) for s in [1, 2, 4, 8]}, set()),
    (M.FULL_AND_PIECEWISE, {BD(s, s, True) for s in [1, 2, 4, 8]}, {BD(s, min(s, 8)) for s in SIZES}),
])
def test_keys_per_mode(mode, full, piecewise):
    # max_num_reqs 8: no uniform key of 16 one-token requests; mixed keys hold at most 8.
    dispatcher = CudagraphDispatcher(mode, SIZES, max_num_reqs=8)
    assert dispatcher.cudagraph_keys[M.FULL] == full
    assert dispatcher.cudagraph_keys[M.PIECEWISE] == piecewise


def test_uniform_keys_follow_the_decode_query_length():
    dispatcher = CudagraphDispatcher(M.FULL_DECODE_ONLY, [1, 2, 4, 6, 8], max_num_reqs=8,
                                     uniform_decode_query_len=2)
    assert dispatcher.cudagraph_keys[M.FULL] == {BD(2, 1, True), BD(4, 2, True), BD(6, 3, True),
                                                 BD(8, 4, True)}
    assert dispatcher.dispatch(5, 2, uniform=False) == (M.NONE, BD(5, 2, False))
    assert dispatcher.dispatch(6, 3, uniform=True) == (M.FULL, BD(6, 3, True))


@pytest.mark.parametrize("num_tokens, padded", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16), (17, 17)])
def test_padding_to_the_next_capture_size(num_tokens, padded):
    assert CudagraphDispatcher(M.PIECEWISE, SIZES, 8).padded_num_tokens(num_tokens) == padded


@pytest.mark.parametrize("mode, args, expected", [
    # Uniform decode: FULL key with the padded number of one-token requests.
    (M.FULL_AND_PIECEWISE, (3, 3, True), (M.FULL, BD(4, 4, True))),
    # Mixed batch: padded tokens, at most max_num_reqs requests, through the pieces.
    (M.FULL_AND_PIECEWISE, (11, 3, False), (M.PIECEWISE, BD(16, 8, False))),
    # A uniform batch too large for a uniform key falls back to the mixed key.
    (M.FULL_AND_PIECEWISE, (9, 9, True), (M.PIECEWISE, BD(16, 8, False))),
    # FULL: uniform batches reuse the mixed graph of their size.
    (M.FULL, (3, 3, True), (M.FULL, BD(4, 4, False))),
    (M.FULL, (6, 2, False), (M.FULL, BD(8, 8, False))),
    (M.PIECEWISE, (2, 2, True), (M.PIECEWISE, BD(2, 2, False))),
    # FULL_DECODE_ONLY: mixed batches run eagerly and unpadded.
    (M.FULL_DECODE_ONLY, (6, 2, False), (M.NONE, BD(6, 2, False))),
    (M.FULL_DECODE_ONLY, (5, 5, True), (M.FULL, BD(8, 8, True))),
    # Past the largest capture size: eager, unpadded.
    (M.FULL_AND_PIECEWISE, (17, 17, True), (M.NONE, BD(17, 17, True))),
    (M.NONE, (3, 3, True), (M.NONE, BD(3, 3, True))),
])
def test_dispatch(mode, args, expected):
    assert CudagraphDispatcher(mode, SIZES, max_num_reqs=8).dispatch(*args) == expected


def test_every_dispatched_key_is_listed_for_capture():
    dispatcher = CudagraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_reqs=8)
    listed = set(dispatcher.keys_to_capture())
    for num_tokens in range(1, 17):
        for num_reqs in range(1, min(num_tokens, 8) + 1):
            uniform = num_reqs == num_tokens
            runtime_mode, key = dispatcher.dispatch(num_tokens, num_reqs, uniform)
            assert (runtime_mode, key) in listed
            assert key.num_tokens >= num_tokens and key.num_reqs >= num_reqs


def test_capture_order_is_largest_first():
    order = CudagraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, 8).keys_to_capture()
    num_tokens = [key.num_tokens for _, key in order]
    assert num_tokens == sorted(num_tokens, reverse=True)
    assert len(order) == 4 + 5


def test_bad_capture_sizes_are_rejected():
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes \[0, 4\] must all be >= 1"):
        CudagraphDispatcher(M.FULL, [0, 4], 8)
