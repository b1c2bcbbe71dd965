"""Sampled outputs with speculative decoding have the distribution of those without.

The tiny random Llama (vocabulary 256) samples 5-token continuations of one
prompt, unseeded (torch's global generator seeded once per run, so the test is
deterministic), with and without drafts. The drafts are the greedy
continuation, so they are often accepted and often rejected: both branches of
the rejection rule shape the result. A chi-square test of homogeneity over the
continuations (rare ones pooled) must not reject at 0.001.

Power, shown rather than assumed: the same test, same sizes, run between the
run without drafts and one at temperature 0.5 instead of 0.4 must reject at
0.001 (it gives p ~ 1e-9, where the runs with and without drafts give p ~ 0.6).
"""

from __future__ import annotations

import collections

import pytest
import torch

from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.sampling_params import SamplingParams
from services.common.speculative import SpeculativeConfig
from tests.worker.helpers import make_scheduler, make_worker, save_tiny_model

NUM_SAMPLES = 1200
OUTPUT_LEN = 5
PROMPT = [17, 42, 99, 3, 150, 77, 8, 201]
LIMITS = SchedulingLimits(max_num_seqs=64, max_num_batched_tokens=512)
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=1,
                         disable_by_batch_size=0)
ALPHA = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def sample(model_dir, temperature: float, drafts: list[int] | None) -> collections.Counter:
    """NUM_SAMPLES continuations; with ``drafts``, each request drafts what is left of them."""
    worker = make_worker(model_dir, num_kv_blocks=256, limits=LIMITS,
                         speculative_config=SPEC if drafts is not None else None)
    if drafts is not None:
        def propose(token_ids, min_n, max_n, k):
            done = len(token_ids) - len(PROMPT)
            return drafts[done:done + k]
        worker.model_runner.drafter.proposer = propose
        worker.model_runner.drafter.step_costs = None  # verify every draft offered
    scheduler = make_scheduler(worker, limits=LIMITS)
    params = SamplingParams(temperature=temperature, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for i in range(NUM_SAMPLES):
        scheduler.add_request(EngineCoreRequest(f"s{i}", PROMPT, params, eos_token_id=2))
    torch.manual_seed(0)
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    while scheduler.has_requests():
        step = scheduler.schedule()
        result = worker.execute_model(step)
        for outs in scheduler.update_from_output(step, result).values():
            for out in outs.outputs:
                outputs[out.request_id] += out.new_token_ids
    stats = scheduler.make_stats().spec_decoding
    if drafts is not None:  # both outcomes of the rejection rule, many times
        assert stats.num_accepted_tokens > 300
        assert stats.num_draft_tokens - stats.num_accepted_tokens > 300
    return collections.Counter(tuple(tokens) for tokens in outputs.values())


def p_value(a: collections.Counter, b: collections.Counter) -> float:
    """Chi-square homogeneity over continuations, those seen < 10 times in all pooled."""
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    table = torch.tensor([[a[k] for k in keys] + [a.total() - sum(a[k] for k in keys)],
                          [b[k] for k in keys] + [b.total() - sum(b[k] for k in keys)]],
                         dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(table.shape[1] - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # chi-square survival


def test_sampled_outputs_keep_their_distribution(model_dir):
    greedy = sample(model_dir, 0.0, None).most_common(1)[0][0]
    plain = sample(model_dir, 0.4, None)
    assert p_value(plain, sample(model_dir, 0.4, list(greedy))) > ALPHA
    assert p_value(plain, sample(model_dir, 0.5, None)) < ALPHA  # the test's power
