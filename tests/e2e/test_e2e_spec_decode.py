"""Speculative decoding across real processes: workers started with
``--speculative-config`` give over gRPC the tokens the in-process engine gives
without drafts, also when one of them is SIGKILLed with drafts in flight; the
scheduler's /metrics and GetStats count the drafts under vLLM's names.

The tiny random model rarely agrees with a draft, so these drafts are mostly
rejected: what is tested here is that drafting, rolling back and re-placing
across the wire change nothing. Acceptance is tested on the real model
(tests/offline/test_spec_decode.py) and on oracle drafts
(tests/worker/spec_decode/test_verification.py).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.client import Client
from kvmesh.cluster import LocalCluster
from kvmesh.offline import LLM, SamplingParams
from tests.e2e.helpers import (
    TINY_MAX_MODEL_LEN,
    TINY_MAX_NUM_SEQS,
    all_blocks_free,
    sigkill_a_busy_worker,
    tiny_cluster_config,
    wait_for,
)
from tests.e2e.test_e2e_cli import scrape

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
MAX_TOKENS = 48


def repetitive_prompts(seed: int, num: int) -> list[list[int]]:
    """A random phrase said four times, then a few words: prompt lookup always finds
    something to propose."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 8))] for _ in range(num)]
    return [p * 4 + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 6))] for p in phrases]


@pytest.fixture(scope="module")
def cluster(make_cluster, tiny_model_dir, tmp_path_factory) -> LocalCluster:
    config = tiny_cluster_config(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                                 num_workers=2, num_frontends=1)
    config.worker_args += ["--speculative-config", json.dumps(SPEC)]
    return make_cluster(config)


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs in process, without speculative decoding."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=TINY_MAX_MODEL_LEN,
              max_num_seqs=TINY_MAX_NUM_SEQS, num_kv_blocks=64, device="cpu")
    prompts = repetitive_prompts(0, 6) + repetitive_prompts(1, 16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs)}


def generate(client: Client, prompt: list[int], seen: list[bool] | None = None) -> list[int]:
    tokens: list[int] = []
    for chunk in client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                 ignore_eos=True):
        tokens += chunk.outputs[0].token_ids
        if seen is not None and len(tokens) >= 8:
            seen.append(True)
    return tokens


def test_over_grpc_the_tokens_of_decoding_without_drafts(cluster, expected):
    client = Client(cluster.frontend_addresses[0], timeout_s=60)
    prompts = repetitive_prompts(0, 6)
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda p: generate(client, p), prompts))
    assert got == [expected[tuple(p)] for p in prompts]
    workers = client.stats().workers
    assert sum(w.spec_num_drafts for w in workers) > 0
    assert all(len(w.spec_num_accepted_tokens_per_pos) == 4 for w in workers)
    metrics = scrape(cluster.metrics_urls()["scheduler"])
    assert metrics["vllm:spec_decode_num_drafts_total"] == sum(w.spec_num_drafts for w in workers)
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    client.close()


def test_sigkill_a_worker_with_drafts_in_flight_keeps_every_output(cluster, expected):
    client = Client(cluster.frontend_addresses[0], timeout_s=60)
    prompts = repetitive_prompts(1, 16)
    seen: list[bool] = []
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(generate, client, p, seen) for p in prompts]
        wait_for(lambda: bool(seen), timeout_s=60, what="8 tokens streamed")
        sigkill_a_busy_worker(cluster, client)
        got = [f.result(timeout=180) for f in futures]
    assert got == [expected[tuple(p)] for p in prompts]
    wait_for(lambda: all_blocks_free(client), what="blocks freed")
    client.close()
