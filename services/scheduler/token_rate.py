"""Tokens per second over the last minutes, kept per worker for the dashboard."""

from __future__ import annotations

from collections import deque


class TokenRateHistory:
    """Token counts in fixed intervals of ``interval_s`` seconds, the last ``num_intervals``.

    ``add`` costs a division and an addition per step; intervals with no
    tokens are filled in as time moves on. Times are ``time.monotonic()``.
    """

    def __init__(self, interval_s: float = 2.0, num_intervals: int = 150) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s is {interval_s}, must be > 0")
        if num_intervals < 1:
            raise ValueError(f"num_intervals is {num_intervals}, must be >= 1")
        self.interval_s = interval_s
        # The newest count is the interval still filling.
        self._counts: deque[int] = deque([0], maxlen=num_intervals + 1)
        self._current = -1  # index of the interval being filled; -1: none yet

    def add(self, num_tokens: int, now: float) -> None:
        self._advance(now)
        self._counts[-1] += num_tokens

    def rates(self, now: float) -> list[float]:
        """Tokens/s of each complete interval, oldest first."""
        self._advance(now)
        counts = list(self._counts)[:-1]
        return [count / self.interval_s for count in counts]

    def _advance(self, now: float) -> None:
        index = int(now // self.interval_s)
        if self._current < 0:
            self._current = index
        num_new = min(index - self._current, self._counts.maxlen)
        if num_new > 0:
            self._counts.extend([0] * num_new)
            self._current = index
