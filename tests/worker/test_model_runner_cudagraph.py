"""The runner under CUDA graph dispatch: padded batches give the tokens of eager mode.

On the CPU the dispatcher of each mode is installed without wrappers, so the
model runs eagerly on exactly the padded inputs and padded attention metadata
a graph would see (FULL: empty padding requests; PIECEWISE: padding tokens).
On CUDA the graphs are captured and replayed for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.limits import SchedulingLimits
from services.worker.config import WorkerConfig
from services.worker.cudagraph import CUDAGraphMode as M
from services.worker.cudagraph import CudagraphDispatcher
from tests.cuda import needs_cuda
from tests.worker.helpers import (
    greedy_request,
    make_scheduler,
    make_worker,
    random_prompts,
    run_engine,
    save_tiny_model,
)

SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _arrivals():
    """Mixed prefill/decode steps, uniform decode steps of 1..5 requests (between capture
    sizes), chunked prefill, and requests joining and leaving between steps."""
    prompts = random_prompts([21, 4, 9, 30, 3], seed=11)
    max_tokens = [7, 12, 3, 9, 15]
    starts = [0, 0, 3, 5, 9]
    return [(start, greedy_request(f"r{i}", prompt, n))
            for i, (start, prompt, n) in enumerate(zip(starts, prompts, max_tokens))]


def _run(worker) -> dict[str, list[int]]:
    scheduler = make_scheduler(worker, long_prefill_token_threshold=9)
    return run_engine(scheduler, worker, _arrivals()).token_ids


def _record_dispatch(dispatcher: CudagraphDispatcher, seen: list) -> None:
    dispatch = dispatcher.dispatch

    def recording(*args, **kwargs):
        seen.append(dispatch(*args, **kwargs))
        return seen[-1]

    dispatcher.dispatch = recording


@pytest.fixture(scope="module")
def eager_tokens(tiny_llama) -> dict[str, list[int]]:
    return _run(make_worker(tiny_llama, limits=SchedulingLimits(max_num_batched_tokens=16)))


@pytest.mark.parametrize("mode, kernels", [
    (M.FULL, "reference"), (M.FULL_AND_PIECEWISE, "reference"), (M.PIECEWISE, "reference"),
    # The Triton kernels (interpreted) with padding requests and padding rows.
    pytest.param(M.FULL, "triton", marks=pytest.mark.triton_cpu),
    pytest.param(M.FULL_AND_PIECEWISE, "triton", marks=pytest.mark.triton_cpu),
])
def test_padded_batches_match_eager(tiny_llama, eager_tokens, mode, kernels, monkeypatch):
    if kernels == "triton":
        monkeypatch.setenv("KVMESH_FORCE_TRITON", "1")
    limits = SchedulingLimits(max_num_batched_tokens=16, max_num_seqs=4)
    worker = make_worker(tiny_llama, limits=limits)
    runner = worker.model_runner
    runner.cudagraph_dispatcher = CudagraphDispatcher(mode, SIZES, max_num_reqs=4)
    seen: list = []
    _record_dispatch(runner.cudagraph_dispatcher, seen)
    assert _run(worker) == eager_tokens
    modes = {runtime_mode for runtime_mode, _ in seen}
    assert modes == ({M.FULL} if mode is M.FULL else {mode.decode_mode(), mode.mixed_mode()})
    # Some batches really were padded: more tokens, and (FULL) more requests.
    assert any(key.num_tokens not in (1, 2, 4) and key.num_tokens in SIZES for _, key in seen)


def test_worker_config_checks_the_mode_and_sizes():
    assert WorkerConfig().resolved_cudagraph_mode() is M.NONE
    assert WorkerConfig(device="cuda").resolved_cudagraph_mode() is M.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="cudagraph_mode FULL needs a CUDA device"):
        WorkerConfig(cudagraph_mode="full")
    with pytest.raises(ValueError, match="'SOME' is not one of NONE"):
        WorkerConfig(cudagraph_mode="SOME")
    with pytest.raises(ValueError, match=r"capture sizes \[4096\] are out of range; allowed range is \[1, 2048\]"):
        WorkerConfig(device="cuda", cudagraph_capture_sizes=[8, 4096])
    config = WorkerConfig(device="cuda", limits=SchedulingLimits(max_num_seqs=24))
    assert config.resolved_capture_sizes() == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert WorkerConfig(device="cuda", max_cudagraph_capture_size=20).resolved_capture_sizes()[-1] == 20


# ---------------------------------------------------------------------- CUDA
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_cuda_graph_modes_match_eager(tiny_llama, mode, dtype):
    common = dict(device="cuda", dtype=dtype,
                  limits=SchedulingLimits(max_num_batched_tokens=16, max_num_seqs=4),
                  cudagraph_capture_sizes=SIZES)
    expected = _run(make_worker(tiny_llama, cudagraph_mode="NONE", **common))
    worker = make_worker(tiny_llama, cudagraph_mode=mode, **common)
    seen: list = []
    _record_dispatch(worker.model_runner.cudagraph_dispatcher, seen)
    assert _run(worker) == expected
    assert any(runtime_mode is not M.NONE for runtime_mode, _ in seen)


@needs_cuda
def test_cuda_decode_steps_replay_without_allocating(tiny_llama):
    worker = make_worker(tiny_llama, device="cuda", dtype="bfloat16",
                         limits=SchedulingLimits(max_num_seqs=4),
                         cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=SIZES)
    wrapper = worker.model_runner._forward
    scheduler = make_scheduler(worker)
    for i, prompt in enumerate(random_prompts([5, 7, 6], seed=3)):
        scheduler.add_request(greedy_request(f"r{i}", prompt, 40))

    def step():
        output = scheduler.schedule()
        scheduler.update_from_output(output, worker.execute_model(output))

    for _ in range(4):  # prefill, then decode steps that replay the FULL graph of 4 requests
        step()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    assert len(wrapper.captured_keys) == 3  # uniform keys 1, 2, 4 (max_num_seqs=4)
    # Only the step's small sampler tensors come and go; the forward pass allocates nothing.
    assert torch.cuda.memory_allocated() - allocated < 1 << 20
