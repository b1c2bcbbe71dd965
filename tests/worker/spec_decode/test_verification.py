"""Speculative decoding changes no output: the real Scheduler and Worker (tiny random
Llama, float32), one or two steps in flight, against the same run without drafts.

A random model never repeats its prompt, so the drafts here come from an
oracle that knows each request's output from the run without speculation and
corrupts some of its drafts at a random position: every path of verification
(all accepted with a bonus token, a correction after k accepted, nothing
accepted) is taken many times. Prompt lookup itself is tested in
test_ngram_proposer.py and on the real model in tests/offline/test_spec_decode.py.
The workload has chunked prefills, stop tokens and max_tokens that fall inside
accepted runs, a pool small enough to preempt requests with drafts in flight,
penalties, logprobs and seeded sampling; one run loses its worker halfway.
"""

from __future__ import annotations

import copy
import random
from collections import deque

import numpy as np
import pytest

from services.common.engine import EngineCoreRequest, Logprobs
from services.common.limits import SchedulingLimits
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.common.speculative import SpeculativeConfig
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.invariants import check_invariants
from services.scheduler.kv_store import InMemoryKVStore
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.worker import Worker
from tests.cuda import CUDA_MARKS
from tests.worker.helpers import VOCAB_SIZE, make_worker, save_tiny_model

LIMITS = SchedulingLimits(max_num_seqs=8, max_num_batched_tokens=48)
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                         disable_by_batch_size=0)
NUM_BLOCKS = 24  # small enough that the workload preempts


class Engine:
    """A Scheduler and a Worker with up to ``depth`` steps in flight (as the session runs them)."""

    def __init__(self, worker: Worker, depth: int) -> None:
        self.depth = depth
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, Logprobs] = {}
        self.attach(worker)

    def attach(self, worker: Worker) -> None:
        options = SchedulingOptions(limits=LIMITS, async_scheduling=self.depth > 1)
        config = make_scheduler_config(options, worker.registration_info(), engine_index=0)
        self.scheduler = Scheduler(config, InMemoryKVStore())
        self.worker = worker

    def add(self, request: EngineCoreRequest) -> None:
        self.tokens[request.request_id] = []
        self.scheduler.add_request(request)

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self.in_flight)

    def step(self) -> None:
        while len(self.in_flight) < self.depth and self.scheduler.has_requests():
            step = self.scheduler.schedule()
            if not (step.total_num_scheduled_tokens or step.finished_req_ids):
                break
            self.in_flight.append((step, self.worker.execute_model(step)))
        if not self.in_flight:
            step = self.scheduler.schedule()
            self.apply(step, ModelRunnerOutput(step_id=step.step_id))
            return
        self.apply(*self.in_flight.popleft())

    def apply(self, step: SchedulerOutput, output: ModelRunnerOutput) -> None:
        for outputs in self.scheduler.update_from_output(step, output).values():
            for out in outputs.outputs:
                assert not out.status_code, out.finish_message
                self.tokens[out.request_id].extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    self.logprobs.setdefault(out.request_id, Logprobs()).extend(out.new_logprobs)
        check_invariants(self.scheduler)

    def lose_worker(self, worker: Worker) -> None:
        """The worker is gone with its steps in flight: a new one takes its requests."""
        orphans = sorted(self.scheduler.requests.values())
        self.in_flight.clear()
        self.attach(worker)
        for old in orphans:
            self.scheduler.add_request(Request.from_engine_core_request(
                old, self.scheduler.block_hasher))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def workload(seed: int, num: int, sampled: bool = False) -> list[EngineCoreRequest]:
    """Varied prompt lengths (chunked past 48 tokens), stop tokens, max_tokens, and
    with ``sampled`` seeded random sampling with penalties and logprobs."""
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, 70))]
        params = dict(temperature=0.0, max_tokens=rng.randrange(1, 48), ignore_eos=True,
                      stop_token_ids=rng.sample(range(3, VOCAB_SIZE), 2))
        if sampled:
            params.update(temperature=1.0, seed=rng.randrange(1 << 30), top_k=40, top_p=0.9,
                          presence_penalty=0.5, repetition_penalty=1.2, logprobs=3)
        requests.append(EngineCoreRequest(f"r{i}", prompt, SamplingParams(**params),
                                          eos_token_id=2))
    return requests


