"""A structured-output constraint as an xgrammar ``Grammar``.

The frontend builds it to refuse a constraint that cannot compile (naming the
field); the worker builds the same grammar and compiles it against the
tokenizer. The scheduler never imports this: it stays grammar-free.
xgrammar is imported on first use for that reason.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from services.common.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# Whitespace characters allowed between two JSON tokens: room for indented
# output a few levels deep.
MAX_JSON_WHITESPACE = 16


def build_grammar(so: StructuredOutputsParams) -> xgrammar.Grammar:
    """The grammar of ``so``'s one constraint; ValueError says why it is invalid."""
    import xgrammar as xgr

    kind = so.kind
    value = getattr(so, kind)
    if kind == "json":
        _check_json_text(value)
    # JSON between tokens: any whitespace, but bounded, or a sampled small
    # model can spend every token on newlines; or compact separators.
    whitespace = ({"any_whitespace": False} if so.disable_any_whitespace
                  else {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE})
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(value, strict_mode=True, **whitespace)
        if kind == "json_object":  # OpenAI's meaning: an object, any properties
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                **whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        return xgr.Grammar.from_structural_tag(value)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(_reason(e)) from None


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``.

    JSON string literals are valid EBNF literals for xgrammar (the same
    escapes), so any character in a choice is matched literally.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _check_json_text(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")


def _reason(error: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: ".
    text = str(error).strip()
    head, sep, tail = text.partition(": ")
    return tail.strip() if sep and ".cc:" in head else text
