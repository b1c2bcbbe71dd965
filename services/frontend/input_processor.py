"""Prompt + SamplingParams -> a validated EngineCoreRequest with an internal id."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.common.engine import EngineCoreRequest
from services.common.plugins import LOGITS_PROCESSORS_GROUP, load_entry_points, load_qualname
from services.common.sampling_params import SamplingParams
from services.common.validation import (
    CHAT_ROLES,
    DEFAULT_MAX_LOGPROBS,
    RequestLimits,
    ValidationError,
    resolve_max_tokens,
    validate_prompt,
    validate_sampling_params,
)
from services.frontend.structured_outputs import check_structured_outputs
from services.frontend.tokenizer import ChatMessage, encode_chat, encode_prompt, tokenize



@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages with the tools the chat template shows the model (OpenAI's shape)."""

    messages: Sequence[ChatMessage]
    tools: Sequence[Mapping[str, Any]] | None = None


# A prompt: text, token ids, chat messages ({"role", "content"} dicts), a
# ChatPrompt, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": text} /
# {"prompt_token_ids": ids}).
PromptType = str | Sequence[int] | Sequence[ChatMessage] | ChatPrompt | Mapping[str, Any]
_PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")
# (name, check) of a logits processor's ``validate_params``: raises ValueError
# (or TypeError) for params the processor cannot serve.
ParamsValidator = tuple[str, Callable[[SamplingParams], None]]

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def logits_processor_validators(specs: Sequence[str] = ()) -> list[ParamsValidator]:
    """The ``validate_params`` of every installed logits-processor plugin and of
    ``specs`` (``"module.path:Class"``), which the workers load too."""
    objects = [obj for _, obj in load_entry_points(LOGITS_PROCESSORS_GROUP)]
    objects += [load_qualname(spec) for spec in specs]
    return [(getattr(obj, "__qualname__", repr(obj)), obj.validate_params)
            for obj in dict.fromkeys(objects) if callable(getattr(obj, "validate_params", None))]


def make_internal_request_id(external_req_id: str) -> str:
    """``<external>-<8 random hex>``: unique even when clients reuse their ids."""
    return f"{external_req_id}-{secrets.token_hex(4)}"


def external_request_id(internal_req_id: str) -> str:
    """The client's id inside an id made by ``make_internal_request_id``."""
    return _INTERNAL_SUFFIX.sub("", internal_req_id)


