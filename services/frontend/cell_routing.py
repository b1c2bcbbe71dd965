"""Which cell a new request goes to: cached prefix against load.

For each live cell (its stream up, at least one worker) the frontend knows
how many of the request's prompt tokens the cell's prefix cache holds
(``hit_tokens``, from the Redis index; 0 without it) and the cell's load in
tokens (``cell_load_tokens``): the prompt tokens it has yet to compute plus
``request_weight`` tokens for each request it holds (a running request costs
every step; 32, as the scheduler weighs requests against prefix hits between
the workers of one cell), with what this frontend sent it since the cell
last published. As NVIDIA Dynamo's KV router does, it sends the request to
the cell of least

    cost = prefill_weight * (num_prompt_tokens - hit_tokens) + load_tokens / num_workers

the tokens the cell would prefill for it, plus the work already on each of
its workers. Ties go to the lower ``load_tokens``, then to the first cell in
the frontend's list, so the choice is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class RouteReason(str, Enum):
    """Why a request went where it did (the ``reason`` label of the routing metric)."""

    PREFIX = "prefix"      # the chosen cell holds part of its prompt
    LOAD = "load"          # no cell holds any of it: the least loaded one
    FALLBACK = "fallback"  # the Redis index could not be read: load only
    RESUBMIT = "resubmit"  # its cell died; sent again with the tokens it had


DEFAULT_REQUEST_WEIGHT = 32.0


def cell_load_tokens(prefill_tokens: int, num_requests: int,
                     request_weight: float = DEFAULT_REQUEST_WEIGHT) -> float:
    """A cell's load in tokens: its prefill backlog plus ``request_weight`` per request."""
    return prefill_tokens + request_weight * num_requests


@dataclass(frozen=True, slots=True)
class CellCandidate:
    """What routing knows of one live cell for one request."""

    cell_id: str
    num_workers: int
    load_tokens: float
    hit_tokens: int = 0


def routing_cost(candidate: CellCandidate, num_prompt_tokens: int,
                 prefill_weight: float) -> float:
    """The formula of the module docstring."""
    uncached = max(num_prompt_tokens - candidate.hit_tokens, 0)
    return prefill_weight * uncached + candidate.load_tokens / max(candidate.num_workers, 1)


def choose_cell(candidates: Sequence[CellCandidate], num_prompt_tokens: int,
                prefill_weight: float = 1.0) -> int:
    """The index in ``candidates`` of the cell to send the request to.

    Raises ValueError when ``candidates`` is empty (no live cell).
    """
    if not candidates:
        raise ValueError("no live cell to route to")
    return min(range(len(candidates)), key=lambda i: (
        routing_cost(candidates[i], num_prompt_tokens, prefill_weight),
        candidates[i].load_tokens, i))
