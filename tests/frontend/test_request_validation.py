"""Every validation rule rejects its bad value with the field and allowed range."""

from __future__ import annotations

import math

import pytest

from services.common.sampling_params import SamplingParams
from services.common.validation import ValidationError
from services.frontend.input_processor import InputProcessor, logits_processor_validators

MAX_MODEL_LEN = 2048  # the input_processor fixture's

BAD_PARAMS = [
    (dict(n=0), "n", "n must be in [1, 128], got 0"),
    (dict(temperature=-0.5), "temperature", "temperature must be >= 0, got -0.5"),
    (dict(temperature=math.inf), "temperature", "temperature must be >= 0, got inf"),
    (dict(temperature=math.nan), "temperature", "temperature must be >= 0, got nan"),
    (dict(temperature="hot"), "temperature", "temperature must be >= 0, got 'hot'"),
    (dict(top_p=0.0), "top_p", "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p", "top_p must be in (0, 1], got 1.5"),
    (dict(min_p=-0.1), "min_p", "min_p must be in [0, 1], got -0.1"),
    (dict(min_p=1.1), "min_p", "min_p must be in [0, 1], got 1.1"),
    (dict(top_k=-2), "top_k", "top_k must be -1 or 0 (disabled) or >= 1, got -2"),
    (dict(top_k=1.5), "top_k", "top_k must be -1 or 0 (disabled) or >= 1, got 1.5"),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1, got 0"),
    (dict(min_tokens=-1), "min_tokens", "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=8, max_tokens=4), "min_tokens", "min_tokens must be <= max_tokens (4), got 8"),
    (dict(presence_penalty=2.5), "presence_penalty",
     "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty",
     "frequency_penalty must be in [-2, 2], got -3"),
    (dict(repetition_penalty=0.0), "repetition_penalty",
     "repetition_penalty must be in (0, 2], got 0.0"),
    (dict(repetition_penalty=2.5), "repetition_penalty",
     "repetition_penalty must be in (0, 2], got 2.5"),
    (dict(logprobs=21), "logprobs", "logprobs must be in [0, 20], got 21"),
    (dict(logprobs=-1), "logprobs", "logprobs must be in [0, 20], got -1"),
    (dict(prompt_logprobs=50), "prompt_logprobs", "prompt_logprobs must be in [0, 20], got 50"),
    (dict(stop=[""]), "stop", "stop strings must have 1 to 1024 characters, got 0"),
    (dict(stop=["ok", 3]), "stop", "stop must be a list of strings, got ['ok', 3]"),
    (dict(stop=["x"], detokenize=False), "stop", "stop strings need detokenize=True"),
    (dict(stop_token_ids=[49152]), "stop_token_ids",
     "stop_token_ids must hold token ids in [0, 49152), got 49152"),
    (dict(stop_token_ids=[-1]), "stop_token_ids",
     "stop_token_ids must hold token ids in [0, 49152), got -1"),
    (dict(logit_bias={60000: 1.0}), "logit_bias",
     "logit_bias must hold token ids in [0, 49152), got 60000"),
    (dict(logit_bias={5: math.nan}), "logit_bias[5]",
     "logit_bias[5] must be a finite number, got nan"),
    (dict(allowed_token_ids=[]), "allowed_token_ids",
     "allowed_token_ids must be a non-empty list when given, got []"),
    (dict(allowed_token_ids=[1, 99999]), "allowed_token_ids",
     "allowed_token_ids must hold token ids in [0, 49152), got 99999"),
    (dict(thinking_token_budget=-1), "thinking_token_budget",
     "thinking_token_budget must be >= 0, got -1"),
    (dict(seed=2**64), "seed",
     f"seed must be in [{-(2**63)}, {2**63 - 1}], got {2**64}"),
    (dict(extra_args=["a"]), "extra_args", "extra_args must be a dict with string keys, got ['a']"),
    (dict(extra_args={"a": {1: "x"}}), "extra_args",
     "extra_args['a'] keys must be strings, got 1"),
    (dict(extra_args={"a": [1, math.nan]}), "extra_args",
     "extra_args['a'][1] must be a finite number, got nan"),
    (dict(extra_args={"a": -math.inf}), "extra_args",
     "extra_args['a'] must be a finite number, got -inf"),
    (dict(extra_args={"a": 2**53 + 1}), "extra_args",
     "extra_args['a'] must be an integer in [-2**53, 2**53], got 9007199254740993"),
    (dict(extra_args={"a": (1, 2)}), "extra_args",
     "extra_args['a'] must be JSON-like (None, bool, number, str, list or dict), got (1, 2)"),
    (dict(extra_args={"a": b"x"}), "extra_args",
     "extra_args['a'] must be JSON-like (None, bool, number, str, list or dict), got b'x'"),
    (dict(extra_args={"a": [[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]}), "extra_args",
     "extra_args must nest at most 16 levels deep, "
     "extra_args['a'][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0] is at level 17"),
]


@pytest.mark.parametrize("kwargs, field, message", BAD_PARAMS, ids=[b[1] for b in BAD_PARAMS])
def test_bad_sampling_param_is_rejected(input_processor, kwargs, field, message):
    with pytest.raises(ValidationError) as info:
        input_processor.process_inputs("r", "Hello", SamplingParams(**kwargs))
    assert info.value.field == field
    assert str(info.value) == message
    # The processor is unharmed: a valid request right after goes through.
    request = input_processor.process_inputs("r", "Hello", SamplingParams(max_tokens=5))
    assert request.prompt_token_ids == [19556]
    assert request.sampling_params.max_tokens == 5


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "prompt must not be empty"),
        ([], "prompt must not be empty"),
        ([1, 49152], "prompt must hold token ids in [0, 49152), got 49152"),
        ([1, -3], "prompt must hold token ids in [0, 49152), got -3"),
        ([1, "a"], "prompt must be a string, a list of token ids or a list of chat messages"),
    ],
)
def test_bad_prompt_is_rejected(input_processor, prompt, message):
    with pytest.raises(ValidationError) as info:
        input_processor.process_inputs("r", prompt, SamplingParams())
    assert (info.value.field, str(info.value)) == ("prompt", message)