class InputProcessor:
    """Tokenizes, validates and completes requests for the engine core.

    The caller's SamplingParams are never modified: the request carries a
    copy with ``max_tokens`` resolved against ``max_model_len`` and the
    model's extra EOS ids added to ``stop_token_ids``. ``limits`` bound the
    request before anything expensive (tokenization, fan-out) happens.
    ``params_validators`` are the custom logits processors' checks, run at
    admission so a request they refuse never reaches a worker.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        limits: RequestLimits = RequestLimits(),
        params_validators: Sequence[ParamsValidator] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_logprobs = max_logprobs
        self.limits = limits
        self.params_validators = list(params_validators)

    def render_prompt(
        self, prompt: PromptType, *, add_generation_prompt: bool = True
    ) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids.

        Checks the size bounds first: a prompt over them is never tokenized.
        """
        prompt = unwrap_prompt(prompt)
        self.check_prompt_size(prompt)
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.tokenizer, prompt)
        if isinstance(prompt, ChatPrompt):
            return encode_chat(self.tokenizer, prompt.messages, tools=prompt.tools,
                               add_generation_prompt=add_generation_prompt)
        items = list(prompt)
        if items and all(isinstance(item, dict) for item in items):
            return encode_chat(self.tokenizer, items, add_generation_prompt=add_generation_prompt)
        if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            if len(items) >= self.max_model_len:
                raise ValidationError("prompt", f"prompt has {len(items)} tokens, "
                                                f"max_model_len is {self.max_model_len}")
            return None, items
        raise ValidationError(
            "prompt", "prompt must be a string, a list of token ids or a list of chat messages"
        )

    def tokenize(self, prompt: str | Sequence[ChatMessage], *, add_special_tokens: bool = True,
                 add_generation_prompt: bool = True) -> list[int]:
        """What the Tokenize APIs return (see tokenizer.tokenize), once the
        prompt's size bounds are checked; slow for long prompts, so call it on a thread."""
        self.check_prompt_size(prompt)
        return tokenize(self.tokenizer, prompt, add_special_tokens=add_special_tokens,
                        add_generation_prompt=add_generation_prompt)

    def check_prompt_size(self, prompt: PromptType) -> None:
        """ValidationError when text or chat messages exceed ``limits`` (roles too)."""
        if isinstance(prompt, str):
            self._check_prompt_bytes(len(prompt.encode()))
        elif isinstance(prompt, ChatPrompt):
            tools_bytes = len(json.dumps(prompt.tools).encode()) if prompt.tools else 0
            self._check_chat(list(prompt.messages), tools_bytes)
        elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
            self._check_chat(list(prompt))

    def _check_prompt_bytes(self, num_bytes: int) -> None:
        limit = self.limits.max_prompt_bytes
        if limit is not None and num_bytes > limit:
            raise ValidationError("prompt", f"prompt has {num_bytes} bytes of text, at most "
                                            f"{limit} fit max_model_len {self.max_model_len}")

    def _check_chat(self, messages: list[ChatMessage], num_bytes: int = 0) -> None:
        limit = self.limits.max_chat_messages
        if len(messages) > limit:
            raise ValidationError("messages", f"messages must hold at most {limit} messages, "
                                              f"got {len(messages)}")
        for message in messages:
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise ValidationError("messages", f"message role must be one of "
                                                  f"{', '.join(CHAT_ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise ValidationError("messages", "message content must be a string")
            num_bytes += len(content.encode())
        self._check_prompt_bytes(num_bytes)

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
    ) -> EngineCoreRequest:
        """Builds the request; raises ValidationError naming the bad field.

        ``request_id`` is the client's (external) id; the returned request
        carries the internal id ``<request_id>-<8 random hex>``.
        """
        _, prompt_token_ids = self.render_prompt(prompt)
        validate_prompt(prompt_token_ids, vocab_size=self.vocab_size)
        params = self._complete_params(params, len(prompt_token_ids))
        return EngineCoreRequest(
            request_id=make_internal_request_id(request_id),
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            client_index=client_index,
        )

    def _complete_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        params = params.clone()
        if isinstance(params.stop, str):  # accept stop="x" like the OpenAI API
            params.stop = [params.stop]
        validate_sampling_params(params, vocab_size=self.vocab_size,
                                 max_logprobs=self.max_logprobs, limits=self.limits)
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        for name, validate in self.params_validators:
            try:
                validate(params)
            except (ValueError, TypeError) as e:
                raise ValidationError("sampling_params",
                                      f"logits processor {name} refused the request: {e}") from None
        params.max_tokens = resolve_max_tokens(params, num_prompt_tokens, self.max_model_len)
        if not params.ignore_eos:
            # The scheduler knows one eos_token_id; the others stop like stop tokens.
            extra_eos = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
            params.stop_token_ids = [*params.stop_token_ids, *extra_eos]
        return params


def unwrap_prompt(prompt: PromptType) -> PromptType:
    """vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` as the text or
    the ids; any other prompt as it is. ValidationError for another dict."""
    if not isinstance(prompt, Mapping):
        return prompt
    if len(prompt) == 1 and next(iter(prompt)) in _PROMPT_DICT_KEYS:
        return next(iter(prompt.values()))
    raise ValidationError("prompt", "a prompt dict must hold exactly one of the keys "
                                    f"{_PROMPT_DICT_KEYS}, got {sorted(map(str, prompt))[:8]}")
