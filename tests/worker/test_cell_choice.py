"""Workers joining cells: the choice rule, then real workers over two real schedulers.

Schedulers are the real scheduler service on loopback ports; workers run a
tiny random-weight Llama in-process (tests/grpc_utils.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from services.common.redis_server import free_port
from services.scheduler.server import SchedulerServer
from services.worker.cell_choice import choose_cell, rebalance_target
from services.worker.config import WorkerServiceConfig
from services.worker.server import WorkerService
from tests.grpc_utils import (
    FrontendClient,
    get_stats,
    greedy_request,
    reference_tokens,
    save_tiny_llama,
    start_scheduler,
    start_worker,
    wait_until,
)

# ---------------------------------------------------------------- the rule


def test_the_cell_with_the_fewest_workers_wins():
    assert choose_cell("w0", {"a:1": 3, "b:1": 1, "c:1": 2}) == "b:1"


def test_unreachable_cells_are_skipped_and_none_live_is_none():
    assert choose_cell("w0", {"a:1": None, "b:1": 5}) == "b:1"
    assert choose_cell("w0", {"a:1": None, "b:1": None}) is None
    assert choose_cell("w0", {}) is None


def test_ties_are_broken_the_same_way_per_worker_and_spread_over_workers():
    loads = {"10.0.0.1:50052": 2, "10.0.0.2:50052": 2, "10.0.0.3:50052": 2}
    assert len({choose_cell("w7", dict(reversed(loads.items()))) for _ in range(5)}
               | {choose_cell("w7", loads)}) == 1
    counts = Counter(choose_cell(f"worker-{i}", loads) for i in range(3000))
    assert set(counts) == set(loads)
    assert all(900 <= n <= 1100 for n in counts.values()), counts


def test_a_crowded_cell_sends_just_enough_idle_workers_to_the_smallest():
    loads = {"a:1": 4, "b:1": 0}
    idle = ["w0", "w1", "w2", "w3"]
    # All four check at the same moment: two move, and only to b.
    moves = [rebalance_target(w, "a:1", loads, idle) for w in idle]
    assert Counter(moves) == {"b:1": 2, None: 2}
    # One more than the smallest is balanced; busy workers and an unanswered
    # cell of its own keep a worker where it is.
    assert rebalance_target("w0", "a:1", {"a:1": 3, "b:1": 2}, idle) is None
    assert rebalance_target("w0", "a:1", {"a:1": 2, "b:1": 0}, ["w1"]) is None
    assert rebalance_target("w1", "a:1", {"a:1": 2, "b:1": 0}, ["w1"]) == "b:1"
    assert rebalance_target("w1", "a:1", {"a:1": None, "b:1": 0}, ["w1"]) is None
    assert rebalance_target("w1", "a:1", {"a:1": 2, "b:1": None}, ["w1"]) is None


def test_config_checks_the_scheduler_addresses_and_intervals():
    config = WorkerServiceConfig(scheduler_address="10.0.0.1:50052, sched:50052", worker_id="w")
    assert config.scheduler_address == "10.0.0.1:50052, sched:50052"
    for bad in ("", "no-port", "h:0", "h:1,nope"):
        with pytest.raises(ValueError, match="scheduler_address"):
            WorkerServiceConfig(scheduler_address=bad, worker_id="w")
    for name in ("rejoin_grace_s", "rebalance_interval_s"):
        with pytest.raises(ValueError, match=name):
            WorkerServiceConfig(worker_id="w", **{name: -1.0})


# ---------------------------------------------------------------- real cells


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=90))


async def worker_ids(server: SchedulerServer) -> list[str]:
    return sorted(w.worker_id for w in (await get_stats(server.address)).workers)


async def wait_for_cells(servers: list[SchedulerServer], predicate, timeout_s: float = 30.0):
    """Polls every cell's workers until ``predicate(list of id lists)`` holds; returns them."""
    deadline = time.monotonic() + timeout_s
    while True:
        cells = [await worker_ids(s) for s in servers]
        if predicate(cells):
            return cells
        if time.monotonic() > deadline:
            raise TimeoutError(f"cells stayed {cells}")
        await asyncio.sleep(0.05)


def test_workers_started_one_after_the_other_join_the_emptier_cell(model_dir):
    async def scenario():
        a, b = await start_scheduler(), await start_scheduler()
        addresses = f"{a.address},{b.address}"
        workers = []
        for i in range(2):
            workers.append(start_worker(addresses, model_dir, f"w{i}", rebalance_interval_s=0))
            await wait_for_cells([a, b], lambda cells, n=i + 1: sum(map(len, cells)) == n)
        cells = [await worker_ids(a), await worker_ids(b)]
        await a.stop(0.5)
        await b.stop(0.5)
        await asyncio.gather(*(asyncio.wait_for(w.task, 10) for w in workers))
        return cells

    assert sorted(map(len, run(scenario()))) == [1, 1]


