"""What the scheduler accepts from a worker: bounded registrations, honest outputs."""

from __future__ import annotations

import grpc
import pytest

from services.common.engine import Logprobs
from services.common.limits import SchedulingLimits
from services.common.model_runner_output import ModelRunnerOutput, RequestFailure
from services.common.registration import WorkerRegistration
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.config import RegistrationBounds
from services.scheduler.worker_checks import (
    WorkerProtocolError,
    check_registration,
    check_runner_output,
)

VOCAB = 100


def registration(**changes) -> WorkerRegistration:
    fields = dict(worker_id="host-1.a_b", model="m", dtype="float32", block_size=16,
                  num_blocks=64, max_model_len=256, vocab_size=VOCAB, eos_token_ids=[2],
                  limits=SchedulingLimits(max_num_seqs=8))
    fields.update(changes)
    return WorkerRegistration(**fields)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(num_blocks=3_000_000), r"num_blocks is 3000000, allowed range is \[2, 1048576\]"),
    (dict(block_size=0), r"block_size is 0, allowed range is \[1, 1024\]"),
    (dict(max_model_len=1 << 30), "max_model_len is 1073741824"),
    (dict(vocab_size=0), r"vocab_size is 0, allowed range is \[1, 4194304\]"),
    (dict(eos_token_ids=[VOCAB]), r"eos_token_ids is 100, allowed range is \[0, 99\]"),
    (dict(worker_id=""), "worker_id '' must be 1 to 128 characters"),
    (dict(worker_id="a:b"), "worker_id 'a:b' must be"),
    (dict(limits=SchedulingLimits(max_num_seqs=1 << 20)), "max_num_seqs is 1048576"),
])
def test_registration_outside_the_bounds_names_the_field(changes, message):
    check_registration(registration(), RegistrationBounds())
    with pytest.raises(ValueError, match=message):
        check_registration(registration(**changes), RegistrationBounds())


def step() -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 16}, total_num_scheduled_tokens=17,
                           step_id=5)


def output(**changes) -> ModelRunnerOutput:
    fields = dict(req_ids=["a", "b"], sampled_token_ids=[[7], []], step_id=5)
    fields.update(changes)
    return ModelRunnerOutput(**fields)


def failure(code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> RequestFailure:
    return RequestFailure(code.value[0], "logits are not finite")


def rows(n: int, token_id: int = 1) -> Logprobs:
    return Logprobs([[token_id]] * n, [[-0.5]] * n, [1] * n)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(step_id=4), "answered step 4, step in flight is 5"),
    (dict(req_ids=["a", "c"]), "output for request 'c', not scheduled in step 5"),
    (dict(req_ids=["a", "a"]), "a request id appears twice"),
    (dict(sampled_token_ids=[[VOCAB], []]), r"allowed: 0 to 1 token ids in \[0, 100\)"),
    (dict(sampled_token_ids=[[-1], []]), "0 to 1 token ids"),
    (dict(sampled_token_ids=[[1, 2], []]), "0 to 1 token ids"),
    (dict(num_draft_tokens={"a": 1}), r"verified 1 drafts, allowed range is \[0, 0\]"),
    (dict(sampled_token_ids=[[1]]), "2 request ids but 1 token lists"),
    (dict(logprobs={"a": rows(2)}), "2 logprobs rows, at most 1 allowed"),
    (dict(logprobs={"b": rows(1)}), "1 logprobs rows, at most 0 allowed"),
    (dict(logprobs={"a": rows(1, VOCAB)}), "logprobs token id outside"),
    (dict(prompt_logprobs={"b": rows(17)}), "17 prompt_logprobs rows, at most 16 allowed"),
    (dict(req_ids=["a"], sampled_token_ids=[[7]]),
     "answered 1 of the 2 requests scheduled in step 5"),
    (dict(failed={"c": failure()}), "failure for request 'c', not scheduled"),
    (dict(failed={"a": failure()}), "both failed and has an output"),
    (dict(req_ids=["a"], sampled_token_ids=[[7]], failed={"b": failure(grpc.StatusCode.OK)}),
     "failed with status 0, allowed: INVALID_ARGUMENT or INTERNAL"),
    (dict(req_ids=["a"], sampled_token_ids=[[7]], failed={"b": RequestFailure(13, "x" * 1001)}),
     "failure message of 1001 characters, at most 1000 allowed"),
])
def test_dishonest_outputs_are_protocol_errors(changes, message):
    check_runner_output(output(logprobs={"a": rows(1)}, prompt_logprobs={"b": rows(16)}),
                        step(), VOCAB)
    check_runner_output(output(req_ids=["a"], sampled_token_ids=[[7]], failed={"b": failure()}),
                        step(), VOCAB)
    with pytest.raises(WorkerProtocolError, match=message):
        check_runner_output(output(**changes), step(), VOCAB)


def draft_step() -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens={"a": 4, "b": 16}, total_num_scheduled_tokens=20,
                           step_id=5, num_draft_tokens={"a": 3})


@pytest.mark.parametrize(("changes", "message"), [
    (dict(num_draft_tokens={"a": 4}), r"verified 4 drafts, allowed range is \[0, 3\]"),
    (dict(sampled_token_ids=[[7, 8, 9], []], num_draft_tokens={"a": 1}),
     "allowed: 1 to 2 token ids"),
    (dict(sampled_token_ids=[[], []], num_draft_tokens={"a": 2}), "allowed: 1 to 3 token ids"),
])
def test_draft_outputs_stay_within_what_was_verified(changes, message):
    """A worker may verify fewer drafts than its budget, never more, and returns
    the drafts it accepted plus one token."""
    check_runner_output(output(sampled_token_ids=[[7, 8, 9, 10], []],
                               num_draft_tokens={"a": 3}), draft_step(), VOCAB)
    check_runner_output(output(sampled_token_ids=[[7], []]), draft_step(), VOCAB)
    with pytest.raises(WorkerProtocolError, match=message):
        check_runner_output(output(**changes), draft_step(), VOCAB)
