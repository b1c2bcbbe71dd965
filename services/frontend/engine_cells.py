"""Every scheduler (cell) this frontend knows, presented to AsyncLLM as one engine core.

One FrontendStream per cell (``EngineCoreClient``). A new request goes to
the cell ``cell_routing.choose_cell`` picks, from the cells' prefix entries
and load in Redis (one lookup; load alone without Redis); all n>1
children of a request go together. The frontend remembers where each
request runs, so aborts go there.

When a cell's stream breaks, that scheduler dropped everything the stream
carried: its requests become *orphans*. An orphan goes back to its own cell
as soon as that cell serves again, or to another live cell once the cell has
been gone for ``cell_grace_s``, each time with the tokens it has so far
(which the cell recomputes), so greedy and seeded outputs are unchanged and
the client's stream just continues. Requests that arrive while no cell
serves, but one was lost less than ``resubmit_grace_s`` ago, wait as orphans
too; an orphan still waiting after ``resubmit_grace_s`` fails (UNAVAILABLE).

``refresh()`` (the frontend's health loop, about every second and whenever a
stream goes up or down) asks each cell's GetStats (its id, generation,
workers, load), resolves the scheduler addresses again (a DNS name may name
new cells), sends orphans and fails the expired ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from kvmesh.v1 import api_pb2

from services.common.engine import EngineCoreOutputs, EngineCoreRequest
from services.common.scheduler_addresses import SchedulerTarget, resolve_scheduler_targets
from services.common.security import TlsConfig
from services.frontend.cell_routing import (
    DEFAULT_REQUEST_WEIGHT,
    CellCandidate,
    RouteReason,
    cell_load_tokens,
    choose_cell,
)
from services.frontend.engine_core_client import EngineCoreClient, EngineUnavailableError
from services.frontend.prefix_index import PrefixIndexReader, prompt_block_hashes

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 2.0
# A request sent this long before a load reading is taken to be in it.
_TRANSIT_MS = 5
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_RESOLVE_INTERVAL_S = 5.0

OutputsCallback = Callable[[EngineCoreOutputs], None]
# (internal request ids, why): requests that waited longer than the grace.
LostCallback = Callable[[list[str], str], None]
# The request as it stands now (its outputs so far), None once it is finished.
CurrentRequest = Callable[[str], EngineCoreRequest | None]


@dataclass(eq=False)
class Cell:
    """One scheduler: its stream, what its GetStats said last, what runs there."""

    target: SchedulerTarget
    client: EngineCoreClient
    cell_id: str = ""
    generation: int = 0
    num_workers: int = 0
    block_size: int = 0
    prefill_tokens: int = 0  # its prompt tokens not computed yet
    num_requests: int = 0  # running and waiting
    load_updated_ms: int = 0  # the Redis record's, when load came from there
    # Sent here and not yet in the load read last: (wall ms sent, uncached
    # prompt tokens) each, and their sums.
    pending: deque[tuple[int, int]] = field(default_factory=deque)
    pending_tokens: int = 0
    pending_requests: int = 0
    lost_at: float | None = None  # when its stream broke (monotonic); None while up
    request_ids: set[str] = field(default_factory=set)
    routed: Counter[str] = field(default_factory=Counter)  # by RouteReason value

    @property
    def name(self) -> str:
        return self.cell_id or self.target.address

    @property
    def ready(self) -> bool:
        """Its stream is up and it has a worker (as of the last GetStats)."""
        return self.client.connected and self.num_workers > 0

    def load_tokens(self, request_weight: float) -> float:
        return cell_load_tokens(self.prefill_tokens + self.pending_tokens,
                                self.num_requests + self.pending_requests, request_weight)

    def candidate(self, request_weight: float, hit_tokens: int = 0) -> CellCandidate:
        return CellCandidate(self.name, self.num_workers, self.load_tokens(request_weight),
                             hit_tokens)

    def set_load(self, prefill_tokens: int, num_requests: int, as_of_ms: int) -> None:
        """The cell's load as of ``as_of_ms`` (wall clock): what was sent before
        then (less a transit allowance) is in it; what was sent since is not."""
        self.prefill_tokens, self.num_requests = prefill_tokens, num_requests
        while self.pending and self.pending[0][0] < as_of_ms - _TRANSIT_MS:
            _, tokens = self.pending.popleft()
            self.pending_tokens -= tokens
            self.pending_requests -= 1

    def add_pending(self, uncached_tokens: int) -> None:
        self.pending.append((_now_ms(), uncached_tokens))
        self.pending_tokens += uncached_tokens
        self.pending_requests += 1


@dataclass(frozen=True, slots=True)
class Orphan:
    """A request waiting for a cell: since when, and the cell it ran on (None: none)."""

    since: float
    home: Cell | None


class EngineCells:
    """The engine core of AsyncLLM over every cell (see the module docstring).

    ``model`` namespaces the Redis index; ``redis_url`` None routes by load
    alone. ``on_outputs`` gets every cell's outputs; ``on_lost`` the requests
    that found no cell within the grace; ``current_request`` gives a
    request's state to resend (None: it is gone). ``on_change`` runs when a
    stream goes up or down (the frontend's health loop then refreshes).
    ``prefill_weight`` weighs uncached prompt tokens against load, in which
    each request counts ``request_weight`` tokens (cell_routing.py).
    """

    def __init__(self, addresses: list[str], model: str, on_outputs: OutputsCallback,
                 on_lost: LostCallback, current_request: CurrentRequest, *,
                 tls: TlsConfig | None = None, cluster_secret: str | None = None,
                 redis_url: str | None = None, prefill_weight: float = 1.0,
                 request_weight: float = DEFAULT_REQUEST_WEIGHT,
                 cell_grace_s: float = 1.0, resubmit_grace_s: float = 30.0,
                 on_change: Callable[[], None] | None = None) -> None:
        self.addresses = addresses
        self.model = model
        self.prefill_weight = prefill_weight
        self.request_weight = request_weight
        self.cell_grace_s = cell_grace_s
        self.resubmit_grace_s = resubmit_grace_s
        self.index = None if redis_url is None else PrefixIndexReader(redis_url)
        self.cells: dict[str, Cell] = {}  # by address dialed
        self.placements: dict[str, Cell] = {}  # internal request id -> its cell
        self.orphans: dict[str, Orphan] = {}
        self._on_outputs = on_outputs
        self._on_lost = on_lost
        self._current_request = current_request
        self._on_change = on_change or (lambda: None)
        self._tls = tls
        self._cluster_secret = cluster_secret
        self._resolved_at = 0.0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Resolves the addresses and starts one stream per cell (returns at once)."""
        await self._resolve()

    async def close(self) -> None:
        await asyncio.gather(*(cell.client.close() for cell in self.cells.values()))
        if self.index is not None:
            await self.index.close()

    @property
    def connected(self) -> bool:
        return any(cell.client.connected for cell in self.cells.values())

    @property
    def ready(self) -> bool:
        return any(cell.ready for cell in self.cells.values())

    async def wait_connected(self, timeout_s: float | None = None) -> None:
        """Waits until some cell's stream is up; TimeoutError after ``timeout_s``."""
        async def poll() -> None:
            while not self.connected:
                await asyncio.sleep(0.02)
        await asyncio.wait_for(poll(), timeout_s)

    async def _resolve(self) -> None:
        self._resolved_at = time.monotonic()
        targets = await asyncio.to_thread(resolve_scheduler_targets, self.addresses)
        for target in targets:
            if target.address not in self.cells:
                self._add_cell(target)
        known = {target.address for target in targets}
        for address, cell in list(self.cells.items()):
            # Gone from the list and idle: forget it (a name dialed before it
            # resolved, now dialed by address, would otherwise count twice).
            if address not in known and not cell.request_ids:
                del self.cells[address]
                await cell.client.close()

    def _add_cell(self, target: SchedulerTarget) -> None:
        cell = Cell(target, client=None)  # type: ignore[arg-type]  # set just below
        cell.client = EngineCoreClient(
            target.address, lambda outputs: self._handle_outputs(cell, outputs),
            on_connect=lambda: self._handle_connect(cell),
            on_disconnect=lambda reason: self._handle_disconnect(cell, reason),
            tls=self._tls, cluster_secret=self._cluster_secret,
            channel_options=target.channel_options())
        self.cells[target.address] = cell
        cell.client.start()
        logger.info("event=cell_added address=%s", target.address)

    # ------------------------------------------------------------ requests

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Routes the requests (a request's n>1 children, same prompt) to one cell.

        With no cell connected, they wait as orphans if a cell was lost less
        than ``resubmit_grace_s`` ago; otherwise EngineUnavailableError.
        """
        # A connected cell whose workers were not counted yet still gets it (its
        # scheduler refuses it if it has none): GetStats is polled, streams are not.
        ready = ([cell for cell in self.cells.values() if cell.ready]
                 or [cell for cell in self.cells.values() if cell.client.connected])
        if not ready:
            if not self._expecting_a_cell():
                raise EngineUnavailableError(
                    "no scheduler can serve: " + (", ".join(
                        f"{c.name} {'has no worker' if c.client.connected else 'is not connected'}"
                        for c in self.cells.values()) or "none is known yet"))
            now = time.monotonic()
            for request in requests:
                self.orphans[request.request_id] = Orphan(now, None)
            return
        cell, reason = await self._route(requests[0], ready)
        for request in requests:
            # The caller may have left during the lookup: send only what is still wanted.
            if self._current_request(request.request_id) is not None:
                self._send(cell, request, reason)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Aborts internal ids in the cells that run them (orphans are just dropped)."""
        by_cell: dict[Cell, list[str]] = {}
        for request_id in request_ids:
            self.orphans.pop(request_id, None)
            cell = self.placements.pop(request_id, None)
            if cell is not None:
                cell.request_ids.discard(request_id)
                by_cell.setdefault(cell, []).append(request_id)
        for cell, ids in by_cell.items():
            cell.client.abort_requests(ids)

    def _send(self, cell: Cell, request: EngineCoreRequest, reason: RouteReason) -> None:
        try:
            cell.client.add_request(request)
        except EngineUnavailableError:
            # The stream broke during routing: the request waits like the cell's others.
            self.orphans[request.request_id] = Orphan(time.monotonic(), cell)
            return
        self.placements[request.request_id] = cell
        cell.request_ids.add(request.request_id)
        cell.routed[reason.value] += 1

    async def _route(self, request: EngineCoreRequest,
                     ready: list[Cell]) -> tuple[Cell, RouteReason]:
        num_tokens = _num_tokens(request)
        hits = await self._lookup_hits(request, ready) if len(ready) > 1 else {}
        found = hits or {}
        candidates = [cell.candidate(self.request_weight, found.get(cell.name, 0))
                      for cell in ready]
        chosen = ready[choose_cell(candidates, num_tokens, self.prefill_weight)]
        hit_tokens = found.get(chosen.name, 0)
        chosen.add_pending(num_tokens - hit_tokens)
        if hits is None:
            reason = RouteReason.FALLBACK
        else:
            reason = RouteReason.PREFIX if hit_tokens else RouteReason.LOAD
        return chosen, reason

    async def _lookup_hits(self, request: EngineCoreRequest,
                           ready: list[Cell]) -> dict[str, int] | None:
        """Cached prompt tokens per cell name from Redis ({} without an index,
        None when it cannot be read); refreshes each cell's load from its
        record on the way."""
        if self.index is None:
            return {}
        token_ids = [*request.prompt_token_ids, *request.output_token_ids]
        hashes_by_size: dict[int, list[str]] = {}
        queries: list[tuple[str, list[str]]] = []
        for cell in ready:
            if cell.cell_id and cell.block_size:
                hashes = hashes_by_size.get(cell.block_size)
                if hashes is None:
                    hashes = hashes_by_size[cell.block_size] = prompt_block_hashes(
                        token_ids, cell.block_size, request.cache_salt)
                queries.append((cell.cell_id, hashes))
        lookups = await self.index.lookup(self.model, queries)
        if lookups is None:
            return None
        hits: dict[str, int] = {}
        for cell in ready:
            found = lookups.get(cell.cell_id)
            if found is None or found.record is None:
                hits[cell.name] = 0
                continue
            record = found.record
            if record.updated_ms != cell.load_updated_ms:
                cell.load_updated_ms = record.updated_ms
                cell.set_load(record.prefill_tokens, record.num_running + record.num_waiting,
                              record.updated_ms)
            hits[cell.name] = found.num_hit_blocks * cell.block_size
        return hits

    # ------------------------------------------------------------ stream callbacks

    def _handle_outputs(self, cell: Cell, outputs: EngineCoreOutputs) -> None:
        """Forwards a cell's outputs, forgetting where finished requests ran.

        A request the cell gives up as UNAVAILABLE (its last worker died, or it
        is draining) is not failed while another cell is connected: it waits as
        an orphan and goes, with its tokens so far, to the first cell that
        serves (at once when one is known to, not after the grace; the stats
        this frontend holds may be a second old, so a cell they show without
        workers may have one by now), failing after ``resubmit_grace_s``.
        """
        moved: set[str] = set()
        for output in outputs.outputs:
            request_id = output.request_id
            if output.finish_reason is None or self.placements.get(request_id) is not cell:
                continue
            del self.placements[request_id]
            cell.request_ids.discard(request_id)
            if output.status_code == _UNAVAILABLE and self._another_connected(cell):
                cell.num_workers = 0  # until its GetStats says otherwise
                self.orphans[request_id] = Orphan(time.monotonic() - self.cell_grace_s, cell)
                moved.add(request_id)
                logger.info("event=request_moving request_id=%s cell=%s reason=%r",
                            request_id, cell.name, output.finish_message)
        if moved:
            outputs = dataclasses.replace(
                outputs, outputs=[o for o in outputs.outputs if o.request_id not in moved])
            self._on_change()  # the orphans go out at once
        self._on_outputs(outputs)

    def _another_connected(self, cell: Cell) -> bool:
        return any(other.client.connected for other in self.cells.values() if other is not cell)

    def _handle_connect(self, cell: Cell) -> None:
        cell.lost_at = None
        self._on_change()

    def _handle_disconnect(self, cell: Cell, reason: str) -> None:
        """The cell's scheduler dropped every request of the stream: they wait for a cell."""
        now = time.monotonic()
        cell.lost_at = now
        cell.num_workers = 0
        for request_id in cell.request_ids:
            self.placements.pop(request_id, None)
            self.orphans[request_id] = Orphan(now, cell)
        logger.warning("event=cell_lost cell=%s num_orphans=%d reason=%r", cell.name,
                       len(cell.request_ids), reason)
        cell.request_ids.clear()
        self._on_change()

    # ------------------------------------------------------------ refresh

    async def refresh(self) -> bool:
        """Polls every cell, re-resolves now and then, places orphans; whether any cell serves."""
        if time.monotonic() - self._resolved_at >= _RESOLVE_INTERVAL_S:
            await self._resolve()
        await asyncio.gather(*(self._poll(cell) for cell in list(self.cells.values())))
        self.place_orphans()
        return self.ready

    async def _poll(self, cell: Cell) -> None:
        if not cell.client.connected:
            cell.num_workers = 0
            return
        asked_ms = _now_ms()
        try:
            stats = await cell.client.get_stats(timeout_s=_STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            cell.num_workers = 0  # a frozen or failing scheduler
            return
        cell.cell_id = stats.cell_id
        cell.generation = stats.cell_generation
        cell.num_workers = len(stats.workers)
        cell.block_size = stats.block_size
        cell.set_load(stats.prefill_tokens,
                      sum(w.num_running_reqs + w.num_waiting_reqs for w in stats.workers),
                      asked_ms)

    def place_orphans(self) -> None:
        """Sends each orphan home if its cell serves again, else, past the cell's
        grace, to the least loaded live cell; fails those past ``resubmit_grace_s``."""
        now = time.monotonic()
        ready = [cell for cell in self.cells.values() if cell.ready]
        expired: list[str] = []
        for request_id, orphan in list(self.orphans.items()):
            request = self._current_request(request_id)
            if request is None:
                del self.orphans[request_id]
                continue
            home = orphan.home
            if home is not None and home.ready:
                target = home
            elif ready and (home is None or now - orphan.since >= self.cell_grace_s):
                candidates = [c.candidate(self.request_weight) for c in ready]
                target = ready[choose_cell(candidates, _num_tokens(request), self.prefill_weight)]
            else:
                if now - orphan.since >= self.resubmit_grace_s:
                    expired.append(request_id)
                continue
            del self.orphans[request_id]
            target.add_pending(_num_tokens(request))
            self._send(target, request, RouteReason.RESUBMIT)
            logger.info("event=request_resubmitted request_id=%s cell=%s num_output_tokens=%d",
                        request_id, target.name, len(request.output_token_ids))
        if expired:
            for request_id in expired:
                del self.orphans[request_id]
            self._on_lost(expired, f"no scheduler served it within {self.resubmit_grace_s}s")

    def _expecting_a_cell(self) -> bool:
        """A cell was lost less than ``resubmit_grace_s`` ago (a restart is likely)."""
        now = time.monotonic()
        return any(cell.lost_at is not None and now - cell.lost_at < self.resubmit_grace_s
                   for cell in self.cells.values())

    # ------------------------------------------------------------ stats

    async def get_stats(self, include_block_map: bool = False) -> api_pb2.ClusterStats:
        """Every connected cell's workers (each tagged with its cell) and every
        cell's state; raises grpc.aio.AioRpcError when no cell answers."""
        cells = list(self.cells.values())
        answers = await asyncio.gather(
            *(cell.client.get_stats(include_block_map) for cell in cells if cell.client.connected),
            return_exceptions=True)
        merged = api_pb2.ClusterStats()
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors and len(errors) == len(answers):
            raise errors[0]
        for stats in answers:
            if isinstance(stats, BaseException):
                continue
            for worker in stats.workers:
                worker.cell_id = stats.cell_id
                merged.workers.append(worker)
        for cell in cells:
            merged.cells.append(api_pb2.CellStats(
                cell_id=cell.cell_id, address=cell.target.address,
                connected=cell.client.connected, generation=cell.generation,
                num_workers=cell.num_workers,
                load_tokens=round(cell.load_tokens(self.request_weight)),
                routed_requests=dict(cell.routed)))
        return merged


def _now_ms() -> int:
    return int(time.time() * 1000)


def _num_tokens(request: EngineCoreRequest) -> int:
    return len(request.prompt_token_ids) + len(request.output_token_ids)
