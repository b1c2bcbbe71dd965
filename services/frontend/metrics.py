"""Per-request timing and token counts, kept by the frontend.

Times are wall-clock seconds (``time.time()``), the clock ``arrival_time``
uses, so TTFT can be taken across processes. Latencies are measured at the
moment the frontend sees the engine's output, which is what a client sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestStateStats:
    """Timeline of one request (one child of an n>1 request).

    ``inter_token_latencies_s`` holds one entry per engine output after the
    first token: the time since the previous output that carried tokens.
    """

    arrival_time: float
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies_s: list[float] = field(default_factory=list)

    def observe_tokens(self, num_new_tokens: int, now: float) -> None:
        """Records ``num_new_tokens`` tokens arriving at ``now``."""
        if num_new_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies_s.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_generation_tokens += num_new_tokens

    def observe_finished(self, now: float) -> None:
        self.finished_time = now

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None below two tokens)."""
        if self.num_generation_tokens < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished request (one child of an n>1 request), for the stat logger."""

    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_time_per_output_token_s: float | None


@dataclass(slots=True)
class IterationStats:
    """What one EngineCoreOutputs message brought, for the stat logger (vLLM's
    IterationStats). Prompt tokens count when a request's first token arrives."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def observe_tokens(
        self, stats: RequestStateStats, num_new_tokens: int, previous_token_time: float | None
    ) -> None:
        """Records tokens ``stats`` just observed; ``previous_token_time`` is its
        ``last_token_time`` from before (None: these are its first tokens)."""
        if num_new_tokens <= 0:
            return
        self.num_generation_tokens += num_new_tokens
        if previous_token_time is None:
            self.num_prompt_tokens += stats.num_prompt_tokens
            self.time_to_first_tokens_s.append(stats.ttft_s)
        else:
            self.inter_token_latencies_s.append(stats.last_token_time - previous_token_time)

    def observe_finished(self, stats: RequestStateStats, finish_reason: str) -> None:
        self.finished_requests.append(FinishedRequestStats(
            finish_reason, stats.e2e_latency_s or 0.0, stats.num_prompt_tokens,
            stats.num_generation_tokens, stats.tpot_s,
        ))
