"""The one place where in-memory engine types meet their kvmesh.v1 messages.

Every service converts through these functions; nothing else touches pb2
field names. ``to_proto``/``from_proto`` pairs round-trip exactly, except that
numbers in ``SamplingParams.extra_args`` come back as floats.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, islice
from typing import Any

from google.protobuf import struct_pb2
from kvmesh.v1 import api_pb2
from kvmesh.v1 import engine_pb2 as pb
from kvmesh.v1 import scheduler_pb2 as spb

from services.common.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
)
from services.common.limits import SchedulingLimits
from services.common.model_runner_output import ModelRunnerOutput, RequestFailure
from services.common.registration import Drain, LeaveRefused, LeaveRequest, WorkerRegistration
from services.common.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from services.common.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from services.common.stats import SchedulerStats, SpecDecodingStats
from services.common.validation import ValidationError

# ---------------------------------------------------------------- sampling

# Optional scalars whose vLLM default is not their proto3 zero: unset takes
# SamplingParams' default (vLLM's), an explicit zero stays a zero.
_DEFAULTED_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "repetition_penalty",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
)
# Optional scalars whose unset value is None (no seed, no logprobs, ...).
_NULLABLE_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "thinking_token_budget")


def sampling_params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        top_k=p.top_k,
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=p.logit_bias or {},
        allowed_token_ids=p.allowed_token_ids or [],
        stop=p.stop,
        include_stop_str_in_output=p.include_stop_str_in_output,
        output_kind=int(p.output_kind),
        **{name: getattr(p, name) for name in _DEFAULTED_FIELDS},
    )
    for name in _NULLABLE_FIELDS:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    if p.extra_args is not None:
        # Mark the Struct present first so that {} stays apart from None.
        msg.extra_args.SetInParent()
        msg.extra_args.update(p.extra_args)
    if p.structured_outputs is not None:
        _structured_outputs_to_proto(p.structured_outputs, msg)
    return msg


def _structured_outputs_to_proto(so: StructuredOutputsParams, msg: pb.SamplingParams) -> None:
    # Every set constraint goes out (the oneof keeps the last): validation
    # upstream refuses params that set several.
    for name in so.constraints:
        if name == "choice":
            msg.choice.SetInParent()  # an empty list stays set (and is refused)
            msg.choice.choices.extend(so.choice or ())
        else:
            setattr(msg, name, getattr(so, name))
    msg.disable_any_whitespace = so.disable_any_whitespace
    msg.reasoning_end_token_ids.extend(so.reasoning_end_token_ids or ())


def _structured_outputs_from_proto(msg: pb.SamplingParams) -> StructuredOutputsParams | None:
    kind = msg.WhichOneof("structured_output")
    if kind is None:
        return None
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputsParams(
        **{kind: value}, disable_any_whitespace=msg.disable_any_whitespace,
        reasoning_end_token_ids=list(msg.reasoning_end_token_ids) or None)


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The in-memory params of ``msg``; unset fields take vLLM's defaults.

    Unset ``max_tokens`` (and the other nullable fields) is None. Numbers in
    ``extra_args`` come back as floats: a Struct stores every number as a
    double, so an int and an integral float cannot be told apart.
    """
    return SamplingParams(
        top_k=msg.top_k,
        min_p=msg.min_p,
        min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        stop=list(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        output_kind=_output_kind(msg.output_kind),
        extra_args=_struct_to_dict(msg.extra_args) if msg.HasField("extra_args") else None,
        structured_outputs=_structured_outputs_from_proto(msg),
        **{name: getattr(msg, name) for name in _DEFAULTED_FIELDS if msg.HasField(name)},
        **{name: getattr(msg, name) if msg.HasField(name) else None for name in _NULLABLE_FIELDS},
    )


def _output_kind(value: int) -> RequestOutputKind:
    try:
        return RequestOutputKind(value)
    except ValueError:
        allowed = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
        raise ValidationError("output_kind",
                              f"output_kind must be one of {allowed}, got {value}") from None


def _struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    return {key: _value_to_python(value) for key, value in struct.fields.items()}


def _value_to_python(value: struct_pb2.Value) -> Any:
    # Not json_format.MessageToDict: it raises on NaN/inf, which the frontend's
    # validation must see and reject as INVALID_ARGUMENT naming extra_args.
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return _struct_to_dict(value.struct_value)
    if kind == "list_value":
        return [_value_to_python(item) for item in value.list_value.values]
    if kind is None or kind == "null_value":
        return None
    return getattr(value, kind)  # number_value (always a float), string_value, bool_value


# ---------------------------------------------------------------- logprobs


def logprobs_to_proto(lp: Logprobs | None) -> pb.Logprobs | None:
    if lp is None:
        return None
    return pb.Logprobs(
        positions=[
            pb.Logprobs.Position(token_ids=ids, logprobs=vals, sampled_token_rank=rank)
            for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.sampled_token_ranks)
        ]
    )


