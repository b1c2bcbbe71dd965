"""DirtyBlockLog: the KV blocks a worker may have written that the scheduler's
durable mirror does not cover yet.

The scheduler mirrors its prefix index to Redis after each step, in the
background. If it dies, a restarted scheduler recovers that index while the
worker keeps its KV memory, so the index must not name a block whose KV the
worker has overwritten since the index was written. A block is only
overwritten after the scheduler gives it to a request anew, so the worker
logs the block ids each step hands out, forgets them once a step message
says the mirror covers that step (``durable_step_id``), and reports the rest
when it registers again: they are left out of the recovery.
"""

from __future__ import annotations

from services.common.scheduler_output import SchedulerOutput

# The log of a previous registration: covered once the new scheduler's first
# (recovery) state is durable, which is step 0 of its numbering.
_PREVIOUS_REGISTRATION_STEP_ID = 0


class DirtyBlockLog:
    """Block ids handed out per step, since the mirror last became durable."""

    def __init__(self) -> None:
        self._by_step: dict[int, set[int]] = {}

    def record(self, step: SchedulerOutput) -> None:
        """Logs the blocks ``step`` hands out (before the worker writes them) and
        forgets every step the mirror now covers."""
        new_ids = {block_id for req in step.scheduled_new_reqs for block_id in req.block_ids}
        for block_ids in step.scheduled_cached_reqs.new_block_ids:
            new_ids.update(block_ids)
        if new_ids:
            self._by_step.setdefault(step.step_id, set()).update(new_ids)
        durable = step.durable_step_id
        if durable >= 0 and any(step_id <= durable for step_id in self._by_step):
            self._by_step = {s: ids for s, ids in self._by_step.items() if s > durable}

    def dirty_block_ids(self) -> list[int]:
        """Every logged block id, for the next registration."""
        return sorted(set().union(*self._by_step.values()))

    def start_registration(self) -> None:
        """A scheduler accepted the registration that reported ``dirty_block_ids``:
        its step ids start again, so the old log waits for its first durable state."""
        self._by_step = {_PREVIOUS_REGISTRATION_STEP_ID: set(self.dirty_block_ids())}
