"""BatchUpdateBuilder: collects one step's batch changes into a BatchUpdate."""

from __future__ import annotations

from services.worker.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    MovedRequest,
    RemovedRequest,
)


class BatchUpdateBuilder:
    """Mutable collector turned into a frozen ``BatchUpdate`` once per step.

    Rows are recorded in the order the batch reports them: ``removed`` via
    ``removed_append`` / ``discard_removed``, ``added`` and ``moved`` by
    appending to the lists. ``get_and_reset`` hands them over as one
    ``BatchUpdate`` and starts the next step with empty lists.
    """

    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []

    def removed_append(self, index: int) -> None:
        """Record that row ``index`` was emptied this step."""
        self._removed.append(index)

    @property
    def removed(self) -> list[RemovedRequest]:
        """Rows emptied this step, in the order they were removed."""
        return self._removed

    def discard_removed(self, index: int) -> bool:
        """Forget a removal because an added request reuses its row.

        The add replaces the row's state, so reporting the removal too would be
        redundant. Returns True if ``index`` was pending removal.
        """
        try:
            self._removed.remove(index)
        except ValueError:
            return False
        return True

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """Freeze the pending changes (None if there are none) and start afresh."""
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(
            batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved
        )
        # New lists: the BatchUpdate keeps the old ones.
        self._removed, self.added, self.moved = [], [], []
        return update
