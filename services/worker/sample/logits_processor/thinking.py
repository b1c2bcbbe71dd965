"""Thinking-token budget: force the end-of-thinking sequence once a budget is spent.

Reasoning models wrap their thinking in start/end token sequences (for example
``<think>`` ... ``</think>``). A request with ``thinking_token_budget = B`` may
emit at most B tokens after the start sequence; then the end sequence is forced
token by token. A later start sequence opens a new section with a fresh budget.
Tokens already thinking at the end of the prompt (a chat template that opens
``<think>``) count against the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample.logits_processor.device_tensors import to_device_tensor
from services.worker.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    process_dict_updates,
)


def _find_last(tokens: list[int], seq: list[int]) -> int:
    """Start index of the last occurrence of ``seq`` in ``tokens``, or -1."""
    n = len(seq)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i : i + n] == seq:
            return i
    return -1


def _ends_with(tail: list[int], seq: list[int]) -> bool:
    return len(tail) >= len(seq) and tail[len(tail) - len(seq) :] == seq


def _end_prefix_len(tail: list[int], end: list[int]) -> int:
    """Longest k < len(end) such that ``tail`` ends with ``end[:k]`` (already emitted)."""
    for k in range(min(len(end) - 1, len(tail)), 0, -1):
        if tail[len(tail) - k :] == end[:k]:
            return k
    return 0


@dataclass(slots=True)
class _ThinkState:
    budget: int
    output_ids: list[int]  # the request's live output list
    num_scanned: int  # output tokens already consumed
    tail: list[int]  # last few tokens (prompt then output), to match the sequences
    in_think: bool
    num_think_tokens: int  # tokens since the current start sequence
    end_pos: int  # index of the end-sequence token to force next; -1 when not forcing


class ThinkingBudgetLogitsProcessor(LogitsProcessor):
    """Forces ``think_end_token_ids`` once a request's thinking budget is spent.

    Not argmax-invariant. A forced row keeps only the forced token (every other
    logit becomes -inf), so greedy and random sampling both pick it whatever
    the other processors, penalties or filters do to the row.
    """

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        if config.thinking is None:
            raise ValueError("ThinkingBudgetLogitsProcessor needs LogitsProcessorConfig.thinking")
        self._start = list(config.thinking.think_start_token_ids)
        self._end = list(config.thinking.think_end_token_ids)
        self._tail_len = max(len(self._start), len(self._end))
        self._device = device
        self._pin_memory = is_pin_memory
        self._states: dict[int, _ThinkState] = {}
        self._forced: list[tuple[int, int]] = []  # (row, token id) forced this step
        self._rows = to_device_tensor([], torch.int64, device, is_pin_memory)
        self._token_ids = to_device_tensor([], torch.int64, device, is_pin_memory)
        self._zero = torch.tensor(0.0, dtype=torch.float32, device=device)

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        budget = params.thinking_token_budget
        if budget is not None and budget < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {budget}")

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _ThinkState | None:
        if params.thinking_token_budget is None:
            return None
        prompt = prompt_ids or []
        last_start = _find_last(prompt, self._start)
        in_think = last_start > _find_last(prompt, self._end)
        num_think = len(prompt) - (last_start + len(self._start)) if in_think else 0
        state = _ThinkState(
            budget=params.thinking_token_budget,
            output_ids=output_ids,
            num_scanned=0,
            tail=prompt[-self._tail_len :],
            in_think=in_think,
            num_think_tokens=num_think,
            end_pos=-1,
        )
        self._maybe_start_forcing(state)
        return state

    def _maybe_start_forcing(self, state: _ThinkState) -> None:
        if state.in_think and state.end_pos < 0 and state.num_think_tokens >= state.budget:
            # Continue an end sequence the model already began on its own.
            state.end_pos = _end_prefix_len(state.tail, self._end)

    def _consume(self, state: _ThinkState, token_id: int) -> None:
        tail = state.tail
        tail.append(token_id)
        if len(tail) > self._tail_len:
            del tail[0]
        if state.end_pos >= 0:
            if token_id == self._end[state.end_pos]:
                state.end_pos += 1
            else:  # something overrode the forcing: resynchronise with what was emitted
                state.end_pos = _end_prefix_len(tail, self._end)
            if state.end_pos == len(self._end):
                state.end_pos = -1
                state.in_think = False
            return
        if state.in_think:
            if _ends_with(tail, self._end):
                state.in_think = False
                return
            state.num_think_tokens += 1
        elif _ends_with(tail, self._start):
            state.in_think = True
            state.num_think_tokens = 0
        self._maybe_start_forcing(state)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._states, batch_update, self._new_state)
        forced: list[tuple[int, int]] = []
        for row, state in self._states.items():
            output = state.output_ids
            for i in range(state.num_scanned, len(output)):
                self._consume(state, output[i])
            state.num_scanned = len(output)
            if state.end_pos >= 0:
                forced.append((row, self._end[state.end_pos]))
        if forced != self._forced:
            self._forced = forced
            self._rows = to_device_tensor(
                [r for r, _ in forced], torch.int64, self._device, self._pin_memory
            )
            self._token_ids = to_device_tensor(
                [t for _, t in forced], torch.int64, self._device, self._pin_memory
            )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._forced:
            logits.index_fill_(0, self._rows, float("-inf"))
            logits.index_put_((self._rows, self._token_ids), self._zero)
        return logits
