"""The scheduler's cluster state: frontend connections, worker sessions, placement, failover.

The `Coordinator` ties the scheduler service together: each worker session
runs its own scheduling loop (an engine core per worker, ``engine_index``),
and the coordinator routes requests between frontends and those sessions.
Everything runs on one asyncio event loop, so no locks: state changes only
between awaits. The gRPC plumbing is in ``servicer.py``; this module knows
nothing about gRPC beyond status code values.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from services.common.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from services.common.cell_index import CellRecord
from services.common.convert import leave_refused_message
from services.common.model_files import DEFAULT_MODEL_NAME
from services.common.registration import WorkerRegistration
from services.common.stats import SchedulerStats
from services.common.validation import ValidationError, validate_engine_core_request
from services.scheduler.cell_publisher import CellIndex, CellPublisher
from services.scheduler.config import SchedulerServiceConfig, make_scheduler_config
from services.scheduler.kv_mirror import MirroredKVStore
from services.scheduler.kv_store import KVStore
from services.scheduler.metrics import SchedulerMetrics, WorkerSnapshot
from services.scheduler.request import Request
from services.scheduler.router import RequestFactory, Router
from services.scheduler.scheduler import Scheduler, WaitingQueueFullError
from services.scheduler.worker_checks import check_registration
from services.scheduler.worker_session import WorkerSession
from services.scheduler.worker_stores import WorkerStores

logger = logging.getLogger(__name__)


class RegistrationError(Exception):
    """A worker's registration was refused; ``code`` is the gRPC status to end its stream with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True, eq=False)
class ClientStream:
    """One frontend connection: its outgoing outputs and the requests it has in flight.

    None in ``outputs`` ends the stream. After the frontend half-closes
    (``closing``), the stream ends once its last request finished.
    """

    client_index: int
    outputs: asyncio.Queue[EngineCoreOutputs | None] = field(default_factory=asyncio.Queue)
    request_ids: set[str] = field(default_factory=set)
    closing: bool = False

    def end_if_done(self) -> None:
        if self.closing and not self.request_ids:
            self.outputs.put_nowait(None)


@dataclass(slots=True, eq=False)
class Placement:
    """Where a request runs, which frontend connection waits for it, and how
    many workers it has already lost."""

    session: WorkerSession
    client: ClientStream
    num_failovers: int = 0


# A request whose worker was lost this many times is failed instead of being
# placed again: two crashes in a row are more likely its fault than chance.
MAX_FAILOVERS = 1


def normalize_model_name(model: str | None) -> str | None:
    """The default model's aliases ("default", None on the worker side) name it the same way."""
    return DEFAULT_MODEL_NAME if model == "default" else model


