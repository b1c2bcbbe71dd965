"""The CPU attention path: decode queries read the cache in place (the C++ kernel, or
the compiled torch one), the rest gather; checked against the reference on random
ragged batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import paged_attention_ref, reshape_and_cache_ref
from kernels.cpu_extension import load_cpu_kernels
from kernels.paged_attention_cpu import (
    decode_attention,
    decode_attention_with_kv_write,
    paged_attention_cpu,
    plan_paged_attention_cpu,
)
from tests.kernels.test_paged_attention import (
    DECODE_ONLY,
    MIXED,
    PREFILL_ONLY,
    dense_causal_attention,
    make_batch,
    max_rel_error,
)

# "prompt": one whole prompt alone, which takes plain causal attention (no mask).
LENS = {"decode": DECODE_ONLY, "prefill": PREFILL_ONLY, "mixed": MIXED, "prompt": ([37], [37])}
# Relative to the float64 oracle: float32 math, and bfloat16 inputs and output.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _poison_unowned_slots(batch, block_size: int) -> None:
    """NaN in every cache slot no request owns (past seq_len, stale table entries)."""
    owned = torch.zeros(batch.kv_cache.shape[1:3], dtype=torch.bool)
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        owned[batch.block_table[row, pos // block_size].long(), pos % block_size] = True
    batch.kv_cache[:, ~owned] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_eager_matches_dense(dtype: torch.dtype) -> None:
    """The kernel's torch source, run eagerly: GQA folding, masking, stale blocks."""
    batch = make_batch(*DECODE_ONLY, 8, 9, 3, 32, dtype=dtype, seed=3)
    _poison_unowned_slots(batch, 8)
    n = batch.num_actual_tokens
    out = decode_attention(batch.query[:n], batch.kv_cache[0], batch.kv_cache[1],
                           batch.block_table[:n], batch.seq_lens, 0.2)
    assert out.dtype == dtype
    assert max_rel_error(out, dense_causal_attention(batch, 0.2)[:n]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(LENS))
def test_cpu_path_matches_reference(case: str, dtype: torch.dtype) -> None:
    batch = make_batch(*LENS[case], 16, 9, 3, 64, dtype=dtype, seed=5)
    _poison_unowned_slots(batch, 16)
    out = paged_attention_cpu(*batch.args(0.125), out=torch.full_like(batch.query, float("nan")))
    n = batch.num_actual_tokens
    assert out.dtype == dtype
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert max_rel_error(out[:n], dense_causal_attention(batch, 0.125)[:n]) < TOLERANCE[dtype]
    expected = paged_attention_ref(*batch.args(0.125))
    assert max_rel_error(out[:n], expected[:n]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_kv_write_compiled_matches_reference(dtype: torch.dtype) -> None:
    """Compiled, as a whole decode step compiles it: the new K/V land at their slots of
    the cache passed in (nothing else changes), and attention sees them."""
    block_size, num_kv_heads, head_size = 8, 3, 32
    batch = make_batch(*DECODE_ONLY, block_size, 9, num_kv_heads, head_size, dtype=dtype, seed=4)
    n = batch.num_actual_tokens
    gen = torch.Generator().manual_seed(8)
    key, value = (torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype) for _ in range(2))
    # Each request's newest token is its last position.
    last = batch.seq_lens.long() - 1
    slots = batch.block_table[:n].long().gather(1, (last // block_size)[:, None])[:, 0]
    slots = slots * block_size + last % block_size
    expected_cache = batch.kv_cache.clone()
    reshape_and_cache_ref(key, value, expected_cache[0], expected_cache[1], slots)
    expected = paged_attention_ref(batch.query, expected_cache[0], expected_cache[1],
                                   *batch.args(0.2)[3:])
    plan = plan_paged_attention_cpu(batch.block_table, batch.query_start_loc, batch.seq_lens,
                                    n, n, block_size, num_kv_heads, head_size)
    with torch.inference_mode():
        compiled = torch.compile(decode_attention_with_kv_write, dynamic=True)
        out = compiled(batch.query[:n], key, value, batch.kv_cache, slots,
                       plan.decode_block_table, plan.decode_seq_lens, 0.2)
    assert torch.equal(batch.kv_cache, expected_cache)
    assert max_rel_error(out, expected[:n]) < TOLERANCE[dtype]


def test_plan_is_shared_and_checked() -> None:
    batch = make_batch(*MIXED, 16, 4, 2, 32, seed=7)
    args = batch.args(0.2)
    plan = plan_paged_attention_cpu(batch.block_table, batch.query_start_loc, batch.seq_lens,
                                    batch.seq_lens.numel(), batch.num_actual_tokens, 16, 2, 32)
    # Decodes are requests 0 and 2 of MIXED; the rest go through the prefill chunks.
    assert plan.num_decodes == 2 and plan.decode_rows.tolist() == [0, 8]
    assert plan.decode_block_table.shape == (2, 3)  # 33 keys in blocks of 16
    short = plan_paged_attention_cpu(batch.block_table[:1, :1], batch.query_start_loc[:2],
                                     torch.tensor([5], dtype=torch.int32), 1, 1, 16, 2, 32)
    assert short.decode_block_table.shape == (1, 2)  # never one column: see the plan
    assert torch.equal(paged_attention_cpu(*args, plan=plan), paged_attention_cpu(*args))
    with pytest.raises(ValueError, match="plan for"):
        paged_attention_cpu(*args[:8], args[8] - 1, *args[9:], plan=plan)


def test_decode_only_batch_reads_query_rows_in_place() -> None:
    batch = make_batch(*DECODE_ONLY, 16, 4, 2, 32, seed=9)
    plan = plan_paged_attention_cpu(batch.block_table, batch.query_start_loc, batch.seq_lens,
                                    4, 4, 16, 2, 32)
    assert plan.decode_rows is None and plan.prefill is None


def test_without_a_cpp_compiler_decode_runs_eagerly(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    import torch._inductor.cpp_builder as cpp_builder

    from kernels import paged_attention_cpu as module

    def no_compiler() -> str:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built to load
    module._compiled_decode_attention.cache_clear()
    load_cpu_kernels.cache_clear()
    try:
        assert module._compiled_decode_attention() is decode_attention
        batch = make_batch(*DECODE_ONLY, 16, 4, 2, 32, seed=1)
        assert not module.uses_cpu_kernel(batch.query, batch.kv_cache[0])
        n = batch.num_actual_tokens
        out = paged_attention_cpu(*batch.args(0.2))
        assert max_rel_error(out[:n], dense_causal_attention(batch, 0.2)[:n]) < 1e-4
    finally:
        module._compiled_decode_attention.cache_clear()
        load_cpu_kernels.cache_clear()
