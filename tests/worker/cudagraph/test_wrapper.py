"""CUDAGraphWrapper: call-through when its mode is not the runtime mode; capture, replay,
static buffers and no allocation on replay on CUDA."""

from __future__ import annotations

import pytest
import torch

from services.worker.cudagraph import CUDAGraphMode as M
from services.worker.cudagraph import CUDAGraphWrapper
from services.worker.forward_context import BatchDescriptor, ForwardContext
from tests.cuda import needs_cuda



class Counting:
    """x -> (2x + 1, x.sum(-1, keepdim)), counting Python calls (replays make none)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return x * 2 + 1, x.sum(-1, keepdim=True)


def test_other_runtime_modes_call_straight_through():
    fn = Counting()
    context = ForwardContext()
    wrapper = CUDAGraphWrapper(fn, M.FULL, None, context)
    x = torch.arange(6.0).view(3, 2)
    for mode in (M.NONE, M.PIECEWISE):
        key = None if mode is M.NONE else BatchDescriptor(3, 3)
        with context.set(mode, key):
            out, total = wrapper(x)
    assert fn.calls == 2 and not wrapper.captured_keys
    assert torch.equal(out, x * 2 + 1) and torch.equal(total, x.sum(-1, keepdim=True))
    # Outside a forward pass the context is NONE: eager.
    wrapper(x)
    assert fn.calls == 3


def test_wrapper_modes_are_full_or_piecewise():
    with pytest.raises(ValueError, match="FULL or PIECEWISE, not NONE"):
        CUDAGraphWrapper(Counting(), M.NONE, None, ForwardContext())
    with pytest.raises(ValueError, match="needs a batch_descriptor"):
        with ForwardContext().set(M.FULL, None):
            pass


def _wrap(fn, mode: M) -> CUDAGraphWrapper:
    return CUDAGraphWrapper(fn, mode, torch.cuda.graph_pool_handle(), ForwardContext())


def _run(wrapper, mode, x, num_tokens):
    with wrapper.forward_context.set(mode, BatchDescriptor(num_tokens, num_tokens)):
        return wrapper(x[:num_tokens])


@needs_cuda
def test_capture_then_replay_reads_the_static_inputs():
    fn = Counting()
    wrapper = _wrap(fn, M.PIECEWISE)
    x = torch.randn(8, 4, device="cuda")
    big = _run(wrapper, M.PIECEWISE, x, 8)
    small = _run(wrapper, M.PIECEWISE, x, 4)
    assert fn.calls == 2 and wrapper.captured_keys == {BatchDescriptor(8, 8), BatchDescriptor(4, 4)}
    # Smaller keys write slices of the largest key's outputs.
    assert small[0].data_ptr() == big[0].data_ptr() and small[0].shape == (4, 4)
    x.copy_(torch.randn(8, 4, device="cuda"))
    out, total = _run(wrapper, M.PIECEWISE, x, 4)
    assert fn.calls == 2  # replayed, not called
    torch.testing.assert_close(out, x[:4] * 2 + 1)
    torch.testing.assert_close(total, x[:4].sum(-1, keepdim=True))


@needs_cuda
def test_an_input_at_another_address_is_copied_in():
    wrapper = _wrap(Counting(), M.FULL)
    x = torch.randn(4, 4, device="cuda")
    _run(wrapper, M.FULL, x, 4)
    y = torch.randn(4, 4, device="cuda")
    out, _ = _run(wrapper, M.FULL, y, 4)
    torch.testing.assert_close(out, y * 2 + 1)


@needs_cuda
def test_replay_does_not_allocate():
    wrapper = _wrap(Counting(), M.FULL)
    x = torch.randn(16, 32, device="cuda")
    for n in (16, 8):
        _run(wrapper, M.FULL, x, n)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(3):
        for n in (16, 8):
            _run(wrapper, M.FULL, x, n)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated


@needs_cuda
def test_capturing_a_larger_key_after_a_smaller_one_is_an_error():
    wrapper = _wrap(Counting(), M.FULL)
    x = torch.randn(8, 4, device="cuda")
    _run(wrapper, M.FULL, x, 4)
    with pytest.raises(ValueError, match="capture the largest key first"):
        _run(wrapper, M.FULL, x, 8)
