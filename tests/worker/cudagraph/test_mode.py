"""CUDAGraphMode: parsing, member modes, and the downgrade to what attention supports."""

from __future__ import annotations

import logging

import pytest

from services.worker.attention.backend import TORCH_REF_ATTN, AttentionCGSupport, get_attention_backend
from services.worker.cudagraph.mode import CUDAGraphMode, resolve_cudagraph_mode

M = CUDAGraphMode
S = AttentionCGSupport


def test_parse_is_case_insensitive_and_names_the_allowed_modes():
    assert M.parse("full_and_piecewise") is M.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="'FAST' is not one of NONE, PIECEWISE, FULL, FULL_DECODE_ONLY"):
        M.parse("FAST")


@pytest.mark.parametrize("mode, decode, mixed", [
    (M.NONE, M.NONE, M.NONE),
    (M.PIECEWISE, M.PIECEWISE, M.PIECEWISE),
    (M.FULL, M.FULL, M.FULL),
    (M.FULL_DECODE_ONLY, M.FULL, M.NONE),
    (M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE),
])
def test_member_modes(mode, decode, mixed):
    assert (mode.decode_mode(), mode.mixed_mode()) == (decode, mixed)
    assert mode.separate_routine() == (mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE))


@pytest.mark.parametrize("requested, support, expected", [
    # ALWAYS keeps every mode.
    *[(m, S.ALWAYS, m) for m in M],
    # Full graphs of uniform batches only: FULL keeps them for decode, pieces for the rest.
    (M.FULL, S.UNIFORM_BATCH, M.FULL_AND_PIECEWISE),
    (M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE, M.FULL_AND_PIECEWISE),
    (M.FULL_AND_PIECEWISE, S.UNIFORM_BATCH, M.FULL_AND_PIECEWISE),
    (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE, M.FULL_DECODE_ONLY),
    (M.PIECEWISE, S.UNIFORM_BATCH, M.PIECEWISE),
    # No full graphs at all.
    (M.FULL, S.NEVER, M.PIECEWISE),
    (M.FULL_AND_PIECEWISE, S.NEVER, M.PIECEWISE),
    (M.FULL_DECODE_ONLY, S.NEVER, M.NONE),
    (M.PIECEWISE, S.NEVER, M.PIECEWISE),
    (M.NONE, S.NEVER, M.NONE),
])
def test_downgrade_to_attention_support(requested, support, expected):
    assert resolve_cudagraph_mode(requested, support) is expected


@pytest.mark.parametrize("requested, support, expected", [
    (M.FULL, S.UNIFORM_BATCH, M.FULL_DECODE_ONLY),
    (M.FULL_AND_PIECEWISE, S.ALWAYS, M.FULL_DECODE_ONLY),
    (M.PIECEWISE, S.ALWAYS, M.NONE),
    (M.FULL, S.NEVER, M.NONE),
    (M.FULL, S.ALWAYS, M.FULL),
])
def test_downgrade_without_a_piecewise_split(requested, support, expected):
    assert resolve_cudagraph_mode(requested, support, piecewise_available=False) is expected


def test_single_token_decode_support_cannot_capture_speculative_decode():
    resolve = resolve_cudagraph_mode
    assert resolve(M.FULL_AND_PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE,
                   uniform_decode_query_len=3) is M.PIECEWISE
    assert resolve(M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE,
                   uniform_decode_query_len=3) is M.NONE
    assert resolve(M.FULL_DECODE_ONLY, S.UNIFORM_BATCH, uniform_decode_query_len=3) is M.FULL_DECODE_ONLY


def test_downgrade_is_logged_once_and_no_change_is_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="services.worker.cudagraph.mode"):
        resolve_cudagraph_mode(M.FULL, S.UNIFORM_BATCH)
        resolve_cudagraph_mode(M.FULL_AND_PIECEWISE, S.ALWAYS)
    assert len(caplog.records) == 1
    assert "cudagraph_mode FULL" in caplog.text and "using FULL_AND_PIECEWISE" in caplog.text


def test_cpu_attention_backend_never_supports_graphs(monkeypatch):
    import torch

    monkeypatch.delenv("KVMESH_FORCE_TRITON", raising=False)
    assert get_attention_backend(torch.device("cpu")) is TORCH_REF_ATTN
    monkeypatch.setenv("KVMESH_FORCE_TRITON", "1")
    assert get_attention_backend(torch.device("cpu")).cudagraph_support is S.ALWAYS
