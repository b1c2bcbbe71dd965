"""Thinking-token budget: the end sequence is forced token by token once the budget is spent."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample import Sampler, SamplingState, ThinkingConfig

CPU = torch.device("cpu")
VOCAB = 16
START, END_A, END_B, FILLER = 10, 11, 12, 5
THINKING = ThinkingConfig(think_start_token_ids=[START], think_end_token_ids=[END_A, END_B])


def preferred_logits(tokens: list[int]) -> torch.Tensor:
    """One row per request; each row strongly prefers the given token."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def run(
    state: SamplingState, outputs: list[list[int]], wants: list[list[int]]
) -> None:
    """Each step every request's model 'wants' ``wants[step][row]``; append what is sampled."""
    sampler = Sampler()
    for want in wants:
        md = state.make_sampling_metadata(len(outputs))
        sampled = sampler(preferred_logits(want), md).sampled_token_ids.tolist()
        for out, token in zip(outputs, sampled):
            out.append(token)


def single(budget: int, prompt: list[int], wants: list[int], temperature: float = 0.0) -> list[int]:
    state = SamplingState(1, VOCAB, CPU, thinking=THINKING)
    out: list[int] = []
    params = SamplingParams(temperature=temperature, thinking_token_budget=budget)
    state.add_request(0, params, prompt, out)
    run(state, [out], [[w] for w in wants])
    return out


def test_budget_forces_the_end_sequence_then_releases() -> None:
    wants = [START] + [FILLER] * 8
    assert single(3, [1, 2], wants) == [START, 5, 5, 5, END_A, END_B, 5, 5, 5]


def test_budget_zero_ends_thinking_at_once() -> None:
    assert single(0, [1], [START, FILLER, FILLER, FILLER]) == [START, END_A, END_B, 5]


def test_prompt_that_opens_thinking_counts_against_the_budget() -> None:
    # One thinking token (7) is already in the prompt.
    assert single(2, [1, START, 7], [FILLER] * 5) == [5, END_A, END_B, 5, 5]
    # A prompt whose thinking already closed is not counted.
    assert single(1, [START, 7, END_A, END_B], [FILLER] * 3) == [5, 5, 5]


def test_model_ending_on_its_own_is_not_forced_and_a_new_section_gets_a_fresh_budget() -> None:
    wants = [START, 5, END_A, END_B, 5, START, 5, 5, 5, 5, 5]
    assert single(2, [1], wants) == [START, 5, END_A, END_B, 5, START, 5, 5, END_A, END_B, 5]


def test_end_sequence_already_begun_is_continued() -> None:
    # The model emits END_A as its last budgeted token: only END_B is forced.
    assert single(3, [1], [START, 5, 5, END_A, 5, 5]) == [START, 5, 5, END_A, END_B, 5]


def test_forcing_holds_under_random_sampling() -> None:
    torch.manual_seed(0)
    out = single(2, [1], [START, 5, 5, 5, 5], temperature=1.5)
    assert out[0] == START and out[3:5] == [END_A, END_B]


def test_requests_without_budget_are_untouched() -> None:
    state = SamplingState(2, VOCAB, CPU, thinking=THINKING)
    outputs: list[list[int]] = [[], []]
    state.add_request(0, SamplingParams(temperature=0.0), [1], outputs[0])
    state.add_request(1, SamplingParams(temperature=0.0, thinking_token_budget=1), [1], outputs[1])
    run(state, outputs, [[START, START], [5, 5], [5, 5], [5, 5]])
    assert outputs == [[START, 5, 5, 5], [START, 5, END_A, END_B]]


def test_state_follows_moves() -> None:
    state = SamplingState(3, VOCAB, CPU, thinking=THINKING)
    outputs: list[list[int]] = [[], [], []]
    for row, budget in enumerate((3, 1, 2)):
        params = SamplingParams(temperature=0.0, thinking_token_budget=budget)
        state.add_request(row, params, [1], outputs[row])
    run(state, outputs, [[START] * 3])
    run(state, outputs, [[5] * 3])
    # Budget-1 request (row 1) is forced next; budget 3 (row 0) and 2 (row 2) are not.
    state.remove_request(0)
    state.move_request(2, 0)
    outputs = [outputs[2], outputs[1]]
    run(state, outputs, [[5, 5], [5, 5], [5, 5]])
    assert outputs[0] == [START, 5, 5, END_A, END_B]  # budget 2
    assert outputs[1] == [START, 5, END_A, END_B, 5]  # budget 1


def test_budget_without_thinking_config_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    state = SamplingState(1, VOCAB, CPU)
    out: list[int] = []
    state.add_request(0, SamplingParams(temperature=0.0, thinking_token_budget=0), [1], out)
    assert "ignored" in caplog.text
    run(state, [out], [[START], [5]])
    assert out == [START, 5]


def test_negative_budget_is_rejected() -> None:
    state = SamplingState(1, VOCAB, CPU, thinking=THINKING)
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0, got -1"):
        state.add_request(0, SamplingParams(thinking_token_budget=-1), [1], [])
