"""Placement of new requests on workers: longest prefix hit, weighted by load.

Each worker's prefix-hash index is in this process (its Scheduler's block
pool), so routing costs no Redis round trip: the request's block hashes are
computed once per block size and looked up in every candidate's pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from services.common.block_hash import get_request_block_hasher
from services.scheduler.request import BlockHasher, Request
from services.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from services.scheduler.worker_session import WorkerSession

# Builds the Request for one worker from its block hasher (None: no prefix caching).
RequestFactory = Callable[[BlockHasher | None], Request]


def prefix_hit_tokens(scheduler: Scheduler, request: Request) -> int:
    """Tokens of ``request`` the scheduler's prefix cache would serve.

    The same rule as ``KVCacheManager.get_computed_blocks`` (whole blocks,
    at least one token left to compute, token ids verified), without
    touching its hit statistics.
    """
    config = scheduler.config
    if not config.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
        return 0
    block_size = config.block_size
    block_pool = scheduler.kv_cache_manager.block_pool
    token_ids = request.all_token_ids
    max_num_blocks = (request.num_tokens - 1) // block_size
    num_hit_blocks = 0
    for i, block_hash in enumerate(request.block_hashes[:max_num_blocks]):
        start = i * block_size
        if block_pool.get_cached_block(block_hash, token_ids[start:start + block_size]) is None:
            break
        num_hit_blocks += 1
    return num_hit_blocks * block_size


class Router:
    """Ranks workers for a request by ``hit_tokens - load_weight_tokens * load``.

    ``load`` is the worker's number of unfinished (running + waiting)
    requests, so ``load_weight_tokens`` says how many prefix-hit tokens one
    queued request is worth. Ties go to the least loaded worker, then to the
    lowest engine index, so placement is deterministic.
    """

    def __init__(self, load_weight_tokens: float) -> None:
        if load_weight_tokens < 0:
            raise ValueError(f"load_weight_tokens is {load_weight_tokens}, must be >= 0")
        self.load_weight_tokens = load_weight_tokens
        self._hashers: dict[int, BlockHasher] = {}

    def rank(
        self, make_request: RequestFactory, sessions: Iterable[WorkerSession]
    ) -> list[tuple[WorkerSession, Request, int]]:
        """Candidates best first, each with the Request built for its block size
        and the number of its tokens that worker's prefix cache holds.

        Workers that share a block size share one Request, so each request is
        hashed once per distinct block size (in practice once).
        """
        requests: dict[int | None, Request] = {}
        ranked: list[tuple[float, int, int, WorkerSession, Request, int]] = []
        for session in sessions:
            scheduler = session.scheduler
            config = scheduler.config
            key = config.block_size if config.enable_prefix_caching else None
            request = requests.get(key)
            if request is None:
                request = requests[key] = make_request(self._hasher(key))
            load = scheduler.get_num_unfinished_requests()
            hit_tokens = prefix_hit_tokens(scheduler, request)
            score = hit_tokens - self.load_weight_tokens * load
            ranked.append((-score, load, session.engine_index, session, request, hit_tokens))
        ranked.sort(key=lambda entry: entry[:3])
        return [entry[3:] for entry in ranked]

    def _hasher(self, block_size: int | None) -> BlockHasher | None:
        if block_size is None:
            return None
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = get_request_block_hasher(block_size)
        return hasher