def oracle(reference: dict[str, tuple[list[int], list[int]]], seed: int, corrupt: float):
    """Drafts from the outputs of a run without speculation; with probability
    ``corrupt`` one draft, at a random position, is wrong."""
    rng = random.Random(seed)
    sequences = [prompt + output for prompt, output in reference.values()]

    def propose(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
        tokens = token_ids.tolist()
        for sequence in sequences:
            if sequence[: len(tokens)] == tokens:
                drafts = sequence[len(tokens) : len(tokens) + k]
                if drafts and rng.random() < corrupt:
                    j = rng.randrange(len(drafts))
                    drafts[j] = (drafts[j] + 1) % VOCAB_SIZE
                return drafts
        return []

    return propose


def run(model_dir, requests, depth: int, spec: SpeculativeConfig | None = None, proposer=None,
        lose_worker_at: int | None = None, device: str = "cpu") -> Engine:
    def new_worker() -> Worker:
        worker = make_worker(model_dir, num_kv_blocks=NUM_BLOCKS, limits=LIMITS,
                             speculative_config=spec, device=device)
        if proposer is not None:
            worker.model_runner.drafter.proposer = proposer
            worker.model_runner.drafter.step_costs = None  # verify every draft offered
        return worker

    engine = Engine(new_worker(), depth)
    pending = copy.deepcopy(requests)
    rng = random.Random(depth)
    step = 0
    while pending or engine.busy():
        while pending and rng.random() < 0.5:
            engine.add(pending.pop(0))
        if step == lose_worker_at:
            engine.lose_worker(new_worker())
        engine.step()
        step += 1
        assert step < 3000, "the workload does not finish"
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1  # no block leaked
    return engine


def references(engine: Engine, requests) -> dict[str, tuple[list[int], list[int]]]:
    return {r.request_id: (list(r.prompt_token_ids), engine.tokens[r.request_id])
            for r in requests}


CUDA = pytest.param("cuda", marks=CUDA_MARKS)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_outputs_equal_without_speculation(model_dir, depth, device):
    """On CUDA with its default graphs: FULL for plain decodes, PIECEWISE around the
    multi-query attention of verification steps."""
    requests = workload(seed=depth, num=24)
    base = run(model_dir, requests, depth, device=device)
    engine = run(model_dir, requests, depth, SPEC, oracle(references(base, requests), 0, 0.4),
                 device=device)
    assert engine.tokens == base.tokens
    stats = engine.scheduler.make_stats()
    spec = stats.spec_decoding
    assert stats.num_preemptions > 0
    # Every kind of verification happened: full acceptance, corrections, nothing accepted.
    assert spec.num_accepted_tokens_per_pos[-1] > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for request in requests:  # stops and max_tokens inside accepted runs end the output
        tokens = engine.tokens[request.request_id]
        stops = [i for i, t in enumerate(tokens) if t in request.sampling_params.stop_token_ids]
        assert stops in ([], [len(tokens) - 1])
        assert len(tokens) <= request.sampling_params.max_tokens


def test_drafts_never_accepted_change_nothing(model_dir):
    rng = np.random.default_rng(0)

    def wrong(token_ids, min_n, max_n, k):
        return rng.integers(3, VOCAB_SIZE, size=k).tolist()

    requests = workload(seed=5, num=16)
    base = run(model_dir, requests, 2)
    engine = run(model_dir, requests, 2, SPEC, wrong)
    assert engine.tokens == base.tokens
    spec = engine.scheduler.make_stats().spec_decoding
    assert spec.num_draft_tokens > 200 and spec.num_accepted_tokens < spec.num_draft_tokens / 20


@pytest.mark.parametrize("depth", [1, 2])
def test_seeded_sampling_and_logprobs_equal_without_speculation(model_dir, depth):
    """Each position is sampled as without drafts, its generator at the same output index."""
    requests = workload(seed=10 + depth, num=16, sampled=True)
    base = run(model_dir, requests, depth)
    engine = run(model_dir, requests, depth, SPEC, oracle(references(base, requests), 1, 0.4))
    assert engine.tokens == base.tokens
    assert engine.scheduler.make_stats().spec_decoding.num_accepted_tokens > 50
    for req_id, tokens in base.tokens.items():
        got, want = engine.logprobs[req_id], base.logprobs[req_id]
        assert len(got) == len(tokens)  # one position per emitted token
        assert got.token_ids == want.token_ids and got.sampled_token_ranks == want.sampled_token_ranks
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)


def test_worker_lost_with_drafts_in_flight(model_dir):
    requests = workload(seed=20, num=16)
    base = run(model_dir, requests, 2)
    proposer = oracle(references(base, requests), 2, 0.3)
    engine = run(model_dir, requests, 2, SPEC, proposer, lose_worker_at=25)
    assert engine.tokens == base.tokens
