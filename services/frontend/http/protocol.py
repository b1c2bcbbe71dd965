"""OpenAI API requests (pydantic models), with vLLM's extra sampling fields.

The models check types only: every range is checked once, by the frontend's
shared validation, on the SamplingParams built from them (``sampling.py``),
so the HTTP and gRPC APIs accept exactly the same values. Unknown fields are
ignored, as vLLM and OpenAI do; fields that would change the answer but are
not supported are refused by ``sampling.py`` naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat completions share (OpenAI's, then vLLM's)."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    return_token_ids: bool = False  # each choice's token_ids and the prompt's
    # OpenAI's constraint on the output, and vLLM's wider one (json, regex,
    # choice, grammar, json_object, structural_tag); at most one of the two.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required or a function
    parallel_tool_calls: bool = True  # False: at most one call per answer


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize`` (vLLM's): text, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = True
