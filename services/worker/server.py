"""The worker service: loads the model, dials the scheduler, and runs the steps it is sent.

``python -m services.worker.server --scheduler-address HOST:PORT --model M --health-port P``

Order matters: the model is loaded and the KV cache sized FIRST, because the
registration carries the number of KV blocks. Then the worker dials the
scheduler (waiting for it to come up), registers, and answers each
SchedulerOutput with a ModelRunnerOutput; the steps run on the StepPipeline's
thread (the next one prepared while this one computes) so the event loop
keeps reading steps, writing outputs and serving health checks meanwhile. If the
scheduler goes away the worker forgets its requests, keeps its KV memory, and
dials again; it exits on Drain or SIGTERM / SIGINT (after the step in flight).

Given several schedulers (cells: ``--scheduler-address A:P,B:P`` or a DNS name
with one address per scheduler), the worker joins the live cell with the
fewest workers (services/worker/cell_choice.py), dials a lost one again for
``--rejoin-grace-s`` before choosing again, and every
``--rebalance-interval-s`` asks to move, when idle, from a crowded cell to the
smallest. The scheduler grants a move only while the cell keeps another serving
worker, places nothing more on the worker, and drains it once the requests
already there are done: a move never cuts a request off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Awaitable
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.v1 import scheduler_pb2_grpc
from services.common.convert import (
    leave_message,
    registration_ack_from_proto,
    registration_message,
    runner_output_message,
    scheduler_message_from_proto,
)
from services.common.limits import SchedulingLimits
from services.common.process import SHUTDOWN_SIGNALS, configure_logging
from services.common.prometheus import MetricsServer
from services.common.rpc import KV_CACHE_ID_METADATA_KEY, LIVENESS_SERVICE
from services.common.security import (
    add_security_args,
    read_cluster_secret,
    secret_metadata,
    tls_from_args,
)
from services.common.model_runner_output import ModelRunnerOutput
from services.common.registration import Drain, LeaveRefused, LeaveRequest
from services.common.scheduler_addresses import (
    SchedulerTarget,
    parse_scheduler_addresses,
    resolve_scheduler_targets,
)
from services.common.scheduler_output import SchedulerOutput
from services.common.speculative import SpeculativeConfig
from services.worker.cell_choice import (
    SchedulerChannels,
    choose_cell,
    idle_workers_of,
    num_workers_of,
    probe_cells,
    rebalance_target,
)
from services.worker.config import (
    LatencyModel,
    WorkerConfig,
    WorkerServiceConfig,
    default_worker_id,
)
from services.worker.dirty_blocks import DirtyBlockLog
from services.worker.metrics import WorkerMetrics
from services.worker.sample import ThinkingConfig
from services.worker.step_pipeline import StepPipeline
from services.worker.worker import Worker

logger = logging.getLogger(__name__)

T = TypeVar("T")
# What the session's writer sends, in order: step outputs (as they complete) and
# requests to leave; None ends it.
_Outgoing = asyncio.Future[ModelRunnerOutput] | LeaveRequest | None

# Status codes of a refused registration worth retrying: the scheduler is
# restarting or draining, or it has not yet noticed our previous stream died.
_RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS,
                    grpc.StatusCode.CANCELLED)
_MIN_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 2.0
_CLOSE_TIMEOUT_S = 5.0
# However little of rejoin_grace_s is left, a freshly chosen live scheduler
# gets this long to acknowledge the registration.
_MIN_REGISTER_WAIT_S = 1.0


class _Stopped(Exception):
    """stop() was called while waiting."""


class _SchedulerLost(Exception):
    """The scheduler ended the stream without a Drain."""


class WorkerService:
    """One worker process's service loop (``run``) and health endpoint."""

    def __init__(self, config: WorkerServiceConfig) -> None:
        self.config = config
        self.worker = Worker(config.worker)
        # Names this process's KV cache allocation: the scheduler trusts its
        # stored prefix index only for the cache it was built for.
        self.kv_cache_id = ""
        self.dirty_blocks = DirtyBlockLog()
        self.engine_index: int | None = None
        self.health = health.aio.HealthServicer()
        self.health_port = 0
        self.metrics = WorkerMetrics(config.worker_id)
        self.metrics_server: MetricsServer | None = None
        if config.metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics.registry, config.health_host,
                                                config.metrics_port)
        self.pipeline: StepPipeline | None = None
        self._scheduler_addresses = parse_scheduler_addresses(config.scheduler_address)
        self._channels = SchedulerChannels(config.tls)
        self._stop = asyncio.Event()
        self._stop_waiter: asyncio.Future[bool] | None = None

    def stop(self) -> None:
        """Leave the scheduler after answering the step in flight, then return from run()."""
        self._stop.set()

    async def run(self) -> None:
        """Loads, registers and serves steps until Drain or stop()."""
        health_server = await self._start_health_server()
        if self.metrics_server is not None:
            await self.metrics_server.start()
        self._stop_waiter = asyncio.ensure_future(self._stop.wait())
        try:
            logger.info("event=worker_loading worker=%s model=%s", self.config.worker_id,
                        self.config.worker.model)
            num_blocks = await asyncio.to_thread(self._load)
            await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            self.metrics.bind(self.worker.model_name, num_blocks)
            self.pipeline = StepPipeline(self.worker, self._observe_step)
            logger.info("event=worker_loaded worker=%s num_blocks=%d compiled=%s",
                        self.config.worker_id, num_blocks, self.worker.model_runner.compiled_pieces)
            await self._serve()
        except Exception as e:
            logger.error("event=worker_failed worker=%s error=%r", self.config.worker_id, e)
            raise
        finally:
            self._stop_waiter.cancel()
            await self._channels.close()
            if self.pipeline is not None:
                await asyncio.to_thread(self.pipeline.close)
            if health_server is not None:
                await health_server.stop(None)
            if self.metrics_server is not None:
                await self.metrics_server.stop()
        logger.info("event=worker_stopped worker=%s", self.config.worker_id)

    def _observe_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        self.metrics.observe_step(scheduler_output.total_num_scheduled_tokens, seconds)

    def _load(self) -> int:
        self.worker.load_model()
        num_blocks = self.worker.initialize_kv_cache()
        self.kv_cache_id = uuid.uuid4().hex
        return num_blocks

    async def _start_health_server(self) -> grpc.aio.Server | None:
        if self.config.health_port is None:
            return None
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.health_port = server.add_insecure_port(f"{self.config.health_host}:{self.config.health_port}")
        for service in ("", LIVENESS_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        return server

    # ------------------------------------------------------------ scheduler

    async def _serve(self) -> None:
        """Registers and serves steps; dials again whenever the scheduler goes away.

        A lost scheduler is dialed again (with backoff) until the worker has
        gone ``rejoin_grace_s`` without registering there; then it chooses
        again (with one target: that one). A rebalance moves it directly.
        """
        backoff_s = _MIN_BACKOFF_S
        try:
            target, num_targets = await self._choose_target()
            unregistered_since = time.monotonic()
            while True:
                rejoin_deadline = (unregistered_since + self.config.rejoin_grace_s
                                   if num_targets > 1 else None)
                ended = await self._session(target, rejoin_deadline)
                if ended is None:
                    return  # drained or stopped
                await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await self._forget_requests()
                if isinstance(ended, SchedulerTarget):  # rebalanced: join at once
                    target, backoff_s = ended, _MIN_BACKOFF_S
                    unregistered_since = time.monotonic()
                    continue
                if ended:
                    unregistered_since = time.monotonic()
                backoff_s = _MIN_BACKOFF_S if ended else min(backoff_s * 2, _MAX_BACKOFF_S)
                await self._until_stopped(asyncio.sleep(backoff_s))
                if time.monotonic() >= unregistered_since + self.config.rejoin_grace_s:
                    target, num_targets = await self._choose_target()
                    unregistered_since = time.monotonic()
        except _Stopped:
            return

    async def _choose_target(self) -> tuple[SchedulerTarget, int]:
        """The scheduler to join and the number of targets there are now.

        One target is returned as it is. Of several, the live cell with the
        fewest workers (``cell_choice.choose_cell``); while none answers it
        asks again, up to ``connect_timeout_s`` (then TimeoutError).
        """
        timeout_s = self.config.connect_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            targets = await self._until_stopped(self._resolve())
            if len(targets) == 1:
                return targets[0], 1
            metadata = secret_metadata(self.config.cluster_secret)
            stats = await self._until_stopped(probe_cells(self._channels, targets, metadata))
            address = choose_cell(self.config.worker_id, num_workers_of(targets, stats))
            if address is not None:
                return next(t for t in targets if t.address == address), len(targets)
            addresses = ",".join(t.address for t in targets)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no scheduler of {addresses} answered within "
                                   f"connect_timeout_s={timeout_s}")
            logger.warning("event=no_live_cell worker=%s schedulers=%s", self.config.worker_id,
                           addresses)
            await self._until_stopped(asyncio.sleep(_MIN_BACKOFF_S))

    async def _resolve(self, keep: SchedulerTarget | None = None) -> list[SchedulerTarget]:
        """The scheduler targets now (DNS runs on a thread); closes the channels
        to targets gone from the list, except ``keep``'s."""
        targets = await asyncio.to_thread(resolve_scheduler_targets, self._scheduler_addresses)
        await self._channels.retain([*targets, *((keep,) if keep is not None else ())])
        return targets

    async def _next_move(self, current: SchedulerTarget) -> SchedulerTarget:
        """Returns the cell to move to once a rebalance check says so (never with one target).

        Checks every ``rebalance_interval_s``, jittered by +-50% so that workers
        do not check together; the rule is ``cell_choice.rebalance_target``,
        and a worker holding a request does not ask. The stats it decides on
        may be stale by the time the scheduler reads the request, so the
        scheduler has the last word (``Coordinator.request_leave``).
        """
        while True:
            await asyncio.sleep(self.config.rebalance_interval_s * random.uniform(0.5, 1.5))
            targets = await self._resolve(keep=current)
            if len(targets) < 2:
                continue
            stats = await probe_cells(self._channels, targets,
                                      secret_metadata(self.config.cluster_secret))
            if current.address not in stats:
                continue
            address = rebalance_target(self.config.worker_id, current.address,
                                       num_workers_of(targets, stats),
                                       idle_workers_of(stats[current.address]))
            if address is not None and not self._holds_requests():
                return next(t for t in targets if t.address == address)

    def _holds_requests(self) -> bool:
        runner = self.worker.model_runner
        return runner is not None and bool(runner.requests)

    async def _session(self, target: SchedulerTarget,
                       rejoin_deadline: float | None) -> bool | SchedulerTarget | None:
        """One WorkerStream to ``target``. None: leave for good (Drain or stop); a
        target: rebalanced, join that one; else whether it had registered.

        With a ``rejoin_deadline`` (several targets), a registration still
        unanswered then ends the session as not registered. Steps go to the
        pipeline as they arrive (with asynchronous scheduling the next one
        comes while this one computes, and is prepared meanwhile); a writer
        task sends their outputs back in order.
        """
        metadata = ((KV_CACHE_ID_METADATA_KEY, self.kv_cache_id),
                    *secret_metadata(self.config.cluster_secret))
        stub = scheduler_pb2_grpc.EngineCoreStub(self._channels.get(target))
        call = stub.WorkerStream(metadata=metadata, wait_for_ready=True)
        assert self._stop_waiter is not None and self.pipeline is not None, "only inside run()"
        # Cancelling a pending read would cancel the whole call, so on stop()
        # the read stays pending and _close finishes it after half-closing.
        pending_read: asyncio.Future | None = None
        outputs: asyncio.Queue[_Outgoing] = asyncio.Queue()
        writer: asyncio.Future[None] | None = None
        move: asyncio.Future[SchedulerTarget] | None = None
        leaving_for: SchedulerTarget | None = None  # asked to leave for it, not answered yet
        registered = False
        try:
            if not await self._register_within(call, target, rejoin_deadline):
                return False
            registered = True
            writer = asyncio.ensure_future(_write_outputs(call, outputs))
            if self.config.rebalance_interval_s > 0:
                move = asyncio.ensure_future(self._next_move(target))
            await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            while True:
                if pending_read is None:
                    pending_read = asyncio.ensure_future(_read_step(call))
                await asyncio.wait((pending_read, self._stop_waiter, writer,
                                    *((move,) if move is not None else ())),
                                   return_when=asyncio.FIRST_COMPLETED)
                if writer.done():
                    writer.result()  # raises what ended it
                if self._stop_waiter.done():
                    # stop(): leave once the steps already running are answered,
                    # without the next one even when it is already here.
                    await _finish_writing(outputs, writer)
                    return None
                if move is not None and move.done():
                    # The scheduler decides: it lets the requests placed here
                    # meanwhile finish, then drains this worker, or it refuses.
                    leaving_for, move = move.result(), None
                    outputs.put_nowait(LeaveRequest())
                    continue
                message, pending_read = pending_read.result(), None
                if isinstance(message, LeaveRefused):
                    logger.info("event=worker_leave_refused worker=%s scheduler=%s reason=%r",
                                self.config.worker_id, target.address, message.reason)
                    leaving_for, move = None, asyncio.ensure_future(self._next_move(target))
                    continue
                if isinstance(message, Drain):
                    await _finish_writing(outputs, writer)
                    # A shutdown's Drain may cross our LeaveRequest (whose
                    # refusal then comes after it): only a grant moves us.
                    if message.leave_granted and leaving_for is not None:
                        logger.info("event=worker_rebalanced worker=%s from=%s to=%s",
                                    self.config.worker_id, target.address, leaving_for.address)
                        return leaving_for
                    logger.info("event=worker_drained worker=%s scheduler=%s",
                                self.config.worker_id, target.address)
                    return None
                self.dirty_blocks.record(message)
                outputs.put_nowait(asyncio.wrap_future(self.pipeline.submit(message)))
        except _Stopped:
            return None
        except _SchedulerLost as e:
            logger.warning("event=scheduler_lost worker=%s scheduler=%s reason=%r",
                           self.config.worker_id, target.address, str(e))
            return registered
        except grpc.aio.AioRpcError as e:
            if e.code() not in _RETRYABLE_CODES:
                raise
            logger.warning("event=scheduler_lost worker=%s scheduler=%s status=%s details=%r",
                           self.config.worker_id, target.address, e.code().name, e.details())
            return registered
        finally:
            if move is not None and not move.done():
                move.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await move
            if writer is not None and not writer.done():
                # The session ended early: its outputs go nowhere. The pipeline
                # still runs its steps, before any step submitted later.
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, _SchedulerLost):
                    await writer
            if registered:
                await _close(call, pending_read)
            else:  # never got through: nothing to close cleanly
                call.cancel()

    async def _register_within(self, call: grpc.aio.StreamStreamCall, target: SchedulerTarget,
                               rejoin_deadline: float | None) -> bool:
        """Registers over ``call``; False when ``rejoin_deadline`` passed first.

        TimeoutError past ``connect_timeout_s``; _Stopped on stop().
        """
        timeout_s = self.config.connect_timeout_s
        grace_s = (None if rejoin_deadline is None
                   else max(rejoin_deadline - time.monotonic(), _MIN_REGISTER_WAIT_S))
        register = self._register(call, target)
        if grace_s is None or (timeout_s is not None and timeout_s <= grace_s):
            await self._until_stopped(register, timeout_s, target.address)
            return True
        try:
            await self._until_stopped(register, grace_s, target.address)
        except TimeoutError:
            logger.warning("event=scheduler_unanswered worker=%s scheduler=%s "
                           "rejoin_grace_s=%s", self.config.worker_id, target.address,
                           self.config.rejoin_grace_s)
            return False
        return True

    async def _register(self, call: grpc.aio.StreamStreamCall, target: SchedulerTarget) -> None:
        registration = dataclasses.replace(self.worker.registration_info(self.config.worker_id),
                                           dirty_block_ids=self.dirty_blocks.dirty_block_ids())
        await call.write(registration_message(registration))
        ack = await call.read()
        if ack is grpc.aio.EOF:
            raise _SchedulerLost("the scheduler ended the stream before acknowledging")
        self.engine_index = registration_ack_from_proto(ack)
        self.dirty_blocks.start_registration()
        logger.info("event=worker_registered worker=%s scheduler=%s engine_index=%d",
                    self.config.worker_id, target.address, self.engine_index)

    async def _until_stopped(self, awaitable: Awaitable[T], timeout_s: float | None = None,
                             address: str = "") -> T:
        """Awaits ``awaitable`` unless stop() comes first (then raises _Stopped);
        TimeoutError naming the scheduler at ``address`` after ``timeout_s``."""
        assert self._stop_waiter is not None, "only inside run()"
        task = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait((task, self._stop_waiter), timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        if self._stop_waiter in done:
            raise _Stopped
        raise TimeoutError(f"scheduler at {address} did not answer "
                           f"within connect_timeout_s={timeout_s}")

    async def _forget_requests(self) -> None:
        """Drops every request the lost scheduler placed here; the KV memory stays.

        The next scheduler knows none of them, so a step that lists them all as
        finished is the worker's own way to clear its persistent batch.
        """
        runner = self.worker.model_runner
        if runner is not None and runner.requests and self.pipeline is not None:
            step = SchedulerOutput(finished_req_ids=set(runner.requests))
            await asyncio.wrap_future(self.pipeline.submit(step))


async def _close(call: grpc.aio.StreamStreamCall, pending_read: asyncio.Future | None) -> None:
    """Half-closes our side so the scheduler sees a clean end, then lets go of the call."""
    try:
        if not call.done():
            await call.done_writing()
            # The call only completes once every message sent to us was read.
            await asyncio.wait_for(_read_to_end(call, pending_read), _CLOSE_TIMEOUT_S)
    except (TimeoutError, grpc.aio.AioRpcError):
        pass
    finally:
        call.cancel()


async def _write_outputs(call: grpc.aio.StreamStreamCall, outputs: asyncio.Queue[_Outgoing]) -> None:
    """Sends each step's output as its future completes, and each LeaveRequest, in
    order, until None."""
    while (item := await outputs.get()) is not None:
        message = (leave_message() if isinstance(item, LeaveRequest)
                   else runner_output_message(await item))
        try:
            await call.write(message)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError) as e:
            # The scheduler ended the RPC while the step ran (with the next
            # read pending, grpc reports it as a failed write).
            raise _SchedulerLost(f"the stream finished during a step: {e!r}") from e


