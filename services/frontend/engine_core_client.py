"""The frontend's client of the scheduler (kvmesh.v1.EngineCore): ONE long-lived FrontendStream.

Every request of this frontend process travels over the same bidi stream:
EngineCoreRequests and aborts go up, EngineCoreOutputs come down (vLLM V1's
AsyncMPClient, with gRPC in place of ZMQ). When the stream breaks the client
reports it once (the scheduler aborts whatever this stream had in flight)
and reconnects with exponential backoff; requests sent while disconnected
fail at once with ``EngineUnavailableError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
from kvmesh.v1 import api_pb2, scheduler_pb2, scheduler_pb2_grpc

from services.common.convert import abort_message, add_request_message, engine_core_outputs_from_proto
from services.common.engine import EngineCoreOutputs, EngineCoreRequest
from services.common.rpc import CHANNEL_OPTIONS
from services.common.security import TlsConfig, aio_channel, secret_metadata

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 10.0


class EngineUnavailableError(RuntimeError):
    """The scheduler stream is not connected; the request was not sent."""


OutputsCallback = Callable[[EngineCoreOutputs], None]
DisconnectCallback = Callable[[str], None]
ConnectCallback = Callable[[], None]


class EngineCoreClient:
    """Shares one FrontendStream to ``address`` among all requests.

    ``on_outputs`` runs in the event loop for every EngineCoreOutputs message;
    ``on_disconnect(reason)`` once each time an established stream breaks;
    ``on_connect()`` each time a stream is established. Backoff between
    connection attempts doubles from ``initial_backoff_s`` to ``max_backoff_s``.
    ``tls`` and ``cluster_secret`` authenticate this frontend to the scheduler;
    ``channel_options`` add to the channel's (a TLS name for a resolved address).
    """

    def __init__(
        self,
        address: str,
        on_outputs: OutputsCallback,
        *,
        on_connect: ConnectCallback | None = None,
        on_disconnect: DisconnectCallback | None = None,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        tls: TlsConfig | None = None,
        cluster_secret: str | None = None,
        channel_options: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.address = address
        self._metadata = secret_metadata(cluster_secret)
        self._on_outputs = on_outputs
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._channel = aio_channel(address, tls, (*CHANNEL_OPTIONS, *channel_options))
        self._stub = scheduler_pb2_grpc.EngineCoreStub(self._channel)
        # The outgoing queue of the current stream; None while disconnected.
        self._send_queue: asyncio.Queue[scheduler_pb2.FrontendMessage | None] | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self._send_queue is not None

    def start(self) -> None:
        """Starts connecting in the background (returns at once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="frontend-stream")

    async def wait_connected(self, timeout_s: float | None = None) -> None:
        """Waits for the stream to be up; raises TimeoutError after ``timeout_s``."""
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues ``request`` on the stream; raises EngineUnavailableError when down."""
        self._send(add_request_message(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Aborts internal ids in the engine core. A no-op while disconnected:
        the scheduler already aborted everything the broken stream carried."""
        request_ids = list(request_ids)
        if request_ids and self.connected:
            self._send(abort_message(request_ids))

    async def get_stats(self, include_block_map: bool = False,
                        timeout_s: float = _STATS_TIMEOUT_S) -> api_pb2.ClusterStats:
        """The scheduler's GetStats (raises grpc.aio.AioRpcError on failure)."""
        request = api_pb2.GetStatsRequest(include_block_map=include_block_map)
        return await self._stub.GetStats(request, timeout=timeout_s, metadata=self._metadata)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._channel.close()

    # ------------------------------------------------------------ internals

    def _send(self, message: scheduler_pb2.FrontendMessage) -> None:
        queue = self._send_queue
        if queue is None:
            raise EngineUnavailableError(f"the scheduler at {self.address} is not connected")
        queue.put_nowait(message)

    async def _run(self) -> None:
        backoff_s = self._initial_backoff_s
        while True:
            established, reason = await self._run_one_stream()
            if established:
                logger.warning("event=scheduler_stream_broken address=%s reason=%r",
                               self.address, reason)
                if self._on_disconnect is not None:
                    self._on_disconnect(reason)
                backoff_s = self._initial_backoff_s
            else:
                logger.info("event=scheduler_connect_failed address=%s retry_in_s=%.2f reason=%r",
                            self.address, backoff_s, reason)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)

    async def _run_one_stream(self) -> tuple[bool, str]:
        """Runs one stream until it ends: (whether it was established, why it ended)."""
        queue: asyncio.Queue[scheduler_pb2.FrontendMessage | None] = asyncio.Queue()
        call = self._stub.FrontendStream(_drain(queue), metadata=self._metadata)
        established = False
        try:
            await call.wait_for_connection()
            established = True
            self._send_queue = queue
            self._connected.set()
            logger.info("event=scheduler_connected address=%s", self.address)
            if self._on_connect is not None:
                self._on_connect()
            async for message in call:
                self._on_outputs(engine_core_outputs_from_proto(message))
            return established, "the scheduler closed the stream"
        except grpc.aio.AioRpcError as e:
            return established, f"{e.code().name}: {e.details()}"
        except Exception as e:  # a bug in output handling must not end reconnection
            logger.exception("event=frontend_stream_error address=%s", self.address)
            return established, repr(e)
        finally:
            self._send_queue = None
            self._connected.clear()
            queue.put_nowait(None)
            call.cancel()


async def _drain(
    queue: asyncio.Queue[scheduler_pb2.FrontendMessage | None],
) -> AsyncIterator[scheduler_pb2.FrontendMessage]:
    while (message := await queue.get()) is not None:
        yield message
