"""The argmax kernel against torch.argmax, its reference, on random and adversarial rows."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax_cpu import argmax
from kernels.cpu_extension import has_cpu_kernel, load_cpu_kernels

pytestmark = pytest.mark.skipif(not load_cpu_kernels(),
                                reason="kvmesh's C++ CPU kernels are not built here")


def test_the_library_has_the_kernel():
    assert has_cpu_kernel("argmax_cpu")


def adversarial_rows(generator: torch.Generator, vocab: int) -> torch.Tensor:
    """Random rows, then rows whose maximum is tied, at either end, infinite, NaN or signed zero."""
    logits = torch.randn(12, vocab, generator=generator)
    last = vocab - 1
    logits[1, [3 % vocab, last]] = 10.0  # a tie: the first index wins
    logits[2, last] = 10.0  # in the tail past the last whole vector
    logits[3].fill_(float("-inf"))  # every logit -inf: index 0
    logits[4, last // 2] = float("inf")
    logits[5, [last // 3, last]] = float("nan")  # the first NaN wins over any number
    logits[6, 0] = float("nan")
    logits[7].fill_(float("nan"))
    logits[8].fill_(-1.0)
    logits[8, [last // 2, last]] = torch.tensor([-0.0, 0.0])  # +0 and -0 tie
    logits[9].fill_(5.0)  # all equal
    logits[10, last // 2] = float("nan")
    logits[10, 0] = float("inf")
    return logits


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 1000, 49152, 49155])
def test_the_kernel_gives_torch_argmax_index(vocab):
    logits = adversarial_rows(torch.Generator().manual_seed(vocab), vocab)
    assert torch.equal(torch.ops.kvmesh.argmax_cpu(logits), logits.argmax(dim=-1))
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("num_rows", [0, 1, 3, 64])
def test_every_row_count_is_served(num_rows):
    logits = torch.randn(num_rows, 4099, generator=torch.Generator().manual_seed(num_rows))
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


def test_what_the_kernel_does_not_take_goes_to_torch():
    logits = torch.randn(4, 300, dtype=torch.float64)
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    strided = torch.randn(300, 4).t()
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))
    row = torch.randn(300)  # one dimension: torch's argmax over it
    assert torch.equal(argmax(row), row.argmax(dim=-1))


def test_bad_input_is_named():
    with pytest.raises(RuntimeError, match="contiguous float32 \\[num_rows, vocab\\]"):
        torch.ops.kvmesh.argmax_cpu(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no columns"):
        torch.ops.kvmesh.argmax_cpu(torch.empty(3, 0))
