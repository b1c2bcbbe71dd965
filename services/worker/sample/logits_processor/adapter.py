"""AdapterLogitsProcessor: per-request callables wrapped as a batch processor.

SamplingParams crosses the wire, so it cannot carry callables. A custom
processor subclasses the adapter and maps each request's params to a callable
(or None) in ``new_req_logits_processor``; the adapter binds the request's live
token lists to it and calls it on the request's logits row every step.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial

import grpc
import torch

from services.common.model_runner_output import RequestFailure
from services.common.sampling_params import SamplingParams
from services.worker.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    process_dict_updates,
)

# (output_ids, logits_row) -> logits_row  or  (prompt_ids, output_ids, logits_row) -> logits_row
RequestLogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor]
    | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _num_positional_params(fn: Callable[..., object]) -> int:
    params = inspect.signature(fn).parameters.values()
    return sum(1 for p in params if p.kind in _POSITIONAL)


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs one callable per request that has one; rows without one are untouched.

    The callable gets ``(output_ids, logits_row)`` or, if it takes three
    positional parameters, ``(prompt_ids, output_ids, logits_row)``; the lists
    are the request's live lists. It may edit the row in place or return a new
    one. Subclasses implement ``new_req_logits_processor`` and
    ``is_argmax_invariant``. A request whose callable cannot be made
    (``new_req_logits_processor`` raising: ValueError is a refusal of its
    arguments) or raises fails alone through ``take_row_failures``.
    """

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        # Row -> the bound callable, or why none could be made for the request.
        self._req_fns: dict[int, Callable[[torch.Tensor], torch.Tensor] | RequestFailure] = {}
        self._row_failures: dict[int, RequestFailure] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for a request with ``params``, or None if it needs none."""
        raise NotImplementedError

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> Callable[[torch.Tensor], torch.Tensor] | RequestFailure | None:
        # A request this processor cannot serve fails alone, at its first apply.
        try:
            return self._bind(params, prompt_ids, output_ids)
        except ValueError as e:
            return RequestFailure.of(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"logits processor {type(self).__name__} refused the "
                                     f"request: {e}")
        except Exception as e:
            return RequestFailure.of(grpc.StatusCode.INTERNAL,
                                     f"logits processor {type(self).__name__} failed: {e!r}")

    def _bind(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        num_params = _num_positional_params(fn)
        if num_params == 2:
            return partial(fn, output_ids)
        if num_params == 3:
            if prompt_ids is None:
                raise TypeError(
                    f"{type(self).__name__}: the per-request processor needs prompt token ids"
                )
            return partial(fn, prompt_ids, output_ids)
        raise TypeError(
            f"{type(self).__name__}: a per-request processor takes 2 positional parameters "
            f"(output_ids, logits) or 3 (prompt_ids, output_ids, logits), got {num_params}"
        )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._req_fns, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, fn in self._req_fns.items():
            if isinstance(fn, RequestFailure):
                self._row_failures[row] = fn
                continue
            row_logits = logits[row]
            try:
                new_logits = fn(row_logits)
                if new_logits is not row_logits:
                    logits[row] = new_logits
            except Exception as e:
                self._row_failures[row] = RequestFailure.of(
                    grpc.StatusCode.INTERNAL,
                    f"logits processor {type(self).__name__} failed: {e!r}")
        return logits

    def take_row_failures(self) -> dict[int, RequestFailure]:
        failures, self._row_failures = self._row_failures, {}
        return failures
