"""One generation through the HTTP API: the shared AsyncLLM path, answered whole or
streamed as server-sent events.

Errors before the first output (validation, a full queue, no worker) become
an error response with their HTTP status, streaming or not: the first output
is awaited before the event stream starts. An error after it (the engine
lost the request) ends the stream with an error event, then ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.async_llm import AsyncLLM, RequestFailedError
from services.frontend.http.errors import error_body, error_of
from services.frontend.http.responses import ResponseBuilder
from services.frontend.http.streaming import (
    DONE_EVENT,
    EventStreamResponse,
    sse_event,
    until_disconnected,
)
from services.frontend.input_processor import PromptType
from services.frontend.outputs import RequestOutput


@dataclass(slots=True)
class Generation:
    """One request's inputs, as the gRPC API would hand them to AsyncLLM."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    cache_salt: str | None
    include_usage: bool  # streaming: a last chunk with the usage


async def serve_generation(raw_request: Request, engine: AsyncLLM, generation: Generation,
                           builder: ResponseBuilder, headers: dict[str, str]) -> Response:
    """Runs ``generation`` and answers it whole (JSON) or as server-sent events.

    Raises what ``AsyncLLM.generate`` raises before the first output, and
    ClientDisconnectedError when the client leaves first (the request is
    then aborted).
    """
    stream = engine.generate(generation.request_id, generation.prompt, generation.params,
                             priority=generation.priority, cache_salt=generation.cache_salt)
    try:
        if generation.params.output_kind is not RequestOutputKind.DELTA:
            final = await until_disconnected(raw_request, _final_output(stream))
            return JSONResponse(builder.response(final), headers=headers)
        first = await until_disconnected(raw_request, anext(stream))
    except BaseException:
        await stream.aclose()
        raise
    events = _events(first, stream, builder, generation.include_usage)
    return EventStreamResponse(events, headers=headers)


async def _final_output(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    async with aclosing(stream):
        async for output in stream:
            if output.finished:
                return output
    raise RuntimeError("the engine's stream ended without a finished output")


async def _events(first: RequestOutput, stream: AsyncGenerator[RequestOutput, None],
                  builder: ResponseBuilder, include_usage: bool) -> AsyncGenerator[bytes, None]:
    """The chunks of a DELTA stream as events; closing this closes ``stream``."""
    num_completion_tokens = 0
    output: RequestOutput | None = first
    last = first
    async with aclosing(stream):
        try:
            while output is not None:
                last = output
                num_completion_tokens += sum(len(o.token_ids) for o in output.outputs)
                yield sse_event(builder.chunk(output))
                output = None if output.finished else await anext(stream, None)
        except RequestFailedError as e:
            error = error_of(e)
            yield sse_event(error_body(error.status, error.message))
            yield DONE_EVENT
            return
    if include_usage:
        yield sse_event(builder.usage_chunk(last, num_completion_tokens))
    yield DONE_EVENT
