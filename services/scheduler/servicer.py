"""gRPC plumbing of kvmesh.v1.EngineCore: streams in and out of the Coordinator.

Each bidi stream has one reader task (messages in) and the handler itself
writing (messages out of a queue), so reads and writes never block each other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kvmesh.v1 import api_pb2, engine_pb2, scheduler_pb2_grpc
from kvmesh.v1 import scheduler_pb2 as spb
from services.common.convert import (
    cluster_stats_to_proto,
    engine_core_outputs_to_proto,
    frontend_message_from_proto,
    leave_refused_message,
    worker_message_from_proto,
)
from services.common.engine import EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.registration import LeaveRequest, WorkerRegistration
from services.common.rpc import KV_CACHE_ID_METADATA_KEY
from services.scheduler.coordinator import ClientStream, Coordinator, RegistrationError
from services.scheduler.worker_checks import WorkerProtocolError
from services.scheduler.worker_session import WorkerSession

logger = logging.getLogger(__name__)


class EngineCoreServicer(scheduler_pb2_grpc.EngineCoreServicer):
    """The kvmesh.v1.EngineCore service: frontend and worker streams, and GetStats."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    # ------------------------------------------------------------ frontends

    async def FrontendStream(
        self, request_iterator: AsyncIterator[spb.FrontendMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineCoreOutputs]:
        client = self.coordinator.connect_client()
        reader = asyncio.create_task(self._read_frontend(client, request_iterator))
        try:
            while (outputs := await client.outputs.get()) is not None:
                yield engine_core_outputs_to_proto(outputs)
        finally:
            reader.cancel()
            self.coordinator.disconnect_client(client)
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(reader.exception()))

    async def _read_frontend(
        self, client: ClientStream, request_iterator: AsyncIterator[spb.FrontendMessage]
    ) -> None:
        try:
            async for message in request_iterator:
                try:
                    item = frontend_message_from_proto(message)
                except ValueError as e:
                    if not _is_request(message):
                        raise  # a broken envelope: the stream's protocol is broken
                    # A request that cannot be decoded fails alone.
                    self.coordinator.refuse_malformed(client, message.add_request.request_id,
                                                      str(e))
                    continue
                if isinstance(item, EngineCoreRequest):
                    self.coordinator.add_request(client, item)
                else:
                    self.coordinator.abort_client_requests(client, item)
        except ValueError:
            client.outputs.put_nowait(None)  # the handler ends the call with the error
            raise
        self.coordinator.client_half_closed(client)

    # ------------------------------------------------------------ workers

    async def WorkerStream(
        self, request_iterator: AsyncIterator[spb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.SchedulerMessage]:
        first = await anext(aiter(request_iterator), None)
        error = "the first WorkerMessage must be a registration"
        try:
            registration = worker_message_from_proto(first) if first is not None else None
        except ValueError as e:  # e.g. limits out of range
            registration, error = None, f"{error}: {e}"
        if not isinstance(registration, WorkerRegistration):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        metadata = dict(context.invocation_metadata() or ())
        kv_cache_id = str(metadata.get(KV_CACHE_ID_METADATA_KEY, ""))
        try:
            session = await self.coordinator.register_worker(registration, kv_cache_id)
        except RegistrationError as e:
            logger.warning("event=worker_refused worker=%s status=%s reason=%r",
                           registration.worker_id, e.code.name, str(e))
            await context.abort(e.code, str(e))
        reader = asyncio.create_task(self._read_worker(session, request_iterator))
        reason = "stream ended"
        try:
            while (message := await session.outbox.get()) is not None:
                yield message
        except asyncio.CancelledError:
            reason = "stream cancelled"
            raise
        finally:
            reader.cancel()
            self.coordinator.remove_worker(session, reason)

    async def _read_worker(
        self, session: WorkerSession, request_iterator: AsyncIterator[spb.WorkerMessage]
    ) -> None:
        reason = "worker closed its stream"
        try:
            async for message in request_iterator:
                item = worker_message_from_proto(message)
                if isinstance(item, LeaveRequest):
                    if (refusal := self.coordinator.request_leave(session)) is not None:
                        session.outbox.put_nowait(leave_refused_message(refusal))
                    continue
                if not isinstance(item, ModelRunnerOutput):
                    raise WorkerProtocolError(f"worker {session.worker_id} registered twice")
                session.on_runner_output(item)
        except (WorkerProtocolError, ValueError) as e:
            reason = str(e)
        except grpc.RpcError as e:
            reason = f"stream broke: {e}"
        self.coordinator.remove_worker(session, reason)

    # ------------------------------------------------------------ stats

    async def GetStats(
        self, request: api_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ClusterStats:
        coordinator = self.coordinator
        stats = cluster_stats_to_proto(coordinator.stats(request.include_block_map))
        record = coordinator.cell_record()
        stats.cell_id = coordinator.cell_id
        stats.cell_generation = record.generation
        stats.prefill_tokens = record.prefill_tokens
        stats.block_size = record.block_size
        return stats


def _is_request(message: spb.FrontendMessage) -> bool:
    return message.WhichOneof("kind") == "add_request" and bool(message.add_request.request_id)
