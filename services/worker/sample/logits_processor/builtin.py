"""Built-in processors: min-p, logit bias, min tokens (vLLM V1's builtin set)."""

from __future__ import annotations

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample.logits_processor.device_tensors import sparse_index, to_device_tensor
from services.worker.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    process_dict_updates,
)


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens whose probability is below ``min_p * max_probability``.

    Argmax-invariant: the most likely token always survives. Per-row values
    live in a CPU array (rows follow the BatchUpdate) copied to the device only
    when the batch changed.
    """

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        n = config.max_num_reqs
        self._min_p_cpu = torch.zeros(n, dtype=torch.float32, pin_memory=is_pin_memory)
        self._min_p_np = self._min_p_cpu.numpy()
        self._min_p_device = (
            self._min_p_cpu
            if device.type == "cpu"
            else torch.zeros(n, dtype=torch.float32, device=device)
        )
        self._min_p = self._min_p_device[:0].unsqueeze(1)  # [batch_size, 1]
        self._num_active = 0

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        if not 0.0 <= params.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        min_p = self._min_p_np
        for row in batch_update.removed:
            min_p[row] = 0.0
        for row, params, _, _ in batch_update.added:
            min_p[row] = params.min_p
        # kvmesh's batch only emits UNIDIRECTIONAL moves (see MoveDirectionality).
        for src, dst, _ in batch_update.moved:
            min_p[dst] = min_p[src]
            min_p[src] = 0.0
        self._num_active = int(np.count_nonzero(min_p))
        if self._num_active:
            size = batch_update.batch_size
            device_slice = self._min_p_device[:size]
            if device_slice.device.type != "cpu":
                device_slice.copy_(self._min_p_cpu[:size], non_blocking=True)
            self._min_p = device_slice.unsqueeze(1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._num_active:
            return logits
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True).mul_(self._min_p)
        return logits.masked_fill_(probs < threshold, float("-inf"))


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds ``logit_bias[token]`` to each biased token, in one scatter for the batch."""

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self._device = device
        self._pin_memory = is_pin_memory
        self._biases: dict[int, dict[int, float]] = {}
        self._index = sparse_index([], [], device, is_pin_memory)
        self._values = to_device_tensor([], torch.float32, device, is_pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(
            self._biases, batch_update, lambda params, _prompt, _output: params.logit_bias or None
        )
        if not changed:
            return
        rows: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for row, bias in self._biases.items():
            rows.extend([row] * len(bias))
            token_ids.extend(int(t) for t in bias)
            values.extend(bias.values())
        self._index = sparse_index(rows, token_ids, self._device, self._pin_memory)
        self._values = to_device_tensor(values, torch.float32, self._device, self._pin_memory)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._biases:
            logits.index_put_(self._index, self._values, accumulate=True)
        return logits


class MinTokensLogitsProcessor(LogitsProcessor):
    """Masks every stop token of a request until it has ``min_tokens`` outputs.

    The stop tokens are ``params.stop_token_ids``; SamplingState folds the
    request's EOS into that list (unless ``ignore_eos``), as vLLM's
    ``all_stop_token_ids``. A request leaves the processor's state as soon as
    its live output list is long enough.
    """

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self._device = device
        self._pin_memory = is_pin_memory
        # row -> (min_tokens, live output token ids, stop token ids)
        self._min_toks: dict[int, tuple[int, list[int], tuple[int, ...]]] = {}
        self._index = sparse_index([], [], device, is_pin_memory)
        self._neg_inf = torch.tensor(float("-inf"), dtype=torch.float32, device=device)

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        if params.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {params.min_tokens}")

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _new_state(
        params: SamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[int, list[int], tuple[int, ...]] | None:
        if params.min_tokens <= len(output_ids) or not params.stop_token_ids:
            return None
        return params.min_tokens, output_ids, tuple(params.stop_token_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self._min_toks, batch_update, self._new_state)
        done = [row for row, (n, out, _) in self._min_toks.items() if len(out) >= n]
        for row in done:
            del self._min_toks[row]
        if not (changed or done):
            return
        rows: list[int] = []
        token_ids: list[int] = []
        for row, (_, _, stop_ids) in self._min_toks.items():
            rows.extend([row] * len(stop_ids))
            token_ids.extend(stop_ids)
        self._index = sparse_index(rows, token_ids, self._device, self._pin_memory)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._min_toks:
            logits.index_put_(self._index, self._neg_inf)
        return logits
