"""Client disconnects abort requests: server-sent events and awaited answers alike.

A request's generation is an ``AsyncLLM.generate`` iteration; closing or
cancelling it aborts the request in the engine and frees its KV blocks. So
whatever waits on it here also watches the connection (ASGI's
``http.disconnect``) and cancels the wait when the client goes away, whether
or not a byte was due to be sent (Starlette only notices a disconnect when a
send fails, which may be long after the client left).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE_EVENT = b"data: [DONE]\n\n"


class ClientDisconnectedError(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """``await awaitable`` unless the client disconnects first.

    Then the awaitable is cancelled (aborting the generation inside it) and
    ClientDisconnectedError raised. Call after the body has been read.
    """
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnectedError
    return task.result()


def sse_event(data: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``data`` as JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(Response):
    """Streams ``events`` (each one complete ``data: ...`` event) as text/event-stream.

    ``events`` is closed when the stream ends for any reason: finished, the
    client disconnected, or the send failed; closing it aborts the request.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None],
                 headers: Mapping[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_events(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sender.cancel()
            watcher.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            # Cancelling the sender ended an iteration in progress; a stream
            # suspended between two events is closed here.
            await self.events.aclose()
        error = None if sender.cancelled() else sender.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: the client left
            raise error

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
