"""Request: token bookkeeping, block hashes during decode, status and ordering."""

from __future__ import annotations

from services.common.engine import EngineCoreRequest, FinishReason
from services.common.sampling_params import SamplingParams
from services.common.block_hash import get_request_block_hasher, hash_block_tokens
from services.scheduler.request import Request, RequestStatus


def test_from_engine_core_request_copies_every_field():
    params = SamplingParams(max_tokens=7)
    core = EngineCoreRequest("r1", [1, 2, 3], params, eos_token_id=2, arrival_time=5.0,
                             priority=3, cache_salt="s", client_index=4)
    req = Request.from_engine_core_request(core)
    assert (req.request_id, req.prompt_token_ids, req.eos_token_id) == ("r1", [1, 2, 3], 2)
    assert (req.arrival_time, req.priority, req.cache_salt, req.client_index) == (5.0, 3, "s", 4)
    assert req.sampling_params is params and req.max_tokens == 7
    assert req.status == RequestStatus.WAITING
    assert (req.num_computed_tokens, req.num_cached_tokens, req.num_preemptions) == (0, -1, 0)
    assert req.block_hashes == []  # no hasher, no hashes


def test_prompt_is_copied_and_outputs_stay_in_sync():
    prompt = [10, 11, 12]
    req = Request("r", prompt, SamplingParams())
    prompt.append(99)
    req.append_output_token_ids(13)
    req.append_output_token_ids([14, 15])
    assert req.prompt_token_ids == [10, 11, 12]
    assert req.output_token_ids == [13, 14, 15]
    assert req.all_token_ids == [10, 11, 12, 13, 14, 15]
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 3, 6)


def test_block_hashes_extend_during_decode():
    req = Request("r", list(range(30)), SamplingParams(),
                  block_hasher=get_request_block_hasher(16))
    h0 = hash_block_tokens(None, list(range(16)))
    assert req.block_hashes == [h0]
    req.append_output_token_ids(100)  # 31 tokens: second block not full yet
    assert req.block_hashes == [h0]
    req.append_output_token_ids(101)  # 32 tokens: second block full
    h1 = hash_block_tokens(h0, list(range(16, 30)) + [100, 101])
    assert req.block_hashes == [h0, h1]
    req.append_output_token_ids(list(range(200, 216)))  # 48 tokens in one call
    h2 = hash_block_tokens(h1, list(range(200, 216)))
    assert req.block_hashes == [h0, h1, h2]


def test_finished_statuses_and_reasons():
    expected = {
        RequestStatus.WAITING: None,
        RequestStatus.RUNNING: None,
        RequestStatus.PREEMPTED: None,
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    }
    req = Request("r", [1], SamplingParams())
    for status, reason in expected.items():
        req.status = status
        assert req.get_finished_reason() == reason
        assert req.is_finished() == (reason is not None)
        assert RequestStatus.is_finished(status) == (reason is not None)


def test_ordering_is_priority_then_arrival_then_id():
    a = Request("a", [1], SamplingParams(), priority=1, arrival_time=2.0)
    b = Request("b", [1], SamplingParams(), priority=0, arrival_time=9.0)
    c = Request("c", [1], SamplingParams(), priority=1, arrival_time=1.0)
    d = Request("d", [1], SamplingParams(), priority=1, arrival_time=1.0)
    assert [r.request_id for r in sorted([a, b, c, d])] == ["b", "c", "d", "a"]
    assert not a < a
