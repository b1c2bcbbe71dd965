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
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
