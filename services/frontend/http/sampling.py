"""OpenAI requests -> the prompt and SamplingParams the shared engine path takes.

Nothing here checks a range: ``AsyncLLM.generate`` validates the result
exactly as it validates a gRPC request, and its ValidationError names the
field. Fields this server cannot honour are refused here, naming the field.
"""

from __future__ import annotations

from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
)
from services.frontend.http.response_format import structured_outputs_params
from services.frontend.input_processor import PromptType
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


def chat_inputs(request: ChatCompletionRequest) -> tuple[list[dict[str, str]], SamplingParams]:
    """The chat messages and SamplingParams of a chat completion request."""
    if request.tools:
        raise ValidationError("tools", "tools are not supported by this server")
    if request.top_logprobs is not None and not request.logprobs:
        raise ValidationError("top_logprobs", "top_logprobs needs logprobs set to true")
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    messages = chat_messages(request.messages)
    return messages, sampling_params(request, max_tokens, num_logprobs)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template takes them."""
    return [_chat_message(index, message) for index, message in enumerate(messages)]


def _chat_message(index: int, message: ChatMessage) -> dict[str, str]:
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
    result = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    return result
