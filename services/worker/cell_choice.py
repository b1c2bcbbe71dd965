"""Which cell (scheduler) a worker joins, and the channels it dials them over.

A worker given several schedulers asks each for its stats and joins the live
one with the fewest workers. Ties are broken by rendezvous hashing of the
worker id and the address, so workers that start together spread over the
cells instead of all picking the first; the same hashing decides which idle
workers of a crowded cell move when the cells are rebalanced.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Collection, Iterable, Mapping

import grpc

from kvmesh.v1 import api_pb2, scheduler_pb2_grpc
from services.common.rpc import CHANNEL_OPTIONS
from services.common.scheduler_addresses import SchedulerTarget
from services.common.security import TlsConfig, aio_channel

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
# What a scheduler that is down, starting or unreachable answers; any other
# refusal (a wrong cluster secret, no GetStats) is logged.
_DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.CANCELLED)


def rendezvous_score(worker_id: str, address: str) -> int:
    """A stable pseudo-random rank of (worker, cell); higher wins a tie."""
    digest = hashlib.blake2b(f"{worker_id}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def choose_cell(worker_id: str, num_workers_by_address: Mapping[str, int | None]) -> str | None:
    """The address of the cell with the fewest workers; None when no cell is live.

    A count of None marks a cell that did not answer: it is never chosen.
    Among cells with equally few workers the one with the highest
    ``rendezvous_score(worker_id, address)`` wins, so the choice is the same
    every time for one worker and spread evenly over many workers.
    """
    live = [(n, a) for a, n in num_workers_by_address.items() if n is not None]
    if not live:
        return None
    return min(live, key=lambda na: (na[0], -rendezvous_score(worker_id, na[1])))[1]


def rebalance_target(worker_id: str, current: str, num_workers_by_address: Mapping[str, int | None],
                     idle_worker_ids: Collection[str]) -> str | None:
    """The cell ``worker_id`` should move to from ``current``, or None to stay.

    It moves to the smallest live cell (as ``choose_cell`` picks it) when
    ``current`` has at least 2 more workers than that one, and only if it is
    among the ``difference // 2`` workers of ``idle_worker_ids`` (the idle
    workers of ``current``) that rank first for the smallest cell: workers
    that check at the same moment then move no more of them than evens the
    cells. None as well when ``current`` did not answer.
    """
    live = {a: n for a, n in num_workers_by_address.items() if n is not None}
    if current not in live:
        return None
    smallest = choose_cell(worker_id, live)
    assert smallest is not None  # current is live
    num_to_move = (live[current] - live[smallest]) // 2
    if num_to_move < 1 or worker_id not in idle_worker_ids:
        return None
    ranked = sorted(idle_worker_ids, key=lambda w: -rendezvous_score(w, smallest))
    return smallest if worker_id in ranked[:num_to_move] else None


class SchedulerChannels:
    """One channel per scheduler target, reused by the worker stream and the probes."""

    def __init__(self, tls: TlsConfig | None) -> None:
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, target: SchedulerTarget) -> grpc.aio.Channel:
        """The channel to ``target``, opened on first use."""
        channel = self._channels.get(target.address)
        if channel is None:
            options = (*CHANNEL_OPTIONS, *target.channel_options())
            channel = aio_channel(target.address, self.tls, options)
            self._channels[target.address] = channel
        return channel

    async def retain(self, targets: Iterable[SchedulerTarget]) -> None:
        """Closes the channels to every target not in ``targets``."""
        keep = {t.address for t in targets}
        for address in [a for a in self._channels if a not in keep]:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        await self.retain(())


async def probe_cells(channels: SchedulerChannels, targets: Iterable[SchedulerTarget],
                      metadata: tuple[tuple[str, str], ...],
                      timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, api_pb2.ClusterStats]:
    """GetStats of every target at once, by address; those that fail or do not
    answer within ``timeout_s`` (a scheduler still starting is waited for that
    long) are left out."""
    targets = list(targets)

    async def probe(target: SchedulerTarget) -> api_pb2.ClusterStats | None:
        stub = scheduler_pb2_grpc.EngineCoreStub(channels.get(target))
        try:
            return await stub.GetStats(api_pb2.GetStatsRequest(), metadata=metadata,
                                       timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            if e.code() not in _DOWN_CODES:
                logger.warning("event=cell_probe_refused scheduler=%s status=%s details=%r",
                               target.address, e.code().name, e.details())
            return None

    answers = await asyncio.gather(*(probe(t) for t in targets))
    return {t.address: stats for t, stats in zip(targets, answers) if stats is not None}


def num_workers_of(targets: Iterable[SchedulerTarget],
                   stats: Mapping[str, api_pb2.ClusterStats]) -> dict[str, int | None]:
    """Each target's number of registered workers; None for one that did not answer."""
    return {t.address: len(stats[t.address].workers) if t.address in stats else None
            for t in targets}


def idle_workers_of(stats: api_pb2.ClusterStats) -> list[str]:
    """The workers of a cell with no request running or waiting."""
    return [w.worker_id for w in stats.workers
            if w.num_running_reqs == 0 and w.num_waiting_reqs == 0]
