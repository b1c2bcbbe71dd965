"""A request as the scheduler sees it: its tokens, progress and status."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.engine import EngineCoreRequest, FinishReason
from services.common.sampling_params import SamplingParams
from services.common.block_hash import BlockHash, BlockHasher


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # the prompt can never fit (max_model_len or KV cache)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        """The FinishReason a client sees, or None while the request is live."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


@dataclass(slots=True, frozen=True)
class RequestTimes:
    """Where a finished request spent its time on one worker, in seconds (vLLM's
    queue, prefill and decode times)."""

    queue_time_s: float  # queued -> first scheduled
    prefill_time_s: float  # first scheduled -> first token
    decode_time_s: float  # first token -> finished


class Request:
    """One request's state inside the scheduler.

    ``all_token_ids`` is the prompt followed by the outputs; ``num_computed_tokens``
    counts the leading positions whose KV is in the cache or being computed,
    ``num_output_placeholders`` of them for tokens sampled in steps whose output
    has not arrived yet. ``block_hashes`` holds one
    hash per FULL block of ``all_token_ids``; when a block hasher is given it is
    filled at construction and extended by ``append_output_token_ids``. Token lists
    must only be changed through ``append_output_token_ids`` so they stay in sync.
    """

    __slots__ = (
        "request_id", "client_index", "priority", "arrival_time", "sampling_params",
        "eos_token_id", "cache_salt", "prompt_token_ids", "output_token_ids",
        "all_token_ids", "num_computed_tokens", "num_output_placeholders", "num_cached_tokens",
        "num_placed_hit_tokens", "num_preemptions",
        "status", "stop_reason", "finish_message", "status_code", "block_hashes", "max_tokens",
        "queued_time", "scheduled_time", "first_token_time", "_block_hasher",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.arrival_time = arrival_time
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens the worker samples in steps still in flight (asynchronous
        # scheduling): already computed as positions, not yet known as ids.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # set the first time the request is scheduled
        # The prefix hit its worker's cache offered when it was placed: what it
        # should not need to compute while it waits (the cell's load summary).
        self.num_placed_hit_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.finish_message = ""
        # A grpc.StatusCode value when the request failed instead of finishing.
        self.status_code = 0
        self.max_tokens = sampling_params.max_tokens
        # time.monotonic() when the scheduler queued it, first scheduled it
        # and got its first token (RequestTimes).
        self.queued_time = 0.0
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        if block_hasher is not None:
            self.block_hashes = block_hasher(self)

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest | Request, block_hasher: BlockHasher | None = None
    ) -> Request:
        """A new WAITING request with ``req``'s prompt, parameters and outputs so far
        (a Request has the same attribute names, so it can be the source too).

        Outputs so far come from a lost worker (failover) or a frontend that
        resubmits after a scheduler restart: the worker recomputes every token;
        ``max_tokens`` and ``min_tokens`` keep counting the outputs produced.
        """
        request = cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            client_index=req.client_index,
            block_hasher=block_hasher,
        )
        if req.output_token_ids:
            request.append_output_token_ids(list(req.output_token_ids))
        return request

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Appends generated tokens and hashes every block they complete."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def times(self, finished_time: float) -> RequestTimes:
        """Its RequestTimes when it finishes at ``finished_time`` (monotonic);
        a phase it never reached lasts 0."""
        scheduled = self.scheduled_time if self.scheduled_time is not None else finished_time
        first_token = self.first_token_time if self.first_token_time is not None else finished_time
        return RequestTimes(scheduled - self.queued_time, first_token - scheduled,
                            finished_time - first_token)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        """Lower (priority, arrival_time, request_id) runs first."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