async def _finish_writing(outputs: asyncio.Queue[_Outgoing], writer: asyncio.Future[None]) -> None:
    """Lets the writer send what is queued, then waits for it to end."""
    outputs.put_nowait(None)
    await writer


async def _read_step(call: grpc.aio.StreamStreamCall) -> SchedulerOutput | LeaveRefused | Drain:
    """The scheduler's next step, refusal of a leave or drain; _SchedulerLost when
    the stream ends."""
    message = await call.read()
    if message is grpc.aio.EOF:
        raise _SchedulerLost("the scheduler ended the stream")
    return scheduler_message_from_proto(message)


async def _read_to_end(call: grpc.aio.StreamStreamCall, pending_read: asyncio.Future | None) -> None:
    if pending_read is not None:
        try:
            await pending_read
        except _SchedulerLost:
            return  # EOF
    while await call.read() is not grpc.aio.EOF:
        pass


async def run_worker(config: WorkerServiceConfig) -> None:
    """Runs a worker until the scheduler drains it; SIGTERM/SIGINT stop it cleanly
    (when called from the main thread)."""
    service = WorkerService(config)
    loop = asyncio.get_running_loop()
    signals = SHUTDOWN_SIGNALS
    try:
        for sig in signals:
            loop.add_signal_handler(sig, service.stop)
    except (RuntimeError, ValueError):  # not the main thread: the caller stops us
        signals = ()
    try:
        await service.run()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


