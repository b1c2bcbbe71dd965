"""One live stack for every HTTP test: scheduler, worker and two frontends over real
gRPC and HTTP on loopback, on one asyncio loop in a background thread.

The worker runs the tiny random Llama carrying SmolLM2's tokenizer. Frontend
``open`` has no API keys and SmolLM2's tool-aware chat template; frontend
``keyed`` has two tenants' keys and an admin key, and the model's own template.
The scheduler and the worker serve ``/metrics`` on ports of their own. Tests
that need the engine idle wait for it (``wait_idle``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from kvmesh.client import Client
from services.frontend.server import FrontendServer, serve_frontend
from services.scheduler.config import SchedulingOptions
from services.scheduler.server import SchedulerServer
from tests.e2e.tiny_model import save_tiny_llama
from tests.frontend.test_frontend_server import LoopThread, frontend_config, wait_for
from tests.grpc_utils import (
    LIMITS,
    RunningWorker,
    get_stats,
    start_scheduler,
    start_worker,
    wait_for_workers,
)

MAX_NUM_SEQS = 4
TENANT_KEYS = ("tenant-a", "tenant-b")
ADMIN_KEY = "admin-key"


@dataclass
class HttpStack:
    loop: LoopThread
    scheduler: SchedulerServer
    worker: RunningWorker
    frontend: FrontendServer  # no API keys
    keyed: FrontendServer  # TENANT_KEYS and ADMIN_KEY
    grpc: Client

    @property
    def url(self) -> str:
        return self.frontend.http.url

    @property
    def model(self) -> str:
        return self.frontend.servicer.model_info.name

    def openai(self, frontend: FrontendServer | None = None, api_key: str = "none"
               ) -> openai.OpenAI:
        """The official client; no retries, so a 429 or 503 shows as it is."""
        frontend = frontend or self.frontend
        return openai.OpenAI(base_url=f"{frontend.http.url}/v1", api_key=api_key,
                             max_retries=0, timeout=60)

    def stats(self):
        return self.loop.run(get_stats(self.scheduler.address))

    def idle(self) -> bool:
        (worker,) = self.stats().workers
        engines = (self.frontend.servicer.engine, self.keyed.servicer.engine)
        return (worker.num_free_blocks == worker.num_total_blocks
                and worker.num_running_reqs == worker.num_waiting_reqs == 0
                and all(e.num_unfinished_requests == 0 for e in engines))

    def wait_idle(self) -> None:
        wait_for(self.idle, timeout_s=20)


@pytest.fixture(scope="session")
def http_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-http"), default_model_dir)


@pytest.fixture(scope="session")
def http_stack(http_model_dir) -> Iterator[HttpStack]:
    loop = LoopThread()
    limits = dataclasses.replace(LIMITS, max_num_seqs=MAX_NUM_SEQS)

    async def start() -> tuple[SchedulerServer, RunningWorker, FrontendServer, FrontendServer]:
        scheduler = await start_scheduler(SchedulingOptions(limits=limits), metrics_port=0)
        worker = start_worker(scheduler.address, http_model_dir, "w0", metrics_port=0,
                              worker=dict(limits=limits))
        await wait_for_workers(scheduler.address, ["w0"])
        # SmolLM2's tokenizer: its tool-aware template (the default model's).
        frontend = await serve_frontend(frontend_config(http_model_dir, scheduler.address,
                                                        http_port=0,
                                                        chat_template="smollm2_tools"))
        keyed = await serve_frontend(frontend_config(
            http_model_dir, scheduler.address, http_port=0, api_keys=TENANT_KEYS,
            admin_api_keys=(ADMIN_KEY,)))
        for server in (frontend, keyed):
            await server.engine_core.wait_connected(10)
        return scheduler, worker, frontend, keyed

    scheduler, worker, frontend, keyed = loop.run(start())
    client = Client(frontend.address, timeout_s=30)
    yield HttpStack(loop, scheduler, worker, frontend, keyed, client)
    client.close()

    async def stop() -> None:
        await asyncio.gather(frontend.stop(1.0), keyed.stop(1.0))
        await scheduler.stop(1.0)  # drains the worker
        await asyncio.wait_for(worker.task, 10)

    loop.run(stop())
    loop.close()
