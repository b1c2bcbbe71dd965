"""check_stop on its own: each condition, its stop_reason, and min_tokens."""

from __future__ import annotations

from services.common.sampling_params import SamplingParams
from services.scheduler.request import Request, RequestStatus
from services.scheduler.stop import check_stop

EOS = 2


def make(**params) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(**params), eos_token_id=EOS)


def feed(request: Request, token_ids: list[int], max_model_len: int = 100) -> int | None:
    """Appends tokens until one stops the request; returns how many were appended."""
    for i, token_id in enumerate(token_ids):
        request.append_output_token_ids(token_id)
        if check_stop(request, max_model_len):
            return i + 1
    return None


def test_eos_stops_with_no_stop_reason():
    r = make(max_tokens=10)
    assert feed(r, [9, 9, EOS, 9]) == 3
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    r = make(max_tokens=4, ignore_eos=True)
    assert feed(r, [EOS, EOS, EOS, EOS, EOS]) == 4
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_id_is_the_stop_reason():
    r = make(max_tokens=10, stop_token_ids=[40, 41])
    assert feed(r, [9, 41, 40]) == 2
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 41


def test_max_tokens_caps_length():
    r = make(max_tokens=3)
    assert feed(r, [9, 9, 9, 9]) == 3
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.stop_reason is None


def test_max_model_len_caps_length():
    r = make(max_tokens=None)
    # 3 prompt tokens + 5 outputs reach max_model_len 8.
    assert feed(r, [9] * 10, max_model_len=8) == 5
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_holds_back_eos_and_stop_ids():
    r = make(max_tokens=10, min_tokens=3, stop_token_ids=[40])
    # EOS and 40 as outputs 1 and 2 are ignored; EOS as output 3 stops.
    assert feed(r, [EOS, 40, EOS]) == 3
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason is None


def test_min_tokens_never_holds_back_the_length_cap():
    r = make(max_tokens=10, min_tokens=8)
    assert feed(r, [9] * 10, max_model_len=6) == 3
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_beats_length_cap_on_the_same_token():
    r = make(max_tokens=2, stop_token_ids=[40])
    assert feed(r, [9, 40]) == 2
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 40
