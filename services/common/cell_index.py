"""The cell index in Redis: what every cell publishes and frontends route by.

A *cell* is one scheduler and the workers registered with it. Each scheduler
alone writes its cell's keys, all under ``kvmesh:{model}:cell:{cell_id}:``:

- ``record``      HASH  the lease and a load summary (``CellRecord``); its TTL is
                        the lease: the owner renews it, a dead or frozen owner's
                        record expires and its cell routes nothing.
- ``blocks``      HASH  hex block hash -> generation that wrote it: the prefix
                        entries, one per full block some worker of the cell
                        holds computed; same TTL as the record.
- ``generation``  STRING bumped at every start of the cell's scheduler.

Readers trust an entry only while the record exists and names the same
generation as the entry. The index is a hint: a stale entry costs a cache
miss where the request lands, never a wrong answer (the scheduler checks
every block's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


def cell_key(model: str, cell_id: str, name: str) -> str:
    """The key ``name`` (record, blocks, generation) of a cell."""
    return f"kvmesh:{model}:cell:{cell_id}:{name}"


@dataclass(slots=True)
class CellRecord:
    """A cell's published state (the ``record`` hash, every value a decimal string).

    ``prefill_tokens``: prompt tokens of the cell's requests not computed yet;
    ``num_waiting`` and ``num_running``: its requests. ``updated_ms``: the
    owner's wall clock at the write, so readers see a fresh summary.
    ``block_size``: what the cell's prefix entries are hashed with.
    """

    generation: int = 0
    block_size: int = 0
    num_workers: int = 0
    prefill_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    updated_ms: int = 0

    def to_fields(self) -> dict[str, str]:
        """The hash fields, the owner's nonce excluded (the publisher adds it)."""
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_fields(cls, values: dict[str, str]) -> CellRecord | None:
        """The record read back, or None for a missing or malformed one."""
        try:
            return cls(**{f.name: int(values[f.name]) for f in fields(cls)})
        except (KeyError, ValueError):
            return None
