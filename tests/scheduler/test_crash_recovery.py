"""Crash-consistent prefix recovery, hundreds of times over.

One real worker (tiny Llama, its KV memory kept across scheduler deaths) and
a real valkey-server. Each round a fresh scheduler recovers the prefix index
from Redis, leaving out the blocks the worker reports dirty, and runs
requests that share prefixes in a pool small enough that cached blocks are
evicted and overwritten all the time. Rounds end by killing the scheduler
between ``schedule()`` and the worker's answer (the worker has written the
step's KV, the scheduler never learns), sometimes with Redis stopped for the
last steps so recent mirror writes are lost. Every request that finishes
must give transformers' greedy tokens, prefix hits or not.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal

import torch
from transformers import AutoModelForCausalLM

from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.redis_server import EmbeddedRedis
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_stores import WorkerStores
from services.worker.config import WorkerConfig
from services.worker.dirty_blocks import DirtyBlockLog
from services.worker.worker import Worker

NUM_ROUNDS = 200
MAX_TOKENS = 6
LIMITS = SchedulingLimits(max_num_seqs=4, max_num_batched_tokens=64)


def prompt_pool() -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 256) for _ in range(12)] for _ in range(3)]
    return [prefix + [rng.randrange(1, 256) for _ in range(rng.randrange(3, 10))]
            for prefix in prefixes for _ in range(3)]


def transformers_greedy(model_dir, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = {}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             pad_token_id=0)
        expected[tuple(prompt)] = out[0, len(prompt):].tolist()
    return expected


class Cluster:
    """The worker that survives, and whatever scheduler is alive."""

    def __init__(self, model_dir, redis_url: str) -> None:
        self.worker = Worker(WorkerConfig(model=str(model_dir), dtype="float32", block_size=4,
                                          num_kv_blocks=28, max_model_len=64, limits=LIMITS,
                                          num_threads=1))
        self.worker.load_model()
        self.worker.initialize_kv_cache()
        self.stores = WorkerStores(redis_url, timeout_s=0.1)  # stopped-Redis rounds stay short
        self.log = DirtyBlockLog()
        self.scheduler: Scheduler | None = None

    def start_scheduler(self) -> Scheduler:
        """What a restarted scheduler does when the worker registers again."""
        runner = self.worker.model_runner
        self.worker.execute_model(SchedulerOutput(finished_req_ids=set(runner.requests)))
        registration = dataclasses.replace(self.worker.registration_info("w0"),
                                           dirty_block_ids=self.log.dirty_block_ids())
        store = self.stores.open(registration.model, "w0", "kv-cache-1")
        config = make_scheduler_config(SchedulingOptions(limits=LIMITS), registration, 0)
        self.scheduler = Scheduler(config, store, registration.dirty_block_ids)
        self.log.start_registration()
        return self.scheduler

    def step(self, scheduler: Scheduler, crash: bool):
        output = scheduler.schedule()
        output.durable_step_id = scheduler.kv_cache_manager.store.durable_step_id
        self.log.record(output)
        runner_output = self.worker.execute_model(output)  # the KV is written
        if crash:
            return None
        runner_output.step_id = output.step_id
        return scheduler.update_from_output(output, runner_output)


def test_recovery_never_serves_overwritten_kv(model_dir):
    pool = prompt_pool()
    expected = transformers_greedy(model_dir, pool)
    rng = random.Random(1234)
    checked = num_hits = num_crashes = 0
    with EmbeddedRedis() as redis_server:
        cluster = Cluster(model_dir, redis_server.url)
        for round_index in range(NUM_ROUNDS):
            scheduler = cluster.start_scheduler()
            prompts: dict[str, list[int]] = {}
            tokens: dict[str, list[int]] = {}
            crash_at = rng.randrange(1, 12)
            stop_redis_for = rng.choice([0, 0, 0, 1, 3])  # lose the last mirror writes
            for step_index in range(crash_at + 1):
                while len(scheduler.requests) < 3:
                    req_id = f"{round_index}-{step_index}-{len(prompts)}"
                    prompts[req_id] = rng.choice(pool)
                    tokens[req_id] = []
                    scheduler.add_request(EngineCoreRequest(req_id, prompts[req_id], SamplingParams(
                        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)))
                if step_index == crash_at - stop_redis_for and stop_redis_for:
                    os.kill(redis_server.pid, signal.SIGSTOP)
                outputs = cluster.step(scheduler, crash=step_index == crash_at)
                for client_outputs in (outputs or {}).values():
                    for output in client_outputs.outputs:
                        tokens[output.request_id] += output.new_token_ids
                        if output.finished:
                            assert tokens[output.request_id] == expected[
                                tuple(prompts[output.request_id])], output.request_id
                            checked += 1
                            num_hits += output.num_cached_tokens > 0
            # The scheduler dies: what its writer has not written by now is lost.
            store = scheduler.kv_cache_manager.store
            store.close()
            if stop_redis_for:
                store.join(0.2)
                os.kill(redis_server.pid, signal.SIGCONT)
            num_crashes += 1
    assert num_crashes == NUM_ROUNDS
    assert checked > NUM_ROUNDS and num_hits > NUM_ROUNDS / 4  # hits after recoveries
