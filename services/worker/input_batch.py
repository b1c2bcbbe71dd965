"""The worker's persistent batch (vLLM V1's CachedRequestState and InputBatch).

A request keeps its row across steps, so per-step work is proportional to the
tokens scheduled, not to the requests held. Removals leave holes; new requests
fill the lowest hole first and :meth:`InputBatch.condense` moves rows from the
tail into the holes that remain, so rows ``[0, num_reqs)`` are dense before a
step runs. Every move is replayed on the block table and the sampling state.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.worker.block_table import BlockTable
from services.worker.grammar import GrammarBackend
from services.worker.sample import SamplingState, ThinkingConfig
from services.worker.spec_decode import DraftState


@dataclass(slots=True)
class CachedRequestState:
    """Everything the worker knows about one request, in or out of the batch.

    ``output_token_ids`` is the live list: the runner appends each sampled
    token to it and the sampling state (penalties, logits processors) reads it.
    A preempted request keeps its state here while it is out of the batch.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]
    # Prompt positions whose logprobs were already returned (recompute after a
    # preemption must not send them twice).
    num_prompt_logprobs_sent: int = 0
    # Speculative decoding: its drafts for the next step (None: the worker does not draft).
    drafts: DraftState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Dense rows of running requests: token ids, counters, block table, sampling state."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        block_size: int,
        vocab_size: int,
        logitsprocs: Sequence[str | type] = (),
        thinking: ThinkingConfig | None = None,
        eos_token_id: int | None = None,
        grammar: GrammarBackend | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        # Masked with the stop ids until min_tokens (the scheduler stops on it).
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        # int64 so input ids are gathered straight into the model's dtype.
        self.token_ids_cpu = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int64)
        self.token_ids_np = self.token_ids_cpu.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        max_num_blocks_per_req = -(-max_model_len // block_size)
        self.block_table = BlockTable(
            max_num_reqs, max_num_blocks_per_req, max_num_batched_tokens, device, block_size
        )
        self.vocab_size = vocab_size
        self._make_sampling_state = partial(
            SamplingState, max_num_reqs, vocab_size, self.device, logitsprocs=logitsprocs,
            thinking=thinking, grammar=grammar,
        )
        self.sampling_state = self._make_sampling_state()
        # Row -> request id (None = hole) and the inverse; rows past the last
        # request are not kept, so len(req_ids) is the high-water mark.
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.req_output_token_ids: list[list[int] | None] = []
        self._holes: list[int] = []  # min-heap of empty rows below len(req_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        """Puts ``state`` into the lowest empty row and returns that row.

        Raises ValueError, with the batch unchanged, for a request this batch
        cannot hold: too many tokens, a token id outside the vocabulary,
        sampling parameters the sampling state refuses, or no free row.
        """
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        num_prompt = len(state.prompt_token_ids)
        num_tokens = num_prompt + len(state.output_token_ids)
        if not 0 < num_tokens <= self.max_model_len:
            raise ValueError(
                f"request {state.req_id!r} has {num_tokens} tokens; allowed range is "
                f"[1, {self.max_model_len}] (max_model_len)"
            )
        self._check_token_ids(state.prompt_token_ids, "prompt_token_ids")
        self._check_token_ids(state.output_token_ids, "output_token_ids")
        self.sampling_state.validate(state.sampling_params, self.eos_token_id)
        if self._holes:
            row = heapq.heappop(self._holes)
            self.req_ids[row] = state.req_id
            self.req_output_token_ids[row] = state.output_token_ids
        else:
            row = len(self.req_ids)
            if row >= self.max_num_reqs:
                raise ValueError(
                    f"batch is full: {row} requests; allowed range is [0, {self.max_num_reqs}] "
                    f"(max_num_seqs)"
                )
            self.req_ids.append(state.req_id)
            self.req_output_token_ids.append(state.output_token_ids)
        self.req_id_to_index[state.req_id] = row
        self.token_ids_np[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_np[row, num_prompt:num_tokens] = state.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        self.sampling_state.add_request(
            row, state.sampling_params, state.prompt_token_ids, state.output_token_ids,
            eos_token_id=self.eos_token_id,
        )
        return row

    def _check_token_ids(self, token_ids: list[int], field: str) -> None:
        # An id past the embedding table would fail the whole step (on CUDA,
        # the whole process), not just this request.
        if token_ids and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
            bad = min(token_ids) if min(token_ids) < 0 else max(token_ids)
            raise ValueError(f"{field} holds token id {bad}; allowed range is "
                             f"[0, {self.vocab_size})")

    def remove_request(self, req_id: str) -> int | None:
        """Empties the request's row and returns it; None if it was not in the batch."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.req_output_token_ids[row] = None
        self.block_table.clear_row(row)
        self.sampling_state.remove_request(row)
        heapq.heappush(self._holes, row)
        return row

    def reset(self) -> None:
        """Empties every row, whatever state a failed step left them in.

        The sampling state and its logits processors are built anew; the
        device tensors captured by CUDA graphs (the block table) are kept.
        """
        for row in range(len(self.req_ids)):
            self.block_table.clear_row(row)
        self.req_ids.clear()
        self.req_id_to_index.clear()
        self.req_output_token_ids.clear()
        self._holes.clear()
        self.sampling_state = self._make_sampling_state()

    def condense(self) -> list[tuple[int, int]]:
        """Fills the holes with the last rows; returns the ``(src, dst)`` moves in order.

        Afterwards rows ``[0, num_reqs)`` hold exactly the batch's requests.
        """
        moves: list[tuple[int, int]] = []
        last = len(self.req_ids) - 1
        while self._holes:
            while last >= 0 and self.req_ids[last] is None:
                last -= 1
            hole = self._holes[0]
            if hole > last:
                break
            heapq.heappop(self._holes)
            self._move(last, hole)
            moves.append((last, hole))
            last -= 1
        self._holes.clear()
        del self.req_ids[self.num_reqs :]
        del self.req_output_token_ids[self.num_reqs :]
        return moves

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None and self.req_ids[dst] is None
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_output_token_ids[dst] = self.req_output_token_ids[src]
        self.req_output_token_ids[src] = None
        self.req_id_to_index[req_id] = dst
        num_tokens = int(self.num_tokens[src])
        self.token_ids_np[dst, :num_tokens] = self.token_ids_np[src, :num_tokens]
        for counter in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu):
            counter[dst] = counter[src]
        self.block_table.move_row(src, dst)
        self.sampling_state.move_request(src, dst)

    def append_token(self, row: int, token_id: int) -> None:
        """Records a sampled token: token ids, count and the live output list."""
        num_tokens = int(self.num_tokens[row])
        self.token_ids_np[row, num_tokens] = token_id
        self.num_tokens[row] = num_tokens + 1
        output_token_ids = self.req_output_token_ids[row]
        assert output_token_ids is not None
        output_token_ids.append(token_id)
