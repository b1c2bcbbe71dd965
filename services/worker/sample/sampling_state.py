"""SamplingState: the persistent batch's per-row sampling parameters.

The runner's InputBatch owns the row of each request and reports every change
here (add / remove / move; condense only moves a row into an empty one).
Parameters live in preallocated CPU arrays and reach the device in one copy
per step, only after a change; logits processors follow the rows through one
BatchUpdate per step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessor,
    LogitsProcessorConfig,
    MoveDirectionality,
    ThinkingConfig,
    build_logitsprocs,
)
from services.worker.sample.logprobs import resolve_num_logprobs
from services.worker.sample.ops.penalties import make_padded_token_ids
from services.worker.sample.sampling_metadata import SAMPLING_EPS, SamplingMetadata

if TYPE_CHECKING:
    from services.worker.grammar import GrammarBackend

logger = logging.getLogger(__name__)

# Rows of the packed float32 parameter block [_NUM_FIELDS, max_num_reqs].
_TEMPERATURE, _TOP_P, _TOP_K, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
_NUM_FIELDS = 6

_MASK64 = (1 << 64) - 1
_ORDER_ERROR = (
    "add_request/remove_request after move_request in the same step: "
    "a BatchUpdate applies removed -> added -> moved, so call them in that order"
)


def position_seed(seed: int, position: int) -> int:
    """The ``position``-th output of splitmix64 seeded with ``seed``.

    A seeded request's generator is re-seeded with this before each draw, for
    the output position being sampled. Its tokens then depend only on (seed,
    position, distribution): not on the other rows, on chunked-prefill steps
    whose sample is discarded, nor on preemption and recompute.
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _with_eos_as_stop(params: SamplingParams, eos_token_id: int | None) -> SamplingParams:
    """The params processors see: EOS joins ``stop_token_ids`` (vLLM's all_stop_token_ids)."""
    if eos_token_id is None or params.ignore_eos or eos_token_id in params.stop_token_ids:
        return params
    return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, eos_token_id])


@dataclasses.dataclass(slots=True)
class _SeededRow:
    seed: int
    generator: torch.Generator