class Coordinator:
    """Routes requests from frontends to worker sessions and outputs back.

    - A new request goes to the best-ranked worker (``Router``); a worker whose
      waiting queue is full is skipped; none left -> RESOURCE_EXHAUSTED (8),
      no worker at all -> UNAVAILABLE (14). Refusals are EngineCoreOutputs with
      finish_reason ABORT and ``status_code`` set.
    - A frontend that disconnects has all its requests aborted.
    - A worker that is lost has its unfinished requests re-placed on the
      others as fresh requests carrying the tokens generated so far, which the
      new worker recomputes; the client's stream just continues. A request
      lost with a second worker fails with INTERNAL instead.
    - Every request is validated again here (INVALID_ARGUMENT), and a
      frontend can only abort the requests it placed.
    """

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.model = normalize_model_name(config.model)  # None: the first worker's
        self.vocab_size: int | None = None  # the first worker's; all must agree
        self.router = Router(config.load_weight_tokens)
        self.stores = WorkerStores(config.redis_url)
        self.sessions: dict[str, WorkerSession] = {}
        self.clients: dict[int, ClientStream] = {}
        self.placements: dict[str, Placement] = {}  # by request id
        self.draining = False
        # The cell (this scheduler and its workers): named at start (start_cell).
        self.cell_id = config.cell_id
        self.cell_index = CellIndex()
        self.cell_publisher: CellPublisher | None = None
        self._next_client_index = 0
        self._next_engine_index = 0
        self.metrics = SchedulerMetrics(lambda: self.model or "", self.metrics_snapshots)

    # ------------------------------------------------------------ frontends

    def connect_client(self) -> ClientStream:
        client = ClientStream(self._next_client_index)
        self._next_client_index += 1
        self.clients[client.client_index] = client
        logger.info("event=frontend_connected client_index=%d", client.client_index)
        return client

    def disconnect_client(self, client: ClientStream) -> None:
        """Aborts everything the frontend still had in flight."""
        if self.clients.pop(client.client_index, None) is None:
            return
        logger.info("event=frontend_disconnected client_index=%d num_aborted=%d",
                    client.client_index, len(client.request_ids))
        self.abort_requests(list(client.request_ids))

    def add_request(self, client: ClientStream, request: EngineCoreRequest) -> None:
        """Places a request from ``client``; refusals come back on the client's stream."""
        req_id = request.request_id
        # Outputs route by the connection, whatever index the frontend wrote.
        request.client_index = client.client_index
        if (why := self._unavailable_reason()) is not None:
            self._refuse(client, req_id, grpc.StatusCode.UNAVAILABLE, why)
        elif req_id in client.request_ids:
            self._refuse(client, req_id, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request id {req_id!r} is already in flight")
        elif (error := self._validate(request)) is not None:
            self._refuse(client, req_id, grpc.StatusCode.INVALID_ARGUMENT, error)
        else:
            if req_id in self.placements:
                # Its frontend resubmits over a new stream before this scheduler
                # noticed the old one break: the new stream takes it over.
                logger.info("event=request_taken_over request_id=%s", req_id)
                self.abort_requests([req_id])
            self._place(client, req_id, lambda hasher: Request.from_engine_core_request(request, hasher))

    def _unavailable_reason(self) -> str | None:
        """Why no new request can be placed here; None when one can."""
        if self.draining:
            return "the scheduler is shutting down"
        if not self.sessions:
            return "no worker is registered"
        if not self.serving_sessions():
            return "every worker is leaving for another cell"
        return None

    def serving_sessions(self) -> list[WorkerSession]:
        """The workers new requests may go to: all but those leaving the cell."""
        return [s for s in self.sessions.values() if not s.leaving]

    def _validate(self, request: EngineCoreRequest) -> str | None:
        assert self.vocab_size is not None  # set by the first registration
        try:
            validate_engine_core_request(request, vocab_size=self.vocab_size,
                                         max_logprobs=self.config.max_logprobs)
        except ValidationError as e:
            return str(e)
        return None

    def refuse_malformed(self, client: ClientStream, req_id: str, reason: str) -> None:
        """A request the frontend sent but that could not be decoded."""
        self._refuse(client, req_id, grpc.StatusCode.INVALID_ARGUMENT, reason)

    def abort_client_requests(self, client: ClientStream, request_ids: Iterable[str]) -> None:
        """Aborts those of ``request_ids`` that ``client`` placed; others are ignored."""
        self.abort_requests([r for r in request_ids if r in client.request_ids])

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Aborts wherever the requests run; unknown or finished ids are ignored."""
        by_session: dict[WorkerSession, list[str]] = {}
        for req_id in request_ids:
            placement = self.placements.pop(req_id, None)
            if placement is None:
                continue
            by_session.setdefault(placement.session, []).append(req_id)
            placement.client.request_ids.discard(req_id)
            placement.client.end_if_done()
        for session, req_ids in by_session.items():
            session.abort_requests(req_ids)
            logger.info("event=requests_aborted worker=%s request_ids=%s",
                        session.worker_id, ",".join(req_ids))

    def client_half_closed(self, client: ClientStream) -> None:
        client.closing = True
        client.end_if_done()

    # ------------------------------------------------------------ placement

    def _place(self, client: ClientStream, req_id: str, make_request: RequestFactory,
               num_failovers: int = 0) -> None:
        full: list[str] = []
        for session, request, hit_tokens in self.router.rank(make_request, self.serving_sessions()):
            try:
                session.add_request(request)
            except WaitingQueueFullError as e:
                full.append(f"{session.worker_id}: {e}")
                continue
            except ValueError as e:
                self._refuse(client, req_id, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                return
            request.num_placed_hit_tokens = hit_tokens
            self.placements[req_id] = Placement(session, client, num_failovers)
            client.request_ids.add(req_id)
            reason = "fallback" if full else "prefix_hit" if hit_tokens else "least_loaded"
            self.metrics.placements.labels(self.model, reason).inc()
            logger.info("event=request_placed request_id=%s worker=%s num_tokens=%d",
                        req_id, session.worker_id, request.num_tokens)
            return
        self._refuse(client, req_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                     "every worker's waiting queue is full (" + "; ".join(full) + ")")

    def _refuse(self, client: ClientStream, req_id: str, code: grpc.StatusCode, message: str) -> None:
        logger.info("event=request_refused request_id=%s status=%s reason=%r",
                    req_id, code.name, message)
        output = EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT,
                                  finish_message=message, status_code=code.value[0])
        client.outputs.put_nowait(EngineCoreOutputs([output], timestamp=time.monotonic()))
        client.end_if_done()

    def route_outputs(self, session: WorkerSession, outputs: dict[int, EngineCoreOutputs]) -> None:
        """A session's step outputs, to the frontends that sent the requests."""
        placements = self.placements
        for client_index, client_outputs in outputs.items():
            for output in client_outputs.outputs:
                if output.finish_reason is not None:
                    placement = placements.get(output.request_id)
                    if placement is not None and placement.session is session:
                        del placements[output.request_id]
                        placement.client.request_ids.discard(output.request_id)
                    logger.info("event=request_finished request_id=%s worker=%s finish_reason=%s",
                                output.request_id, session.worker_id, output.finish_reason)
            client = self.clients.get(client_index)
            if client is not None:  # else: it disconnected and its requests were aborted
                client.outputs.put_nowait(client_outputs)
                client.end_if_done()

    # ------------------------------------------------------------ workers

    async def register_worker(self, registration: WorkerRegistration,
                              kv_cache_id: str) -> WorkerSession:
        """Builds the worker's session: a Scheduler sized by what it reported, on
        the prefix cache its store still holds for ``kv_cache_id``.

        Raises RegistrationError while draining (UNAVAILABLE), for a duplicate
        worker id (ALREADY_EXISTS), another model or vocabulary than the
        cluster serves (FAILED_PRECONDITION) or a geometry outside
        ``registration_bounds`` (INVALID_ARGUMENT). The store is opened on a
        thread: Redis never blocks the event loop, and never refuses a worker.
        """
        model = normalize_model_name(registration.model)
        self._check_admission(registration, model)
        try:
            check_registration(registration, self.config.registration_bounds)
        except ValueError as e:
            raise RegistrationError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        store = await asyncio.to_thread(self.stores.open, model, registration.worker_id,
                                        kv_cache_id)
        try:
            self._check_admission(registration, model)  # the world may have moved meanwhile
        except RegistrationError:
            self.stores.release(store)
            raise
        return self._start_session(registration, model, store)

    def _check_admission(self, registration: WorkerRegistration, model: str | None) -> None:
        if self.draining:
            raise RegistrationError(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        if registration.worker_id in self.sessions:
            raise RegistrationError(grpc.StatusCode.ALREADY_EXISTS,
                                    f"worker_id {registration.worker_id!r} is already registered")
        if self.model is not None and model != self.model:
            raise RegistrationError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"worker serves model {model!r}, this scheduler serves {self.model!r}")
        if self.vocab_size is not None and registration.vocab_size != self.vocab_size:
            raise RegistrationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker has vocab_size {registration.vocab_size}, the cluster {self.vocab_size}")

    def _start_session(self, registration: WorkerRegistration, model: str | None,
                       store: KVStore) -> WorkerSession:
        engine_index = self._next_engine_index
        config = make_scheduler_config(self.config.scheduling, registration, engine_index)
        if isinstance(store, MirroredKVStore) and config.enable_prefix_caching:
            # Before the Scheduler exists: its first delta is the recovered cache.
            store.on_apply = lambda delta: self.cell_index.apply(registration.worker_id, delta)
        # Recovers the stored prefix cache, but what the worker may have overwritten.
        scheduler = Scheduler(config, store, registration.dirty_block_ids, log_stats=True)
        self.model = model
        self.vocab_size = registration.vocab_size
        self._next_engine_index += 1
        worker_id = registration.worker_id
        session = WorkerSession(worker_id, engine_index, scheduler, store, self.route_outputs,
                                self.metrics.for_worker(model, worker_id),
                                registration.vocab_size, self.config.worker_step_timeout_s,
                                self.config.fault_exit_after_step,
                                self.config.scheduling.max_steps_in_flight)
        self.sessions[worker_id] = session
        session.start(on_failure=self._on_session_failure)
        logger.info("event=worker_registered worker=%s engine_index=%d num_blocks=%d "
                    "block_size=%d max_model_len=%d num_cached_blocks=%d", worker_id, engine_index,
                    config.num_blocks, config.block_size, config.max_model_len,
                    scheduler.kv_cache_manager.num_cached_blocks)
        return session

    def request_leave(self, session: WorkerSession) -> str | None:
        """A worker asks to move to another cell: None when granted (``session.leave()``:
        nothing new is placed on it, and it is drained once its requests are done),
        else why not. The cell keeps at least one serving worker, so workers that
        ask at once move one at a time."""
        if session.leaving:
            return None  # already granted
        if self.sessions.get(session.worker_id) is not session:
            return "the worker is not registered"
        if self.draining:
            return "the scheduler is shutting down"
        if len(self.serving_sessions()) < 2:
            return "it is the cell's last serving worker"
        session.leave()
        logger.info("event=worker_leaving worker=%s num_requests=%d", session.worker_id,
                    len(session.scheduler.requests))
        return None

    def remove_worker(self, session: WorkerSession, reason: str) -> None:
        """Ends the session and re-places its unfinished requests. Idempotent."""
        if self.sessions.get(session.worker_id) is not session:
            return
        del self.sessions[session.worker_id]
        self.cell_index.remove_worker(session.worker_id)
        session.close()
        session.metrics.remove()
        orphans = session.unfinished_requests()
        self.stores.release(session.store)
        logger.info("event=worker_removed worker=%s reason=%r num_requeued=%d",
                    session.worker_id, reason, len(orphans))
        if not (self.draining or session.leaving):
            self.metrics.worker_failovers.labels(self.model).inc()
        self._keep_a_serving_worker()
        for old in orphans:
            placement = self.placements.pop(old.request_id, None)
            if placement is None:
                continue
            client = placement.client
            client.request_ids.discard(old.request_id)
            if placement.num_failovers >= MAX_FAILOVERS:
                self._refuse(client, old.request_id, grpc.StatusCode.INTERNAL,
                             f"the request lost {placement.num_failovers + 1} workers (the last "
                             f"{session.worker_id}); it is not placed on another")
            elif self.draining or not self.serving_sessions():
                why = ("the scheduler is shutting down" if self.draining
                       else f"worker {session.worker_id} was lost and no worker is left")
                self._refuse(client, old.request_id, grpc.StatusCode.UNAVAILABLE, why)
            else:
                self.metrics.requests_replaced.labels(self.model).inc()
                self._place(client, old.request_id, _requeued(old), placement.num_failovers + 1)
        # Requests it had refused (IGNORED) but not yet reported: say so now.
        for req_id in [r for r, p in self.placements.items() if p.session is session]:
            placement = self.placements.pop(req_id)
            placement.client.request_ids.discard(req_id)
            self._refuse(placement.client, req_id, grpc.StatusCode.UNAVAILABLE,
                         f"worker {session.worker_id} was lost before answering")

    def _keep_a_serving_worker(self) -> None:
        """When no serving worker is left, workers granted a move that has not begun
        stay (they are told so), so the cell does not empty itself."""
        if self.draining or self.serving_sessions():
            return
        for session in self.sessions.values():
            if session.stay():
                session.outbox.put_nowait(leave_refused_message(
                    "the cell's last other serving worker was lost"))
                logger.info("event=worker_leave_revoked worker=%s", session.worker_id)

    def _on_session_failure(self, session: WorkerSession, error: BaseException) -> None:
        logger.error("event=worker_session_failed worker=%s error=%r", session.worker_id, error,
                     exc_info=error)
        self.remove_worker(session, f"session failed: {error!r}")

    def stop_accepting(self) -> None:
        """From now on new requests and registrations are refused with UNAVAILABLE."""
        self.draining = True

    def drain_workers(self) -> None:
        """Asks every worker to leave; what they still run is refused with UNAVAILABLE."""
        self.stop_accepting()
        for session in self.sessions.values():
            session.drain()

    # ------------------------------------------------------------ the cell

    def start_cell(self, default_cell_id: str) -> None:
        """Names the cell (``config.cell_id``, else ``default_cell_id``) and, with
        Redis, starts publishing it for frontends to route by."""
        self.cell_id = self.config.cell_id or default_cell_id
        if self.config.redis_url is not None and self.cell_publisher is None:
            self.cell_publisher = CellPublisher(
                self.config.redis_url, self.cell_id, self.cell_index, lambda: self.model,
                self.cell_record, lease_ttl_s=self.config.cell_lease_ttl_s)
            self.cell_publisher.start()

    async def stop_cell(self) -> None:
        if self.cell_publisher is not None:
            await self.cell_publisher.close()
            self.cell_publisher = None

    @property
    def cell_generation(self) -> int:
        return 0 if self.cell_publisher is None else self.cell_publisher.generation

    def cell_record(self) -> CellRecord:
        """The cell's load summary: its requests, and their prompt tokens not computed
        yet (for a waiting request, less the prefix hit it was placed for)."""
        record = CellRecord(generation=self.cell_generation,
                            block_size=self.cell_index.block_size,
                            num_workers=0 if self.draining else len(self.serving_sessions()),
                            updated_ms=int(time.time() * 1000))
        for session in self.sessions.values():
            scheduler = session.scheduler
            for request in (*scheduler.waiting, *scheduler.running):
                done = max(request.num_computed_tokens, request.num_placed_hit_tokens)
                record.prefill_tokens += max(request.num_prompt_tokens - done, 0)
            record.num_waiting += len(scheduler.waiting)
            record.num_running += len(scheduler.running)
            if record.block_size == 0:
                record.block_size = scheduler.config.block_size
        return record

    # ------------------------------------------------------------ stats

    def stats(self, include_block_map: bool = False) -> list[tuple[str, SchedulerStats]]:
        # A leaving worker is left out: it takes nothing new and is about to go.
        return [(s.worker_id, s.make_stats(include_block_map)) for s in self.serving_sessions()]

    def metrics_snapshots(self) -> list[WorkerSnapshot]:
        now = time.monotonic()
        return [WorkerSnapshot(worker_id, s.make_stats(), s.store.mirror_lag_s(now),
                               s.store.num_write_errors)
                for worker_id, s in self.sessions.items()]


def _requeued(old: Request) -> RequestFactory:
    """A fresh Request from a lost worker's one: same prompt, outputs so far kept,
    so the client sees one uninterrupted stream."""
    return lambda hasher: Request.from_engine_core_request(old, hasher)
