"""Which requests draft, and how many tokens: prompt lookup, the grammar, the
request's recent acceptance and what verifying drafts costs on this machine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.common.speculative import SpeculativeConfig
from services.worker.spec_decode.ngram_proposer import propose_ngram

# Weight of the latest verification in a request's running acceptance rate.
_ACCEPTANCE_SMOOTHING = 0.3
# A request's acceptance rate before its first verification: prompt lookup
# proposes only where an n-gram repeats, and then is right about this often.
_PRIOR_ACCEPTANCE = 0.7
# Per-position acceptance is capped below 1 so expected gains stay finite.
_MAX_ACCEPTANCE = 0.95

# Trims and extends a draft under the request's grammar (see
# StructuredOutputLogitsProcessor.constrain_drafts): (drafts, most tokens) -> drafts.
ConstrainDrafts = Callable[[list[int], int], list[int]]
# (token ids, min n, max n, k) -> up to k drafts, as propose_ngram.
Proposer = Callable[[np.ndarray, int, int, int], list[int]]


@dataclass(slots=True)
class DraftState:
    """One request's drafts for its next step and how its recent drafts fared."""

    token_ids: list[int] = field(default_factory=list)
    acceptance_rate: float = _PRIOR_ACCEPTANCE  # smoothed accepted / drafted
    steps_without_drafts: int = 0


class Drafter:
    """Proposes each request's drafts after its step and learns from their fate.

    ``step_costs[d]`` is what a step verifying ``d`` drafts costs next to one
    without (1.0 at d = 0), measured on this machine (``calibration.py``):
    where weights are read once per step whatever its width (float32 on most
    CPUs, any dtype on a GPU) it stays near 1, where the matrix units scale with
    the rows (bfloat16 or int8 on a CPU without native support) it grows with
    d. A request drafts the number of tokens that maximises its expected tokens
    per cost, (1 + a + ... + a^d) / step_costs[d] with a its acceptance rate,
    and none when no draft pays; such a request still drafts every
    ``probe_interval`` steps, so its acceptance is noticed when its text starts
    repeating. ``step_costs`` None drafts whatever the proposer offers.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer = propose_ngram) -> None:
        self.config = config
        self.proposer = proposer
        self.step_costs: Sequence[float] | None = None

    def propose(self, state: DraftState, token_ids: np.ndarray,
                constrain: ConstrainDrafts | None = None) -> None:
        """Sets ``state.token_ids`` for a request whose tokens are ``token_ids``."""
        config = self.config
        k = config.num_speculative_tokens
        drafts = self.proposer(token_ids, config.lookup_min, config.lookup_max, k)
        if constrain is not None:
            drafts = constrain(drafts, k)
        num_drafts = self.num_worth_drafting(state.acceptance_rate, len(drafts))
        if num_drafts == 0 and drafts:
            state.steps_without_drafts += 1
            if state.steps_without_drafts >= config.probe_interval:
                num_drafts = len(drafts)
        if num_drafts:
            state.steps_without_drafts = 0
        state.token_ids = drafts[:num_drafts]

    def num_worth_drafting(self, acceptance_rate: float, available: int) -> int:
        """How many of ``available`` drafts maximise expected tokens per step cost."""
        costs = self.step_costs
        if costs is None:
            return available
        a = min(max(acceptance_rate, 0.0), _MAX_ACCEPTANCE)
        best, best_value = 0, 1.0  # without drafts: one token for a step's cost
        expected, p = 1.0, 1.0
        for d in range(1, min(available, len(costs) - 1) + 1):
            p *= a
            expected += p
            if expected / costs[d] > best_value:
                best, best_value = d, expected / costs[d]
        return best

    @staticmethod
    def record(state: DraftState, num_drafts: int, num_accepted: int) -> None:
        """Folds one verified draft into the request's acceptance rate."""
        if num_drafts:
            rate = num_accepted / num_drafts
            state.acceptance_rate += _ACCEPTANCE_SMOOTHING * (rate - state.acceptance_rate)
