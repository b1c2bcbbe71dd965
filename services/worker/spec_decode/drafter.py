"""Which requests draft, and how many tokens: prompt lookup, the grammar, and the
request's recent acceptance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.common.speculative import SpeculativeConfig
from services.worker.spec_decode.ngram_proposer import propose_ngram

# Weight of the latest step in a request's running acceptance rate.
_ACCEPTANCE_SMOOTHING = 0.3

# Trims and extends a draft under the request's grammar (see
# StructuredOutputLogitsProcessor.constrain_drafts): (drafts, most tokens) -> drafts.
ConstrainDrafts = Callable[[list[int], int], list[int]]
# (token ids, min n, max n, k) -> up to k drafts, as propose_ngram.
Proposer = Callable[[np.ndarray, int, int, int], list[int]]


@dataclass(slots=True)
class DraftState:
    """One request's drafts for its next step and how its recent drafts fared."""

    token_ids: list[int] = field(default_factory=list)
    acceptance_rate: float = 1.0  # smoothed accepted / drafted
    steps_since_draft: int = 0


class Drafter:
    """Proposes each request's drafts after its step and learns from their fate.

    A request whose smoothed acceptance fell below ``min_acceptance_rate``
    drafts only once every ``probe_interval`` steps: its rejected drafts
    would cost verification for nothing, and the probe notices when its text
    starts repeating again.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer = propose_ngram) -> None:
        self.config = config
        self.proposer = proposer

    def propose(self, state: DraftState, token_ids: np.ndarray,
                constrain: ConstrainDrafts | None = None) -> None:
        """Sets ``state.token_ids`` for a request whose tokens are ``token_ids``."""
        config = self.config
        state.token_ids = []
        if state.acceptance_rate < config.min_acceptance_rate \
                and state.steps_since_draft + 1 < config.probe_interval:
            state.steps_since_draft += 1
            return
        k = config.num_speculative_tokens
        drafts = self.proposer(token_ids, config.lookup_min, config.lookup_max, k)
        if constrain is not None:
            drafts = constrain(drafts, k)
        state.token_ids = drafts
        if drafts:
            state.steps_since_draft = 0

    @staticmethod
    def record(state: DraftState, num_drafts: int, num_accepted: int) -> None:
        """Folds one verified draft into the request's acceptance rate."""
        if num_drafts:
            rate = num_accepted / num_drafts
            state.acceptance_rate += _ACCEPTANCE_SMOOTHING * (rate - state.acceptance_rate)
