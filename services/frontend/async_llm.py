"""The asyncio frontend engine behind the gRPC server (vLLM V1's AsyncLLM).

Many concurrent ``generate()`` calls share one InputProcessor, one
OutputProcessor and one engine-core client. Engine outputs arrive on the
client's stream; ``handle_outputs`` turns them into RequestOutputs and hands
each to the collector of the call that is waiting for it.

Request keys: each call's requests are registered in the OutputProcessor
under the call's internal id (``<client id>-<8 hex>``) as their external id,
so two calls that reuse a client id never receive each other's outputs; the
gRPC layer puts the client's own id back on the wire.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

import grpc

from services.common.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.common.validation import (
    MAX_CACHE_SALT_CHARS,
    MAX_CLIENT_REQUEST_ID_CHARS,
    check_string_length,
)
from services.frontend.engine_cells import EngineCells
from services.frontend.engine_core_client import EngineUnavailableError
from services.frontend.input_processor import InputProcessor, PromptType
from services.frontend.metrics import IterationStats
from services.frontend.output_processor import OutputProcessor
from services.frontend.outputs import RequestOutput
from services.frontend.stat_logger import PrometheusStatLogger

logger = logging.getLogger(__name__)

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class RequestFailedError(Exception):
    """The engine refused or lost a request; ``code`` is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def engine_failure(output: EngineCoreOutput) -> RequestFailedError | None:
    """The error an engine output carries, or None for a normal output.

    A non-zero ``status_code`` is the engine refusing the request (UNAVAILABLE:
    no worker; RESOURCE_EXHAUSTED: queue full) or a worker dropping it
    (INVALID_ARGUMENT: a logits processor refused its arguments; INTERNAL:
    computing it failed). A ``finish_message`` without
    one is a prompt the workers can never hold: INVALID_ARGUMENT.
    """
    if output.status_code:
        code = _STATUS_BY_VALUE.get(output.status_code, grpc.StatusCode.UNKNOWN)
        return RequestFailedError(code, output.finish_message or f"engine status {code.name}")
    if output.finished and output.finish_message:
        return RequestFailedError(grpc.StatusCode.INVALID_ARGUMENT, output.finish_message)
    return None


class RequestOutputCollector:
    """The outputs of one call, in order, for one consumer; ends with the final
    output or an error.

    Outputs that arrive while the consumer has not taken the previous one
    merge into it (as vLLM's collector does): under load a stream gets fewer,
    larger DELTA chunks (``aggregate``) or only the newest cumulative output,
    instead of one message per token falling ever further behind.
    """

    def __init__(self, aggregate: bool) -> None:
        self.aggregate = aggregate
        self._items: deque[RequestOutput | RequestFailedError] = deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | RequestFailedError) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(last, RequestOutput) and isinstance(item, RequestOutput):
            last.add(item, self.aggregate)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the RequestFailedError that ended the call."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, RequestFailedError):
            raise item
        return item