def logprobs_from_proto(msg: pb.Logprobs, present: bool) -> Logprobs | None:
    if not present:
        return None
    return Logprobs(
        token_ids=[list(p.token_ids) for p in msg.positions],
        logprobs=[list(p.logprobs) for p in msg.positions],
        sampled_token_ranks=[p.sampled_token_rank for p in msg.positions],
    )


# ---------------------------------------------------------------- frontend <-> scheduler


def engine_core_request_to_proto(r: EngineCoreRequest) -> pb.EngineCoreRequest:
    msg = pb.EngineCoreRequest(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        sampling_params=sampling_params_to_proto(r.sampling_params),
        arrival_time=r.arrival_time,
        priority=r.priority,
        client_index=r.client_index,
        output_token_ids=r.output_token_ids,
    )
    if r.eos_token_id is not None:
        msg.eos_token_id = r.eos_token_id
    if r.cache_salt is not None:
        msg.cache_salt = r.cache_salt
    return msg


def engine_core_request_from_proto(msg: pb.EngineCoreRequest) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=sampling_params_from_proto(msg.sampling_params),
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        arrival_time=msg.arrival_time,
        priority=msg.priority,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
        client_index=msg.client_index,
        output_token_ids=list(msg.output_token_ids),
    )


def engine_core_output_to_proto(o: EngineCoreOutput) -> pb.EngineCoreOutput:
    # One per request per step: only the fields that are set (most outputs are
    # a request id and one token) are built.
    msg = pb.EngineCoreOutput(request_id=o.request_id, new_token_ids=o.new_token_ids)
    if o.new_logprobs is not None:
        msg.new_logprobs.CopyFrom(logprobs_to_proto(o.new_logprobs))
    if o.new_prompt_logprobs is not None:
        msg.new_prompt_logprobs.CopyFrom(logprobs_to_proto(o.new_prompt_logprobs))
    if o.finish_reason is not None:
        msg.finish_reason = int(o.finish_reason)
    if isinstance(o.stop_reason, str):
        msg.stop_str = o.stop_reason
    elif o.stop_reason is not None:
        msg.stop_token_id = o.stop_reason
    if o.num_cached_tokens:
        msg.num_cached_tokens = o.num_cached_tokens
    if o.finish_message:
        msg.finish_message = o.finish_message
    if o.status_code:
        msg.status_code = o.status_code
    return msg


def engine_core_output_from_proto(msg: pb.EngineCoreOutput) -> EngineCoreOutput:
    which = msg.WhichOneof("stop_reason")
    return EngineCoreOutput(
        msg.request_id,
        list(msg.new_token_ids),
        logprobs_from_proto(msg.new_logprobs, True) if msg.HasField("new_logprobs") else None,
        (logprobs_from_proto(msg.new_prompt_logprobs, True)
         if msg.HasField("new_prompt_logprobs") else None),
        FinishReason(msg.finish_reason) if msg.finish_reason else None,
        getattr(msg, which) if which else None,
        msg.num_cached_tokens,
        msg.finish_message,
        msg.status_code,
    )


def engine_core_outputs_to_proto(o: EngineCoreOutputs) -> pb.EngineCoreOutputs:
    return pb.EngineCoreOutputs(
        engine_index=o.engine_index,
        outputs=[engine_core_output_to_proto(x) for x in o.outputs],
        timestamp=o.timestamp,
    )


def engine_core_outputs_from_proto(msg: pb.EngineCoreOutputs) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        outputs=[engine_core_output_from_proto(x) for x in msg.outputs],
        engine_index=msg.engine_index,
        timestamp=msg.timestamp,
    )


