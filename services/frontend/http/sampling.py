"""OpenAI requests -> the prompt and SamplingParams the shared engine path takes.

Nothing here checks a range: ``AsyncLLM.generate`` validates the result
exactly as it validates a gRPC request, and its ValidationError names the
field. Fields this server cannot honour are refused here, naming the field.
"""

from __future__ import annotations

from typing import Any

from services.common.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from services.frontend.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
)
from services.frontend.http.response_format import structured_outputs_params
from services.frontend.http.tool_calls import ChatToolCalls
from services.frontend.input_processor import ChatPrompt, PromptType
from services.frontend.tool_parsers import ToolParser
from services.frontend.tool_parsers.tool_choice import (
    forces_tool_calls,
    tool_call_schema,
    validate_tools,
)
from services.common.validation import ValidationError

# Fields of SamplingParams whose unset value in a request means "vLLM's default".
_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")


def sampling_params(request: SamplingRequest, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The SamplingParams of a request: DELTA when streaming, else FINAL_ONLY."""
    params = SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        seed=request.seed,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or ()),
        stop_token_ids=list(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        logit_bias=_logit_bias(request.logit_bias),
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs_params(request.response_format,
                                                     request.structured_outputs),
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(request, name)
        if value is not None:
            setattr(params, name, value)
    return params


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    # JSON object keys are strings; the token ids inside are checked by validation.
    if logit_bias is None:
        return None
    try:
        return {int(token_id): bias for token_id, bias in logit_bias.items()}
    except ValueError:
        keys = [k for k in logit_bias if not k.lstrip("-").isdigit()]
        raise ValidationError(
            "logit_bias", f"logit_bias keys must be token ids, got {keys[0]!r}") from None


def completion_inputs(request: CompletionRequest) -> tuple[PromptType, SamplingParams]:
    """The prompt (text or token ids) and SamplingParams of a completion request."""
    for field, unsupported in (("echo", request.echo), ("suffix", request.suffix is not None),
                               ("best_of", request.best_of not in (None, request.n))):
        if unsupported:
            raise ValidationError(field, f"{field} is not supported by this server")
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValidationError("prompt", f"prompt must be one prompt (text or token ids), got "
                                  f"a batch of {len(prompt)}: send one request per prompt")
        prompt = prompt[0]
    return prompt, sampling_params(request, request.max_tokens, request.logprobs)


def chat_inputs(request: ChatCompletionRequest, tool_parser: ToolParser
                ) -> tuple[PromptType, SamplingParams, ChatToolCalls | None]:
    """The chat prompt, SamplingParams and tool-call handling of a chat request.

    With ``tools`` (and ``tool_choice`` not "none") the prompt is a ChatPrompt
    offering them; "required" or a named function constrains the answer to
    a list of calls; "auto" leaves it free and ``tool_parser`` reads it.
    """
    validate_tools(request.tools, request.tool_choice)
    if request.top_logprobs is not None and not request.logprobs:
        raise ValidationError("top_logprobs", "top_logprobs needs logprobs set to true")
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    messages = chat_messages(request.messages)
    params = sampling_params(request, max_tokens, num_logprobs)
    tool_choice = request.tool_choice or "auto"
    if not request.tools or tool_choice == "none":
        return messages, params, None
    prompt = ChatPrompt(messages, request.tools)
    if not forces_tool_calls(tool_choice):
        return prompt, params, ChatToolCalls(tool_parser)
    if params.structured_outputs is not None:
        raise ValidationError("tool_choice", "tool_choice 'required' or a named function "
                              "constrains the answer: it cannot be combined with "
                              "response_format or structured_outputs")
    schema = tool_call_schema(request.tools, tool_choice)
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    # Calls are read by programs, not people: compact JSON, no runs of whitespace.
    params.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return prompt, params, ChatToolCalls(None)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them."""
    return [_chat_message(index, message) for index, message in enumerate(messages)]


def _chat_message(index: int, message: ChatMessage) -> dict[str, Any]:
    # Text parts join with newlines, as vLLM joins them.
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ValidationError(f"messages[{index}].content",
                                      f"messages[{index}].content parts must be text, "
                                      f"got type {part.type!r}")
            texts.append(part.text)
        content = "\n".join(texts)
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    for field in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, field)
        if value is not None:
            result[field] = value
    return result
