"""Admission check for structured outputs: a constraint that cannot compile is refused.

A worker never meets an invalid constraint: the frontend builds its grammar
first (the worker's own builder, ``services.common.grammar``) and answers
INVALID_ARGUMENT naming the field and xgrammar's reason. Grammars already
checked are remembered, so a repeated schema costs a dictionary lookup.
"""

from __future__ import annotations

import functools
import json

from services.common.grammar import build_grammar
from services.common.sampling_params import StructuredOutputsParams
from services.common.validation import ValidationError

_CHECKED_GRAMMARS = 1024


def check_structured_outputs(so: StructuredOutputsParams, field_prefix: str = "structured_outputs"
                             ) -> None:
    """ValidationError naming ``<field_prefix>.<kind>`` when ``so`` cannot compile.

    ``so`` has passed the shape check (exactly one constraint, right type).
    """
    reason = _grammar_error(so.key)
    if reason is not None:
        field = f"{field_prefix}.{so.kind}"
        raise ValidationError(field, f"{field} is not a valid {_WHAT[so.kind]}: {reason}")


_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
         "grammar": "EBNF grammar", "json_object": "constraint",
         "structural_tag": "structural tag"}


@functools.lru_cache(maxsize=_CHECKED_GRAMMARS)
def _grammar_error(key: tuple[str, str, bool]) -> str | None:
    kind, text, disable_any_whitespace = key
    value: object = text
    if kind == "choice":
        value = json.loads(text)
    elif kind == "json_object":
        value = True
    so = StructuredOutputsParams(**{kind: value}, disable_any_whitespace=disable_any_whitespace)
    try:
        build_grammar(so)
    except ValueError as e:
        return str(e)
    return None
