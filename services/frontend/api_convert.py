"""The frontend's one place where the public kvmesh.v1 API meets in-memory types.

Engine messages (EngineCoreRequest, EngineCoreOutputs, SamplingParams on the
wire) convert through ``services.common.convert``; this module adds the
public ``Generation`` messages on top of it.

Public sampling defaults: an unset field takes vLLM's default. The fields
whose default is not their proto3 zero (``n``, ``temperature``, ``top_p``,
``repetition_penalty``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``detokenize``) are ``optional`` in the
proto, so ``services.common.convert`` tells unset (default) from an explicit
zero (``temperature`` 0 is greedy; ``n`` 0 is rejected by validation). An
unset ``max_tokens`` means "up to max_model_len". A request without
``sampling_params`` gets ``SamplingParams()``: every vLLM default, its
``max_tokens`` 16 included.
The Generate API always returns text, so ``detokenize`` is always on.
"""

from __future__ import annotations

from kvmesh.v1 import api_pb2, engine_pb2

from services.common.convert import sampling_params_from_proto
from services.common.sampling_params import SamplingParams
from services.frontend.input_processor import PromptType
from services.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from services.common.validation import ValidationError


def sampling_params_from_api(msg: engine_pb2.SamplingParams, present: bool) -> SamplingParams:
    """SamplingParams from a public request, with the defaults above applied."""
    params = sampling_params_from_proto(msg) if present else SamplingParams()
    params.detokenize = True
    return params


def chat_messages_from_api(msg: api_pb2.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in msg.messages]


def prompt_from_api(msg: api_pb2.GenerateRequest | api_pb2.TokenizeRequest) -> PromptType:
    """The prompt of a Generate or Tokenize request: text, chat messages or token ids.

    Raises ValidationError("prompt") when none is set.
    """
    which = msg.WhichOneof("prompt")
    if which == "text":
        return msg.text
    if which == "chat":
        return chat_messages_from_api(msg.chat)
    if which == "token_ids":
        return list(msg.token_ids.ids)
    raise ValidationError("prompt", "prompt must be set: one of text, chat or token_ids")


# ---------------------------------------------------------------- outputs


def _position_to_api(position: dict[int, Logprob] | None) -> api_pb2.PositionLogprobs:
    # None: the first prompt token, which has no logprob (an empty position).
    if position is None:
        return api_pb2.PositionLogprobs()
    return api_pb2.PositionLogprobs(
        entries=[
            api_pb2.TokenLogprob(
                token_id=token_id,
                logprob=lp.logprob,
                rank=lp.rank or 0,
                decoded_token=lp.decoded_token or "",
            )
            for token_id, lp in position.items()
        ]
    )


def completion_output_to_api(output: CompletionOutput) -> api_pb2.CompletionOutput:
    msg = api_pb2.CompletionOutput(
        index=output.index,
        text=output.text,
        token_ids=output.token_ids,
        logprobs=[_position_to_api(p) for p in output.logprobs or ()],
        finish_reason=output.finish_reason or "",
    )
    if output.cumulative_logprob is not None:
        msg.cumulative_logprob = output.cumulative_logprob
    if isinstance(output.stop_reason, str):
        msg.stop_str = output.stop_reason
    elif output.stop_reason is not None:
        msg.stop_token_id = output.stop_reason
    return msg


def _metrics_to_api(output: RequestOutput) -> api_pb2.RequestMetrics:
    stats = output.metrics
    if stats is None:
        return api_pb2.RequestMetrics(num_cached_tokens=output.num_cached_tokens)
    return api_pb2.RequestMetrics(
        arrival_time=stats.arrival_time,
        first_token_latency_s=stats.ttft_s or 0.0,
        mean_time_per_output_token_s=stats.tpot_s or 0.0,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
        num_generation_tokens=stats.num_generation_tokens,
    )


def request_output_to_api(
    client_request_id: str, output: RequestOutput, *, first: bool
) -> api_pb2.GenerateResponse:
    """One streamed chunk.

    The prompt (ids and logprobs) rides only on the first chunk, the metrics
    only on the final one; with n > 1 they are those of the sequence that
    finished last.
    """
    msg = api_pb2.GenerateResponse(
        request_id=client_request_id,
        outputs=[completion_output_to_api(o) for o in output.outputs],
        finished=output.finished,
    )
    if first:
        msg.prompt_token_ids.extend(output.prompt_token_ids)
        if output.prompt_logprobs:
            msg.prompt_logprobs.extend(_position_to_api(p) for p in output.prompt_logprobs)
    if output.finished:
        msg.metrics.CopyFrom(_metrics_to_api(output))
    return msg
