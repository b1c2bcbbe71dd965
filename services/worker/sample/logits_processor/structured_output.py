"""Structured outputs: each constrained row may only sample what its grammar allows.

The grammar lives here, beside the sampler (the scheduler never sees it). A
request's constraint is compiled once (``services.worker.grammar``); each step
the processor accepts the tokens sampled since the last step into the
request's matcher, fills the row's bitmask for the next token and masks the
logits. Accepting from the live output list makes asynchronous scheduling and
re-placement correct without new messages: a row (re)joining the batch
replays every output token it already has, and token N is always accepted
before the mask for N+1 is filled.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import torch

from kernels.token_bitmask import apply_token_bitmask
from services.common.model_runner_output import RequestFailure
from services.common.sampling_params import CONSTRAINT_FIELDS, SamplingParams
from services.worker.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    process_dict_updates,
)

if TYPE_CHECKING:
    import xgrammar

    from services.worker.grammar import GrammarBackend


@dataclass(slots=True)
class _GrammarRow:
    field: str  # "structured_outputs.<kind>", for failure messages
    compiled: Future[Any]  # Future[xgrammar.CompiledGrammar]
    output_ids: list[int]  # the request's live output list
    # Set while the output is still in the model's reasoning: the sequence that ends it.
    reasoning_end: list[int] | None = None
    matcher: xgrammar.GrammarMatcher | None = None
    num_accepted: int = 0  # output tokens consumed (reasoning included)

    def skip_reasoning(self) -> None:
        """Consumes output tokens up to the end of the reasoning, if it has ended."""
        end, output = self.reasoning_end, self.output_ids
        assert end is not None
        start = max(self.num_accepted - len(end) + 1, 0)
        for i in range(start, len(output) - len(end) + 1):
            if output[i : i + len(end)] == end:
                self.num_accepted = i + len(end)
                self.reasoning_end = None
                return
        self.num_accepted = len(output)


class StructuredOutputLogitsProcessor(LogitsProcessor):
    """Masks every token a constrained row's grammar forbids; rows without one are untouched.

    Not argmax-invariant, and the last built-in (after min tokens, logit bias
    and the thinking budget): a row they and the grammar leave with no token
    at all fails its request (the sampler finds it) with the reason, never samples.
    A terminated grammar allows only the end-of-sequence tokens. A row whose
    constraint has ``reasoning_end_token_ids`` is free until its output holds
    them; the grammar applies to the tokens after. A request
    whose constraint does not compile, or whose output breaks the grammar
    (tokens from elsewhere), fails alone.
    """

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        import xgrammar as xgr

        if config.grammar is None:
            raise ValueError("StructuredOutputLogitsProcessor needs LogitsProcessorConfig.grammar")
        self._grammar: GrammarBackend = config.grammar
        self._bitmask = xgr.allocate_token_bitmask(config.max_num_reqs, config.vocab_size)
        self._rows: dict[int, _GrammarRow] = {}
        self._masked: list[int] = []  # rows masked this step, ascending
        self._failures: dict[int, RequestFailure] = {}
        self._stop_bitmask = self._stop_tokens_bitmask(config.vocab_size)
        # One row for finding the tokens a grammar forces (constrain_drafts).
        self._draft_bitmask = xgr.allocate_token_bitmask(1, config.vocab_size)
        self._vocab_size = config.vocab_size
        self._no_token_left = {
            f"structured_outputs.{kind}": RequestFailure.of(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"no token is allowed next: structured_outputs.{kind} forbids every token "
                "that min_tokens, logit_bias or allowed_token_ids leave")
            for kind in CONSTRAINT_FIELDS}

    def _stop_tokens_bitmask(self, vocab_size: int) -> torch.Tensor:
        # One bitmask row allowing only the end-of-sequence tokens.
        words = [0] * -(-vocab_size // 32)
        for token_id in self._grammar.stop_token_ids:
            word, bit = divmod(token_id, 32)
            words[word] |= 1 << bit
        # int32 words: bit 31 is the sign bit.
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                            dtype=torch.int32)

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_row(self, params: SamplingParams, prompt_ids: list[int] | None,
                 output_ids: list[int]) -> _GrammarRow | None:
        so = params.structured_outputs
        if so is None:
            return None
        return _GrammarRow(f"structured_outputs.{so.kind}", self._grammar.compile(so), output_ids,
                           list(so.reasoning_end_token_ids or ()) or None)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)
        masked = []
        for row in sorted(self._rows):
            state = self._rows[row]
            if state.reasoning_end is not None:
                state.skip_reasoning()
                if state.reasoning_end is not None:
                    continue  # still reasoning: free
            failure = self._advance(state)
            if failure is not None:
                self._failures[row] = failure
                del self._rows[row]
                continue
            self._fill(row, state)
            masked.append(row)
        self._masked = masked

    def _advance(self, state: _GrammarRow) -> RequestFailure | None:
        """Accepts the row's new output tokens; the failure that ends it, if any."""
        if state.matcher is None:
            try:
                compiled = state.compiled.result()  # waits only for a cold grammar
            except Exception as e:  # invalid (ValueError) or xgrammar failed: this row alone
                return RequestFailure.of(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"{state.field} cannot be compiled: {e}")
            state.matcher = self._grammar.new_matcher(compiled)
        matcher = state.matcher
        output = state.output_ids
        for i in range(state.num_accepted, len(output)):
            # Past termination only the end-of-sequence token was allowed; a
            # step run before the stop was seen adds nothing to the grammar.
            if not matcher.is_terminated() and not matcher.accept_token(output[i]):
                return RequestFailure.of(
                    grpc.StatusCode.INTERNAL,
                    f"output token {output[i]} at position {i} breaks {state.field}")
            state.num_accepted = i + 1
        return None

    def _fill(self, row: int, state: _GrammarRow) -> None:
        assert state.matcher is not None
        if state.matcher.is_terminated():
            self._bitmask[row] = self._stop_bitmask
        else:
            state.matcher.fill_next_token_bitmask(self._bitmask, row)

    def constrain_drafts(self, row: int, drafts: list[int], k: int) -> list[int]:
        """Speculative decoding: the longest head of ``drafts`` the row's grammar
        accepts after its output so far, then what the grammar forces (a token
        when it allows only one; a string it forces, tokenized), at most ``k``
        tokens in all. The matcher ends where it began.

        A row without a grammar, or still in its reasoning, keeps its drafts;
        one whose output breaks its grammar gets none (its failure is reported
        by the next step's ``update_state``).
        """
        state = self._rows.get(row)
        if state is None:
            return drafts[:k]
        if state.reasoning_end is not None:
            state.skip_reasoning()
            if state.reasoning_end is not None:
                return drafts[:k]
        if self._advance(state) is not None:
            return []
        matcher = state.matcher
        assert matcher is not None
        out: list[int] = []
        for token_id in drafts[:k]:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            out.append(token_id)
        while len(out) < k and not matcher.is_terminated():
            forced = self._forced_token(matcher)
            if forced is not None and matcher.accept_token(forced):
                out.append(forced)
                continue
            if not self._accept_forced_string(matcher, out, k):
                break
        if out:
            matcher.rollback(len(out))
        return out

    def _accept_forced_string(self, matcher: xgrammar.GrammarMatcher, out: list[int],
                              k: int) -> bool:
        """Appends the tokens of the string the grammar forces next, as far as it
        accepts them; whether it forced a string and all of it fit."""
        forced = matcher.find_jump_forward_string()
        if not forced:
            return False
        token_ids = self._grammar.encode(forced)
        for token_id in token_ids:
            if len(out) >= k or not matcher.accept_token(token_id):
                return False
            out.append(token_id)
        return True

    def _forced_token(self, matcher: xgrammar.GrammarMatcher) -> int | None:
        """The one token the matcher allows next, or None when it allows several."""
        scratch = self._draft_bitmask
        if not matcher.fill_next_token_bitmask(scratch, 0):
            return None  # every token allowed
        bits = np.unpackbits(scratch.numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self._vocab_size])
        return int(allowed[0]) if allowed.size == 1 else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._masked:
            apply_token_bitmask(logits, self._bitmask[: logits.shape[0]], self._masked)
        return logits

    def nonfinite_reasons(self) -> dict[int, RequestFailure]:
        # The grammar together with min_tokens, logit_bias or allowed_token_ids
        # may allow nothing; the sampler finds such a row (it checks every
        # row's logits anyway) and its request fails with this reason.
        return {row: self._no_token_left[self._rows[row].field] for row in self._masked}

    def take_row_failures(self) -> dict[int, RequestFailure]:
        failures, self._failures = self._failures, {}
        return failures
