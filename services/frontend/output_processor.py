"""EngineCoreOutputs -> RequestOutputs (vLLM V1's OutputProcessor and RequestState).

The engine core speaks in internal request ids and token ids; clients get
their own ids, text, logprobs and finish reasons. Stop strings are found
here, so a request they end is still running in the engine: its internal id
comes back in ``reqs_to_abort`` for the caller to abort there.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from services.common.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from services.common.sampling_params import RequestOutputKind
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.input_processor import external_request_id
from services.frontend.logprobs_processor import LogprobsProcessor
from services.frontend.metrics import IterationStats, RequestStateStats
from services.frontend.outputs import CompletionOutput, RequestOutput
from services.frontend.parent_request import ParentRequest


class RequestState:
    """Everything the frontend keeps about one engine request (one child of n)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        request: EngineCoreRequest,
        external_req_id: str,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        stream_interval: int = 1,
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.external_req_id = external_req_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = request.sampling_params.output_kind
        self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor.from_new_request(tokenizer, request)
        self.parent_req = parent_req
        self.request_index = request_index
        self.stream_interval = stream_interval
        # Output tokens already handed to the client.
        self.sent_tokens_offset = 0
        self.stats = RequestStateStats(
            arrival_time=request.arrival_time, num_prompt_tokens=len(request.prompt_token_ids)
        )

    def _should_send(self, finished: bool) -> bool:
        if finished:
            return True
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            return False
        num_unsent = len(self.detokenizer.output_token_ids) - self.sent_tokens_offset
        # The first token goes out at once (time to first token), then every
        # stream_interval tokens.
        return num_unsent > 0 and (
            self.sent_tokens_offset == 0 or num_unsent >= self.stream_interval
        )

    def make_request_output(
        self,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        finish_message: str = "",
    ) -> RequestOutput | None:
        """The output to send after an engine step, or None when nothing is due."""
        finished = finish_reason is not None
        if not self._should_send(finished):
            return None
        output = self._new_completion_output(finish_reason, stop_reason, finish_message)
        outputs = [output]
        if self.parent_req is not None:
            outputs, finished = self.parent_req.get_outputs(self.request_id, output)
            if not outputs:
                return None
        delta = self.output_kind == RequestOutputKind.DELTA
        processor = self.logprobs_processor
        return RequestOutput(
            request_id=self.external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=(
                processor.pop_prompt_logprobs() if delta else processor.prompt_logprobs
            ),
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.stats.num_cached_tokens,
            metrics=self.stats,
        )

    def _new_completion_output(
        self, finish_reason: FinishReason | None, stop_reason: int | str | None, finish_message: str
    ) -> CompletionOutput:
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        start = self.sent_tokens_offset if delta else 0
        all_token_ids = self.detokenizer.output_token_ids
        logprobs = self.logprobs_processor.logprobs
        self.sent_tokens_offset = len(all_token_ids)
        return CompletionOutput(
            index=self.request_index,
            text=self.detokenizer.get_next_output_text(finished, delta),
            token_ids=all_token_ids[start:],
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs[start:] if logprobs is not None else None,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
            finish_message=finish_message if finished else "",
        )


@dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Internal ids that finished here (stop string) but still run in the engine.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Holds a RequestState per internal request id and processes engine outputs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self.external_req_ids: defaultdict[str, list[str]] = defaultdict(list)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt_text: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        *,
        external_req_id: str | None = None,
    ) -> None:
        """Registers a request before it is sent to the engine core.

        The client's id is, in order: the parent's, ``external_req_id``, or the
        one inside an id made by ``make_internal_request_id``.
        """
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already registered")
        if parent_req is not None:
            external_req_id = parent_req.external_req_id
            self.parent_requests[parent_req.request_id] = parent_req
        elif external_req_id is None:
            external_req_id = external_request_id(request_id)
        self.request_states[request_id] = RequestState(
            self.tokenizer, request, external_req_id, prompt_text, parent_req, request_index,
            self.stream_interval,
        )
        self.external_req_ids[external_req_id].append(request_id)

    def add_client_request(
        self, request: EngineCoreRequest, prompt_text: str | None, external_req_id: str
    ) -> list[EngineCoreRequest]:
        """Registers a client's request, as n children under a ParentRequest when
        n > 1; returns the EngineCoreRequests to send to the engine core."""
        if request.sampling_params.n == 1:
            self.add_request(request, prompt_text, external_req_id=external_req_id)
            return [request]
        parent = ParentRequest(request, external_req_id)
        children = parent.make_child_requests()
        for index, child in enumerate(children):
            self.add_request(child, prompt_text, parent, index)
        return children

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        engine_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        """Detokenizes, checks stop strings and builds the RequestOutputs due now.

        ``engine_timestamp`` (wall-clock seconds) times the tokens; default now.
        Outputs for unknown (e.g. already aborted) requests are ignored. Token
        counts, latencies and finished requests go into ``iteration_stats``
        when given.
        """
        now = time.time() if engine_timestamp is None else engine_timestamp
        result = OutputProcessorOutput()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            num_tokens_before = len(state.detokenizer.output_token_ids)
            stop_string = state.detokenizer.update(
                output.new_token_ids, finish_reason == FinishReason.STOP
            )
            if stop_string is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            num_kept = len(state.detokenizer.output_token_ids) - num_tokens_before
            state.logprobs_processor.update(
                output.new_logprobs, output.new_prompt_logprobs, num_kept
            )
            state.stats.num_cached_tokens = output.num_cached_tokens
            previous_token_time = state.stats.last_token_time
            state.stats.observe_tokens(num_kept, now)
            if iteration_stats is not None:
                iteration_stats.observe_tokens(state.stats, num_kept, previous_token_time)
            if finish_reason is not None:
                state.stats.observe_finished(now)
                if iteration_stats is not None:
                    iteration_stats.observe_finished(state.stats, str(finish_reason))
                self._finish_request(state)
                if not output.finished:
                    result.reqs_to_abort.append(output.request_id)
            request_output = state.make_request_output(
                finish_reason, stop_reason, output.finish_message
            )
            if request_output is not None:
                result.request_outputs.append(request_output)
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forgets requests; returns the internal ids to abort in the engine core.

        Each id may be internal, a parent's internal id, or a client's id (then
        every request sent under it, all n children included). Unknown ids are
        ignored.
        """
        internal_ids: list[str] = []
        for request_id in request_ids:
            if request_id in self.request_states:
                internal_ids.append(request_id)
            elif (parent := self.parent_requests.get(request_id)) is not None:
                internal_ids.extend(parent.child_request_ids)
            else:
                internal_ids.extend(self.external_req_ids.get(request_id, ()))
        aborted: list[str] = []
        for request_id in dict.fromkeys(internal_ids):
            state = self.request_states.get(request_id)
            if state is not None:
                self._finish_request(state)
                aborted.append(request_id)
        return aborted

    def request_to_resubmit(self, request_id: str) -> EngineCoreRequest | None:
        """The unfinished engine request ``request_id`` with the output tokens it has
        so far, to send to a scheduler that does not know it; None if finished."""
        state = self.request_states.get(request_id)
        if state is None:
            return None
        return dataclasses.replace(state.request,
                                   output_token_ids=list(state.detokenizer.output_token_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def _finish_request(self, state: RequestState) -> None:
        request_id = state.request_id
        del self.request_states[request_id]
        siblings = self.external_req_ids[state.external_req_id]
        siblings.remove(request_id)
        if not siblings:
            del self.external_req_ids[state.external_req_id]
        parent = state.parent_req
        if parent is not None:
            parent.child_requests.discard(request_id)
            if not parent.child_requests:
                self.parent_requests.pop(parent.request_id, None)
