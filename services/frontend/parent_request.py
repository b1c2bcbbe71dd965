"""Parallel sampling (n > 1): one client request fanned out into n engine requests.

The engine core only ever sees n = 1. Each child gets its own internal id and,
when the parent has a seed, its own seed derived from it, so the n samples
differ yet the whole request is reproducible.
"""

from __future__ import annotations

import dataclasses

from services.common.engine import EngineCoreRequest
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.outputs import CompletionOutput

_INT64_SPAN = 2**64
_INT64_MIN = -(2**63)


def derive_child_seed(seed: int | None, index: int) -> int | None:
    """``seed + index``, wrapped into int64 (the proto's seed type)."""
    if seed is None:
        return None
    return (seed + index - _INT64_MIN) % _INT64_SPAN + _INT64_MIN


class ParentRequest:
    """Fans a request with n > 1 out into children and merges their outputs.

    Outputs merge by the child's index, per output kind: DELTA passes each
    child's chunk through as it comes; CUMULATIVE returns the latest output of
    every child that has produced one; FINAL_ONLY returns all n once the last
    child finishes. The parent is finished when every child is.
    """

    def __init__(self, request: EngineCoreRequest, external_req_id: str) -> None:
        self.request = request
        self.request_id = request.request_id
        self.external_req_id = external_req_id
        self.sampling_params = request.sampling_params
        self.n = request.sampling_params.n
        self.child_request_ids = [f"{index}_{self.request_id}" for index in range(self.n)]
        # Children not finished yet (aborted ones are removed too).
        self.child_requests: set[str] = set(self.child_request_ids)
        self._latest_outputs: list[CompletionOutput | None] = [None] * self.n

    def child_sampling_params(self, index: int) -> SamplingParams:
        params = self.sampling_params.clone()
        params.n = 1
        params.seed = derive_child_seed(self.sampling_params.seed, index)
        return params

    def make_child_requests(self) -> list[EngineCoreRequest]:
        """The n requests to send to the engine core, in index order."""
        return [
            dataclasses.replace(
                self.request,
                request_id=self.child_request_ids[index],
                sampling_params=self.child_sampling_params(index),
            )
            for index in range(self.n)
        ]

    def get_outputs(
        self, child_request_id: str, output: CompletionOutput
    ) -> tuple[list[CompletionOutput], bool]:
        """The outputs to send for the parent after ``output`` from one child.

        Returns ``(outputs, finished)``; an empty list means nothing to send yet.
        """
        if output.finished():
            self.child_requests.discard(child_request_id)
        finished = not self.child_requests
        kind = self.sampling_params.output_kind
        if kind == RequestOutputKind.DELTA:
            return [output], finished
        self._latest_outputs[output.index] = output
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return [], False
        return [o for o in self._latest_outputs if o is not None], finished
