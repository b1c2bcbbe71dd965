"""The scheduler's side of speculative decoding: draft budgets, placeholders, rollback.

The worker's answers are written by hand here, so each rule is seen alone;
tests/worker/spec_decode/test_verification.py runs the real worker.
"""

from __future__ import annotations

from services.common.engine import EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.invariants import check_invariants
from services.scheduler.kv_store import InMemoryKVStore
from services.scheduler.scheduler import Scheduler

EOS = 2


def make_scheduler(k: int = 4, **config) -> Scheduler:
    config = {"num_blocks": 32, "block_size": 4, "max_model_len": 64, **config}
    return Scheduler(SchedulerConfig(num_speculative_tokens=k, **config), InMemoryKVStore())


def request(req_id: str, prompt_len: int = 6, **params) -> EngineCoreRequest:
    params = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **params}
    return EngineCoreRequest(req_id, list(range(3, 3 + prompt_len)), SamplingParams(**params),
                             eos_token_id=EOS)


def answer(scheduler: Scheduler, step, sampled: dict[str, list[int]],
           num_drafts: dict[str, int] | None = None):
    output = ModelRunnerOutput(req_ids=list(sampled), sampled_token_ids=list(sampled.values()),
                               step_id=step.step_id, num_draft_tokens=num_drafts or {})
    outputs = scheduler.update_from_output(step, output)
    return {o.request_id: o for outs in outputs.values() for o in outs.outputs}


def test_decoding_requests_get_draft_slots_and_roll_back_what_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(request("a"))
    prefill = scheduler.schedule()
    assert prefill.num_draft_tokens == {}  # a prefill samples no drafts' worth
    answer(scheduler, prefill, {"a": [50]})
    decode = scheduler.schedule()
    assert decode.num_draft_tokens == {"a": 4} and decode.num_scheduled_tokens == {"a": 5}
    a = scheduler.requests["a"]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (11, 5)
    outputs = answer(scheduler, decode, {"a": [51, 52, 53]}, {"a": 4})  # 2 accepted + 1
    assert outputs["a"].new_token_ids == [51, 52, 53]
    assert (a.num_tokens, a.num_computed_tokens, a.num_output_placeholders) == (10, 9, 0)
    check_invariants(scheduler)  # the slots of the rejected drafts stay with it
    # A worker that had fewer drafts than its budget rolls back the unused slots too.
    step = scheduler.schedule()
    answer(scheduler, step, {"a": [54]})
    assert (a.num_tokens, a.num_computed_tokens) == (11, 10)
    check_invariants(scheduler)


def test_two_steps_in_flight_count_each_others_drafts():
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(request("a"))
    answer(scheduler, scheduler.schedule(), {"a": [50]})
    first = scheduler.schedule()
    second = scheduler.schedule()  # before the first's answer
    assert first.num_draft_tokens == second.num_draft_tokens == {"a": 4}
    a = scheduler.requests["a"]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (16, 10)
    answer(scheduler, first, {"a": [51, 52]}, {"a": 4})  # the second step is already shifted
    assert (a.num_computed_tokens, a.num_output_placeholders) == (13, 5)
    check_invariants(scheduler)
    answer(scheduler, second, {"a": [53, 54, 55, 56, 57]}, {"a": 4})
    assert (a.num_tokens, a.num_computed_tokens, a.num_output_placeholders) == (14, 13, 0)


def test_budgets_stop_at_max_tokens_max_model_len_and_the_batch_size():
    scheduler = make_scheduler(max_model_len=12)
    scheduler.add_request(request("a", max_tokens=3))
    scheduler.add_request(request("b", prompt_len=7))
    answer(scheduler, scheduler.schedule(), {"a": [50], "b": [60]})
    step = scheduler.schedule()
    # a: 1 output, 2 to go -> 1 draft; b: 8 tokens, its last computed position at most
    # max_model_len - 2 (as without drafts) -> 3 drafts.
    assert step.num_draft_tokens == {"a": 1, "b": 3}
    crowded = make_scheduler(speculative_disable_by_batch_size=1)
    for req_id in "ab":
        crowded.add_request(request(req_id))
    answer(crowded, crowded.schedule(), {"a": [50], "b": [60]})
    assert crowded.schedule().num_draft_tokens == {}


def test_a_stop_inside_accepted_drafts_ends_the_output_there():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", stop_token_ids=[99], max_tokens=40))
    scheduler.add_request(request("b", max_tokens=3))
    answer(scheduler, scheduler.schedule(), {"a": [50], "b": [60]})
    step = scheduler.schedule()
    outputs = answer(scheduler, step, {"a": [51, 99, 52], "b": [61, 62, 63]},
                     {"a": 4, "b": 2})
    assert outputs["a"].new_token_ids == [51, 99] and outputs["a"].finished
    assert outputs["b"].new_token_ids == [61, 62] and outputs["b"].finished
    kv = scheduler.kv_cache_manager
    assert not scheduler.requests and kv.num_free_blocks == kv.num_blocks - 1


def test_drafts_go_first_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    scheduler.add_request(request("a", prompt_len=7))
    answer(scheduler, scheduler.schedule(), {"a": [50]})  # 8 tokens, 2 blocks
    step = scheduler.schedule()
    assert step.num_draft_tokens == {"a": 3}  # 12 slots fill the pool
    answer(scheduler, step, {"a": [51, 52, 53, 54]}, {"a": 3})
    step = scheduler.schedule()  # 12 tokens: the next slot needs a 4th block
    assert step.num_draft_tokens == {} and step.num_scheduled_tokens == {}