def test_prompt_plus_max_tokens_over_max_model_len(input_processor):
    with pytest.raises(ValidationError) as info:
        input_processor.process_inputs("r", [5] * 2000, SamplingParams(max_tokens=49))
    assert info.value.field == "max_tokens"
    assert str(info.value) == (
        "prompt has 2000 tokens and max_tokens is 49, but max_model_len is 2048")
    # Exactly filling the context is allowed.
    request = input_processor.process_inputs("r", [5] * 2000, SamplingParams(max_tokens=48))
    assert request.sampling_params.max_tokens == 48


def test_unset_max_tokens_fills_the_context(input_processor):
    request = input_processor.process_inputs("r", [5] * 2000, SamplingParams(max_tokens=None))
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - 2000
    with pytest.raises(ValidationError) as info:
        input_processor.process_inputs("r", [5] * 2048, SamplingParams(max_tokens=None))
    assert (info.value.field, str(info.value)) == (
        "prompt", "prompt has 2048 tokens, max_model_len is 2048")
    with pytest.raises(ValidationError) as info:
        input_processor.process_inputs(
            "r", [5] * 2040, SamplingParams(max_tokens=None, min_tokens=10))
    assert str(info.value) == "min_tokens must be <= max_tokens (8), got 10"


def test_json_like_extra_args_pass_unchanged(input_processor):
    deepest: list = []
    for _ in range(14):  # extra_args, then 15 nested lists: 16 levels, the maximum
        deepest = [deepest]
    extra_args = {"s": "x", "b": True, "none": None, "i": -(2**53), "f": 0.5, "list": [1, "y"],
                  "dict": {"k": {}}, "a": deepest}
    request = input_processor.process_inputs(
        "r", "Hello", SamplingParams(extra_args=extra_args))
    assert request.sampling_params.extra_args == extra_args


def test_validation_error_is_a_value_error():
    assert issubclass(ValidationError, ValueError)


def test_custom_logits_processors_validate_at_admission(tokenizer, eos_token_ids):
    spec = "tests.worker.sample.kvmesh_test_logitsprocs:RejectMaxTokens13Processor"
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, 49152, eos_token_ids,
                               params_validators=logits_processor_validators([spec]))
    with pytest.raises(ValidationError, match="RejectMaxTokens13Processor refused the request: "
                                              "max_tokens=13 is not served") as info:
        processor.process_inputs("r", "Hello", SamplingParams(max_tokens=13))
    assert info.value.field == "sampling_params"
    assert processor.process_inputs("r", "Hello", SamplingParams(max_tokens=12))
