"""SamplingState: validation, call order, metadata flags, and a fuzz of batch changes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample import SamplingState
from services.worker.sample.logits_processor import MinTokensLogitsProcessor

CPU = torch.device("cpu")
TEST_PROCS = "kvmesh_test_logitsprocs"


@pytest.fixture(autouse=True)
def _test_procs_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def processed(state: SamplingState, logits: torch.Tensor) -> torch.Tensor:
    md = state.make_sampling_metadata(state.num_reqs)
    out = logits.clone()
    for proc in md.logitsprocs.non_argmax_invariant:
        out = proc.apply(out)
    return out


@pytest.mark.parametrize(
    ("params", "eos", "match"),
    [
        (SamplingParams(temperature=-0.1), None, r"temperature must be >= 0, got -0.1"),
        (SamplingParams(top_p=0.0), None, r"top_p must be in \(0, 1\], got 0.0"),
        (SamplingParams(top_k=-2), None, r"top_k must be .* got -2"),
        (SamplingParams(repetition_penalty=0.0), None, r"repetition_penalty must be > 0"),
        (SamplingParams(allowed_token_ids=[]), None, "allowed_token_ids must not be empty"),
        (
            SamplingParams(allowed_token_ids=[3, 10]),
            None,
            r"allowed_token_ids holds token id 10; allowed range is \[0, 10\)",
        ),
        (SamplingParams(logit_bias={-1: 1.0}), None, r"logit_bias holds token id -1"),
        (SamplingParams(stop_token_ids=[12]), None, r"stop_token_ids holds token id 12"),
        (SamplingParams(), 10, r"eos_token_id holds token id 10"),
        (
            SamplingParams(min_p=1.5),
            None,
            r"MinPLogitsProcessor rejected the request: min_p must be in \[0, 1\], got 1.5",
        ),
        (
            SamplingParams(max_tokens=13),
            None,
            r"RejectMaxTokens13Processor rejected the request: max_tokens=13",
        ),
    ],
)
def test_add_request_validates(params: SamplingParams, eos: int | None, match: str) -> None:
    state = SamplingState(2, 10, CPU, logitsprocs=[f"{TEST_PROCS}:RejectMaxTokens13Processor"])
    with pytest.raises(ValueError, match=match):
        state.add_request(0, params, [1], [], eos_token_id=eos)
    assert state.num_reqs == 0


def test_row_checks() -> None:
    state = SamplingState(2, 10, CPU)
    with pytest.raises(ValueError, match=r"row must be in \[0, 2\), got 2"):
        state.add_request(2, SamplingParams(), [1], [])
    state.add_request(0, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match="row 0 is occupied"):
        state.add_request(0, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match="row 1 is empty"):
        state.remove_request(1)
    match = r"rows \[0, 2\) must hold exactly the batch; occupied rows: \[0\]"
    with pytest.raises(ValueError, match=match):
        state.make_sampling_metadata(2)


def test_holes_are_rejected() -> None:
    state = SamplingState(3, 10, CPU)
    state.add_request(0, SamplingParams(), [1], [])
    state.add_request(2, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match=r"occupied rows: \[0, 2\]"):
        state.make_sampling_metadata(2)
    state.move_request(2, 1)
    state.make_sampling_metadata(2)


def test_add_or_remove_after_a_move_in_the_same_step_raises() -> None:
    state = SamplingState(3, 10, CPU)
    state.add_request(0, SamplingParams(), [1], [])
    state.add_request(1, SamplingParams(), [1], [])
    state.make_sampling_metadata(2)
    state.remove_request(0)
    state.move_request(1, 0)
    with pytest.raises(RuntimeError, match="removed -> added -> moved"):
        state.add_request(2, SamplingParams(), [1], [])
    with pytest.raises(RuntimeError, match="removed -> added -> moved"):
        state.remove_request(0)
    state.make_sampling_metadata(1)
    state.add_request(1, SamplingParams(), [1], [])  # a new step
    state.make_sampling_metadata(2)


def test_add_then_remove_in_one_step_never_reaches_processors() -> None:
    state = SamplingState(2, 4, CPU)
    logits = torch.zeros(1, 4)
    state.add_request(0, SamplingParams(logit_bias={1: 5.0}), [1], [])
    state.remove_request(0)
    state.add_request(0, SamplingParams(), [1], [])
    assert processed(state, logits).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    # Remove and re-add the same row in one step: the new request's state wins.
    state.remove_request(0)
    state.add_request(0, SamplingParams(logit_bias={2: 1.5}), [1], [])
    assert processed(state, logits).tolist() == [[0.0, 0.0, 1.5, 0.0]]
    state.remove_request(0)
    state.add_request(0, SamplingParams(logit_bias={3: -1.0}), [1], [])
    state.remove_request(0)
    assert state.make_sampling_metadata(0).all_greedy


def test_metadata_flags_and_caching() -> None:
    state = SamplingState(4, 50, CPU)
    state.add_request(0, SamplingParams(temperature=0.0), [1], [])
    md = state.make_sampling_metadata(1)
    assert md.all_greedy and not md.all_random and md.temperature is None
    assert md.top_k is None and md.top_p is None and md.no_penalties
    assert md.prompt_token_ids is None and md.output_token_ids == []
    assert md.allowed_token_ids_mask is None and md.generators == {}
    assert state.make_sampling_metadata(1) is md  # unchanged state: cached

    state.add_request(1, SamplingParams(temperature=0.8, top_k=70, top_p=0.9, seed=3), [1], [])
    state.add_request(2, SamplingParams(temperature=1.0, top_k=7, allowed_token_ids=[4]), [1], [])
    md2 = state.make_sampling_metadata(3)
    assert md2 is not md
    assert not md2.all_greedy and not md2.all_random
    assert md2.temperature is not None
    assert md2.temperature.tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert md2.top_k is not None and md2.top_k.tolist() == [50, 50, 7]  # 70 clamps to vocab: off
    assert md2.max_top_k == 7
    assert md2.top_p is not None and md2.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert list(md2.generators) == [1]
    assert md2.allowed_token_ids_mask is not None
    assert md2.allowed_token_ids_mask.sum(dim=1).tolist() == [0, 0, 49]

    state.remove_request(0)
    state.move_request(2, 0)
    md3 = state.make_sampling_metadata(2)
    assert md3.all_random
    assert md3.allowed_token_ids_mask is not None
    assert md3.allowed_token_ids_mask.sum(dim=1).tolist() == [49, 0]
    assert md3.top_k is not None and md3.top_k.tolist() == [7, 50]


def test_eos_is_folded_into_stop_ids_for_processors_only() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=[5])
    state = SamplingState(1, 10, CPU)
    state.add_request(0, params, [1], [], eos_token_id=9)
    assert params.stop_token_ids == [5]  # the caller's params are not mutated
    row = processed(state, torch.zeros(1, 10))[0]
    assert torch.isinf(row).nonzero().flatten().tolist() == [5, 9]


# ---- fuzz ---------------------------------------------------------------------------

VOCAB = 24
MAX_REQS = 8


@dataclass
class FuzzRequest:
    key: int
    params: SamplingParams
    prompt: list[int]
    output: list[int]
    eos: int


def fuzz_request(key: int) -> FuzzRequest:
    params = SamplingParams(
        temperature=0.0 if key % 3 == 0 else 0.5 + 0.1 * (key % 4),
        top_k=key % 6,
        top_p=1.0 - 0.05 * (key % 3),
        min_p=0.05 * (key % 5),
        seed=key if key % 2 else None,
        min_tokens=key % 4,
        stop_token_ids=[(key + 5) % VOCAB],
        frequency_penalty=0.1 * (key % 3),
        repetition_penalty=1.0 + 0.1 * (key % 2),
        logit_bias={key % VOCAB: 1.0 + key, (key * 7) % VOCAB: -0.5},
        logprobs=key % 4 if key % 5 else None,
    )
    return FuzzRequest(key, params, [key % VOCAB, 1], [], eos=(key + 11) % VOCAB)


def expected_non_argmax(base: torch.Tensor, req: FuzzRequest) -> torch.Tensor:
    row = base.clone()
    if len(req.output) < req.params.min_tokens:
        row[[*req.params.stop_token_ids, req.eos]] = float("-inf")
    for token, bias in (req.params.logit_bias or {}).items():
        row[token] += bias
    if req.params.seed is not None and req.output:  # NoRepeatAdapter
        row[req.output[-1]] = float("-inf")
    return row


def check_step(state: SamplingState, rows: dict[int, FuzzRequest], gen: torch.Generator) -> None:
    n = len(rows)
    md = state.make_sampling_metadata(n)
    reqs = [rows[r] for r in range(n)]
    base = torch.randn(n, VOCAB, generator=gen)

    got = base.clone()
    for proc in md.logitsprocs.non_argmax_invariant:
        got = proc.apply(got)
    want_rows = [expected_non_argmax(base[r], req) for r, req in enumerate(reqs)]
    want = torch.stack(want_rows) if want_rows else base.clone()
    assert torch.equal(got, want)

    min_p = torch.tensor([req.params.min_p for req in reqs], dtype=torch.float32).reshape(n, 1)
    probs = want.softmax(dim=-1)
    want_min_p = want.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    for proc in md.logitsprocs.argmax_invariant:
        got = proc.apply(got)
    assert torch.equal(got, want_min_p)

    temps = [req.params.temperature for req in reqs]
    if md.temperature is None:
        assert all(t == 0.0 for t in temps)
    else:
        assert md.temperature.tolist() == pytest.approx(temps)
    top_k = [req.params.top_k if req.params.top_k > 0 else VOCAB for req in reqs]
    assert (md.top_k.tolist() if md.top_k is not None else [VOCAB] * n) == top_k
    frequency = [req.params.frequency_penalty for req in reqs]
    assert md.frequency_penalties.tolist() == pytest.approx(frequency)
    seeded_random = [
        r for r, req in enumerate(reqs) if req.params.seed is not None and req.params.temperature
    ]
    assert sorted(md.generators) == seeded_random
    for r, req in enumerate(reqs):
        if req.params.frequency_penalty or req.params.repetition_penalty != 1.0:
            assert md.output_token_ids[r] is req.output
    asked = [req.params.logprobs for req in reqs if req.params.logprobs is not None]
    assert md.max_num_logprobs == (max(asked) if asked else None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fuzz_processor_state_follows_requests(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    state = SamplingState(MAX_REQS, VOCAB, CPU, logitsprocs=[f"{TEST_PROCS}:NoRepeatAdapter"])
    rows: dict[int, FuzzRequest] = {}
    next_key = 0
    for _ in range(150):
        for row in rng.sample(sorted(rows), k=min(len(rows), rng.randint(0, 2))):
            state.remove_request(row)
            del rows[row]
        for _ in range(rng.randint(0, 3)):
            empty = [r for r in range(MAX_REQS) if r not in rows]
            if not empty:
                break
            row, req = rng.choice(empty), fuzz_request(next_key)
            next_key += 1
            state.add_request(row, req.params, req.prompt, req.output, eos_token_id=req.eos)
            rows[row] = req
        while rows and max(rows) >= len(rows):  # condense: tail rows into the lowest holes
            src, dst = max(rows), min(r for r in range(MAX_REQS) if r not in rows)
            state.move_request(src, dst)
            rows[dst] = rows.pop(src)
        check_step(state, rows, gen)
        for req in rows.values():
            if rng.random() < 0.8:  # the rest were mid-prefill: no token this step
                req.output.append(rng.randrange(VOCAB))
    assert next_key > 100


def test_min_tokens_state_is_dropped_once_reached() -> None:
    state = SamplingState(1, 10, CPU)
    out: list[int] = []
    state.add_request(0, SamplingParams(min_tokens=1), [1], out, eos_token_id=2)
    proc = next(p for p in state.logitsprocs.all if isinstance(p, MinTokensLogitsProcessor))
    state.make_sampling_metadata(1)
    assert proc._min_toks  # noqa: SLF001 - checking the processor drops finished requests
    out.append(4)
    state.make_sampling_metadata(1)
    assert not proc._min_toks  # noqa: SLF001
