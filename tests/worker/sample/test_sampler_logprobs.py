"""Sample logprobs (raw, sampled token first, top-N, rank) and prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample import Sampler, SamplingState, compute_prompt_logprobs

CPU = torch.device("cpu")


def test_logprobs_are_raw_sampled_first_then_sorted_top_n_with_rank() -> None:
    logits = torch.tensor(
        [
            [1.0, 4.0, 2.0, 3.0, 0.0],
            [0.5, 0.1, 3.0, 2.0, 1.0],
            [2.0, 1.0, 0.0, -1.0, 5.0],
        ]
    )
    raw = logits.log_softmax(dim=-1)
    params = [
        # Bias moves greedy to token 0 (raw rank 4); logprobs stay those of the raw logits.
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 10.0}),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0),  # asked for nothing, still computed (batch max N)
    ]
    state = SamplingState(3, 5, CPU)
    for row, p in enumerate(params):
        state.add_request(row, p, [0], [])
    md = state.make_sampling_metadata(3)
    assert md.max_num_logprobs == 2
    out = Sampler()(logits.clone(), md)
    assert out.sampled_token_ids.tolist() == [0, 2, 4]
    assert out.logprobs_tensors is not None

    row0 = out.logprobs_for_row(0)
    assert row0.token_ids == [[0, 1, 3]]
    assert row0.logprobs == [[raw[0, 0].item(), raw[0, 1].item(), raw[0, 3].item()]]
    assert row0.sampled_token_ranks == [4]

    row1 = out.logprobs_for_row(1, num_logprobs=0)
    assert row1.token_ids == [[2]]
    assert row1.logprobs == [[raw[1, 2].item()]]
    assert row1.sampled_token_ranks == [1]

    row2 = out.logprobs_for_row(2)
    assert row2.token_ids == [[4, 4, 0]]
    assert row2.sampled_token_ranks == [1]


def test_logprobs_of_randomly_sampled_tokens_match_raw_log_softmax() -> None:
    torch.manual_seed(0)
    n, vocab = 16, 30
    logits = torch.randn(n, vocab)
    raw = logits.log_softmax(dim=-1)
    state = SamplingState(n, vocab, CPU)
    for row in range(n):
        p = SamplingParams(temperature=0.6, top_k=5, logprobs=3, frequency_penalty=0.5)
        state.add_request(row, p, [1], [1, 2])
    out = Sampler()(logits.clone(), state.make_sampling_metadata(n))
    assert out.logprobs_tensors is not None
    ids = out.logprobs_tensors.logprob_token_ids
    assert torch.equal(ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprobs_tensors.logprobs, raw.gather(1, ids))
    top = raw.topk(3, dim=1)
    assert torch.equal(ids[:, 1:], top.indices)
    sampled_lp = raw.gather(1, out.sampled_token_ids.unsqueeze(1))
    assert torch.equal(out.logprobs_tensors.sampled_token_ranks, (raw > sampled_lp).sum(1) + 1)


def test_no_logprobs_when_nobody_asks() -> None:
    state = SamplingState(2, 8, CPU)
    state.add_request(0, SamplingParams(temperature=0.0), [0], [])
    state.add_request(1, SamplingParams(temperature=1.0), [0], [])
    md = state.make_sampling_metadata(2)
    assert md.max_num_logprobs is None
    out = Sampler()(torch.randn(2, 8), md)
    assert out.logprobs_tensors is None
    with pytest.raises(ValueError, match="logprobs"):
        out.logprobs_for_row(0)


def test_logprobs_minus_one_means_whole_vocab() -> None:
    state = SamplingState(1, 6, CPU)
    state.add_request(0, SamplingParams(temperature=0.0, logprobs=-1), [0], [])
    md = state.make_sampling_metadata(1)
    assert md.max_num_logprobs == 6
    out = Sampler()(torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 3.0]]), md)
    assert out.logprobs_for_row(0).token_ids == [[1, 1, 3, 5, 4, 2, 0]]


def test_prompt_logprobs() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 2.0], [1.0, 1.0, 0.0]])
    raw = logits.log_softmax(dim=-1)
    targets = torch.tensor([2, 0, 2])
    result = compute_prompt_logprobs(logits, targets, num_logprobs=1)
    assert result.token_ids == [[2, 1], [0, 0], [2, 0]]
    assert result.logprobs == [
        [raw[0, 2].item(), raw[0, 1].item()],
        [raw[1, 0].item(), raw[1, 0].item()],
        [raw[2, 2].item(), raw[2, 0].item()],
    ]
    assert result.sampled_token_ranks == [2, 1, 3]
    only_targets = compute_prompt_logprobs(logits.to(torch.bfloat16), targets, num_logprobs=0)
    assert [ids for ids in only_targets.token_ids] == [[2], [0], [2]]
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        compute_prompt_logprobs(logits, targets, num_logprobs=4)
