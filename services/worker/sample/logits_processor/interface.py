"""The logits-processor contract (vLLM V1's ``LogitsProcessor`` / ``BatchUpdate``).

A logits processor is a batch-level object: it keeps per-row state for the
persistent batch, follows the batch through ``update_state(BatchUpdate | None)``
(called once per step, before sampling) and edits the ``[num_reqs, vocab]``
float32 logits in ``apply``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from services.common.model_runner_output import RequestFailure
from services.common.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    """How a request changed rows in the persistent batch.

    kvmesh's persistent batch only condenses, so it only emits UNIDIRECTIONAL
    moves. SWAP stays (with vLLM's meaning) because third-party processors
    written for vLLM import it.
    """

    UNIDIRECTIONAL = enum.auto()  # i1 -> i2; i1 is left empty
    SWAP = enum.auto()  # i1 <-> i2; both rows stay occupied (never emitted by kvmesh)


RemovedRequest = int
# (row, sampling params, prompt token ids, output token ids). The output list is
# the live list the runner appends to, so a processor always sees the latest tokens.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """The persistent batch's changes since the previous step.

    Apply in this order: ``removed``, then ``added``, then ``moved`` (in list
    order). An ``added`` row replaces whatever state the row held. Every
    ``moved`` entry is UNIDIRECTIONAL: the request leaves ``src`` empty and
    lands in an empty ``dst``. After the update the batch occupies rows
    ``[0, batch_size)``.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclass(frozen=True, slots=True)
class ThinkingConfig:
    """The model's think start/end token sequences (each non-empty)."""

    think_start_token_ids: tuple[int, ...]
    think_end_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("think_start_token_ids", "think_end_token_ids"):
            ids = tuple(getattr(self, name))
            if not ids:
                raise ValueError(f"{name} must hold at least one token id")
            object.__setattr__(self, name, ids)


@dataclass(frozen=True, slots=True)
class LogitsProcessorConfig:
    """What every processor constructor receives (vLLM passes its VllmConfig).

    ``grammar`` is the worker's ``GrammarBackend`` (None: structured outputs
    are refused), typed loosely so that this contract does not import xgrammar.
    """

    max_num_reqs: int
    vocab_size: int
    thinking: ThinkingConfig | None = None
    grammar: Any = None


class LogitsProcessor(ABC):
    """A batch-level logits transform.

    ``is_argmax_invariant()`` decides where the sampler applies it: processors
    that can change the argmax (logit bias, min tokens) run before greedy
    sampling; argmax-invariant ones (min-p) run after temperature, on the
    random-sampling path only.
    """

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError if ``params`` cannot be served by this processor.

        Called for every request when it joins the batch.
        """
        return None

    @abstractmethod
    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform float32 ``[batch_size, vocab]`` logits (in place allowed) and return them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` never changes any row's argmax."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch; called every step (None when rows did not change)."""
        raise NotImplementedError

    def take_row_failures(self) -> dict[int, RequestFailure]:
        """Rows whose request this processor could not serve since the last call.

        The worker drops each such request alone, with the failure's status,
        and discards its sample; the other rows go on. The built-ins never fail.
        """
        return {}

    def nonfinite_reasons(self) -> dict[int, RequestFailure]:
        """Why rows this processor masked may be left with no finite logit.

        Consulted only for rows the sampler finds with none (their request
        fails): a better reason than "logits not finite". Called every step.
        """
        return {}


T = TypeVar("T")
NewStateFn = Callable[[SamplingParams, list[int] | None, list[int]], T | None]


def process_dict_updates(
    req_entries: dict[int, T], batch_update: BatchUpdate | None, new_state: NewStateFn
) -> bool:
    """Apply ``batch_update`` to a ``{row: state}`` dict; return True if it changed.

    ``new_state(params, prompt_ids, output_ids)`` builds an added request's
    state, or returns None when the request does not use the processor (any
    stale state at that row is then dropped).
    """
    if batch_update is None:
        return False
    changed = False
    for row in batch_update.removed:
        if req_entries.pop(row, None) is not None:
            changed = True
    for row, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[row] = state
            changed = True
        elif req_entries.pop(row, None) is not None:
            changed = True
    for src, dst, _ in batch_update.moved:  # UNIDIRECTIONAL only (see BatchUpdate)
        src_entry = req_entries.pop(src, None)
        dst_entry = req_entries.pop(dst, None)
        if src_entry is not None:
            req_entries[dst] = src_entry
            changed = True
        if dst_entry is not None:
            changed = True
    return changed
