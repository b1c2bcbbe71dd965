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

    ``removed`` is kept in descending order once read, so ``pop_removed``
    returns the lowest free row in O(1): new requests fill the lowest holes
    first. Registering a removal after ``removed`` was read raises
    RuntimeError, because the caller may already have reused a row it saw.
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
        self._is_removed_sorted = False

    def removed_append(self, index: int) -> None:
        if self._is_removed_sorted:
            raise RuntimeError(
                f"cannot register removed row {index} after the removed rows were read"
            )
        self._removed.append(index)

    def _ensure_removed_sorted(self) -> None:
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        """Removed rows, highest first."""
        self._ensure_removed_sorted()
        return self._removed

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest removed row, or None."""
        if not self._removed:
            return None
        self._ensure_removed_sorted()
        return self._removed[-1]

    def pop_removed(self) -> int | None:
        """Take the lowest removed row (to reuse it for an added request), or None."""
        if not self._removed:
            return None
        self._ensure_removed_sorted()
        return self._removed.pop()

    def discard_removed(self, index: int) -> bool:
        """Forget a removal because an added request reuses its row.

        The add replaces the row's state, so reporting the removal too would be
        redundant. Returns True if ``index`` was pending removal.
        """
        try:
            self._removed.remove(index)  # removing keeps a sorted list sorted
        except ValueError:
            return False
        return True

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """Freeze the pending changes (None if there are none) and start afresh."""
        self._is_removed_sorted = False
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(
            batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved
        )
        # New lists: the BatchUpdate keeps the old ones.
        self._removed, self.added, self.moved = [], [], []
        return update
