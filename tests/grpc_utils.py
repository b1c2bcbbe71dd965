"""Helpers for tests that run the scheduler and worker services in-process over real gRPC.

Servers listen on free loopback ports; workers run a tiny random-weight Llama
saved to a tmp dir; ``FrontendClient`` speaks the raw FrontendStream the way a
frontend does (EngineCoreRequests in, EngineCoreOutputs out).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.offline import EngineCore
from kvmesh.v1 import api_pb2, scheduler_pb2_grpc
from services.common.convert import (
    abort_message,
    add_request_message,
    engine_core_output_from_proto,
)
from services.common.engine import EngineCoreOutput, EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulerServiceConfig, SchedulingOptions
from services.scheduler.server import SchedulerServer, serve_scheduler
from services.worker.config import WorkerConfig, WorkerServiceConfig
from services.worker.server import WorkerService

VOCAB_SIZE = 256
NUM_KV_BLOCKS = 64  # including the null block
MAX_MODEL_LEN = 256
LIMITS = SchedulingLimits(max_num_seqs=16, max_num_batched_tokens=512)


def save_tiny_llama(path: Path) -> Path:
    """A 2-layer random Llama (fixed seed) with a wide greedy margin, saved as HF files."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        # Large weights keep the top-1 margin far above float32 rounding
        # differences between batch shapes (recompute after failover).
        initializer_range=0.25,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def worker_config(model_dir: Path, **overrides) -> WorkerConfig:
    """An in-process worker on the tiny checkpoint, eager unless overridden: these
    tests are about the services around it, and a cold compile would take longer
    than most of them (tests/worker/test_compilation.py and the e2e clusters run
    the compiled worker)."""
    fields = dict(model=str(model_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS,
                  max_model_len=MAX_MODEL_LEN, limits=LIMITS, num_threads=1,
                  compile_pieces=False)
    fields.update(overrides)
    return WorkerConfig(**fields)


def greedy_request(req_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, list(prompt), params, arrival_time=time.time())


def reference_tokens(model_dir: Path, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """The in-process engine core's result for ``requests`` (the oracle)."""
    engine_core = EngineCore.create(worker_config(model_dir), SchedulingOptions(limits=LIMITS))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine_core.add_request(request)
    while engine_core.has_requests():
        for output in engine_core.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    return tokens


async def start_scheduler(scheduling: SchedulingOptions | None = None,
                          **overrides) -> SchedulerServer:
    fields = dict(port=0, scheduling=scheduling or SchedulingOptions(limits=LIMITS))
    fields.update(overrides)
    return await serve_scheduler(SchedulerServiceConfig(**fields))


class RunningWorker:
    """A WorkerService running as a task of the test's event loop."""

    def __init__(self, config: WorkerServiceConfig) -> None:
        self.service = WorkerService(config)
        self.task = asyncio.create_task(self.service.run())

    async def stop(self, timeout_s: float = 10.0) -> None:
        """The SIGTERM path: leave after the step in flight."""
        self.service.stop()
        await asyncio.wait_for(self.task, timeout_s)

    async def kill(self) -> None:
        """Cuts the stream mid-whatever, like a crashed process."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def start_worker(address: str, model_dir: Path, worker_id: str, **overrides) -> RunningWorker:
    worker = worker_config(model_dir, **overrides.pop("worker", {}))
    return RunningWorker(WorkerServiceConfig(
        scheduler_address=address, worker_id=worker_id, worker=worker, **overrides))


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


async def get_stats(address: str) -> api_pb2.ClusterStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await scheduler_pb2_grpc.EngineCoreStub(channel).GetStats(api_pb2.GetStatsRequest())


async def wait_for_workers(address: str, worker_ids: list[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sorted(w.worker_id for w in (await get_stats(address)).workers) != sorted(worker_ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers {worker_ids} did not register")
        await asyncio.sleep(0.02)


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


async def reflection_services(address: str) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        await call.done_writing()
        return sorted(s.name for s in response.list_services_response.service)


class FrontendClient:
    """One FrontendStream, collecting every EngineCoreOutput per request id."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = scheduler_pb2_grpc.EngineCoreStub(self.channel).FrontendStream()
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.engine_indexes: dict[str, list[int]] = defaultdict(list)  # per output, in order
        self.finished: dict[str, EngineCoreOutput] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.call:
            for proto in message.outputs:
                output = engine_core_output_from_proto(proto)
                self.tokens[output.request_id].extend(output.new_token_ids)
                self.engine_indexes[output.request_id].append(message.engine_index)
                if output.finished:
                    self.finished[output.request_id] = output

    async def add(self, *requests: EngineCoreRequest) -> None:
        for request in requests:
            await self.call.write(add_request_message(request))

    async def abort(self, *request_ids: str) -> None:
        await self.call.write(abort_message(request_ids))

    async def wait_finished(self, *request_ids: str, timeout_s: float = 30.0) -> None:
        await wait_until(lambda: all(r in self.finished for r in request_ids), timeout_s)

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.channel.close()
