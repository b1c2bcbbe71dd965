"""The model's Hugging Face tokenizer and the prompt rules kvmesh applies on top.

Everything here works on a plain ``transformers`` tokenizer so any HF model
directory loads; the only policy is BOS handling: a prompt gets exactly one BOS
when the model expects one, whether it came from the tokenizer, the chat
template, or the user's own text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common.validation import ValidationError

ChatMessage = dict[str, Any]


def load_tokenizer(model_dir: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Loads the tokenizer stored in ``model_dir`` (never downloads)."""
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_eos_token_ids(
    model_dir: str | os.PathLike, tokenizer: PreTrainedTokenizerBase
) -> list[int]:
    """Every id that ends generation, primary first, without duplicates.

    config.json's first, then generation_config.json's (the order the worker's
    ModelConfig uses, so both agree on the primary EOS), then the tokenizer's.
    """
    eos_ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos_ids.extend(_as_id_list(json.loads(path.read_text()).get("eos_token_id")))
    eos_ids.extend(_as_id_list(tokenizer.eos_token_id))
    return list(dict.fromkeys(eos_ids))


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def tokenizer_adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether encoding plain text with special tokens prepends the BOS token."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer.encode("a", add_special_tokens=True)
    without_special = tokenizer.encode("a", add_special_tokens=False)
    return with_special[:1] == [bos] and without_special[:1] != [bos]


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most bytes of text one token stands for (decodes the whole vocabulary once).

    A text longer than ``max_model_len`` times this can never fit the model,
    so it can be refused before it is tokenized.
    """
    return max(len(tokenizer.decode([token_id]).encode()) for token_id in range(len(tokenizer)))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a text prompt, with the model's special tokens.

    A prompt whose text already starts with the BOS string would get two BOS
    tokens from a tokenizer that adds one; the copy is dropped.
    """
    ids = tokenizer.encode(text, add_special_tokens=True)
    return _dedupe_leading_bos(tokenizer, ids)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Renders chat messages (dicts with "role" and "content") as prompt text;
    ``tools`` (OpenAI's) go to the template, which decides how to show them."""
    if tokenizer.chat_template is None:
        raise ValidationError(
            "prompt", "the model's tokenizer has no chat template; send a text prompt instead"
        )
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
        tools=list(tools) if tools else None,
    )


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """The rendered chat prompt and its token ids.

    Templates usually write the BOS themselves, so the text is encoded without
    special tokens; the BOS is added only when the model expects one and the
    template left it out.
    """
    text = apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                               tools=tools)
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if ids[:1] != [bos] and tokenizer_adds_bos(tokenizer):
        ids.insert(0, bos)
    return text, ids


def _dedupe_leading_bos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:2] == [bos, bos] and tokenizer_adds_bos(tokenizer):
        return ids[1:]
    return ids


def tokenize(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | Sequence[ChatMessage],
    *,
    add_special_tokens: bool = True,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The token ids the Tokenize APIs return: text (with or without the model's
    special tokens) or chat messages through the chat template.

    Raises ValidationError("prompt") for anything else, an empty chat included.
    """
    if isinstance(prompt, str):
        if add_special_tokens:
            return encode_prompt(tokenizer, prompt)
        return tokenizer.encode(prompt, add_special_tokens=False)
    if prompt and all(isinstance(message, dict) for message in prompt):
        return encode_chat(tokenizer, prompt, add_generation_prompt=add_generation_prompt)[1]
    raise ValidationError("prompt", "Tokenize takes text or chat messages")