# ---------------------------------------------------------------- scheduler <-> worker


def scheduler_output_to_proto(s: SchedulerOutput) -> pb.SchedulerOutput:
    cached = s.scheduled_cached_reqs
    num_scheduled = s.num_scheduled_tokens
    return pb.SchedulerOutput(
        scheduled_new_reqs=[
            pb.NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=sampling_params_to_proto(r.sampling_params),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=r.output_token_ids,
            )
            for r in s.scheduled_new_reqs
        ],
        scheduled_cached_reqs=pb.CachedRequestData(
            req_ids=cached.req_ids,
            resumed_from_preemption=cached.resumed_from_preemption,
            num_computed_tokens=cached.num_computed_tokens,
            new_block_ids=list(chain.from_iterable(cached.new_block_ids)),
            num_new_block_ids=list(map(len, cached.new_block_ids)),
        ),
        num_scheduled_tokens=[num_scheduled[r.req_id] for r in s.scheduled_new_reqs]
        + list(map(num_scheduled.__getitem__, cached.req_ids)),
        total_num_scheduled_tokens=s.total_num_scheduled_tokens,
        finished_req_ids=sorted(s.finished_req_ids),
        step_id=s.step_id,
        durable_step_id=s.durable_step_id,
        num_draft_tokens=_draft_column(s.num_draft_tokens, s.scheduled_new_reqs, cached.req_ids),
    )


def _draft_column(num_draft_tokens: dict[str, int], new_reqs: list[NewRequestData],
                  cached_req_ids: list[str]) -> list[int]:
    """The draft budgets in num_scheduled_tokens' order; [] when there is none."""
    if not num_draft_tokens:
        return []
    get = num_draft_tokens.get
    return [get(r.req_id, 0) for r in new_reqs] + [get(r, 0) for r in cached_req_ids]


def scheduler_output_from_proto(msg: pb.SchedulerOutput) -> SchedulerOutput:
    """ValueError when the columns do not line up."""
    cached = msg.scheduled_cached_reqs
    new_reqs = [
        NewRequestData(
            req_id=r.req_id,
            prompt_token_ids=list(r.prompt_token_ids),
            sampling_params=sampling_params_from_proto(r.sampling_params),
            block_ids=list(r.block_ids),
            num_computed_tokens=r.num_computed_tokens,
            output_token_ids=list(r.output_token_ids),
        )
        for r in msg.scheduled_new_reqs
    ]
    req_ids = list(cached.req_ids)
    num_reqs = len(req_ids)
    if not (len(cached.resumed_from_preemption) == len(cached.num_computed_tokens)
            == len(cached.num_new_block_ids) == num_reqs
            and len(msg.num_scheduled_tokens) == len(new_reqs) + num_reqs
            and len(msg.num_draft_tokens) in (0, num_reqs + len(new_reqs))):
        raise ValueError("SchedulerOutput columns of different lengths")
    all_req_ids = [r.req_id for r in new_reqs] + req_ids
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=list(cached.resumed_from_preemption),
            new_block_ids=_split(cached.new_block_ids, cached.num_new_block_ids),
            num_computed_tokens=list(cached.num_computed_tokens),
        ),
        num_scheduled_tokens=dict(zip(all_req_ids, msg.num_scheduled_tokens)),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        step_id=msg.step_id,
        durable_step_id=msg.durable_step_id,
        num_draft_tokens={r: n for r, n in zip(all_req_ids, msg.num_draft_tokens) if n},
    )