class SamplingState:
    """Sampling parameters and logits processors for rows ``[0, max_num_reqs)``.

    Call order within a step (the order a BatchUpdate applies them):
    ``remove_request`` / ``add_request``, then ``move_request``, then
    ``make_sampling_metadata(num_reqs)``, which needs rows ``[0, num_reqs)``
    to hold exactly the batch. Tensors in the returned metadata stay valid
    until the next change to this state.
    """

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device,
        logitsprocs: Sequence[str | type[LogitsProcessor]] = (),
        thinking: ThinkingConfig | None = None,
        grammar: GrammarBackend | None = None,
    ) -> None:
        if max_num_reqs <= 0 or vocab_size <= 0:
            raise ValueError(
                f"max_num_reqs and vocab_size must be >= 1, got {max_num_reqs} and {vocab_size}"
            )
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._pin_memory = self.device.type == "cuda"
        self._neutral = np.array([0.0, 1.0, vocab_size, 0.0, 0.0, 1.0], dtype=np.float32)
        self._params_cpu = torch.empty(
            (_NUM_FIELDS, max_num_reqs), dtype=torch.float32, pin_memory=self._pin_memory
        )
        self._params_np = self._params_cpu.numpy()
        self._params_np[:] = self._neutral[:, None]
        self._params_device = (
            self._params_cpu
            if self.device.type == "cpu"
            else torch.empty_like(self._params_cpu, device=self.device)
        )
        self._num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none asked
        self._occupied = np.zeros(max_num_reqs, dtype=bool)
        self._prompt_token_ids: list[list[int] | None] = [None] * max_num_reqs
        self._output_token_ids: list[list[int] | None] = [None] * max_num_reqs
        self._seeded: dict[int, _SeededRow] = {}
        # bool [max_num_reqs, vocab], True = disallowed; allocated on first use.
        self._disallowed_cpu: torch.Tensor | None = None
        self._disallowed_device: torch.Tensor | None = None
        self._has_allowed = np.zeros(max_num_reqs, dtype=bool)
        self._has_thinking = thinking is not None
        self._has_grammar = grammar is not None
        self.logitsprocs = build_logitsprocs(
            LogitsProcessorConfig(max_num_reqs, vocab_size, thinking, grammar),
            self.device,
            self._pin_memory,
            logitsprocs,
        )
        self._builder = BatchUpdateBuilder()
        self._metadata: SamplingMetadata | None = None  # cached until the state changes

    @property
    def num_reqs(self) -> int:
        """Number of occupied rows."""
        return int(np.count_nonzero(self._occupied))

    # ---- batch changes -------------------------------------------------------

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        *,
        eos_token_id: int | None = None,
    ) -> None:
        """Put a request in the empty ``row``.

        ``output_token_ids`` is the live list the runner appends sampled tokens
        to (penalties, min tokens and the thinking budget read it).
        ``eos_token_id`` is masked with the stop tokens until ``min_tokens``
        outputs unless ``params.ignore_eos``. Raises ValueError for parameters
        out of range or rejected by a processor's ``validate_params``.
        """
        self._check_row(row, occupied=False)
        if self._builder.moved:
            raise RuntimeError(_ORDER_ERROR)
        self.validate(params, eos_token_id)
        num_logprobs = -1
        if params.logprobs is not None:
            num_logprobs = resolve_num_logprobs(params.logprobs, self.vocab_size)
        is_greedy = params.temperature < SAMPLING_EPS
        column = self._params_np[:, row]
        column[_TEMPERATURE] = 0.0 if is_greedy else params.temperature
        column[_TOP_P] = params.top_p
        column[_TOP_K] = min(params.top_k, self.vocab_size) if params.top_k > 0 else self.vocab_size
        column[_PRESENCE] = params.presence_penalty
        column[_FREQUENCY] = params.frequency_penalty
        column[_REPETITION] = params.repetition_penalty
        self._num_logprobs[row] = num_logprobs
        self._prompt_token_ids[row] = prompt_token_ids
        self._output_token_ids[row] = output_token_ids
        if params.seed is not None and not is_greedy:
            self._seeded[row] = _SeededRow(params.seed, torch.Generator(device=self.device))
        if params.allowed_token_ids is not None:
            self._set_allowed(row, params.allowed_token_ids)
        if params.thinking_token_budget is not None and not self._has_thinking:
            logger.warning(
                "thinking_token_budget=%d ignored: the worker has no ThinkingConfig",
                params.thinking_token_budget,
            )
        self._occupied[row] = True
        # The add replaces the row's processor state; a pending removal of it is moot.
        self._builder.discard_removed(row)
        self._builder.added.append(
            (row, _with_eos_as_stop(params, eos_token_id), prompt_token_ids, output_token_ids)
        )
        self._metadata = None

    def validate(self, params: SamplingParams, eos_token_id: int | None) -> None:
        """Raises ValueError naming the first parameter this state cannot serve.

        A processor's ``validate_params`` that raises anything is a refusal of
        this request alone, reported as ValueError.
        """
        if params.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {params.top_k}")
        if params.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
        if params.allowed_token_ids is not None and not params.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if params.structured_outputs is not None and not self._has_grammar:
            raise ValueError("structured_outputs needs a worker with a grammar backend")
        token_id_fields = (
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logit_bias", tuple(params.logit_bias or ())),
            ("stop_token_ids", params.stop_token_ids),
            ("eos_token_id", () if eos_token_id is None else (eos_token_id,)),
        )
        for name, token_ids in token_id_fields:
            if token_ids and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
                bad = min(token_ids) if min(token_ids) < 0 else max(token_ids)
                raise ValueError(
                    f"{name} holds token id {bad}; allowed range is [0, {self.vocab_size})"
                )
        for proc in self.logitsprocs.all:
            try:
                type(proc).validate_params(params)
            except Exception as e:
                raise ValueError(
                    f"logits processor {type(proc).__name__} rejected the request: {e}"
                ) from e

    def remove_request(self, row: int) -> None:
        """Empty ``row``."""
        self._check_row(row, occupied=True)
        if self._builder.moved:
            raise RuntimeError(_ORDER_ERROR)
        self._clear_row(row)
        self._occupied[row] = False
        # A request added earlier in this step never reaches the processors.
        self._builder.added[:] = [a for a in self._builder.added if a[0] != row]
        self._builder.removed_append(row)
        self._metadata = None

    def move_request(self, src: int, dst: int) -> None:
        """Move ``src``'s request into the empty ``dst`` (condense); ``src`` becomes empty."""
        self._check_row(src, occupied=True)
        self._check_row(dst, occupied=False)
        params = self._params_np
        params[:, dst] = params[:, src]
        params[:, src] = self._neutral
        self._num_logprobs[dst] = self._num_logprobs[src]
        self._num_logprobs[src] = -1
        for lists in (self._prompt_token_ids, self._output_token_ids):
            lists[dst], lists[src] = lists[src], None
        if (seeded := self._seeded.pop(src, None)) is not None:
            self._seeded[dst] = seeded
        if self._has_allowed[src]:
            assert self._disallowed_cpu is not None
            self._disallowed_cpu[dst].copy_(self._disallowed_cpu[src])
            self._disallowed_cpu[src].fill_(False)
            self._has_allowed[dst], self._has_allowed[src] = True, False
        self._occupied[dst], self._occupied[src] = True, False
        self._builder.moved.append((src, dst, MoveDirectionality.UNIDIRECTIONAL))
        self._metadata = None

    # ---- per step ------------------------------------------------------------

    def make_sampling_metadata(self, num_reqs: int) -> SamplingMetadata:
        """This step's SamplingMetadata for rows ``[0, num_reqs)``.

        Flushes the pending BatchUpdate (None if the batch did not change) into
        every processor's ``update_state`` and positions seeded generators.
        Rebuilds the metadata (one host-to-device copy) only after a change.
        """
        if num_reqs != self.num_reqs or not self._occupied[:num_reqs].all():
            occupied = np.flatnonzero(self._occupied).tolist()
            raise ValueError(
                f"rows [0, {num_reqs}) must hold exactly the batch; occupied rows: {occupied}"
            )
        batch_update = self._builder.get_and_reset(num_reqs)
        for proc in self.logitsprocs.all:
            proc.update_state(batch_update)
        if self._metadata is None:
            self._metadata = self._build_metadata(num_reqs)
        for row, seeded in self._seeded.items():
            output = self._output_token_ids[row]
            assert output is not None
            seeded.generator.manual_seed(position_seed(seeded.seed, len(output)))
        return self._metadata

    # ---- helpers -------------------------------------------------------------

    def _check_row(self, row: int, *, occupied: bool) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row must be in [0, {self.max_num_reqs}), got {row}")
        if bool(self._occupied[row]) != occupied:
            state = "empty" if occupied else "occupied"
            raise ValueError(f"row {row} is {state}")

    def _clear_row(self, row: int) -> None:
        self._params_np[:, row] = self._neutral
        self._num_logprobs[row] = -1
        self._prompt_token_ids[row] = None
        self._output_token_ids[row] = None
        self._seeded.pop(row, None)
        if self._has_allowed[row]:
            assert self._disallowed_cpu is not None
            self._disallowed_cpu[row].fill_(False)
            self._has_allowed[row] = False

    def _set_allowed(self, row: int, allowed_token_ids: list[int]) -> None:
        if self._disallowed_cpu is None:
            self._disallowed_cpu = torch.zeros(
                (self.max_num_reqs, self.vocab_size), dtype=torch.bool, pin_memory=self._pin_memory
            )
        mask = self._disallowed_cpu[row]
        mask.fill_(True)
        mask[torch.tensor(allowed_token_ids, dtype=torch.int64)] = False
        self._has_allowed[row] = True

    def _build_metadata(self, n: int) -> SamplingMetadata:
        params = self._params_np[:, :n]
        num_random = int(np.count_nonzero(params[_TEMPERATURE]))  # greedy rows hold 0.0
        top_k_on = params[_TOP_K] < self.vocab_size
        use_top_k = bool(top_k_on.any())
        penalised = (params[_PRESENCE] != 0.0) | (params[_FREQUENCY] != 0.0)
        repetition_on = params[_REPETITION] != 1.0
        penalised |= repetition_on
        no_penalties = not penalised.any()
        device_params = self._device_params(n)
        max_num_logprobs = int(self._num_logprobs[:n].max()) if n else -1
        return SamplingMetadata(
            temperature=device_params[_TEMPERATURE] if num_random else None,
            all_greedy=num_random == 0,
            all_random=n > 0 and num_random == n,
            top_p=device_params[_TOP_P] if (params[_TOP_P] < 1.0).any() else None,
            top_k=device_params[_TOP_K].to(torch.int64) if use_top_k else None,
            max_top_k=int(params[_TOP_K][top_k_on].max()) if use_top_k else 0,
            generators={row: seeded.generator for row, seeded in self._seeded.items()},
            max_num_logprobs=max_num_logprobs if max_num_logprobs >= 0 else None,
            no_penalties=no_penalties,
            presence_penalties=device_params[_PRESENCE],
            frequency_penalties=device_params[_FREQUENCY],
            repetition_penalties=device_params[_REPETITION],
            prompt_token_ids=None if no_penalties else self._padded_prompts(repetition_on),
            output_token_ids=[] if no_penalties else self._penalised_outputs(penalised),
            allowed_token_ids_mask=self._allowed_mask(n),
            logitsprocs=self.logitsprocs,
        )

    def _device_params(self, n: int) -> torch.Tensor:
        if self._params_device is self._params_cpu:
            return self._params_cpu[:, :n]
        device_params = self._params_device[:, :n]
        device_params.copy_(self._params_cpu[:, :n], non_blocking=True)
        return device_params

    def _padded_prompts(self, repetition_on: np.ndarray) -> torch.Tensor:
        # Rows [0, n) are occupied, so their lists are set.
        prompts = [
            self._prompt_token_ids[row] if on else [] for row, on in enumerate(repetition_on)
        ]
        return make_padded_token_ids(prompts, self.vocab_size, self.device, self._pin_memory)

    def _penalised_outputs(self, penalised: np.ndarray) -> list[list[int]]:
        # The live lists themselves: the sampler reads this step's tokens from them.
        return [self._output_token_ids[row] if on else [] for row, on in enumerate(penalised)]

    def _allowed_mask(self, n: int) -> torch.Tensor | None:
        if self._disallowed_cpu is None or not self._has_allowed[:n].any():
            return None
        if self.device.type == "cpu":
            return self._disallowed_cpu[:n]
        if self._disallowed_device is None:
            self._disallowed_device = torch.empty_like(self._disallowed_cpu, device=self.device)
        mask = self._disallowed_device[:n]
        mask.copy_(self._disallowed_cpu[:n], non_blocking=True)
        return mask
