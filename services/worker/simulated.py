"""The simulated worker's model runner: a modelled wait and deterministic tokens.

``--simulate`` keeps the whole worker (service, registration, persistent
batch, block table, slot mapping, input preparation, the step protocol) and
replaces the forward pass and the sampler: a launched step is done on its
"device" as long after its launch as ``LatencyModel`` says a fast
accelerator would take, and collecting its output waits until then, so the
CPU stays free for the control plane (or for preparing the next step), and
each request's next token is a function of its last token and its position.
Outputs are then the same in every mode and
run, and the control plane's cost shows as it would next to a GPU (the idea
of NVIDIA Dynamo's mock engine). Logprobs are not simulated: none are
returned. A measurement tool only; never a stand-in for the real worker in
tests of the model path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from services.common.engine import Logprobs
from services.worker.config import LatencyModel, ModelConfig
from services.worker.model_runner import ModelRunner, StepInputs
from services.worker.sample import SamplerOutput
from services.worker.step_events import DeadlineEvent, StepEvent

# SplitMix64's multipliers: every bit of (last token, position) reaches the result.
_MIX_1 = np.uint64(0x9E3779B97F4A7C15)
_MIX_2 = np.uint64(0xBF58476D1CE4E5B9)


def simulated_token_ids(
    last_token_ids: np.ndarray, positions: np.ndarray, vocab_size: int,
    eos_token_ids: Sequence[int] = (),
) -> np.ndarray:
    """The next token of each row: a function of its last token id and its position.

    Never an EOS id, so a simulated request runs to ``max_tokens``.
    """
    x = (last_token_ids.astype(np.uint64) << np.uint64(32)) | positions.astype(np.uint64)
    x *= _MIX_1  # uint64 arithmetic wraps, as the hash wants
    x ^= x >> np.uint64(29)
    x *= _MIX_2
    x ^= x >> np.uint64(32)
    token_ids = (x % np.uint64(vocab_size)).astype(np.int64)
    for eos in sorted(eos_token_ids):  # ascending: a run of EOS ids is skipped whole
        token_ids[token_ids == eos] = (eos + 1) % vocab_size
    return token_ids


class SimulatedModelRunner(ModelRunner):
    """A ModelRunner whose model is ``latency``'s wait; it holds no weights and no KV."""

    def __init__(self, latency: LatencyModel, model_config: ModelConfig, **kwargs) -> None:
        self.latency = latency
        self._done_at = 0.0
        super().__init__(nn.Module(), model_config, [], **kwargs)

    def _init_logits_buffers(self, max_num_reqs: int, model_config: ModelConfig) -> None:
        return None  # no logits are ever computed

    def _run_model(
        self, inputs: StepInputs, num_reqs: int
    ) -> tuple[SamplerOutput, dict[str, Logprobs]]:
        # As in a real step: the processors follow the batch's adds, removals and moves.
        self.input_batch.sampling_state.make_sampling_metadata(num_reqs)
        last = self.query_start_loc.np[1 : num_reqs + 1] - 1
        mc = self.model_config
        token_ids = simulated_token_ids(self.input_ids.np[last], self.positions.np[last],
                                        mc.vocab_size, mc.eos_token_ids)
        # The accelerator starts now (it is idle: the previous step was finished
        # before this launch) and the CPU is free until finish_step waits.
        self._done_at = time.perf_counter() + self.latency.step_seconds(
            int(inputs.num_scheduled_tokens.sum()), int(self.seq_lens.np[:num_reqs].sum()))
        return SamplerOutput(torch.from_numpy(token_ids)), {}

    def _step_event(self) -> StepEvent:
        return DeadlineEvent(self._done_at)