def _split(flat: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """``flat`` cut into consecutive lists of ``counts`` items; ValueError if they
    do not add up."""
    if any(c < 0 for c in counts) or sum(counts) != len(flat):
        raise ValueError(f"{len(flat)} items cannot be split into lists of {list(counts)[:8]}")
    if not flat:
        return [[] for _ in counts]
    items = iter(flat)
    return [list(islice(items, c)) for c in counts]


def model_runner_output_to_proto(o: ModelRunnerOutput) -> pb.ModelRunnerOutput:
    msg = pb.ModelRunnerOutput(
        step_id=o.step_id,
        req_ids=o.req_ids,
        sampled_token_ids=list(chain.from_iterable(o.sampled_token_ids)),
        num_sampled_token_ids=list(map(len, o.sampled_token_ids)),
        num_draft_tokens=([o.num_draft_tokens.get(r, 0) for r in o.req_ids]
                          if o.num_draft_tokens else []),
        failed=[
            pb.ModelRunnerOutput.RequestFailure(
                req_id=req_id, status_code=f.status_code, message=f.message
            )
            for req_id, f in o.failed.items()
        ],
    )
    for req_id in o.logprobs.keys() | o.prompt_logprobs.keys():
        msg.logprobs.append(pb.ModelRunnerOutput.RequestLogprobs(
            req_id=req_id,
            logprobs=logprobs_to_proto(o.logprobs.get(req_id)),
            prompt_logprobs=logprobs_to_proto(o.prompt_logprobs.get(req_id)),
        ))
    return msg


def model_runner_output_from_proto(msg: pb.ModelRunnerOutput) -> ModelRunnerOutput:
    """ValueError when the columns do not line up."""
    if len(msg.num_sampled_token_ids) != len(msg.req_ids):
        raise ValueError(f"{len(msg.req_ids)} request ids but "
                         f"{len(msg.num_sampled_token_ids)} token counts")
    if len(msg.num_draft_tokens) not in (0, len(msg.req_ids)):
        raise ValueError(f"{len(msg.req_ids)} request ids but "
                         f"{len(msg.num_draft_tokens)} draft counts")
    out = ModelRunnerOutput(
        req_ids=list(msg.req_ids),
        sampled_token_ids=_split(msg.sampled_token_ids, msg.num_sampled_token_ids),
        step_id=msg.step_id,
        num_draft_tokens={r: n for r, n in zip(msg.req_ids, msg.num_draft_tokens) if n},
    )
    for r in msg.logprobs:
        if r.HasField("logprobs"):
            out.logprobs[r.req_id] = logprobs_from_proto(r.logprobs, True)
        if r.HasField("prompt_logprobs"):
            out.prompt_logprobs[r.req_id] = logprobs_from_proto(r.prompt_logprobs, True)
    for f in msg.failed:
        out.failed[f.req_id] = RequestFailure(f.status_code, f.message)
    return out


# ---------------------------------------------------------------- scheduler.proto envelopes


def add_request_message(r: EngineCoreRequest) -> spb.FrontendMessage:
    return spb.FrontendMessage(add_request=engine_core_request_to_proto(r))


def abort_message(request_ids: Iterable[str]) -> spb.FrontendMessage:
    return spb.FrontendMessage(abort=spb.AbortRequests(request_ids=list(request_ids)))


def frontend_message_from_proto(msg: spb.FrontendMessage) -> EngineCoreRequest | list[str]:
    """A request to add, or the ids of requests to abort; ValueError for an empty message."""
    kind = msg.WhichOneof("kind")
    if kind == "add_request":
        return engine_core_request_from_proto(msg.add_request)
    if kind == "abort":
        return list(msg.abort.request_ids)
    raise ValueError("FrontendMessage has no kind set, must be add_request or abort")


def registration_message(r: WorkerRegistration) -> spb.WorkerMessage:
    msg = spb.WorkerRegistration(
        worker_id=r.worker_id, model=r.model, dtype=r.dtype, block_size=r.block_size,
        num_blocks=r.num_blocks, max_model_len=r.max_model_len, vocab_size=r.vocab_size,
        eos_token_ids=r.eos_token_ids, dirty_block_ids=r.dirty_block_ids,
        num_speculative_tokens=r.num_speculative_tokens,
        speculative_disable_by_batch_size=r.speculative_disable_by_batch_size,
    )
    if r.limits is not None:
        msg.max_num_seqs = r.limits.max_num_seqs
        msg.max_num_batched_tokens = r.limits.max_num_batched_tokens
    return spb.WorkerMessage(registration=msg)


def _registration_from_proto(r: spb.WorkerRegistration) -> WorkerRegistration:
    """ValueError when the limits are half reported or out of range."""
    limits = None
    if r.max_num_seqs or r.max_num_batched_tokens:  # both 0: not reported
        limits = SchedulingLimits(max_num_seqs=r.max_num_seqs,
                                  max_num_batched_tokens=r.max_num_batched_tokens)
    return WorkerRegistration(
        r.worker_id, r.model, r.dtype, r.block_size, r.num_blocks, r.max_model_len,
        r.vocab_size, list(r.eos_token_ids), limits, list(r.dirty_block_ids),
        r.num_speculative_tokens, r.speculative_disable_by_batch_size,
    )


def runner_output_message(o: ModelRunnerOutput) -> spb.WorkerMessage:
    return spb.WorkerMessage(output=model_runner_output_to_proto(o))


def leave_message() -> spb.WorkerMessage:
    return spb.WorkerMessage(leave=spb.LeaveRequest())


def worker_message_from_proto(
    msg: spb.WorkerMessage,
) -> WorkerRegistration | ModelRunnerOutput | LeaveRequest:
    """A registration, a step's output or a request to leave; ValueError for an
    empty message."""
    kind = msg.WhichOneof("kind")
    if kind == "output":
        return model_runner_output_from_proto(msg.output)
    if kind == "registration":
        return _registration_from_proto(msg.registration)
    if kind == "leave":
        return LeaveRequest()
    raise ValueError("WorkerMessage has no kind set, must be registration, output or leave")


def registered_message(engine_index: int) -> spb.SchedulerMessage:
    return spb.SchedulerMessage(registered=spb.RegistrationAck(engine_index=engine_index))


def step_message(s: SchedulerOutput) -> spb.SchedulerMessage:
    return spb.SchedulerMessage(step=scheduler_output_to_proto(s))


def drain_message(leave_granted: bool = False) -> spb.SchedulerMessage:
    return spb.SchedulerMessage(drain=spb.Drain(leave_granted=leave_granted))


def leave_refused_message(reason: str) -> spb.SchedulerMessage:
    return spb.SchedulerMessage(leave_refused=spb.LeaveRefused(reason=reason))


def registration_ack_from_proto(msg: spb.SchedulerMessage) -> int:
    """The engine index the scheduler gave this worker; ValueError if ``msg`` is no ack."""
    if msg.WhichOneof("kind") != "registered":
        raise ValueError(f"expected a registration ack, got {msg.WhichOneof('kind')!r}")
    return msg.registered.engine_index


def scheduler_message_from_proto(
    msg: spb.SchedulerMessage,
) -> SchedulerOutput | LeaveRefused | Drain:
    """A step to run, a refused leave or a drain; ValueError for anything else."""
    kind = msg.WhichOneof("kind")
    if kind == "step":
        return scheduler_output_from_proto(msg.step)
    if kind == "drain":
        return Drain(msg.drain.leave_granted)
    if kind == "leave_refused":
        return LeaveRefused(msg.leave_refused.reason)
    raise ValueError(f"expected a step, drain or leave_refused, got {kind!r}")


def worker_stats_to_proto(worker_id: str, s: SchedulerStats) -> api_pb2.WorkerStats:
    spec = s.spec_decoding or SpecDecodingStats(0)
    return api_pb2.WorkerStats(
        worker_id=worker_id,
        num_total_blocks=s.num_total_blocks,
        num_free_blocks=s.num_free_blocks,
        num_cached_blocks=s.num_cached_blocks,
        num_running_reqs=s.num_running_reqs,
        num_waiting_reqs=s.num_waiting_reqs,
        prefix_cache_hit_rate=s.prefix_cache_hit_rate,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        kv_cache_usage=s.kv_cache_usage,
        num_preemptions=s.num_preemptions,
        num_evicted_blocks=s.num_evicted_blocks,
        num_generation_tokens=s.num_generation_tokens,
        generation_tokens_per_s=s.generation_tokens_per_s,
        history_interval_s=s.history_interval_s,
        block_map=s.block_map,
        blocks_per_cell=s.blocks_per_cell,
        num_cached_free_blocks=s.num_cached_free_blocks,
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
    )


def cluster_stats_to_proto(per_worker: Iterable[tuple[str, SchedulerStats]]) -> api_pb2.ClusterStats:
    return api_pb2.ClusterStats(
        workers=[worker_stats_to_proto(worker_id, s) for worker_id, s in per_worker]
    )
