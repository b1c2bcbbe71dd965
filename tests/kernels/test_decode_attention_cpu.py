"""kvmesh::decode_attention_cpu (kernels/csrc, built by kernels/cpu_extension.py) against
its PyTorch reference `decode_attention` on random paged batches, and the fallback
to the torch kernel where the C++ one cannot serve."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from kernels.paged_attention_cpu import compiled_decode_attention, decode_attention, uses_cpu_kernel
from tests.kernels.test_paged_attention import make_batch, max_rel_error
from tests.kernels.test_paged_attention_cpu import _poison_unowned_slots

pytestmark = pytest.mark.skipif(not cpu_extension.load_cpu_kernels(),
                                reason="kvmesh's C++ CPU kernels could not be built here")
BF16, F32 = torch.bfloat16, torch.float32
# Relative to the reference, which also sums in float32 (in another order).
TOLERANCE = {F32: 1e-5, BF16: 1e-2}


def _batch(seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
           head_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, seed: int):
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size, num_heads, num_kv_heads,
                       head_size, num_padding=0, seed=seed)
    _poison_unowned_slots(batch, block_size)  # a kernel that reads past seq_len returns NaN
    kv_cache = batch.kv_cache.to(kv_dtype)
    # The query as the model passes it: heads split off a wider q/k/v row.
    qkv = torch.randn(len(seq_lens), num_heads + 2, head_size,
                      generator=torch.Generator().manual_seed(seed)).to(q_dtype)
    qkv[:, :num_heads] = batch.query.to(q_dtype)
    return qkv[:, :num_heads], kv_cache[0], kv_cache[1], batch.block_table[: len(seq_lens)], batch.seq_lens


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(F32, F32), (BF16, BF16), (BF16, F32), (F32, BF16)])
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_size"),
                         [(16, 9, 3, 64), (8, 4, 4, 32), (32, 8, 2, 128), (16, 16, 2, 64),
                          (16, 5, 1, 32), (16, 12, 2, 256)])
def test_kernel_matches_reference(q_dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int,
                                  num_heads: int, num_kv_heads: int, head_size: int) -> None:
    """Partial last blocks, one-token histories, stale table entries, GQA groups of 1-8
    (the kernel takes a group's heads a few at a time: whole tiles and remainders)."""
    args = _batch([1, 17, 40, 9, 70, block_size], block_size, num_heads, num_kv_heads,
                  head_size, q_dtype, kv_dtype, seed=block_size + head_size)
    out = torch.ops.kvmesh.decode_attention_cpu(*args, 0.2)
    expected = decode_attention(*args, 0.2)
    assert out.dtype == q_dtype and out.shape == expected.shape
    assert max_rel_error(out, expected) < TOLERANCE[BF16 if BF16 in (q_dtype, kv_dtype) else F32]


@pytest.mark.parametrize("seq_len", [5, 160, 1000])
def test_one_long_request_is_split_across_threads(seq_len: int) -> None:
    """A single request's blocks are cut into ranges merged by log-sum-exp."""
    args = _batch([seq_len], 16, 9, 3, 64, F32, F32, seed=seq_len)
    torch.testing.assert_close(torch.ops.kvmesh.decode_attention_cpu(*args, 0.125),
                               decode_attention(*args, 0.125), atol=1e-5, rtol=1e-4)


def test_what_the_kernel_cannot_serve_takes_the_torch_kernel() -> None:
    served = _batch([3, 20], 16, 4, 2, 64, BF16, BF16, seed=1)
    assert uses_cpu_kernel(served[0], served[1])
    for args in (_batch([3, 20], 16, 4, 2, 80, F32, F32, seed=2),  # head size 80
                 _batch([3, 20], 16, 4, 2, 64, torch.float16, torch.float16, seed=3)):
        assert not uses_cpu_kernel(args[0], args[1])
        expected = decode_attention(*args, 0.2)
        assert max_rel_error(compiled_decode_attention(*args, 0.2), expected) < 1e-2


def test_bad_shapes_are_refused_by_the_kernel_itself() -> None:
    query, key_cache, value_cache, block_table, seq_lens = _batch([3], 16, 4, 2, 64, F32, F32, 4)
    with pytest.raises(RuntimeError, match="block_table must be int32"):
        torch.ops.kvmesh.decode_attention_cpu(query, key_cache, value_cache, block_table.long(),
                                              seq_lens, 0.2)
    bad_table = block_table.clone()
    bad_table[0, 0] = key_cache.shape[0]
    with pytest.raises(RuntimeError, match=r"block_table\[0, 0\] = \d+ is outside \[0, "):
        torch.ops.kvmesh.decode_attention_cpu(query, key_cache, value_cache, bad_table,
                                              seq_lens, 0.2)
    too_long = torch.full_like(seq_lens, block_table.shape[1] * 16 + 1)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = \d+ is outside \[1, "):
        torch.ops.kvmesh.decode_attention_cpu(query, key_cache, value_cache, block_table,
                                              too_long, 0.2)
    _, key_cache, value_cache, _, _ = _batch([3], 16, 3, 3, 64, F32, F32, 4)
    with pytest.raises(RuntimeError, match="unsupported attention shape: heads 4, kv heads 3"):
        torch.ops.kvmesh.decode_attention_cpu(query, key_cache, value_cache, block_table,
                                              seq_lens, 0.2)


def test_without_a_compiler_nothing_is_built(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import torch._inductor.cpp_builder as cpp_builder

    def no_compiler() -> str:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu_extension.load_cpu_kernels.cache_clear()
    try:
        assert not cpu_extension.load_cpu_kernels()
        args = _batch([3, 20], 16, 4, 2, 64, F32, F32, seed=5)
        assert not uses_cpu_kernel(args[0], args[1])
        assert not any(tmp_path.iterdir())
    finally:
        cpu_extension.load_cpu_kernels.cache_clear()  # later tests load the real build
