"""The engine core's scheduler (vLLM V1 semantics) for one worker's block pool.

There are no prefill and decode phases: each step, every request's
``num_computed_tokens`` catches up with its ``num_tokens`` under one token
budget. Running requests go first, in order; waiting ones are admitted after,
only in a step that preempted nobody. A long prompt is therefore computed in
chunks across steps (chunked prefill), and a step mixes prefill chunks with
decodes.

Preemption is by recompute: when a running request cannot get a block, the
lowest-priority, latest-arriving running request frees its blocks, resets
``num_computed_tokens`` and goes back to the front of the waiting queue.

Asynchronous scheduling (vLLM V1's AsyncScheduler, folded in): ``schedule()``
may be called again before the previous step's output arrived. A step that
samples a request's next token leaves a placeholder for it
(``num_output_placeholders``), so the next step already computes that
position; the worker feeds in the token it sampled, and the output fills the
placeholder. A request that stops on a token found one step late has its
extra token dropped. Outputs must come back in step order; with one step at a
time (synchronous) placeholders are always filled before the next schedule.

Speculative decoding (the worker drafts, ``num_speculative_tokens`` > 0): a
decoding request is granted up to k draft slots, scheduled as 1 + k tokens
with 1 + k placeholders. The worker answers with the drafts it accepted and
one more token; the scheduler rolls ``num_computed_tokens`` back by the rest.
Blocks past the rollback stay with the request for its next drafts. A step
already in flight was scheduled from the unrolled count; the worker, which
knows what it accepted, shifts that step's positions down itself.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable

from services.common.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Logprobs,
)
from services.common.model_runner_output import ModelRunnerOutput, RequestFailure
from services.common.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from services.common.stats import SchedulerStats, SpecDecodingStats
from services.common.block_hash import get_request_block_hasher
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.kv_store import KVStore
from services.scheduler.request import Request, RequestStatus, RequestTimes
from services.scheduler.request_queue import SchedulingPolicy, create_request_queue
from services.scheduler.stop import check_stop


class WaitingQueueFullError(RuntimeError):
    """``add_request`` when ``max_num_waiting`` requests already wait (RESOURCE_EXHAUSTED)."""


class Scheduler:
    """Decides, each step, which tokens of which requests the worker computes.

    Call ``schedule()`` then ``update_from_output()`` with the worker's result
    for that step, also when nothing was scheduled: outputs of requests
    finished outside a step (IGNORED on arrival) are returned by the next
    ``update_from_output()``. The scheduler's in-memory state is authoritative;
    ``update_from_output`` mirrors each step's block changes to the store as
    one delta, once the worker has computed the step.

    With ``log_stats``, every request that finishes in ``update_from_output``
    leaves its RequestTimes in ``finished_req_times`` for the caller to take.
    """

    def __init__(self, config: SchedulerConfig, store: KVStore | None = None,
                 dirty_block_ids: Collection[int] = (), *, log_stats: bool = False) -> None:
        self.config = config
        # A request that outgrows the pool could only preempt itself forever,
        # so the pool's capacity caps the model length like max_model_len does.
        pool_capacity = config.num_usable_blocks * config.block_size
        self.max_model_len = min(config.max_model_len, pool_capacity)
        self.block_hasher = (
            get_request_block_hasher(config.block_size) if config.enable_prefix_caching else None
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            enable_caching=config.enable_prefix_caching,
            store=store,
            dirty_block_ids=dirty_block_ids,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        # Ids finished since the last schedule(): the worker drops their state.
        self.finished_req_ids: set[str] = set()
        # Outputs of requests finished outside update_from_output (IGNORED).
        self._pending_outputs: dict[int, list[EngineCoreOutput]] = {}
        self._step_id = 0
        self._num_preemptions = 0
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self.spec_stats = SpecDecodingStats.new(config.num_speculative_tokens)
        self.finished_req_times: list[RequestTimes] | None = [] if log_stats else None

    # ------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Queues a request, or finishes it as IGNORED if it can never fit.

        A ``Request`` passed in must have been built with ``self.block_hasher``.
        Raises ValueError for an empty prompt or a duplicate id, and
        WaitingQueueFullError when ``max_num_waiting`` requests already wait.
        """
        if isinstance(request, EngineCoreRequest):
            request = Request.from_engine_core_request(request, self.block_hasher)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has 0 prompt tokens, needs >= 1")
        limit = self.config.max_num_waiting
        if limit and len(self.waiting) >= limit:
            raise WaitingQueueFullError(
                f"waiting queue holds {len(self.waiting)} requests, max_num_waiting is {limit}"
            )
        reason = self._why_never_fits(request)
        if reason:
            request.status = RequestStatus.FINISHED_IGNORED
            request.finish_message = reason
            self._pending_outputs.setdefault(request.client_index, []).append(
                self._make_output(request, [], None, None)
            )
            return
        request.queued_time = time.monotonic()
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def _why_never_fits(self, request: Request) -> str:
        # All tokens, not just the prompt's: a request re-queued with outputs
        # (recompute after a lost worker) recomputes them like a prompt.
        num_prompt_tokens = request.num_tokens
        if num_prompt_tokens >= self.config.max_model_len:
            return f"prompt has {num_prompt_tokens} tokens, max_model_len is {self.config.max_model_len}"
        # The prompt plus the first sampled token must fit the empty pool.
        if not self.kv_cache_manager.can_fit(num_prompt_tokens + 1):
            block_size = self.config.block_size
            num_needed = -(-(num_prompt_tokens + 1) // block_size)
            return (
                f"prompt has {num_prompt_tokens} tokens and needs {num_needed} blocks, "
                f"the KV cache has {self.config.num_usable_blocks}"
            )
        return ""

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finishes waiting or running requests (e.g. aborts) and frees their blocks.

        Unknown or already finished ids are ignored. The ids go into the next
        ``SchedulerOutput.finished_req_ids``. No output is produced: whoever
        finishes a request already knows. The freed blocks reach the store with
        the next ``update_from_output``: a step may be in flight, and the store
        must not see the blocks it allocated before the worker computed them.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status is {finished_status!r}, must be a FINISHED_* status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running_ids: set[str] = set()
        waiting: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                running_ids.add(req_id)
            else:
                waiting.append(request)
            request.status = finished_status
            self._free_request(request)
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        if waiting:
            self.waiting.remove_requests(waiting)

    def commit_store(self) -> None:
        """Pushes what the store has not seen (the whole state when it asks for it).

        Only between steps: update_from_output does this for every step; an idle
        loop calls it so that a store which lost writes is repaired without waiting
        for the next request.
        """
        self.kv_cache_manager.commit(self._step_id)

    def _free_request(self, request: Request, uncache: bool = False) -> None:
        self.kv_cache_manager.free(request, uncache)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """Unfinished requests, or outputs / finished ids not yet handed out: keep stepping."""
        return self.has_unfinished_requests() or bool(self._pending_outputs or self.finished_req_ids)

    # ------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Picks this step's tokens and allocates their KV slots.

        Advances each scheduled request's ``num_computed_tokens`` by its
        scheduled tokens (the worker computes them before the next step) and
        leaves a placeholder for the token it samples; the output carries the
        values from before, where the worker starts.
        """
        self._step_id += 1
        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        output = SchedulerOutput(finished_req_ids=finished_req_ids, step_id=self._step_id)
        token_budget, preempted = self._schedule_running(output, self.config.limits.max_num_batched_tokens)
        if not preempted:
            self._schedule_waiting(output, token_budget)
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        self.kv_cache_manager.end_schedule(self._step_id)
        return output

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        placeholders = request.num_output_placeholders
        if placeholders and request.max_tokens is not None \
                and request.num_output_tokens + placeholders >= request.max_tokens:
            return 0  # the steps in flight already sample its last token
        num_new_tokens = request.num_tokens + placeholders - num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        # The last position is kept for the token the model will sample.
        return min(num_new_tokens, token_budget, self.max_model_len - 1 - num_computed_tokens)

    def _schedule_running(self, output: SchedulerOutput, token_budget: int) -> tuple[int, bool]:
        """Schedules running requests in order, preempting when blocks run out.

        Adds them to ``output`` as cached requests (new block ids only).
        Returns the token budget left and whether anything was preempted.
        """
        running = self.running
        cached = output.scheduled_cached_reqs
        num_scheduled_tokens = output.num_scheduled_tokens
        allocate_slots = self.kv_cache_manager.allocate_slots
        preempted = False
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_computed_tokens = request.num_computed_tokens
            num_new_tokens = self._num_new_tokens(request, num_computed_tokens, token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            num_drafts = self._num_draft_tokens(request, num_computed_tokens, num_new_tokens,
                                                token_budget)
            num_new_tokens += num_drafts
            while (new_blocks := allocate_slots(request, num_new_tokens)) is None:
                if num_drafts:  # drafts are the first thing to go when blocks run out
                    num_new_tokens -= num_drafts
                    num_drafts = 0
                    continue
                victim_index = self._select_victim_index()
                victim = running.pop(victim_index)
                if victim_index < req_index:
                    # Scheduled earlier in this step: take its tokens back.
                    req_index -= 1
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    output.num_draft_tokens.pop(victim.request_id, None)
                    _remove_cached_request(cached, victim.request_id)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                continue  # it preempted itself; running[req_index] is the next one
            _advance(request, num_computed_tokens + num_new_tokens, num_drafts)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            if num_drafts:
                output.num_draft_tokens[request.request_id] = num_drafts
            token_budget -= num_new_tokens
            cached.req_ids.append(request.request_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
            cached.num_computed_tokens.append(num_computed_tokens)
            req_index += 1
        return token_budget, preempted

    def _num_draft_tokens(self, request: Request, num_computed_tokens: int,
                          num_new_tokens: int, token_budget: int) -> int:
        """Draft slots for a request whose step computes its last token and samples
        the next: within the budget, ``max_tokens`` (counting the tokens steps in
        flight may sample) and ``max_model_len``; none for a prefill chunk."""
        k = self.config.num_speculative_tokens
        if not k or num_new_tokens != 1 or \
                num_computed_tokens + 1 != request.num_tokens + request.num_output_placeholders:
            return 0
        limit = self.config.speculative_disable_by_batch_size
        if limit and len(self.running) > limit:
            return 0
        if request.max_tokens is not None:
            k = min(k, request.max_tokens - request.num_output_tokens
                    - request.num_output_placeholders - 1)
        return max(0, min(k, token_budget - 1, self.max_model_len - 2 - num_computed_tokens))

    def _select_victim_index(self) -> int:
        """Index in ``running`` of the lowest-priority, latest-arriving request."""
        running = self.running
        last = len(running) - 1
        if self.config.policy is SchedulingPolicy.FCFS:
            return last
        # Scanning from the back makes the latest admitted win exact ties.
        best = last
        best_key = (running[last].priority, running[last].arrival_time)
        for i in range(last - 1, -1, -1):
            key = (running[i].priority, running[i].arrival_time)
            if key > best_key:
                best, best_key = i, key
        return best

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # What a step in flight samples for it is still appended when it arrives.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> None:
        """Admits waiting requests in queue order until one does not fit.

        Stopping at the first misfit keeps FCFS fair: a large request at the
        head is not starved by smaller ones behind it. A request scheduled
        for the first time goes out in full (NewRequestData); one resumed
        from preemption as a cached request whose block ids replace the old.
        """
        kv = self.kv_cache_manager
        max_num_seqs = self.config.limits.max_num_seqs
        while self.waiting and token_budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting.peek_request()
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            num_new_tokens = self._num_new_tokens(request, num_computed_tokens, token_budget)
            new_blocks = kv.allocate_slots(request, num_new_tokens, num_computed_tokens, computed_blocks)
            if new_blocks is None:
                break
            self.waiting.pop_request()
            self.running.append(request)
            req_id = request.request_id
            if request.status == RequestStatus.PREEMPTED:
                cached = output.scheduled_cached_reqs
                cached.req_ids.append(req_id)
                cached.resumed_from_preemption.append(True)
                cached.new_block_ids.append(kv.get_block_ids(req_id))
                cached.num_computed_tokens.append(num_computed_tokens)
            else:
                output.scheduled_new_reqs.append(NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(req_id),
                    num_computed_tokens=num_computed_tokens,
                    output_token_ids=list(request.output_token_ids),
                ))
            if request.num_cached_tokens < 0:  # scheduled for the first time
                request.num_cached_tokens = num_computed_tokens
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            _advance(request, num_computed_tokens + num_new_tokens)
            output.num_scheduled_tokens[req_id] = num_new_tokens
            token_budget -= num_new_tokens

    # ------------------------------------------------------------ outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Appends sampled tokens, applies stop conditions, frees finished requests.

        ``sampled_token_ids[i]`` is empty for a request partway through its
        prompt (its ``num_computed_tokens`` already advanced in schedule());
        a sampled token fills the request's placeholder. Results for requests
        that ``scheduler_output`` did not schedule, or that finished since
        (aborted, or stopped a step earlier), are dropped; a request preempted
        since keeps its token and recomputes it with the rest. Requests the worker
        dropped (``failed``) finish ABORTED with the worker's status and
        message. Returns the outputs grouped by client index, including those
        of requests IGNORED since the last call; ends with one commit to the
        store.
        """
        outputs, self._pending_outputs = self._pending_outputs, {}
        now = time.monotonic()
        finished_req_times = self.finished_req_times
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        requests = self.requests
        scheduled = scheduler_output.num_scheduled_tokens
        running_status = RequestStatus.RUNNING
        any_stopped = False
        stopped_waiting: list[Request] = []
        draft_budgets = scheduler_output.num_draft_tokens
        if model_runner_output.num_draft_tokens:
            self.spec_stats.observe(model_runner_output)
        for req_id, sampled in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            request = requests.get(req_id)
            if request is None or req_id not in scheduled:
                continue
            status = request.status
            if status is running_status:
                if sampled:
                    if not request.num_output_placeholders:
                        continue  # a token for a prefill chunk: not the worker's to sample
                    num_drafts = draft_budgets.get(req_id, 0) if draft_budgets else 0
                    request.num_output_placeholders -= 1 + num_drafts
                    # Positions of rejected drafts (and of unused budget) are computed again.
                    request.num_computed_tokens -= 1 + num_drafts - len(sampled)
            elif status is not RequestStatus.PREEMPTED:
                continue
            new_token_ids, stopped = self._append_tokens(request, sampled)
            if request.first_token_time is None and new_token_ids:
                request.first_token_time = now
            new_logprobs = logprobs.get(req_id) if logprobs else None
            if new_logprobs is not None and len(new_token_ids) < len(sampled):
                new_logprobs = _first_rows(new_logprobs, len(new_token_ids))
            new_prompt_logprobs = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if stopped:
                any_stopped = True
                if status is not running_status:
                    stopped_waiting.append(request)
                if finished_req_times is not None:
                    finished_req_times.append(request.times(now))
                self._free_request(request)
            elif not new_token_ids and new_prompt_logprobs is None:
                continue  # a prefill chunk with nothing to report
            output = self._make_output(request, new_token_ids, new_logprobs, new_prompt_logprobs)
            client_outputs = outputs.get(request.client_index)
            if client_outputs is None:
                outputs[request.client_index] = [output]
            else:
                client_outputs.append(output)
        if model_runner_output.failed:
            any_stopped |= self._finish_failed(model_runner_output.failed, scheduled, outputs,
                                               stopped_waiting)
        if any_stopped:
            self.running = [r for r in self.running if r.status is running_status]
        if stopped_waiting:
            self.waiting.remove_requests(stopped_waiting)
        self.kv_cache_manager.commit(scheduler_output.step_id)
        engine_index = self.config.engine_index
        return {
            client_index: EngineCoreOutputs(client_outputs, engine_index, now)
            for client_index, client_outputs in outputs.items()
        }

    def _finish_failed(
        self,
        failed: dict[str, RequestFailure],
        scheduled: dict[str, int],
        outputs: dict[int, list[EngineCoreOutput]],
        stopped_waiting: list[Request],
    ) -> bool:
        """Finishes the requests the worker dropped, each with its status; True if any.
        Those preempted since the step go into ``stopped_waiting``."""
        any_failed = False
        for req_id, failure in failed.items():
            request = self.requests.get(req_id)
            if request is None or req_id not in scheduled:
                continue
            if request.status is RequestStatus.PREEMPTED:
                stopped_waiting.append(request)
            elif request.status is not RequestStatus.RUNNING:
                continue
            any_failed = True
            request.status = RequestStatus.FINISHED_ABORTED
            request.finish_message = failure.message
            request.status_code = failure.status_code
            # The worker may have dropped it before writing this step's KV, so
            # its blocks leave the prefix cache. A block still shared stays:
            # it was written before, unless another request hit it in this
            # very step and the worker refused this one at admission (a
            # logits processor the frontend does not run refused it).
            self._free_request(request, uncache=True)
            outputs.setdefault(request.client_index, []).append(
                self._make_output(request, [], None, None))
        return any_failed

    def _append_tokens(self, request: Request, sampled: list[int]) -> tuple[list[int], bool]:
        """Appends sampled tokens one by one; stops at the first that finishes the request.

        Returns the tokens kept and whether the request finished.
        """
        if len(sampled) == 1:  # the common case, without the loop
            request.append_output_token_ids(sampled)
            return sampled, check_stop(request, self.max_model_len)
        for i, token_id in enumerate(sampled):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                return sampled[: i + 1], True
        return sampled, False

    @staticmethod
    def _make_output(
        request: Request,
        new_token_ids: list[int],
        new_logprobs: Logprobs | None,
        new_prompt_logprobs: Logprobs | None,
    ) -> EngineCoreOutput:
        # Positional: this runs once per request per step, and keywords cost
        # more than the rest of the construction.
        return EngineCoreOutput(
            request.request_id,
            new_token_ids,
            new_logprobs,
            new_prompt_logprobs,
            request.get_finished_reason(),
            request.stop_reason,
            max(request.num_cached_tokens, 0),
            request.finish_message,
            request.status_code,
        )

    # ------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        prefix_stats = kv.make_prefix_cache_stats()
        self._prefix_cache_queries += prefix_stats.queries
        self._prefix_cache_hits += prefix_stats.hits
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_total_blocks=self.config.num_usable_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            num_evicted_blocks=kv.block_pool.num_evicted_blocks,
            spec_decoding=self.spec_stats.copy() if self.config.num_speculative_tokens else None,
        )


def _advance(request: Request, num_computed_tokens: int, num_drafts: int = 0) -> None:
    """Sets the request's computed positions after scheduling; a step that
    reaches its last token samples the next one, which gets a placeholder, and
    as many more as it has draft slots (each may be accepted)."""
    request.num_computed_tokens = num_computed_tokens
    if num_computed_tokens - num_drafts == request.num_tokens + request.num_output_placeholders:
        request.num_output_placeholders += 1 + num_drafts


def _remove_cached_request(cached: CachedRequestData, req_id: str) -> None:
    i = cached.req_ids.index(req_id)
    for column in (cached.req_ids, cached.resumed_from_preemption,
                   cached.new_block_ids, cached.num_computed_tokens):
        del column[i]


def _first_rows(logprobs: Logprobs, num_rows: int) -> Logprobs:
    return Logprobs(
        token_ids=logprobs.token_ids[:num_rows],
        logprobs=logprobs.logprobs[:num_rows],
        sampled_token_ranks=logprobs.sampled_token_ranks[:num_rows],
    )
