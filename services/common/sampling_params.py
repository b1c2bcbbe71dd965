"""Sampling parameters shared by every service.

The frontend validates them (see services/frontend); the scheduler honours the
stop conditions, the worker the sampling ones. Defaults follow vLLM.

``extra_args`` (vLLM's name and meaning) carries arbitrary JSON-like
per-request arguments for custom extensions: a custom logits processor reads
them from the ``SamplingParams`` it receives for each request. On the wire they
are a ``google.protobuf.Struct``, whose numbers are doubles, so after any hop
between services every number in them is a float (``3`` arrives as ``3.0``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class StructuredOutputsParams:
    """One structured-output constraint (vLLM's ``StructuredOutputsParams``).

    Exactly one of the constraint fields is set: ``json`` (a JSON schema,
    kept as JSON text; a dict is serialised), ``regex``, ``choice`` (the
    output is one of these strings), ``grammar`` (EBNF in xgrammar's GBNF
    dialect), ``json_object`` (any JSON object) or ``structural_tag``
    (xgrammar's structural tag, as JSON text). ``disable_any_whitespace``
    makes JSON compact (xgrammar's default separators) instead of allowing
    any whitespace between tokens. ``reasoning_end_token_ids``: the output
    starts inside the model's reasoning, which is free; the constraint
    applies to what follows the first occurrence of these tokens (the
    frontend sets them when its reasoning parser says the prompt opened one).
    The frontend checks that the constraint compiles; the worker compiles it
    once per request, beside the sampler.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        # Text on the wire and in the worker's compile-cache key. Key order is
        # kept: xgrammar generates an object's properties in the schema's order.
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)

    @property
    def constraints(self) -> list[str]:
        """Names of the constraint fields that are set (valid params have exactly one)."""
        return [name for name in CONSTRAINT_FIELDS
                if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint field set; ValueError when none or several are."""
        names = self.constraints
        if len(names) != 1:
            raise ValueError(f"structured_outputs must set exactly one of "
                             f"{', '.join(CONSTRAINT_FIELDS)}; got {names or 'none'}")
        return names[0]

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, its text, whitespace flag)."""
        kind = self.kind
        value = getattr(self, kind)
        text = json.dumps(value) if kind == "choice" else str(value)
        return kind, text, self.disable_any_whitespace


CONSTRAINT_FIELDS = tuple(f.name for f in fields(StructuredOutputsParams)
                          if f.name not in ("disable_any_whitespace", "reasoning_end_token_ids"))


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None
    # Constrained decoding: the worker masks every token the constraint forbids.
    structured_outputs: StructuredOutputsParams | None = None
    # Frontend-only: text stop conditions and detokenization.
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    # JSON-like arguments for custom extensions; None: no arguments.
    extra_args: dict[str, Any] | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> "SamplingParams":
        from copy import deepcopy

        return deepcopy(self)
