"""`SchedulingLimits`: how much one step may hold, the one definition every service uses.

A worker sizes its batch buffers by these limits and reports them when it
registers; the scheduler service and the offline engine schedule each worker
within its limits and their own (``capped_by``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulingLimits:
    """The most requests and tokens in one step (vLLM's max_num_seqs / max_num_batched_tokens).

    ``max_num_batched_tokens`` is the per-step token budget. A value below 1
    raises ValueError naming the field and the allowed range.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}, must be an integer >= 1")

    def capped_by(self, other: SchedulingLimits | None) -> SchedulingLimits:
        """Each limit at most ``other``'s (None: these limits unchanged)."""
        if other is None:
            return self
        return SchedulingLimits(
            max_num_seqs=min(self.max_num_seqs, other.max_num_seqs),
            max_num_batched_tokens=min(self.max_num_batched_tokens, other.max_num_batched_tokens),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """``--max-num-seqs`` and ``--max-num-batched-tokens``, with the defaults above."""
        defaults = SchedulingLimits()
        parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                            help="most requests in one step")
        parser.add_argument("--max-num-batched-tokens", type=int,
                            default=defaults.max_num_batched_tokens,
                            help="most tokens in one step (the token budget)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> SchedulingLimits:
        return cls(max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens)
