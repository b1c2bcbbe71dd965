"""Scheduler: prefix hits, chunked prefill, stop conditions, IGNORED, aborts, stats.

Block size 16 throughout. ``run_step`` plays the worker: it returns a sampled
token for every scheduled request whose prompt is fully computed after this
step and nothing for a partial prefill, exactly as a model runner would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc
import pytest

from services.common.engine import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from services.common.limits import SchedulingLimits
from services.common.model_runner_output import ModelRunnerOutput, RequestFailure
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.invariants import check_invariants
from services.scheduler.kv_store import InMemoryKVStore
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler, WaitingQueueFullError

EOS = 2


def make_scheduler(num_blocks: int = 11, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, **config), InMemoryKVStore())


def make_request(req_id: str, prompt: list[int], client_index: int = 0, **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 100)
    return EngineCoreRequest(req_id, prompt, SamplingParams(**params), eos_token_id=EOS,
                             client_index=client_index)


def run_step(
    scheduler: Scheduler, sample: Callable[[str], int] = lambda req_id: 7
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    """One schedule() + update_from_output(); returns the outputs by request id."""
    scheduler_output = scheduler.schedule()
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens == request.num_tokens
        sampled.append([sample(req_id)] if done else [])
    runner_output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
    engine_outputs = scheduler.update_from_output(scheduler_output, runner_output)
    check_invariants(scheduler)
    by_id = {o.request_id: o for outs in engine_outputs.values() for o in outs.outputs}
    return scheduler_output, by_id


@pytest.mark.parametrize("first_finished", [True, False])
def test_same_prompt_twice_hits_one_block(first_finished: bool):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [101] * 17, max_tokens=1 if first_finished else 100))
    first, outputs = run_step(scheduler)
    assert first.scheduled_new_reqs[0].block_ids == [1, 2]
    assert outputs["a"].num_cached_tokens == 0
    assert outputs["a"].finished is first_finished

    scheduler.add_request(make_request("b", [101] * 17))
    second, outputs = run_step(scheduler)
    new = second.scheduled_new_reqs[0]
    # 16 of 17 tokens are cached; the 17th is computed to get logits.
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("b", [1, 3], 16)
    assert second.num_scheduled_tokens["b"] == 1
    assert scheduler.requests["b"].num_cached_tokens == 16
    assert outputs["b"].num_cached_tokens == 16
    assert outputs["b"].new_token_ids == [7]
    assert scheduler.kv_cache_manager.block_pool.blocks[1].ref_cnt == (1 if first_finished else 2)
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (34, 16)
    assert stats.prefix_cache_hit_rate == pytest.approx(16 / 34)


def test_chunked_prefill_three_long_prompts():
    scheduler = make_scheduler(num_blocks=160,
                               limits=SchedulingLimits(max_num_batched_tokens=1024),
                               long_prefill_token_threshold=400)
    for i, name in enumerate("abc"):
        scheduler.add_request(make_request(name, [1000 * (i + 1) + t for t in range(800)]))

    step1, out1 = run_step(scheduler)
    assert step1.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    assert step1.total_num_scheduled_tokens == 1024
    assert [r.req_id for r in step1.scheduled_new_reqs] == ["a", "b", "c"]
    assert [len(r.block_ids) for r in step1.scheduled_new_reqs] == [25, 25, 14]
    assert out1 == {}  # partial prefills report nothing

    step2, out2 = run_step(scheduler)
    assert step2.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    cached = step2.scheduled_cached_reqs
    assert cached.req_ids == ["a", "b", "c"]
    assert cached.num_computed_tokens == [400, 400, 224]
    assert [len(ids) for ids in cached.new_block_ids] == [25, 25, 14]
    assert sorted(out2) == ["a", "b"]  # their prompts are done: first tokens

    step3, out3 = run_step(scheduler)
    assert step3.num_scheduled_tokens == {"a": 1, "b": 1, "c": 352}
    assert step3.scheduled_cached_reqs.num_computed_tokens == [800, 800, 448]
    # Token 801 opens block 51 for "a" and "b"; "c" fills blocks 29..50.
    assert [len(ids) for ids in step3.scheduled_cached_reqs.new_block_ids] == [1, 1, 22]
    assert sorted(out3) == ["a", "b", "c"]

    step4, _ = run_step(scheduler)
    assert step4.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert [len(ids) for ids in step4.scheduled_cached_reqs.new_block_ids] == [0, 0, 1]


def test_new_tokens_never_reach_max_model_len_minus_one():
    scheduler = make_scheduler(num_blocks=20, max_model_len=40,
                               limits=SchedulingLimits(max_num_batched_tokens=64))
    scheduler.add_request(make_request("a", list(range(10, 40)), max_tokens=None))
    steps = [run_step(scheduler) for _ in range(10)]
    assert [s[0].num_scheduled_tokens.get("a") for s in steps] == [30] + [1] * 9
    # 30 prompt + 10 outputs = max_model_len: the last output is LENGTH capped.
    assert steps[-1][1]["a"].finish_reason == FinishReason.LENGTH
    assert scheduler.kv_cache_manager.get_block_ids("a") == []


def decode_until_done(scheduler: Scheduler, tokens: list[int]) -> list[EngineCoreOutput]:
    """Feeds ``tokens`` as the samples of request "r" and collects its outputs."""
    feed = iter(tokens)
    outputs = []
    while scheduler.has_unfinished_requests():
        _, by_id = run_step(scheduler, lambda req_id: next(feed))
        outputs.append(by_id["r"])
    return outputs


def test_stop_on_eos():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5] * 20))
    outputs = decode_until_done(scheduler, [9, 8, EOS, 9])
    assert [o.new_token_ids for o in outputs] == [[9], [8], [EOS]]
    assert [o.finish_reason for o in outputs] == [None, None, FinishReason.STOP]
    assert outputs[-1].stop_reason is None
    assert scheduler.kv_cache_manager.num_free_blocks == 10
    assert scheduler.schedule().finished_req_ids == {"r"}


def test_stop_on_stop_token_id():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5] * 20, stop_token_ids=[40, 41]))
    outputs = decode_until_done(scheduler, [9, 41, 9])
    assert [o.new_token_ids for o in outputs] == [[9], [41]]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, 41)


def test_max_tokens_is_length_capped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5] * 20, max_tokens=3))
    outputs = decode_until_done(scheduler, [9, 9, 9, 9])
    assert [o.finish_reason for o in outputs] == [None, None, FinishReason.LENGTH]


def test_ignore_eos_keeps_going():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5] * 20, max_tokens=3, ignore_eos=True))
    outputs = decode_until_done(scheduler, [EOS, EOS, EOS])
    assert [o.new_token_ids for o in outputs] == [[EOS], [EOS], [EOS]]
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_holds_back_eos():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5] * 20, min_tokens=3, stop_token_ids=[40]))
    outputs = decode_until_done(scheduler, [EOS, 40, 9, EOS])
    assert [o.new_token_ids for o in outputs] == [[EOS], [40], [9], [EOS]]
    assert [o.finish_reason for o in outputs] == [None, None, None, FinishReason.STOP]


def test_multi_token_output_stops_at_the_stop_token_and_trims_logprobs():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5] * 20, logprobs=0))
    scheduler_output = scheduler.schedule()
    logprobs = Logprobs([[9], [EOS], [8]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])
    runner_output = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[9, EOS, 8]],
                                      logprobs={"r": logprobs})
    (out,) = scheduler.update_from_output(scheduler_output, runner_output)[0].outputs
    assert out.new_token_ids == [9, EOS]
    assert out.new_logprobs == Logprobs([[9], [EOS]], [[-0.1], [-0.2]], [1, 1])
    assert out.finish_reason == FinishReason.STOP


def test_prompt_bigger_than_pool_is_ignored_and_next_runs():
    scheduler = make_scheduler()  # 10 usable blocks = 160 tokens
    scheduler.add_request(make_request("huge", list(range(200))))
    scheduler.add_request(make_request("next", [3] * 10))
    assert list(scheduler.requests) == ["next"]
    scheduler_output, outputs = run_step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"next": 10}
    huge = outputs["huge"]
    assert (huge.finish_reason, huge.new_token_ids) == (FinishReason.LENGTH, [])
    assert huge.finish_message == "prompt has 200 tokens and needs 13 blocks, the KV cache has 10"
    assert outputs["next"].new_token_ids == [7]


def test_prompt_reaching_max_model_len_is_ignored_and_next_runs():
    scheduler = make_scheduler(max_model_len=64)
    scheduler.add_request(make_request("long", [4] * 64))
    scheduler.add_request(make_request("short", [4] * 63))
    assert scheduler.has_requests()
    scheduler_output, outputs = run_step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"short": 63}
    assert outputs["long"].finish_reason == FinishReason.LENGTH
    assert outputs["long"].finish_message == "prompt has 64 tokens, max_model_len is 64"
    # 63 prompt tokens + 1 output reach max_model_len at once.
    assert outputs["short"].finish_reason == FinishReason.LENGTH


def test_outputs_grouped_by_client_index():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 5, client_index=0))
    scheduler.add_request(make_request("b", [2] * 5, client_index=3))
    scheduler.add_request(make_request("c", [3] * 5, client_index=3))
    scheduler_output = scheduler.schedule()
    runner_output = ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[11], [12], [13]])
    engine_outputs = scheduler.update_from_output(scheduler_output, runner_output)
    assert sorted(engine_outputs) == [0, 3]
    assert [(o.request_id, o.new_token_ids) for o in engine_outputs[3].outputs] == [
        ("b", [12]), ("c", [13])]
    assert [o.request_id for o in engine_outputs[0].outputs] == ["a"]


def test_abort_waiting_and_running():
    scheduler = make_scheduler(limits=SchedulingLimits(max_num_seqs=1))
    scheduler.add_request(make_request("run", [1] * 20))
    scheduler.add_request(make_request("wait", [2] * 20))
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["run"]
    assert [r.request_id for r in scheduler.waiting] == ["wait"]
    assert scheduler.kv_cache_manager.get_block_ids("run") == [1, 2]

    scheduler.finish_requests("wait", RequestStatus.FINISHED_ABORTED)
    assert len(scheduler.waiting) == 0 and list(scheduler.requests) == ["run"]
    scheduler.finish_requests(["run", "unknown", "wait"], RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler, check_store=False)  # frees reach the store at the next update
    assert scheduler.running == [] and scheduler.requests == {}
    assert scheduler.kv_cache_manager.num_free_blocks == 10
    assert not scheduler.has_unfinished_requests() and scheduler.has_requests()
    scheduler_output = scheduler.schedule()
    assert scheduler_output.finished_req_ids == {"run", "wait"}
    assert scheduler_output.total_num_scheduled_tokens == 0
    assert scheduler.update_from_output(scheduler_output, ModelRunnerOutput()) == {}
    check_invariants(scheduler)
    assert not scheduler.has_requests()
    with pytest.raises(ValueError, match="FINISHED_"):
        scheduler.finish_requests("run", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_drops_the_sample():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1] * 5))
    scheduler_output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    runner_output = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[9]])
    assert scheduler.update_from_output(scheduler_output, runner_output) == {}
    check_invariants(scheduler)


def test_a_request_the_worker_dropped_fails_alone_with_its_status():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("bad", [1] * 17))
    scheduler.add_request(make_request("good", [2] * 5))
    scheduler_output = scheduler.schedule()
    failure = RequestFailure.of(grpc.StatusCode.INVALID_ARGUMENT, "extra_args.ban: not a list")
    runner_output = ModelRunnerOutput(req_ids=["good"], sampled_token_ids=[[9]],
                                      failed={"bad": failure})
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    check_invariants(scheduler)
    bad, good = outputs[0].outputs[1], outputs[0].outputs[0]
    assert (bad.request_id, bad.finish_reason, bad.new_token_ids) == ("bad", FinishReason.ABORT, [])
    assert bad.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.finish_message == "extra_args.ban: not a list"
    assert good.new_token_ids == [9] and not good.finished
    assert list(scheduler.requests) == ["good"]
    assert scheduler.kv_cache_manager.get_block_ids("bad") == []
    # Its KV may never have been written: the same prompt again hits nothing.
    scheduler.add_request(make_request("again", [1] * 17))
    scheduler_output, by_id = run_step(scheduler)
    assert "bad" in scheduler_output.finished_req_ids
    assert by_id["again"].num_cached_tokens == 0


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(policy="priority", limits=SchedulingLimits(max_num_seqs=1))
    for req_id, priority, arrival in [("low", 5, 0.0), ("high-late", 0, 2.0), ("high", 0, 1.0)]:
        request = make_request(req_id, [1] * 5, max_tokens=1)
        request.priority, request.arrival_time = priority, arrival
        scheduler.add_request(request)
    order = [next(iter(run_step(scheduler)[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["high", "high-late", "low"]


def test_waiting_head_that_does_not_fit_blocks_later_requests():
    scheduler = make_scheduler(num_blocks=6)  # 5 usable blocks
    scheduler.add_request(make_request("a", [1] * 48, max_tokens=2))  # 3 blocks (4 after 1 decode)
    run_step(scheduler)
    scheduler.add_request(make_request("big", [2] * 40))  # needs 3 blocks, 2 free
    scheduler.add_request(make_request("small", [3] * 5))  # would fit, but FCFS
    scheduler_output, _ = run_step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"a": 1}
    scheduler_output, _ = run_step(scheduler)  # "a" finished last step
    assert scheduler_output.num_scheduled_tokens == {"big": 40, "small": 5}


def test_stats_and_queue_bound():
    scheduler = make_scheduler(max_num_waiting=2, limits=SchedulingLimits(max_num_seqs=1))
    scheduler.add_request(make_request("a", [1] * 20))
    scheduler.add_request(make_request("b", [2] * 20))
    with pytest.raises(WaitingQueueFullError, match="max_num_waiting is 2"):
        scheduler.add_request(make_request("c", [3] * 20))
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(make_request("a", [1] * 20))
    with pytest.raises(ValueError, match="0 prompt tokens"):
        scheduler.add_request(make_request("empty", []))
    run_step(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_cached_blocks) == (10, 8, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)
    # Only "a" was looked up: "b" is not even peeked while max_num_seqs are running.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_blocks", 1, "num_blocks is 1, must be an integer >= 2"),
        ("max_num_batched_tokens", 0, "max_num_batched_tokens is 0, must be an integer >= 1"),
        ("long_prefill_token_threshold", -1, "long_prefill_token_threshold is -1"),
        ("max_model_len", 1, "max_model_len is 1, must be an integer >= 2"),
        ("policy", "lifo", "policy is 'lifo', allowed: 'fcfs', 'priority'"),
    ],
)
def test_config_validation_names_field_and_range(field: str, value, message: str):
    kwargs = {"num_blocks": 11, field: value}
    with pytest.raises(ValueError, match=message):
        if field in {f.name for f in dataclasses.fields(SchedulingLimits)}:
            kwargs["limits"] = SchedulingLimits(**{field: kwargs.pop(field)})
        SchedulerConfig(**kwargs)


def test_results_for_unscheduled_requests_are_dropped():
    scheduler = make_scheduler(limits=SchedulingLimits(max_num_seqs=1))
    scheduler.add_request(make_request("a", [1] * 5))
    scheduler.add_request(make_request("b", [2] * 5))
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {"a": 5}
    runner_output = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[9], [9]])
    (out,) = scheduler.update_from_output(scheduler_output, runner_output)[0].outputs
    assert out.request_id == "a"
    assert scheduler.requests["b"].output_token_ids == []
    check_invariants(scheduler)


def test_prompt_logprobs_of_a_prefill_chunk_are_reported():
    scheduler = make_scheduler(limits=SchedulingLimits(max_num_batched_tokens=8))
    scheduler.add_request(make_request("a", [1] * 12, prompt_logprobs=0))
    chunk = Logprobs([[1]] * 8, [[-1.0]] * 8, [1] * 8)
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {"a": 8}
    runner_output = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]],
                                      prompt_logprobs={"a": chunk})
    (out,) = scheduler.update_from_output(scheduler_output, runner_output)[0].outputs
    assert (out.new_token_ids, out.new_prompt_logprobs, out.finished) == ([], chunk, False)


def answer(scheduler_output: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[tokens.get(r, []) for r in req_ids],
                             step_id=scheduler_output.step_id)


def test_two_steps_in_flight_fill_placeholders_and_drop_a_late_stops_extra_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [5] * 10))
    scheduler.add_request(make_request("one", [6] * 10, max_tokens=1))
    first = scheduler.schedule()  # both prompts: each samples its first token
    second = scheduler.schedule()  # before first's output: "a" computes its placeholder
    assert second.num_scheduled_tokens == {"a": 1}  # "one" already samples its last token
    assert second.scheduled_cached_reqs.num_computed_tokens == [10]
    outputs = scheduler.update_from_output(first, answer(first, {"a": [EOS], "one": [9]}))
    by_id = {o.request_id: o for outs in outputs.values() for o in outs.outputs}
    assert by_id["a"].new_token_ids == [EOS] and by_id["a"].finish_reason == FinishReason.STOP
    assert by_id["one"].finish_reason == FinishReason.LENGTH
    # The token "a" sampled after its EOS, a step late, is never shown.
    assert scheduler.update_from_output(second, answer(second, {"a": [11]})) == {}
    assert not scheduler.has_unfinished_requests()
    check_invariants(scheduler)


def test_a_token_for_a_prefill_chunk_is_not_taken():
    scheduler = make_scheduler(long_prefill_token_threshold=4)
    scheduler.add_request(make_request("a", [5] * 10))
    chunk = scheduler.schedule()
    assert chunk.num_scheduled_tokens == {"a": 4}
    assert scheduler.update_from_output(chunk, answer(chunk, {"a": [9]})) == {}
    assert scheduler.requests["a"].output_token_ids == []
