"""Request validation: every check names the field and the allowed range.

The frontend checks every request at admission; the scheduler checks what it
receives again (``validate_engine_core_request``), because anything that can
reach its port can send an EngineCoreRequest. Servers map ``ValidationError``
to INVALID_ARGUMENT.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from services.common.engine import EngineCoreRequest
from services.common.sampling_params import SamplingParams, StructuredOutputsParams

DEFAULT_MAX_LOGPROBS = 20
# The frontend makes internal ids "<client id>-<8 hex>" (and "<i>_" before a
# child's), so the engine core accepts longer ids than a client may send.
MAX_CLIENT_REQUEST_ID_CHARS = 256
MAX_INTERNAL_REQUEST_ID_CHARS = 512
MAX_CACHE_SALT_CHARS = 256
# Seeds travel as proto int64.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# extra_args travel as a protobuf Struct: numbers are doubles, so larger
# integers would arrive changed.
MAX_EXACT_INT = 2**53
# Each Struct level costs protobuf several message levels, and the services'
# parsers stop at 100 (the worker's SchedulerOutput wraps extra_args deepest):
# deeper extra_args would break a stream other requests share.
MAX_EXTRA_ARGS_DEPTH = 16
# A structured-output constraint's text (schema, regex, grammar, all choices):
# compiling it costs the worker time and memory, so it is bounded.
MAX_STRUCTURED_OUTPUT_CHARS = 65536


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLimits:
    """Bounds a frontend puts on one request, checked before any expensive work.

    Each keeps one request from stalling the others: ``max_n`` sequences,
    ``max_stop`` stop strings of at most ``max_stop_chars`` characters,
    ``max_chat_messages`` messages, and a prompt of at most
    ``max_prompt_bytes`` bytes of text (None: as many as ``max_model_len``
    tokens can hold, from the tokenizer's longest token), checked before it
    is tokenized. Request ids and cache salts are bounded by
    MAX_CLIENT_REQUEST_ID_CHARS and MAX_CACHE_SALT_CHARS.
    """

    max_n: int = 128
    max_stop: int = 64
    max_stop_chars: int = 1024
    max_chat_messages: int = 1024
    max_prompt_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name} is {value!r}, must be an integer >= 1")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in fields(RequestLimits):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class ValidationError(ValueError):
    """A request parameter outside its allowed range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _fail(field: str, allowed: str, value: object) -> ValidationError:
    return ValidationError(field, f"{field} must be {allowed}, got {value!r}")


def _check_float(
    field: str, value: object, predicate: Callable[[float], bool], allowed: str
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not predicate(value):
        raise _fail(field, allowed, value)


def _check_int(
    field: str, value: object, minimum: int, allowed: str, maximum: int | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(field, allowed, value)
    if maximum is not None and value > maximum:
        raise _fail(field, allowed, value)


def validate_sampling_params(
    params: SamplingParams, *, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    limits: RequestLimits = RequestLimits(),
) -> None:
    """Raises ValidationError for the first parameter outside its range.

    ``max_tokens`` may be None here (the input processor fills it from the
    prompt length); when set, ``min_tokens`` must not exceed it.
    """
    _check_int("n", params.n, 1, f"in [1, {limits.max_n}]", limits.max_n)
    _check_float("temperature", params.temperature, lambda v: 0 <= v < math.inf, ">= 0")
    _check_float("top_p", params.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
    _check_float("min_p", params.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
    _check_int("top_k", params.top_k, -1, "-1 or 0 (disabled) or >= 1")
    if params.max_tokens is not None:
        _check_int("max_tokens", params.max_tokens, 1, ">= 1")
    _check_int("min_tokens", params.min_tokens, 0, ">= 0")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise _fail("min_tokens", f"<= max_tokens ({params.max_tokens})", params.min_tokens)
    for field in ("presence_penalty", "frequency_penalty"):
        _check_float(field, getattr(params, field), lambda v: -2 <= v <= 2, "in [-2, 2]")
    _check_float("repetition_penalty", params.repetition_penalty, lambda v: 0 < v <= 2,
                 "in (0, 2]")
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(params, field)
        if value is not None:
            _check_int(field, value, 0, f"in [0, {max_logprobs}]", max_logprobs)
    if params.thinking_token_budget is not None:
        _check_int("thinking_token_budget", params.thinking_token_budget, 0, ">= 0")
    if params.seed is not None:
        _check_int("seed", params.seed, INT64_MIN, f"in [{INT64_MIN}, {INT64_MAX}]", INT64_MAX)
    _validate_stop(params, limits)
    _validate_token_ids(params, vocab_size)
    if params.extra_args is not None:
        if not isinstance(params.extra_args, dict):
            raise _fail("extra_args", "a dict with string keys", params.extra_args)
        _check_json_like("extra_args", params.extra_args, depth=1)
    if params.structured_outputs is not None:
        if not isinstance(params.structured_outputs, StructuredOutputsParams):
            raise _fail("structured_outputs", "a StructuredOutputsParams",
                        params.structured_outputs)
        validate_structured_outputs_shape(params.structured_outputs)


def validate_structured_outputs_shape(so: StructuredOutputsParams) -> None:
    """Exactly one constraint, of the right type and size; not whether it compiles.

    The frontend also compiles it (``services/frontend/structured_outputs.py``);
    the scheduler, which stays grammar-free, checks only this.
    """
    try:
        kind = so.kind
    except ValueError as e:
        raise ValidationError("structured_outputs", str(e)) from None
    field = f"structured_outputs.{kind}"
    value = getattr(so, kind)
    if kind == "json_object":
        return
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise _fail(field, "a non-empty list of strings", value)
        size = sum(len(c) for c in value)
    else:
        if not isinstance(value, str) or not value:
            raise _fail(field, "a non-empty string", value)
        size = len(value)
    if size > MAX_STRUCTURED_OUTPUT_CHARS:
        raise ValidationError(field, f"{field} must hold at most "
                              f"{MAX_STRUCTURED_OUTPUT_CHARS} characters, got {size}")


def _validate_stop(params: SamplingParams, limits: RequestLimits) -> None:
    if not isinstance(params.stop, list) or not all(isinstance(s, str) for s in params.stop):
        raise _fail("stop", "a list of strings", params.stop)
    if len(params.stop) > limits.max_stop:
        raise ValidationError("stop", f"stop must hold at most {limits.max_stop} strings, "
                                      f"got {len(params.stop)}")
    for stop in params.stop:
        if not 1 <= len(stop) <= limits.max_stop_chars:
            raise ValidationError("stop", f"stop strings must have 1 to {limits.max_stop_chars} "
                                          f"characters, got {len(stop)}")
    if params.stop and not params.detokenize:
        raise ValidationError("stop", "stop strings need detokenize=True")


def _validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if params.logit_bias is not None:
        check_token_ids("logit_bias", params.logit_bias.keys(), vocab_size)
        for token_id, bias in params.logit_bias.items():
            _check_float(f"logit_bias[{token_id}]", bias, math.isfinite, "a finite number")
    if params.allowed_token_ids is not None:
        if not params.allowed_token_ids:
            raise _fail("allowed_token_ids", "a non-empty list when given", [])
        check_token_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
    so = params.structured_outputs
    if isinstance(so, StructuredOutputsParams) and so.reasoning_end_token_ids is not None:
        check_token_ids("structured_outputs.reasoning_end_token_ids",
                        so.reasoning_end_token_ids, vocab_size)


def _check_json_like(path: str, value: object, depth: int) -> None:
    """``value`` (at ``path`` inside extra_args) must survive a protobuf Struct unchanged.

    Allowed: None, bool, str, finite float, int within +-2**53, lists, and
    dicts with string keys, nested at most MAX_EXTRA_ARGS_DEPTH deep.
    """
    if isinstance(value, (dict, list)) and depth > MAX_EXTRA_ARGS_DEPTH:
        raise ValidationError(
            "extra_args",
            f"extra_args must nest at most {MAX_EXTRA_ARGS_DEPTH} levels deep, "
            f"{path} is at level {depth}",
        )
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _fail_extra_args(f"{path} keys", "strings", key)
            _check_json_like(f"{path}[{key!r}]", item, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json_like(f"{path}[{index}]", item, depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _fail_extra_args(path, "a finite number", value)
    elif isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > MAX_EXACT_INT:
            raise _fail_extra_args(path, "an integer in [-2**53, 2**53]", value)
    elif value is not None and not isinstance(value, (bool, str)):
        raise _fail_extra_args(path, "JSON-like (None, bool, number, str, list or dict)", value)


def _fail_extra_args(path: str, allowed: str, value: object) -> ValidationError:
    # The field stays "extra_args"; the message says where inside it.
    return ValidationError("extra_args", f"{path} must be {allowed}, got {value!r}")


def check_token_ids(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """Every id must be an int in [0, vocab_size)."""
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not (
            0 <= token_id < vocab_size
        ):
            raise ValidationError(
                field, f"{field} must hold token ids in [0, {vocab_size}), got {token_id!r}"
            )


def validate_prompt(prompt_token_ids: list[int], *, vocab_size: int) -> None:
    """The prompt must be non-empty and made of ids the model knows."""
    if not prompt_token_ids:
        raise ValidationError("prompt", "prompt must not be empty")
    check_token_ids("prompt", prompt_token_ids, vocab_size)


def resolve_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """The max_tokens the request will run with, checked against max_model_len.

    None means "up to the context window": max_model_len - prompt length.
    """
    if params.max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise ValidationError(
                "prompt",
                f"prompt has {num_prompt_tokens} tokens, max_model_len is {max_model_len}",
            )
        max_tokens = max_model_len - num_prompt_tokens
        if params.min_tokens > max_tokens:
            raise _fail("min_tokens", f"<= max_tokens ({max_tokens})", params.min_tokens)
        return max_tokens
    if num_prompt_tokens + params.max_tokens > max_model_len:
        raise ValidationError(
            "max_tokens",
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}, "
            f"but max_model_len is {max_model_len}",
        )
    return params.max_tokens


def check_string_length(field: str, value: object, max_chars: int, *, allow_empty: bool) -> None:
    """``value`` must be a str of at most ``max_chars`` characters (non-empty unless allowed)."""
    if not isinstance(value, str) or len(value) > max_chars or (not value and not allow_empty):
        shown = value if not isinstance(value, str) or len(value) <= 64 else f"{value[:64]}..."
        least = 0 if allow_empty else 1
        raise ValidationError(
            field, f"{field} must be a string of {least} to {max_chars} characters, got {shown!r}")


def validate_engine_core_request(
    request: EngineCoreRequest, *, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS
) -> None:
    """What the frontend guarantees about an EngineCoreRequest, checked again by the engine core.

    Raises ValidationError for a bad request id or cache salt, an empty prompt,
    a token id outside [0, vocab_size) (prompt, EOS, outputs so far, stop ids,
    logit bias, allowed ids), n other than 1 (the frontend fans n > 1 out), an
    unset max_tokens (the frontend resolves it), at least max_tokens outputs
    so far or any sampling parameter out of range.
    """
    check_string_length("request_id", request.request_id, MAX_INTERNAL_REQUEST_ID_CHARS,
                        allow_empty=False)
    if request.cache_salt is not None:
        check_string_length("cache_salt", request.cache_salt, MAX_CACHE_SALT_CHARS,
                            allow_empty=True)
    validate_prompt(request.prompt_token_ids, vocab_size=vocab_size)
    if request.eos_token_id is not None:
        check_token_ids("eos_token_id", [request.eos_token_id], vocab_size)
    params = request.sampling_params
    validate_sampling_params(params, vocab_size=vocab_size, max_logprobs=max_logprobs)
    if params.n != 1:
        raise _fail("n", "1 at the engine core (the frontend fans n > 1 out)", params.n)
    if params.max_tokens is None:
        raise ValidationError("max_tokens", "max_tokens must be set at the engine core")
    check_token_ids("output_token_ids", request.output_token_ids, vocab_size)
    if len(request.output_token_ids) >= params.max_tokens:
        raise _fail("output_token_ids", f"fewer than max_tokens ({params.max_tokens}) ids",
                    len(request.output_token_ids))