def test_four_workers_started_at_once_end_two_and_two(model_dir):
    async def scenario():
        a, b = await start_scheduler(), await start_scheduler()
        workers = [start_worker(f"{a.address},{b.address}", model_dir, f"w{i}",
                                rebalance_interval_s=0.3) for i in range(4)]
        cells = await wait_for_cells([a, b], lambda cells: [len(c) for c in cells] == [2, 2])
        await a.stop(0.5)
        await b.stop(0.5)
        await asyncio.gather(*(asyncio.wait_for(w.task, 10) for w in workers))
        return cells

    cells = run(scenario())
    assert sorted(cells[0] + cells[1]) == ["w0", "w1", "w2", "w3"]


def test_workers_crowded_into_one_cell_rebalance_to_the_new_one(model_dir):
    async def scenario():
        a = await start_scheduler()
        b_port = free_port()  # b is down: every worker joins a
        addresses = f"{a.address},127.0.0.1:{b_port}"
        workers = [start_worker(addresses, model_dir, f"w{i}", rebalance_interval_s=0.3)
                   for i in range(3)]
        crowded = await wait_for_cells([a], lambda cells: len(cells[0]) == 3)
        b = await start_scheduler(port=b_port)
        balanced = await wait_for_cells([a, b], lambda cells: sorted(map(len, cells)) == [1, 2])
        await asyncio.sleep(1.5)  # a few more checks each: it stays balanced
        settled = [await worker_ids(a), await worker_ids(b)]
        await a.stop(0.5)
        await b.stop(0.5)
        await asyncio.gather(*(asyncio.wait_for(w.task, 10) for w in workers))
        return crowded, balanced, settled

    crowded, balanced, settled = run(scenario())
    assert crowded == [["w0", "w1", "w2"]]
    assert sorted(balanced[0] + balanced[1]) == ["w0", "w1", "w2"]
    assert sorted(map(len, settled)) == [1, 2]
    assert sorted(settled[0] + settled[1]) == ["w0", "w1", "w2"]


def test_a_worker_that_lost_its_scheduler_joins_the_other_cell_after_the_grace(model_dir):
    grace_s = 1.0

    async def scenario():
        a, b = await start_scheduler(), await start_scheduler()
        worker = start_worker(f"{a.address},{b.address}", model_dir, "w0",
                              rejoin_grace_s=grace_s, rebalance_interval_s=0)
        cells = await wait_for_cells([a, b], lambda cells: sum(map(len, cells)) == 1)
        first, other = (a, b) if cells[0] else (b, a)
        await first.stop(0.2, drain_workers=False)  # lost, not drained
        lost_at = time.monotonic()
        await wait_for_cells([other], lambda cells: cells[0] == ["w0"])
        rejoined_after_s = time.monotonic() - lost_at
        await other.stop(0.5)
        await asyncio.wait_for(worker.task, 10)
        return rejoined_after_s

    rejoined_after_s = run(scenario())
    assert grace_s <= rejoined_after_s < grace_s + 5


def test_a_scheduler_back_within_the_grace_gets_its_worker_back(model_dir):
    async def scenario():
        port = free_port()
        a, b = await start_scheduler(port=port), await start_scheduler()
        # The worker's id prefers neither: it joined a because b was down.
        b_address = b.address
        await b.stop(0.1)
        worker = start_worker(f"{a.address},{b_address}", model_dir, "w0",
                              rejoin_grace_s=30.0, rebalance_interval_s=0)
        await wait_for_cells([a], lambda cells: cells[0] == ["w0"])
        b = await start_scheduler(port=int(b_address.rpartition(":")[2]))
        await a.stop(0.2, drain_workers=False)
        a = await start_scheduler(port=port)
        cells = await wait_for_cells([a, b], lambda cells: sum(map(len, cells)) == 1)
        await a.stop(0.5)
        await b.stop(0.5)
        await asyncio.wait_for(worker.task, 10)
        return cells

    # Choosing again would have picked the empty b; within the grace it is a again.
    assert run(scenario()) == [["w0"], []]


# ------------------------------------------------- leaving: the scheduler decides


def greedy_rule(worker_id, current, num_workers_by_address, idle_worker_ids):
    """A worker acting on stale stats: every worker of a bigger cell wants to move."""
    live = {a: n for a, n in num_workers_by_address.items() if n is not None}
    smallest = min(live, key=live.get)
    return smallest if current in live and live[current] > live[smallest] else None


