"""The token-bitmask kernel against its PyTorch reference on random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_extension import has_cpu_kernel, load_cpu_kernels
from kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref


def random_bitmask(generator: torch.Generator, num_rows: int, vocab: int) -> torch.Tensor:
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows, words), dtype=torch.int32,
                            generator=generator)
    bitmask[0] = 0  # nothing allowed
    bitmask[1] = -1  # everything allowed
    bitmask[2, 1::2] = 0  # whole words of each kind
    return bitmask


@pytest.mark.parametrize("vocab", [32, 1000, 49152, 49153])
def test_the_kernel_masks_what_the_reference_masks(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    bitmask = random_bitmask(generator, 6, vocab)
    rows = [0, 1, 2, 4]  # rows 3 and 5 are not constrained
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows)

    apply_token_bitmask(logits, bitmask, rows)

    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0]).all() and torch.isfinite(logits[1]).all()


@pytest.mark.skipif(not load_cpu_kernels(), reason="kvmesh's C++ CPU kernels are not built here")
def test_the_library_holds_the_kernel_and_it_refuses_out_of_range_rows():
    assert has_cpu_kernel("apply_token_bitmask_cpu")
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="row 2 is out of range"):
        torch.ops.kvmesh.apply_token_bitmask_cpu(logits, torch.zeros(2, 2, dtype=torch.int32),
                                                 torch.tensor([2]))