class AsyncLLM:
    """Adds requests, streams their outputs, aborts them when the caller leaves.

    Build with ``AsyncLLM(input_processor, output_processor)``, then
    ``attach(engine_core)`` the cells (``EngineCells``) whose callbacks are
    ``handle_outputs``, ``handle_lost`` and ``current_request``. With a
    ``stat_logger``, every output and abort is recorded in it.

    When a scheduler's stream breaks, its requests are kept and sent again
    (to it once it is back, or to another cell) with the tokens they have so
    far, which the engine recomputes before it goes on, so the client's
    stream just continues (see engine_cells.py); those no cell takes within
    the grace fail with UNAVAILABLE (``handle_lost``).
    """

    def __init__(self, input_processor: InputProcessor, output_processor: OutputProcessor,
                 stat_logger: PrometheusStatLogger | None = None) -> None:
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.stat_logger = stat_logger
        self.engine_core: EngineCells | None = None
        self._collectors: dict[str, RequestOutputCollector] = {}

    def attach(self, engine_core: EngineCells) -> None:
        self.engine_core = engine_core

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._collectors)

    async def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the RequestOutputs of one request (per its output kind).

        Raises ValidationError before anything is sent, RequestFailedError when
        the engine refuses or loses the request. Leaving the iteration early
        (the caller was cancelled, or closed the generator) aborts the request
        in the engine, which frees its KV blocks. The prompt is tokenized on a
        thread, so a long one never stalls the other streams.
        """
        check_string_length("request_id", request_id, MAX_CLIENT_REQUEST_ID_CHARS,
                            allow_empty=False)
        if cache_salt is not None:
            check_string_length("cache_salt", cache_salt, MAX_CACHE_SALT_CHARS, allow_empty=True)
        rendered = await asyncio.to_thread(self.input_processor.render_prompt, prompt)
        key, children = self._add_request(request_id, rendered, params, priority, cache_salt)
        collector = self._collectors[key]
        try:
            await self._send(children)
        except RequestFailedError as error:
            self._collectors.pop(key)
            self.output_processor.abort_requests([key])
            self._log_failed(key, error)
            raise
        try:
            while True:
                output = await collector.get()
                yield output
                if output.finished:
                    return
        finally:
            if self._collectors.pop(key, None) is not None:
                self._abort(key, reason="cancelled")

    def _add_request(
        self,
        request_id: str,
        rendered: tuple[str | None, list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> tuple[str, list[EngineCoreRequest]]:
        prompt_text, prompt_token_ids = rendered
        request = self.input_processor.process_inputs(
            request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt
        )
        key = request.request_id
        children = self.output_processor.add_client_request(request, prompt_text, key)
        self._collectors[key] = RequestOutputCollector(
            aggregate=request.sampling_params.output_kind == RequestOutputKind.DELTA)
        logger.info(
            "event=request_added request_id=%s internal_id=%s num_prompt_tokens=%d n=%d "
            "max_tokens=%d", request_id, key, len(prompt_token_ids),
            len(children), request.sampling_params.max_tokens,
        )
        return key, children

    async def _send(self, children: list[EngineCoreRequest]) -> None:
        try:
            if self.engine_core is None:
                raise EngineUnavailableError("the frontend is not connected to a scheduler yet")
            await self.engine_core.add_requests(children)
        except EngineUnavailableError as e:
            raise RequestFailedError(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    def _abort(self, key: str, *, reason: str) -> None:
        internal_ids = self.output_processor.abort_requests([key])
        if internal_ids and self.engine_core is not None:
            self.engine_core.abort_requests(internal_ids)
        if internal_ids and self.stat_logger is not None:
            self.stat_logger.record_aborted(len(internal_ids))
        logger.info("event=request_aborted internal_id=%s reason=%s", key, reason)

    # ------------------------------------------------------------ engine callbacks

    def handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Runs for every EngineCoreOutputs message from the scheduler."""
        normal: list[EngineCoreOutput] = []
        for output in outputs.outputs:
            error = engine_failure(output)
            if error is None:
                normal.append(output)
            else:
                self._fail(output.request_id, error)
        iteration_stats = IterationStats() if self.stat_logger is not None else None
        processed = self.output_processor.process_outputs(normal, iteration_stats=iteration_stats)
        if iteration_stats is not None:
            self.stat_logger.record(iteration_stats)
        if processed.reqs_to_abort and self.engine_core is not None:
            # Finished by a stop string here; still running in the engine.
            self.engine_core.abort_requests(processed.reqs_to_abort)
        for request_output in processed.request_outputs:
            key = request_output.request_id
            collector = self._collectors.get(key)
            if collector is None:
                continue
            collector.put(request_output)
            if request_output.finished:
                # The generator's finally then has nothing left to abort.
                del self._collectors[key]
                self._log_finished(key, request_output)

    def handle_lost(self, internal_ids: list[str], reason: str) -> None:
        """Requests no scheduler took back within the grace: they fail with UNAVAILABLE."""
        for internal_id in internal_ids:
            self._fail(internal_id, RequestFailedError(
                grpc.StatusCode.UNAVAILABLE, f"lost the scheduler stream: {reason}"))

    def current_request(self, internal_id: str) -> EngineCoreRequest | None:
        """The request as it stands (to send again), None once it is finished."""
        return self.output_processor.request_to_resubmit(internal_id)

    def _fail(self, internal_id: str, error: RequestFailedError) -> None:
        state = self.output_processor.request_states.get(internal_id)
        if state is None:
            return
        key = state.external_req_id
        # The engine already dropped this request; its n>1 siblings still run.
        siblings = [i for i in self.output_processor.abort_requests([key]) if i != internal_id]
        if siblings and self.engine_core is not None:
            self.engine_core.abort_requests(siblings)
        collector = self._collectors.pop(key, None)
        if collector is not None:
            collector.put(error)
        self._log_failed(key, error)

    @staticmethod
    def _log_failed(key: str, error: RequestFailedError) -> None:
        logger.info("event=request_failed internal_id=%s code=%s message=%r",
                    key, error.code.name, error.message)

    @staticmethod
    def _log_finished(key: str, output: RequestOutput) -> None:
        stats = output.metrics
        logger.info(
            "event=request_finished internal_id=%s finish_reasons=%s num_generation_tokens=%d "
            "ttft_s=%.4f e2e_s=%.4f", key,
            ",".join(o.finish_reason or "" for o in output.outputs),
            stats.num_generation_tokens if stats else 0,
            (stats.ttft_s or 0.0) if stats else 0.0,
            (stats.e2e_latency_s or 0.0) if stats else 0.0,
        )
