"""The sampler's common path never waits for the device: no host reads of device values.

On the CPU a TorchFunctionMode records every call that would make the host wait
for a CUDA device (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, `nonzero`, boolean
masks, ...); on CUDA, torch's sync debug mode turns any such wait into an error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from services.common.sampling_params import SamplingParams
from services.worker.sample import Sampler, SamplingState
from tests.cuda import needs_cuda

VOCAB = 64
# Calls whose result the host must read from the device.
_SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
            "cpu", "numpy", "masked_select", "unique", "argwhere"}


class HostSyncSpy(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        name = getattr(func, "__name__", str(func))
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
        if name in _SYNCING or (isinstance(index, torch.Tensor) and index.dtype == torch.bool):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def _common_params(with_top_p: bool) -> list[SamplingParams]:
    top_p = 0.9 if with_top_p else 1.0
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3),
        SamplingParams(temperature=0.8, top_k=10, top_p=top_p),
        SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5, seed=7),
        SamplingParams(temperature=0.7, logit_bias={4: 2.0}, min_tokens=2, stop_token_ids=[9]),
    ]


def _make_state(device: torch.device, params: list[SamplingParams]) -> tuple[SamplingState, list[list[int]]]:
    state = SamplingState(8, VOCAB, device)
    outputs: list[list[int]] = [[] for _ in params]
    for row, p in enumerate(params):
        state.add_request(row, p, [1, 2, 3], outputs[row], eos_token_id=8)
    return state, outputs


def test_spy_sees_host_reads():
    x = torch.randn(4)
    with HostSyncSpy() as spy:
        x.sum().item()
        x[x > 0]
        bool(x[0] > 0)
    assert spy.syncs == ["item", "__getitem__", "__bool__"]


def test_sampler_common_path_has_no_host_sync_on_cpu():
    # Top-p is left out here: on the CPU only, it first tries a partial top-k and checks
    # on the host whether that held the nucleus (free there); CUDA takes the full sort.
    params = _common_params(with_top_p=False)
    state, outputs = _make_state(torch.device("cpu"), params)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(0))
    spy = HostSyncSpy()
    for _ in range(4):
        with spy:
            sampled = Sampler()(logits.clone(), state.make_sampling_metadata(len(params)))
        # The runner's one read of the step's tokens, outside the sampler.
        for row, token in enumerate(sampled.sampled_token_ids.tolist()):
            outputs[row].append(token)
    assert spy.syncs == []
    assert [len(tokens) for tokens in outputs] == [4] * len(params)


@needs_cuda
def test_sampler_common_path_has_no_host_sync_on_cuda():
    params = _common_params(with_top_p=True)
    state, _ = _make_state(torch.device("cuda"), params)
    logits = torch.randn(len(params), VOCAB, device="cuda")
    Sampler()(logits.clone(), state.make_sampling_metadata(len(params)))  # lazy CUDA init
    spy = HostSyncSpy()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with spy:
            Sampler()(logits.clone(), state.make_sampling_metadata(len(params)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert spy.syncs == []
