"""A worker's membership of a cell: what it reports when it dials the scheduler
(`WorkerRegistration`), and its asking to leave for another cell (`LeaveRequest`,
`LeaveRefused`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.limits import SchedulingLimits


@dataclass(slots=True)
class WorkerRegistration:
    """A worker's model and KV pool (kvmesh.v1.WorkerRegistration).

    The scheduler builds that worker's block pool from ``num_blocks`` and
    ``block_size`` and never schedules past ``limits``, the sizes of the
    worker's batch buffers (None: not reported, the scheduler's own apply).
    ``dirty_block_ids`` are blocks the worker may have written since the
    scheduler's mirror last became durable: their stored index entries may
    describe KV that is gone, so they are never recovered.
    ``num_speculative_tokens`` > 0: the worker drafts (speculative decoding)
    and the scheduler grants each decoding request up to that many draft
    slots a step, none while more than ``speculative_disable_by_batch_size``
    requests run (0: no such bound).
    """

    worker_id: str
    model: str
    dtype: str
    block_size: int
    num_blocks: int  # includes the null block 0
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    limits: SchedulingLimits | None = None
    dirty_block_ids: list[int] = field(default_factory=list)
    num_speculative_tokens: int = 0
    speculative_disable_by_batch_size: int = 0


@dataclass(frozen=True, slots=True)
class LeaveRequest:
    """A worker asks to move to another cell (kvmesh.v1.LeaveRequest).

    The scheduler grants it by placing nothing more on the worker and sending
    Drain once the worker's requests are done, so no request is cut off by
    the move; or it answers `LeaveRefused`.
    """


@dataclass(frozen=True, slots=True)
class Drain:
    """The scheduler tells the worker to leave (kvmesh.v1.Drain): for the cell it
    asked to move to when ``leave_granted``, else for good."""

    leave_granted: bool = False


@dataclass(frozen=True, slots=True)
class LeaveRefused:
    """The scheduler keeps the worker (kvmesh.v1.LeaveRefused): it is the cell's
    last serving worker, or another one is leaving; ``reason`` says which."""

    reason: str