def test_workers_that_all_ask_to_leave_at_once_move_one_at_a_time(model_dir, monkeypatch):
    monkeypatch.setattr("services.worker.server.rebalance_target", greedy_rule)

    async def scenario():
        a = await start_scheduler()
        b_port = free_port()  # b is down: both workers join a
        workers = [start_worker(f"{a.address},127.0.0.1:{b_port}", model_dir, f"w{i}",
                                rebalance_interval_s=0.1) for i in range(2)]
        await wait_for_cells([a], lambda cells: len(cells[0]) == 2)
        b = await start_scheduler(port=b_port)
        seen = []  # a's workers, sampled until the end: it never empties
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            seen.append(len(await worker_ids(a)))
            await asyncio.sleep(0.02)
        cells = [await worker_ids(a), await worker_ids(b)]
        await a.stop(0.5)
        await b.stop(0.5)
        await asyncio.gather(*(asyncio.wait_for(w.task, 10) for w in workers))
        return seen, cells

    seen, cells = run(scenario())
    assert min(seen) == 1
    assert [len(c) for c in cells] == [1, 1]


def test_a_worker_asking_to_leave_while_it_runs_requests_finishes_them_first(model_dir,
                                                                            monkeypatch):
    """The race a stale view allows: a worker asks to leave just as requests are
    placed on it. They run to the end on it (one engine index each, no failover),
    new requests go to the worker that stays, and then it moves."""
    monkeypatch.setattr("services.worker.server.rebalance_target", greedy_rule)
    monkeypatch.setattr(WorkerService, "_holds_requests", lambda self: False)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(12)] for i in range(8)]
    first = [greedy_request(f"first-{i}", p, 120) for i, p in enumerate(prompts[:4])]
    later = [greedy_request(f"later-{i}", p, 20) for i, p in enumerate(prompts[4:])]
    expected = reference_tokens(model_dir, first + later)

    async def scenario():
        a = await start_scheduler()
        # Grants as they happen: a worker whose requests are already done is
        # granted, drained and gone within a step, too soon to be seen leaving.
        granted, ask = [], a.coordinator.request_leave

        def recording_request_leave(session):
            answer = ask(session)
            if answer is None:
                granted.append(session.worker_id)
            return answer

        monkeypatch.setattr(a.coordinator, "request_leave", recording_request_leave)
        b_port = free_port()
        workers = [start_worker(f"{a.address},127.0.0.1:{b_port}", model_dir, f"w{i}",
                                rebalance_interval_s=0.1) for i in range(2)]
        await wait_for_cells([a], lambda cells: len(cells[0]) == 2)
        client = FrontendClient(a.address)
        await client.add(*first)
        await wait_until(lambda: all(client.tokens[r.request_id] for r in first))
        b = await start_scheduler(port=b_port)
        # One worker asks and is granted at once, the other is refused: it stays.
        await wait_until(lambda: granted)
        await client.add(*later)
        await client.wait_finished(*(r.request_id for r in first + later))
        cells = await wait_for_cells([a, b], lambda cells: [len(c) for c in cells] == [1, 1])
        await client.close()
        await a.stop(0.5)
        await b.stop(0.5)
        await asyncio.gather(*(asyncio.wait_for(w.task, 10) for w in workers))
        return client, cells, granted

    client, cells, granted = run(scenario())
    assert len(set(granted)) == 1  # one worker moved; the other was refused or never asked
    assert {r: client.tokens[r] for r in expected} == expected
    assert all(o.status_code == 0 for o in client.finished.values())
    # Each request ran on one worker from start to end: none was cut off by the move.
    assert all(len(set(client.engine_indexes[r])) == 1 for r in expected)
    stayed = {client.engine_indexes[r.request_id][0] for r in later}
    assert len(stayed) == 1


def test_a_shutdown_drain_that_crosses_a_request_to_leave_ends_the_worker(model_dir,
                                                                         monkeypatch):
    """The scheduler starts shutting down just before it reads the worker's
    LeaveRequest: the Drain goes out first, any refusal after it. The worker
    leaves for good; it does not take that Drain for a grant and join the cell
    it wanted (which, seen in stale stats, may be gone by then)."""
    def always_the_other(worker_id, current, num_workers_by_address, idle_worker_ids):
        return next((a for a, n in num_workers_by_address.items()
                     if a != current and n is not None), None)

    monkeypatch.setattr("services.worker.server.rebalance_target", always_the_other)

    async def scenario():
        a = await start_scheduler()
        asked = []

        def shutdown_first(session):
            asked.append(session.worker_id)
            a.coordinator.drain_workers()  # the Drain is queued before any answer
            return None

        monkeypatch.setattr(a.coordinator, "request_leave", shutdown_first)
        b_port = free_port()  # b is down: the worker joins a
        worker = start_worker(f"{a.address},127.0.0.1:{b_port}", model_dir, "w0",
                              rebalance_interval_s=0.1)
        await wait_for_cells([a], lambda cells: cells == [["w0"]])
        b = await start_scheduler(port=b_port)
        await wait_until(lambda: asked)
        done, _ = await asyncio.wait({worker.task}, timeout=10)
        joined_b = await worker_ids(b)
        await a.stop(0.5)
        await b.stop(0.5)
        await asyncio.wait_for(worker.task, 10)
        return asked, bool(done), joined_b

    asked, left, joined_b = run(scenario())
    assert asked == ["w0"]
    assert left and joined_b == []