# ---------------------------------------------------------------- command line


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def parse_args(argv: list[str] | None = None) -> tuple[WorkerServiceConfig, argparse.Namespace]:
    d = WorkerConfig()
    service_defaults = WorkerServiceConfig(worker_id="-", worker=d)
    p = argparse.ArgumentParser(prog="python -m services.worker.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler-address", default=service_defaults.scheduler_address,
                   help="HOST:PORT[,HOST:PORT...] or a DNS name with one address per "
                        "scheduler (cell); default: %(default)s")
    p.add_argument("--worker-id", default=None, help="default: hostname-pid")
    p.add_argument("--health-host", default="127.0.0.1")
    p.add_argument("--health-port", type=int, default=None, help="0 picks a free port")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on --health-host at this port "
                        "(0: a free one; default: off)")
    p.add_argument("--connect-timeout-s", type=float, default=None, help="default: wait forever")
    p.add_argument("--rejoin-grace-s", type=float, default=service_defaults.rejoin_grace_s,
                   help="with several schedulers: how long a lost one is dialed again before "
                        "joining another cell (default: %(default)s)")
    p.add_argument("--rebalance-interval-s", type=float,
                   default=service_defaults.rebalance_interval_s,
                   help="with several schedulers: how often (+-50%%) an idle worker checks "
                        "whether to move to a cell with 2 fewer workers; 0: never "
                        "(default: %(default)s)")
    p.add_argument("--model", default=d.model, help="HF directory or .gguf; default SmolLM2")
    p.add_argument("--dtype", default=d.dtype,
                   help="auto (default: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32; "
                        "the checkpoint's dtype on cuda), float32, bfloat16, float16")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   help="auto (the model's dtype), float32, bfloat16, float16")
    p.add_argument("--quantization", default=d.quantization, choices=["int8", "w8a8", "gguf"],
                   help="int8: weight-only int8 linear layers and LM head (CPU); w8a8: the "
                        "same with decode activations quantized to int8 per token (CPU, "
                        "AVX512-VNNI where there is one); gguf: a "
                        "GGUF model's own Q4_0/Q4_1/Q8_0 blocks, not dequantized (CPU)")
    p.add_argument("--compile-pieces", action=argparse.BooleanOptionalAction,
                   default=d.compile_pieces,
                   help="torch.compile the model between attention calls (default: on for cpu)")
    p.add_argument("--compile-cache-dir", default=d.compile_cache_dir,
                   help="where compiled artefacts persist (default: <kvmesh cache>/inductor)")
    p.add_argument("--device", default=d.device)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    SchedulingLimits.add_cli_args(p)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--logits-processors", nargs="*", default=[])
    p.add_argument("--think-start-token-ids", type=int, nargs="+", default=None)
    p.add_argument("--think-end-token-ids", type=int, nargs="+", default=None)
    p.add_argument("--num-threads", type=int, default=d.num_threads)
    p.add_argument("--cudagraph-mode", default=d.cudagraph_mode,
                   help="NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE; "
                        "default FULL_AND_PIECEWISE on cuda, NONE on cpu")
    p.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=d.cudagraph_capture_sizes)
    p.add_argument("--max-cudagraph-capture-size", type=int, default=d.max_cudagraph_capture_size)
    latency = LatencyModel()
    p.add_argument("--simulate", action="store_true",
                   help="no model: each step waits as the latency model says and samples "
                        "deterministic tokens (a control-plane measurement tool)")
    p.add_argument("--simulate-base-ms", type=float, default=latency.base_ms,
                   help="simulated step time before per-token costs (default: the real "
                        "worker's decode step on an H200, SmolLM2 bfloat16)")
    p.add_argument("--simulate-us-per-token", type=float, default=latency.us_per_token)
    p.add_argument("--simulate-us-per-context-token", type=float,
                   default=latency.us_per_context_token)
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 5}\' (default: off)')
    p.add_argument("--log-level", default="INFO")
    add_security_args(p)
    args = p.parse_args(argv)
    simulate = None
    if args.simulate:
        simulate = LatencyModel(args.simulate_base_ms, args.simulate_us_per_token,
                                args.simulate_us_per_context_token)
    thinking = None
    if args.think_start_token_ids or args.think_end_token_ids:
        thinking = ThinkingConfig(tuple(args.think_start_token_ids or ()),
                                  tuple(args.think_end_token_ids or ()))
    worker = WorkerConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        compile_pieces=args.compile_pieces,
        compile_cache_dir=args.compile_cache_dir,
        device=args.device,
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        limits=SchedulingLimits.from_cli_args(args),
        max_model_len=args.max_model_len,
        logits_processors=args.logits_processors,
        thinking=thinking,
        num_threads=args.num_threads,
        cudagraph_mode=args.cudagraph_mode,
        cudagraph_capture_sizes=args.cudagraph_capture_sizes,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        simulate=simulate,
        speculative_config=args.speculative_config,
    )
    config = WorkerServiceConfig(
        scheduler_address=args.scheduler_address,
        worker_id=args.worker_id or default_worker_id(),
        worker=worker,
        health_host=args.health_host,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        connect_timeout_s=args.connect_timeout_s,
        rejoin_grace_s=args.rejoin_grace_s,
        rebalance_interval_s=args.rebalance_interval_s,
        tls=tls_from_args(args),
        cluster_secret=read_cluster_secret(args.cluster_secret_file),
    )
    return config, args


def main(argv: list[str] | None = None) -> None:
    config, args = parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(run_worker(config))


if __name__ == "__main__":
    main()
