"""RequestOutputs -> OpenAI response objects: completions and chat completions.

A format object is made per request, since streamed completion logprobs
carry text offsets that run on across chunks. ``choice`` builds a choice of
a whole answer, ``chunk_choice`` one of a streamed chunk (DELTA outputs).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Protocol

from services.frontend.http.chat_reasoning import ChatReasoning
from services.frontend.http.tool_calls import ChatToolCalls
from services.frontend.outputs import CompletionOutput, Logprob, RequestOutput

# JSON has no -inf; OpenAI and vLLM clients expect a very negative number.
_MIN_LOGPROB = -9999.0


class ResponseFormat(Protocol):
    id_prefix: str
    object: str
    chunk_object: str

    def choice(self, output: CompletionOutput) -> dict[str, Any]: ...

    def chunk_choice(self, output: CompletionOutput) -> dict[str, Any]: ...


def _logprob(lp: Logprob) -> float:
    return max(lp.logprob, _MIN_LOGPROB)


def _finish(output: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": output.finish_reason, "stop_reason": output.stop_reason}


class CompletionFormat:
    """``/v1/completions``: text choices and the legacy logprobs object."""

    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def __init__(self, num_logprobs: int | None) -> None:
        self.num_logprobs = num_logprobs
        self._text_offsets: defaultdict[int, int] = defaultdict(int)

    def choice(self, output: CompletionOutput) -> dict[str, Any]:
        return {"index": output.index, "text": output.text, "logprobs": self._logprobs(output),
                **_finish(output)}

    chunk_choice = choice  # a chunk's output holds the new text only

    def _logprobs(self, output: CompletionOutput) -> dict[str, Any] | None:
        """Each position's token, its logprob, the top ``logprobs`` (with the
        sampled token) and where it starts in the choice's text."""
        if self.num_logprobs is None or output.logprobs is None:
            return None
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
        offset = self._text_offsets[output.index]
        for token_id, position in zip(output.token_ids, output.logprobs):
            sampled = position[token_id]
            token = sampled.decoded_token or ""
            result["tokens"].append(token)
            result["token_logprobs"].append(_logprob(sampled))
            result["top_logprobs"].append(
                {(lp.decoded_token or ""): _logprob(lp) for lp in position.values()})
            result["text_offset"].append(offset)
            offset += len(token)
        self._text_offsets[output.index] = offset
        return result


class ChatFormat:
    """``/v1/chat/completions``: assistant messages and chat logprobs."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, num_top_logprobs: int | None, tool_calls: ChatToolCalls | None = None,
                 reasoning: ChatReasoning | None = None) -> None:
        self.num_top_logprobs = num_top_logprobs
        self.tool_calls = tool_calls
        self.reasoning = reasoning
        self._started: set[int] = set()

    def choice(self, output: CompletionOutput) -> dict[str, Any]:
        reasoning, content = None, output.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = _finish(output)
        if self.tool_calls is not None:
            message, finish["finish_reason"] = self.tool_calls.message(
                content, output.finish_reason)
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        return {"index": output.index, "message": message,
                "logprobs": self._logprobs(output), **finish}

    def chunk_choice(self, output: CompletionOutput) -> dict[str, Any]:
        reasoning, content = "", output.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split_delta(
                output.index, content, output.finish_reason is not None)
        delta: dict[str, Any] = {"content": content}
        finish = _finish(output)
        if self.tool_calls is not None:
            delta, finish["finish_reason"] = self.tool_calls.delta(
                output.index, content, output.finish_reason)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if output.index not in self._started:  # the role rides on each choice's first chunk
            self._started.add(output.index)
            delta = {"role": "assistant", **delta}
        return {"index": output.index, "delta": delta, "logprobs": self._logprobs(output),
                **finish}

    def _logprobs(self, output: CompletionOutput) -> dict[str, Any] | None:
        if self.num_top_logprobs is None or output.logprobs is None:
            return None
        content = []
        for token_id, position in zip(output.token_ids, output.logprobs):
            top = sorted((lp for lp in position.values() if lp.rank <= self.num_top_logprobs),
                         key=lambda lp: lp.rank)
            content.append({**_chat_token(position[token_id]),
                            "top_logprobs": [_chat_token(lp) for lp in top]})
        return {"content": content}


def _chat_token(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": _logprob(lp), "bytes": list(token.encode())}


def usage(output: RequestOutput, num_completion_tokens: int) -> dict[str, Any]:
    num_prompt_tokens = len(output.prompt_token_ids)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


class ResponseBuilder:
    """The envelope every response and chunk of one request shares.

    With ``return_token_ids`` (vLLM's extension), choices carry their
    ``token_ids`` and the response (the first chunk) the ``prompt_token_ids``.
    """

    def __init__(self, fmt: ResponseFormat, request_id: str, model_name: str,
                 return_token_ids: bool = False) -> None:
        self.fmt = fmt
        self.id = fmt.id_prefix + request_id
        self.model_name = model_name
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self._sent_prompt = False

    def _choices(self, outputs: list[CompletionOutput], chunk: bool) -> list[dict[str, Any]]:
        make = self.fmt.chunk_choice if chunk else self.fmt.choice
        if not self.return_token_ids:
            return [make(o) for o in outputs]
        return [{**make(o), "token_ids": list(o.token_ids)} for o in outputs]

    def _prompt_token_ids(self, output: RequestOutput) -> dict[str, Any]:
        if not self.return_token_ids or self._sent_prompt:
            return {}
        self._sent_prompt = True
        return {"prompt_token_ids": list(output.prompt_token_ids)}

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model_name}

    def response(self, output: RequestOutput) -> dict[str, Any]:
        """The whole answer, from the final (FINAL_ONLY) output."""
        outputs = sorted(output.outputs, key=lambda o: o.index)
        return {**self._envelope(self.fmt.object), **self._prompt_token_ids(output),
                "choices": self._choices(outputs, chunk=False),
                "usage": usage(output, sum(len(o.token_ids) for o in outputs))}

    def chunk(self, output: RequestOutput) -> dict[str, Any]:
        """One streamed chunk, from a DELTA output."""
        return {**self._envelope(self.fmt.chunk_object), **self._prompt_token_ids(output),
                "choices": self._choices(output.outputs, chunk=True)}

    def usage_chunk(self, output: RequestOutput, num_completion_tokens: int) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return {**self._envelope(self.fmt.chunk_object), "choices": [],
                "usage": usage(output, num_completion_tokens)}
