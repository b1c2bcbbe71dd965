"""Sampler behaviour through SamplingState: greedy, temperature, filters, penalties, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample import Sampler, SamplingState
from services.worker.sample.ops import topk_topp
from services.worker.sample.ops.penalties import apply_penalties, make_padded_token_ids

CPU = torch.device("cpu")


def make_state(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    eos_token_id: int | None = None,
) -> tuple[SamplingState, list[list[int]]]:
    state = SamplingState(max(len(params), 1), vocab_size, CPU)
    outputs: list[list[int]] = [[] for _ in params]
    for row, p in enumerate(params):
        prompt = prompts[row] if prompts else [0]
        state.add_request(row, p, prompt, outputs[row], eos_token_id=eos_token_id)
    return state, outputs


def sample(state: SamplingState, logits: torch.Tensor) -> torch.Tensor:
    md = state.make_sampling_metadata(state.num_reqs)
    return Sampler()(logits.clone(), md).sampled_token_ids


def logits_from_probs(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).clone()


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    state, _ = make_state([SamplingParams(temperature=0.0)] * 8, 50)
    sampled = sample(state, logits)
    assert sampled.dtype == torch.int64
    assert sampled.tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    params = [SamplingParams(temperature=0.0 if row % 2 == 0 else 1.5) for row in range(6)]
    state, _ = make_state(params, 40)
    md = state.make_sampling_metadata(6)
    assert not md.all_greedy and not md.all_random
    sampled = Sampler()(logits.clone(), md).sampled_token_ids
    assert sampled[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature: float) -> None:
    torch.manual_seed(2)
    n = 6000
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    state, _ = make_state([SamplingParams(temperature=temperature)] * n, 4)
    sampled = sample(state, base.expand(n, -1))
    freq = torch.bincount(sampled, minlength=4).float() / n
    expected = (base / temperature).softmax(dim=0)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_top_k_samples_only_the_k_best() -> None:
    torch.manual_seed(3)
    n, vocab, k = 3000, 100, 5
    base = torch.randn(vocab) * 0.1
    best = torch.randperm(vocab)[:k]
    base[best] += 3.0  # the top 5 are close to each other, far from the rest
    state, _ = make_state([SamplingParams(temperature=1.0, top_k=k)] * n, vocab)
    assert state.make_sampling_metadata(n).max_top_k == k
    sampled = sample(state, base.expand(n, -1))
    assert set(sampled.tolist()) == set(best.tolist())


@pytest.mark.parametrize(
    ("top_p", "support"), [(0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_nucleus(top_p: float, support: set[int]) -> None:
    torch.manual_seed(4)
    n = 4000
    state, _ = make_state([SamplingParams(temperature=1.0, top_p=top_p)] * n, 4)
    sampled = sample(state, logits_from_probs([0.5, 0.3, 0.15, 0.05], n))
    assert set(sampled.tolist()) == support


def test_top_k_and_top_p_together() -> None:
    torch.manual_seed(5)
    n = 4000
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    # top-k 3 leaves 0.3/0.25/0.2 (renormalised 0.4/0.333/0.267); top-p 0.6 then keeps two.
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.6)] * n
    state, _ = make_state(params, 5)
    assert set(sample(state, logits_from_probs(probs, n)).tolist()) == {0, 1}


def test_top_k_per_row_with_disabled_rows() -> None:
    torch.manual_seed(6)
    n = 3000
    params = [SamplingParams(temperature=1.0, top_k=2 if row % 2 else 0) for row in range(n)]
    state, _ = make_state(params, 4)
    sampled = sample(state, logits_from_probs([0.4, 0.3, 0.2, 0.1], n))
    assert set(sampled[1::2].tolist()) == {0, 1}
    assert set(sampled[0::2].tolist()) == {0, 1, 2, 3}


def test_min_p_drops_unlikely_tokens() -> None:
    torch.manual_seed(7)
    n = 4000
    # Threshold 0.35 * 0.5 = 0.175: keeps 0.5 and 0.3.
    state, _ = make_state([SamplingParams(temperature=1.0, min_p=0.35)] * n, 4)
    sampled = sample(state, logits_from_probs([0.5, 0.3, 0.15, 0.05], n))
    assert set(sampled.tolist()) == {0, 1}


def test_allowed_token_ids() -> None:
    torch.manual_seed(8)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]] * 2)
    state, _ = make_state([SamplingParams(temperature=0.0, allowed_token_ids=[2, 4])] * 2, 5)
    assert sample(state, logits).tolist() == [2, 2]
    n = 2000
    state, _ = make_state([SamplingParams(temperature=1.0, allowed_token_ids=[1, 3])] * n, 5)
    assert set(sample(state, torch.zeros(n, 5)).tolist()) == {1, 3}


def test_logit_bias_changes_greedy_and_adds_exactly() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [1.0, 2.0, 3.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, logit_bias={0: 2.5, 3: -1.0}),
        SamplingParams(temperature=0.0),
    ]
    state, _ = make_state(params, 4)
    md = state.make_sampling_metadata(2)
    processed = logits.clone()
    for proc in md.logitsprocs.non_argmax_invariant:
        processed = proc.apply(processed)
    assert processed.tolist() == [[3.5, 2.0, 3.0, -1.0], [1.0, 2.0, 3.0, 0.0]]
    assert Sampler()(logits.clone(), md).sampled_token_ids.tolist() == [0, 2]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(temperature=0.0),
    ]
    state, outputs = make_state(params, 5, eos_token_id=eos)
    # Row 0: stop id 2 and EOS 3 masked -> 4. Row 1: EOS not a stop (ignore_eos) -> 3.
    assert sample(state, logits).tolist() == [4, 3, 2]
    for out in outputs:
        out.append(4)
    assert sample(state, logits).tolist() == [4, 3, 2]
    for out in outputs:
        out.append(4)
    assert sample(state, logits).tolist() == [2, 2, 2]


def test_min_tokens_counts_outputs_already_present_on_add() -> None:
    state = SamplingState(1, 5, CPU)
    state.add_request(0, SamplingParams(temperature=0.0, min_tokens=2), [0], [1, 1], eos_token_id=2)
    assert sample(state, torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0]])).tolist() == [2]


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    prompt = make_padded_token_ids([[0, 2]], pad_id=5, device=CPU)
    output = make_padded_token_ids([[3, 3, 1]], pad_id=5, device=CPU)
    result = apply_penalties(
        logits,
        prompt,
        output,
        presence_penalties=torch.tensor([0.25]),
        frequency_penalties=torch.tensor([0.5]),
        repetition_penalties=torch.tensor([2.0]),
    )
    # repetition on seen {0,1,2,3}: [1.0, -2.0, 0.25, 1.5, -0.5]
    # frequency (token 3 twice, token 1 once): [1.0, -2.5, 0.25, 0.5, -0.5]
    # presence (tokens 1, 3): [1.0, -2.75, 0.25, 0.25, -0.5]
    assert result.tolist() == [[1.0, -2.75, 0.25, 0.25, -0.5]]


def test_penalties_through_the_sampler() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0]] * 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),  # prompt token 0: 3.0 -> 2.5
        SamplingParams(temperature=0.0, frequency_penalty=0.06),  # output 1,1 -> 2.78
        SamplingParams(temperature=0.0, presence_penalty=0.5),  # output {1} -> 2.4
    ]
    state, outputs = make_state(params, 4, prompts=[[0], [0], [3], [3]])
    for row in (0, 2, 3):
        outputs[row].extend([0, 1, 1])
    # Row 2: token 0 -> 2.94, token 1 -> 2.78, token 2 untouched 2.8.
    # Row 3: tokens 0 and 1 lose 0.5 -> token 2 wins.
    assert sample(state, logits).tolist() == [0, 1, 0, 2]
    md = state.make_sampling_metadata(4)
    assert md.prompt_token_ids is not None
    assert md.prompt_token_ids.tolist() == [[4], [0], [4], [4]]  # only row 1 needs its prompt
    assert md.output_token_ids[0] == [] and md.output_token_ids[2] is outputs[2]


def _run_seeded(
    state: SamplingState,
    row: int,
    outputs: list[list[int]],
    logits_row: torch.Tensor,
    steps: int,
) -> list[int]:
    tokens = []
    for _ in range(steps):
        n = state.num_reqs
        md = state.make_sampling_metadata(n)
        sampled = Sampler()(logits_row.expand(n, -1).clone(), md).sampled_token_ids.tolist()
        for r in range(n):
            outputs[r].append(sampled[r])
        tokens.append(sampled[row])
    return tokens


def test_seed_reproducible_whatever_the_batch_and_row() -> None:
    vocab = 1000
    flat = torch.zeros(vocab)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    alone = SamplingState(1, vocab, CPU)
    out_alone: list[list[int]] = [[]]
    alone.add_request(0, seeded, [1], out_alone[0])
    reference = _run_seeded(alone, 0, out_alone, flat, steps=6)

    torch.manual_seed(99)
    batch = SamplingState(4, vocab, CPU)
    outs: list[list[int]] = [[], [], []]
    batch.add_request(0, SamplingParams(temperature=1.0), [1], outs[0])
    batch.add_request(1, SamplingParams(temperature=0.7, seed=7), [1], outs[1])
    batch.add_request(2, seeded, [1], outs[2])
    first = _run_seeded(batch, 2, outs, flat, steps=3)
    # Condense: row 0 leaves, the seeded request moves from row 2 into row 0.
    batch.remove_request(0)
    batch.move_request(2, 0)
    outs = [outs[2], outs[1]]
    second = _run_seeded(batch, 0, outs, flat, steps=3)
    assert first + second == reference

    other = SamplingState(1, vocab, CPU)
    other_out: list[list[int]] = [[]]
    other.add_request(0, SamplingParams(temperature=1.0, seed=1235), [1], other_out[0])
    assert _run_seeded(other, 0, other_out, flat, steps=6) != reference


def test_seeded_sample_is_stable_when_the_step_is_discarded() -> None:
    # A chunked-prefill step samples and discards: the next real draw is unchanged.
    vocab = 1000
    state = SamplingState(1, vocab, CPU)
    out: list[int] = []
    state.add_request(0, SamplingParams(temperature=1.0, seed=5), [1], out)
    logits = torch.zeros(1, vocab)
    first = Sampler()(logits.clone(), state.make_sampling_metadata(1)).sampled_token_ids.item()
    again = Sampler()(logits.clone(), state.make_sampling_metadata(1)).sampled_token_ids.item()
    assert first == again


def test_random_sampling_matches_probabilities_roughly() -> None:
    torch.manual_seed(10)
    n = 8000
    probs = [0.6, 0.25, 0.1, 0.05]
    state, _ = make_state([SamplingParams(temperature=1.0)] * n, 4)
    sampled = sample(state, logits_from_probs(probs, n))
    freq = torch.bincount(sampled, minlength=4).float() / n
    for got, want in zip(freq.tolist(), probs):
        assert math.isclose(got, want, abs_tol=0.02)


@pytest.mark.parametrize(("scale", "partial_suffices"), [(3.0, True), (0.3, False)])
def test_cpu_partial_top_p_matches_the_full_sort(scale: float, partial_suffices: bool) -> None:
    torch.manual_seed(11)
    n, vocab = 16, 2000
    logits = torch.randn(n, vocab) * scale  # scale 0.3: flat rows, nuclei beyond 256 tokens
    top_p = torch.linspace(0.05, 0.95, n)
    top_k = torch.tensor([vocab if row % 3 else 40 + row for row in range(n)])
    assert topk_topp._apply_top_p_partial(logits.clone(), top_p) is partial_suffices
    for k in (None, top_k):
        fast = topk_topp.apply_top_k_top_p(logits.clone(), k, top_p, max_top_k=55)
        full = topk_topp._apply_top_k_top_p_sorted(logits.clone(), k, top_p)
        assert torch.equal(fast.isinf(), full.isinf())
        assert torch.equal(fast[~fast.isinf()], logits[~fast.isinf()])


@pytest.mark.parametrize("temperatures", [[0.0] * 4, [1.0] * 4, [0.0, 1.0, 0.0, 1.0],
                                          [1.0, 0.0, 1.0, 0.0]],
                         ids=["greedy", "random", "mixed", "mixed-other-rows"])
def test_rows_whose_logits_are_not_finite_are_flagged_alone(temperatures: list[float]) -> None:
    """A NaN, a +inf, or a row masked everywhere: the sample means nothing,
    whether the row is greedy or random, in a batch of one kind or of both."""
    state, _ = make_state([SamplingParams(temperature=t) for t in temperatures], 4)
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0],
                           [0.0, float("nan"), 1.0, float("inf")],
                           [0.0, float("inf"), 1.0, 0.0],
                           [float("-inf")] * 4])
    output = Sampler()(logits, state.make_sampling_metadata(4))
    assert output.nonfinite_rows.tolist() == [False, True, True, True]
    if temperatures[0] == 0.0:
        assert output.sampled_token_ids.tolist()[0] == 1


def test_a_random_row_made_nan_after_step_5_is_flagged_greedy_rows_not() -> None:
    """The random path checks its own logits again, just before sampling."""
    state, _ = make_state([SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)], 3)
    md = state.make_sampling_metadata(2)
    # A NaN temperature (no request can ask for one) stands for any step after
    # step 5 that breaks the row: the division makes it NaN.
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 1.0, 0.0]])
    md.temperature[1] = 0.0 * float("inf")
    output = Sampler()(logits, md)
    assert output.nonfinite_rows.tolist() == [False, True]
    assert output.sampled_token_ids.tolist()[0] == 1
