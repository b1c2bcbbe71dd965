"""Asynchronous scheduling: two steps in flight, placeholders, late stops, KV safety.

The real Scheduler drives the real simulated worker with up to two steps in
flight: the worker computes each step when it is sent, in order, and the
scheduler sees its output one step later, as over the wire. A shadow of the
worker's KV cache replays every step in the same order: each computed
position writes the identity of its token prefix into its slot, and every
position a step attends to must hold its own request's prefix. A block
reused while a step in flight still writes it, a prefix hit on KV that was
never written, or a wrong position would all read someone else's KV.
"""

from __future__ import annotations

import copy
import random
from collections import deque

import pytest

from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.invariants import check_invariants
from services.scheduler.kv_store import InMemoryKVStore
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.worker.config import LatencyModel
from services.worker.worker import Worker
from tests.worker.helpers import BLOCK_SIZE, VOCAB_SIZE, make_worker, save_tiny_model

LIMITS = SchedulingLimits(max_num_seqs=12, max_num_batched_tokens=48)


class ShadowKV:
    """The worker's token lists, block tables and KV slots, replayed step by step."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> prefix identity
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}

    def _slot(self, req_id: str, position: int) -> tuple[int, int]:
        return self.blocks[req_id][position // BLOCK_SIZE], position % BLOCK_SIZE

    def run(self, step: SchedulerOutput, output: ModelRunnerOutput) -> None:
        for req_id in step.finished_req_ids:
            self.tokens.pop(req_id, None)
        starts: dict[str, int] = {}
        for new in step.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            starts[new.req_id] = new.num_computed_tokens
        cached = step.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                self.blocks[req_id] = list(cached.new_block_ids[i])
            else:
                self.blocks[req_id].extend(cached.new_block_ids[i])
            starts[req_id] = cached.num_computed_tokens[i]
        for req_id, num_tokens in step.num_scheduled_tokens.items():
            tokens, start = self.tokens[req_id], starts[req_id]
            assert start + num_tokens <= len(tokens), f"{req_id}: computes an unknown token"
            for position in range(start):
                assert self.slots.get(self._slot(req_id, position)) == hash(
                    tuple(tokens[:position + 1])), f"{req_id} reads foreign KV at {position}"
            for position in range(start, start + num_tokens):
                self.slots[self._slot(req_id, position)] = hash(tuple(tokens[:position + 1]))
        for req_id, sampled in zip(output.req_ids, output.sampled_token_ids):
            self.tokens[req_id].extend(sampled)

    def check_stored_blocks_written(self, scheduler: Scheduler) -> None:
        """Every block the KV mirror indexes holds the KV of its tokens."""
        stored = scheduler.kv_cache_manager.store.load()
        for block_ids in stored.cached.values():
            for block_id in block_ids:
                for offset in range(BLOCK_SIZE):
                    assert (block_id, offset) in self.slots, f"block {block_id} stored unwritten"


class PipelinedEngine:
    """A Scheduler and a Worker with up to ``depth`` steps in flight (the session's loop)."""

    def __init__(self, worker: Worker, depth: int) -> None:
        self.depth = depth
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.max_in_flight = 0
        self._attach(worker)

    def _attach(self, worker: Worker) -> None:
        """A fresh scheduler for ``worker``'s pool and a shadow of its empty KV."""
        options = SchedulingOptions(limits=LIMITS, async_scheduling=self.depth > 1)
        config = make_scheduler_config(options, worker.registration_info(), engine_index=0)
        self.scheduler = Scheduler(config, InMemoryKVStore())
        self.worker = worker
        self.shadow = ShadowKV()

    def add(self, request: EngineCoreRequest | Request) -> None:
        self.tokens.setdefault(request.request_id, [])
        self.scheduler.add_request(request)

    def step(self) -> None:
        scheduler = self.scheduler
        while len(self.in_flight) < self.depth and scheduler.has_requests():
            step = scheduler.schedule()
            if not (step.total_num_scheduled_tokens or step.finished_req_ids):
                break
            output = self.worker.execute_model(step)  # computed now, seen later
            self.in_flight.append((step, output))
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        if not self.in_flight:
            step = scheduler.schedule()
            self._apply(step, ModelRunnerOutput(step_id=step.step_id))
            return
        self._apply(*self.in_flight.popleft())

    def _apply(self, step: SchedulerOutput, output: ModelRunnerOutput) -> None:
        # The shadow replays steps in the worker's order, once they are answered:
        # the store must name only blocks written by steps answered so far.
        self.shadow.run(step, output)
        for outputs in self.scheduler.update_from_output(step, output).values():
            for out in outputs.outputs:
                self.tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    self.finished.add(out.request_id)
        check_invariants(self.scheduler)
        self.shadow.check_stored_blocks_written(self.scheduler)

    def lose_worker(self, worker: Worker) -> None:
        """The worker is gone with its steps in flight: its requests are re-placed
        on a new one (a new scheduler, as the coordinator builds) with their tokens."""
        orphans = sorted(self.scheduler.requests.values())
        self.in_flight.clear()
        self._attach(worker)
        for old in orphans:
            self.scheduler.add_request(Request.from_engine_core_request(
                old, self.scheduler.block_hasher))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def simulated_worker(model_dir, num_kv_blocks: int) -> Worker:
    return make_worker(model_dir, simulate=LatencyModel(0.0, 0.0, 0.0),
                       num_kv_blocks=num_kv_blocks, limits=LIMITS)


def random_workload(seed: int, num: int) -> list[EngineCoreRequest]:
    """Shared prefixes (prefix hits), a few stop token ids (stops found a step
    late), varied lengths (chunked prefill)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB_SIZE) for _ in range(2 * BLOCK_SIZE)] for _ in range(3)]
    requests = []
    for i in range(num):
        prompt = rng.choice(prefixes)[:rng.randrange(0, 2 * BLOCK_SIZE)]
        prompt += [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True,
                                stop_token_ids=rng.sample(range(3, VOCAB_SIZE), 3))
        requests.append(EngineCoreRequest(f"r{i}", prompt, params, eos_token_id=2))
    return requests


def run(engine: PipelinedEngine, requests: list[EngineCoreRequest], seed: int,
        chaos: bool, make_worker_again=None) -> None:
    rng = random.Random(seed)
    pending = list(requests)
    step = 0
    while pending or engine.scheduler.has_requests() or engine.in_flight:
        while pending and rng.random() < 0.5:
            engine.add(pending.pop(0))
        if chaos and rng.random() < 0.05 and engine.scheduler.running:
            victim = rng.choice(engine.scheduler.running).request_id
            engine.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            engine.finished.add(victim)
        if chaos and make_worker_again is not None and step == 60:
            engine.lose_worker(make_worker_again())
        engine.step()
        step += 1
        assert step < 5000, "the workload does not finish"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_equals_sync_and_reads_only_its_own_kv(tiny_model_dir, seed):
    """A pool small enough to preempt; every request's tokens equal the
    synchronous run's, and the extra token of a late stop never shows."""
    requests = random_workload(seed, 40)
    runs = {}
    for depth in (1, 2):
        engine = PipelinedEngine(simulated_worker(tiny_model_dir, 24), depth)
        run(engine, copy.deepcopy(requests), seed, chaos=False)
        assert engine.max_in_flight == depth
        assert len(engine.finished) == len(requests)
        runs[depth] = engine
    assert runs[2].tokens == runs[1].tokens
    assert runs[2].scheduler.make_stats().num_preemptions > 0  # the pool was too small for all
    for request in requests:  # a stop token ends the output, nothing after it
        tokens = runs[2].tokens[request.request_id]
        stops = [i for i, t in enumerate(tokens) if t in request.sampling_params.stop_token_ids]
        assert stops in ([], [len(tokens) - 1])
        assert len(tokens) <= request.sampling_params.max_tokens


def test_async_with_aborts_preemptions_and_a_worker_loss(tiny_model_dir):
    requests = random_workload(7, 60)
    engine = PipelinedEngine(simulated_worker(tiny_model_dir, 24), depth=2)
    run(engine, requests, seed=7, chaos=True,
        make_worker_again=lambda: simulated_worker(tiny_model_dir, 24))
    assert engine.max_in_flight == 2
    assert engine.finished == {r.request_id for r in requests}
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1  # nothing leaked
