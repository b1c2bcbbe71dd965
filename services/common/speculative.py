"""`SpeculativeConfig`: speculative decoding's settings (vLLM's ``--speculative-config``).

The worker makes and verifies the drafts; the scheduler only grants each
running request a draft budget. Both read this one definition: the worker
from its flag, the scheduler from the worker's registration
(``num_speculative_tokens`` and ``disable_by_batch_size``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The methods a worker can draft with: prompt lookup (and, for a request under a
# grammar, the tokens its grammar forces).
METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
# Above this many running requests a decode step is no longer bound by reading
# the weights, so verifying drafts costs about what it saves (benchmarks/spec_decode.py).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Prompt-lookup speculative decoding.

    Each step, for every running request, the worker looks for the longest
    suffix of its tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``
    tokens long) earlier in its prompt and output and proposes up to
    ``num_speculative_tokens`` tokens that followed it. With more than
    ``disable_by_batch_size`` running requests (0: never) no draft is
    granted. A request drafts only as many tokens as its recent acceptance
    makes worth verifying on this machine (the worker measures the cost at
    start), and one for which no draft pays drafts every ``probe_interval``
    steps, to notice when it starts repeating. As vLLM, either lookup bound
    alone sets both; neither gives 5 and 5.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    probe_interval: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method is {self.method!r}, allowed: "
                             f"{', '.join(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                   MAX_SPECULATIVE_TOKENS)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        _check_int("prompt_lookup_min", low, 1, 64)
        _check_int("prompt_lookup_max", high, low, 64)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 0, 1 << 16)
        _check_int("probe_interval", self.probe_interval, 1, 1 << 16)

    @property
    def lookup_min(self) -> int:
        assert self.prompt_lookup_min is not None
        return self.prompt_lookup_min

    @property
    def lookup_max(self) -> int:
        assert self.prompt_lookup_max is not None
        return self.prompt_lookup_max

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parses ``--speculative-config``: a JSON object of these fields; ValueError
        naming what is wrong."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not JSON: {e}") from e
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; allowed: "
                             f"{sorted(known)}")
        return cls(**value)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} is {value!r}, allowed range is "
                         f"[{low}, {high}]")
