"""What the scheduler accepts from a worker: a bounded registration and honest step outputs.

A worker is a peer like any other: its registration decides how much memory
the scheduler spends on its block pool, and its outputs become other users'
tokens. Both are checked before they are used; a worker that fails a check is
refused (registration) or disconnected and its requests re-placed (outputs).
"""

from __future__ import annotations

import re

from services.common.engine import Logprobs
from services.common.model_runner_output import (
    FAILURE_STATUS_CODES,
    MAX_FAILURE_MESSAGE_CHARS,
    ModelRunnerOutput,
    RequestFailure,
)
from services.common.registration import WorkerRegistration
from services.common.scheduler_output import SchedulerOutput
from services.common.speculative import MAX_SPECULATIVE_TOKENS
from services.scheduler.config import RegistrationBounds

# Worker ids name Redis keys and log lines: hostname-like, bounded.
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class WorkerProtocolError(RuntimeError):
    """The worker sent something the step protocol does not allow."""


def check_registration(registration: WorkerRegistration, bounds: RegistrationBounds) -> None:
    """Raises ValueError naming the first field outside its allowed range."""
    r = registration
    if not _WORKER_ID.fullmatch(r.worker_id):
        raise ValueError(f"worker_id {r.worker_id[:140]!r} must be 1 to 128 characters of "
                         "[A-Za-z0-9._-], starting with a letter or digit")
    _check_range("num_blocks", r.num_blocks, 2, bounds.max_num_blocks)
    _check_range("block_size", r.block_size, 1, bounds.max_block_size)
    _check_range("max_model_len", r.max_model_len, 2, bounds.max_model_len)
    _check_range("vocab_size", r.vocab_size, 1, bounds.max_vocab_size)
    for token_id in r.eos_token_ids:
        _check_range("eos_token_ids", token_id, 0, r.vocab_size - 1)
    if r.limits is not None:
        _check_range("max_num_seqs", r.limits.max_num_seqs, 1, bounds.max_num_seqs)
        _check_range("max_num_batched_tokens", r.limits.max_num_batched_tokens, 1,
                     bounds.max_num_batched_tokens)
    _check_range("num_speculative_tokens", r.num_speculative_tokens, 0, MAX_SPECULATIVE_TOKENS)
    _check_range("speculative_disable_by_batch_size", r.speculative_disable_by_batch_size, 0,
                 bounds.max_num_seqs)


def _check_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{field} is {value}, allowed range is [{low}, {high}]")


def check_runner_output(
    output: ModelRunnerOutput, step: SchedulerOutput, vocab_size: int
) -> None:
    """Raises WorkerProtocolError unless ``output`` answers ``step`` honestly.

    Every scheduled request appears exactly once, as an output or a failure,
    with at most one sampled token id in [0, vocab_size), or with a draft
    budget: at least one and at most one more than the drafts it verified,
    which are within the budget; logprob rows belong to
    requests of the step and never outnumber what was sampled or computed; a
    failed request was scheduled, has no output, and a bounded message with
    an allowed status.
    """
    if output.step_id != step.step_id:
        raise WorkerProtocolError(f"answered step {output.step_id}, step in flight is "
                                  f"{step.step_id}")
    if len(output.sampled_token_ids) != len(output.req_ids):
        raise WorkerProtocolError(f"{len(output.req_ids)} request ids but "
                                  f"{len(output.sampled_token_ids)} token lists")
    scheduled = step.num_scheduled_tokens
    if len(set(output.req_ids)) != len(output.req_ids):
        raise WorkerProtocolError("a request id appears twice in one step's output")
    for req_id, sampled in zip(output.req_ids, output.sampled_token_ids):
        if req_id not in scheduled:
            raise WorkerProtocolError(f"output for request {req_id[:80]!r}, not scheduled "
                                      f"in step {step.step_id}")
        _check_sampled(req_id, sampled, step.num_draft_tokens.get(req_id, 0),
                       output.num_draft_tokens.get(req_id, 0), vocab_size)
    for req_id, failure in output.failed.items():
        _check_failure(req_id, failure, scheduled)
    if not output.failed.keys().isdisjoint(output.req_ids):
        raise WorkerProtocolError("a request both failed and has an output in one step")
    if len(output.req_ids) + len(output.failed) != len(scheduled):
        # The scheduler holds a placeholder for each token the step samples.
        raise WorkerProtocolError(f"answered {len(output.req_ids) + len(output.failed)} of the "
                                  f"{len(scheduled)} requests scheduled in step {step.step_id}")
    sampled_counts = dict(zip(output.req_ids, map(len, output.sampled_token_ids)))
    for req_id, rows in output.logprobs.items():
        _check_logprob_rows("logprobs", req_id, rows, sampled_counts.get(req_id, 0), vocab_size)
    for req_id, rows in output.prompt_logprobs.items():
        _check_logprob_rows("prompt_logprobs", req_id, rows, scheduled.get(req_id, 0), vocab_size)


def _check_sampled(req_id: str, sampled: list[int], budget: int, num_drafts: int,
                   vocab_size: int) -> None:
    if not 0 <= num_drafts <= budget:
        raise WorkerProtocolError(f"request {req_id!r}: verified {num_drafts} drafts, "
                                  f"allowed range is [0, {budget}] (its draft budget)")
    low = 1 if num_drafts else 0
    if not low <= len(sampled) <= num_drafts + 1 \
            or any(not 0 <= t < vocab_size for t in sampled):
        raise WorkerProtocolError(
            f"request {req_id!r}: sampled {sampled[:4]}, allowed: {low} to {num_drafts + 1} "
            f"token ids in [0, {vocab_size})")


def _check_failure(req_id: str, failure: RequestFailure, scheduled: dict[str, int]) -> None:
    if req_id not in scheduled:
        raise WorkerProtocolError(f"failure for request {req_id[:80]!r}, not scheduled")
    if failure.status_code not in FAILURE_STATUS_CODES:
        raise WorkerProtocolError(f"request {req_id!r} failed with status {failure.status_code}, "
                                  "allowed: INVALID_ARGUMENT or INTERNAL")
    if len(failure.message) > MAX_FAILURE_MESSAGE_CHARS:
        raise WorkerProtocolError(f"request {req_id!r}: failure message of "
                                  f"{len(failure.message)} characters, at most "
                                  f"{MAX_FAILURE_MESSAGE_CHARS} allowed")


def _check_logprob_rows(
    field: str, req_id: str, rows: Logprobs, max_rows: int, vocab_size: int
) -> None:
    if len(rows) > max_rows or len(rows.logprobs) != len(rows) \
            or len(rows.sampled_token_ranks) != len(rows):
        raise WorkerProtocolError(f"request {req_id[:80]!r}: {len(rows)} {field} rows, "
                                  f"at most {max_rows} allowed and all columns alike")
    for token_ids in rows.token_ids:
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise WorkerProtocolError(f"request {req_id!r}: {field} token id outside "
                                      f"[0, {vocab_size})")
