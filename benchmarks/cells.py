"""Cells: routing between several schedulers (issue 23).

Every cluster is real processes (``LocalCluster``: Redis, schedulers, workers,
one frontend) on simulated workers (``--simulate``, fixed step time): they
keep no KV memory, but the scheduler does its full block accounting, which is
where prefix hits are counted, and their tokens are deterministic (a function
of the last token and its position), so outputs can be compared across runs.
Tables:

(a) prefix hit rate on a shared-prefix workload: ``--systems`` system prompts
    x ``--users`` users, each request a system prompt of ``--system-len``
    random token ids + ``--suffix-len`` of its own, 8 output tokens, sent in
    random order, ``--concurrency`` in flight. Hit rate = sum(num_cached_tokens)
    / sum(num_prompt_tokens) over the final responses. The same 4 workers as
    1 cell (the reference), 2 and 4 cells with prefix routing (the frontend
    reads Redis), 2 and 4 cells routed by load alone (the frontend started
    without a Redis URL); with ample KV blocks (every system prompt fits in
    every worker) and with tight ones (a worker holds the system prompts
    prefix routing gives its cell, and 3 more);
(b) the frontend's routing cost per request: ``EngineCells._route`` (hashing
    the prompt's full blocks, one pipelined Redis round trip for every cell's
    record and entries, ``choose_cell``) timed in this process, with an
    ``EngineCells`` of its own streaming to the cluster's real schedulers and
    reading its real Redis, on the prompts of (a) (whose prefixes the cells
    hold); with its two parts timed alone;
(c) CPU seconds per 1,000 generated tokens of each scheduler process (utime +
    stime from /proc) with the same load on each scheduler: one worker and
    128 requests of 64 + 128 tokens per cell, all at once; 1 cell, 2 cells,
    and (the control) two one-cell clusters side by side, as busy on the same
    cores with no work between them. Each scheduler's tokens are its routed
    requests x 128; its steps come from its /metrics; its idle CPU over as
    long a quiet spell after is shown beside (lease and index writes to Redis);
    the run of least CPU of ``--repeats``, each on fresh prompts;
(d) a scheduler SIGKILLed under load: 2 cells, 64 greedy DELTA streams; the
    kill comes once every stream has 20 tokens. Lost requests (streams ending
    in an error), the time from the kill until every stream still running
    resumed (its first chunk after its longest silence since the kill: the
    tokens already on their way to the client come first), and until all
    finished; outputs compared with the same requests run undisturbed on the
    same cluster first.

    .venv/bin/python -m benchmarks.cells --quick     # 4 x 16 users: a few minutes
    .venv/bin/python -m benchmarks.cells             # 8 x 64 users
    .venv/bin/python -m benchmarks.cells --tables c d
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from kvmesh.v1 import api_pb2, api_pb2_grpc, engine_pb2

from benchmarks.control_plane import _cpu_s, fixed_step, print_table
from kvmesh.client import Client
from kvmesh.cluster import ClusterConfig, LocalCluster
from services.common.engine import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.frontend.engine_cells import EngineCells
from services.frontend.prefix_index import prompt_block_hashes

MAX_MODEL_LEN = 2048
NUM_KV_BLOCKS = 4096  # per worker: the simulated worker allocates no KV memory
BLOCK_SIZE = 16  # the workers' default
PER_CELL_REQUESTS = 128  # (c)
_TOKEN_IDS = (1000, 40000)
_START_TIMEOUT_S = 120.0


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_TOKEN_IDS) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


# ---------------------------------------------------------------- clusters


def start_cells(stack: ExitStack, num_cells: int, num_workers: int, step_ms: float, *,
                prefix_routing: bool = True, num_kv_blocks: int = NUM_KV_BLOCKS
                ) -> tuple[LocalCluster, Client]:
    """A cluster of ``num_cells`` schedulers sharing ``num_workers`` simulated
    workers and one frontend, once the frontend sees every cell with a worker."""
    config = ClusterConfig(
        num_schedulers=num_cells, num_workers=num_workers, num_frontends=1,
        frontend_http_port=None, max_model_len=MAX_MODEL_LEN, startup_timeout_s=_START_TIMEOUT_S,
        log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-cells-")),
        worker_args=fixed_step(step_ms) + ["--num-kv-blocks", str(num_kv_blocks)],
        # An empty --redis-url: the frontend reads no index and routes by load alone.
        frontend_args=[] if prefix_routing else ["--redis-url="],
    )
    cluster = stack.enter_context(LocalCluster(config))
    client = stack.enter_context(Client(cluster.address, timeout_s=300))
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _all_cells_serve(client, num_cells):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{num_cells} cells with a worker each: {client.stats().cells}")
        time.sleep(0.1)
    return cluster, client


def _all_cells_serve(client: Client, num_cells: int) -> bool:
    cells = client.stats().cells
    return len(cells) == num_cells and all(c.connected and c.num_workers > 0 for c in cells)


def routed_by_cell(client: Client) -> dict[str, int]:
    """Requests the frontend sent to each cell so far, every reason together."""
    return {c.cell_id: sum(c.routed_requests.values()) for c in client.stats().cells}


def _generate_request(prompt: list[int], max_tokens: int, kind: int) -> api_pb2.GenerateRequest:
    params = engine_pb2.SamplingParams(
        n=1, temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=max_tokens,
        ignore_eos=True, detokenize=False, output_kind=kind)
    request = api_pb2.GenerateRequest(sampling_params=params)
    request.token_ids.ids.extend(prompt)
    return request


@dataclass(slots=True)
class Stream:
    """One DELTA stream as the client saw it."""

    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)  # perf_counter, one per chunk
    error: str = ""
    finished_s: float = 0.0


async def _stream(stub, prompt: list[int], max_tokens: int, stream: Stream) -> None:
    try:
        async for chunk in stub.Generate(_generate_request(prompt, max_tokens, engine_pb2.DELTA)):
            token_ids = [t for o in chunk.outputs for t in o.token_ids]
            if token_ids:
                stream.token_ids.extend(token_ids)
                stream.token_times_s.append(time.perf_counter())
    except grpc.aio.AioRpcError as e:
        stream.error = f"{e.code().name}: {e.details()}"
    stream.finished_s = time.perf_counter()


async def _final(stub, prompt: list[int], max_tokens: int,
                 limit: asyncio.Semaphore) -> api_pb2.GenerateResponse:
    async with limit:
        request = _generate_request(prompt, max_tokens, engine_pb2.FINAL_ONLY)
        last = None
        async for chunk in stub.Generate(request):
            last = chunk
        return last


async def run_final(address: str, prompts: list[list[int]], max_tokens: int,
                    concurrency: int) -> list[api_pb2.GenerateResponse]:
    """The final response of each prompt, ``concurrency`` in flight."""
    limit = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(_final(stub, p, max_tokens, limit) for p in prompts))


# ---------------------------------------------------------------- (a) and (b)


def shared_prefix_prompts(args: argparse.Namespace, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [random_tokens(rng, args.system_len) for _ in range(args.systems)]
    prompts = [s + random_tokens(rng, args.suffix_len) for s in systems for _ in range(args.users)]
    rng.shuffle(prompts)
    return prompts


async def _route_times_ms(cluster: LocalCluster, model: str, prompts: list[list[int]],
                          num_samples: int
                          ) -> tuple[dict[str, list[float]], dict[str, int], int]:
    """Milliseconds of ``EngineCells._route`` and of its two parts alone, per
    request, from an EngineCells of this process on the cluster's schedulers and
    Redis; how many requests each RouteReason got; the blocks hashed per prompt."""
    cells = EngineCells(cluster.scheduler_addresses, model, lambda outputs: None,
                        lambda ids, why: None, lambda request_id: None,
                        cluster_secret=cluster.cluster_secret, redis_url=cluster.redis_url)
    await cells.start()
    try:
        deadline = time.monotonic() + 30
        while not all(c.ready for c in cells.cells.values()) or len(cells.cells) < len(
                cluster.schedulers):
            if time.monotonic() > deadline:
                raise TimeoutError("the benchmark's EngineCells never saw every cell ready")
            await cells.refresh()
            await asyncio.sleep(0.1)
        ready = list(cells.cells.values())
        block_size = ready[0].block_size
        times: dict[str, list[float]] = {"hash": [], "lookup": [], "route": []}
        reasons: dict[str, int] = {}
        for i in range(num_samples):
            prompt = prompts[i % len(prompts)]
            request = EngineCoreRequest(f"route-{i}", prompt, SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            hashes = prompt_block_hashes(prompt, block_size, None)
            t1 = time.perf_counter()
            await cells.index.lookup(model, [(c.cell_id, hashes) for c in ready])
            t2 = time.perf_counter()
            _, reason = await cells._route(request, ready)
            t3 = time.perf_counter()
            for name, start, end in (("hash", t0, t1), ("lookup", t1, t2), ("route", t2, t3)):
                times[name].append((end - start) * 1e3)
            reasons[reason.value] = reasons.get(reason.value, 0) + 1
            for cell in ready:  # what _route added stands for nothing that was sent
                cell.set_load(cell.prefill_tokens, cell.num_requests,
                              as_of_ms=int(time.time() * 1e3) + 1000)
        return times, reasons, len(hashes)
    finally:
        await cells.close()


def tables_ab(args: argparse.Namespace) -> None:
    prompts = shared_prefix_prompts(args)
    num_workers = 4
    # Tight: each worker holds the system prompts a prefix-routed cell of one
    # worker gets, and 3 more; ample: every system prompt everywhere.
    blocks_per_system = -(-args.system_len // BLOCK_SIZE)
    tight = blocks_per_system * (-(-args.systems // num_workers) + 3)
    cases = [(NUM_KV_BLOCKS, 1, True), (NUM_KV_BLOCKS, 2, True), (NUM_KV_BLOCKS, 4, True)]
    if "a" in args.tables:
        cases += [(NUM_KV_BLOCKS, 2, False), (NUM_KV_BLOCKS, 4, False),
                  (tight, 1, True), (tight, 2, True), (tight, 4, True), (tight, 2, False),
                  (tight, 4, False)]
    hit_rows, route_rows = [], []
    reference: dict[int, float] = {}
    for num_kv_blocks, num_cells, prefix_routing in cases:
        with ExitStack() as stack:
            cluster, client = start_cells(stack, num_cells, num_workers, args.step_ms,
                                          prefix_routing=prefix_routing,
                                          num_kv_blocks=num_kv_blocks)
            t0 = time.perf_counter()
            responses = asyncio.run(run_final(cluster.address, prompts, 8, args.concurrency))
            duration_s = time.perf_counter() - t0
            cached = sum(r.metrics.num_cached_tokens for r in responses)
            prompt_tokens = sum(r.metrics.num_prompt_tokens for r in responses)
            hit_rate = cached / prompt_tokens
            reference.setdefault(num_kv_blocks, hit_rate)  # the one-cell row comes first
            per_cell = "/".join(str(n) for n in sorted(routed_by_cell(client).values(),
                                                       reverse=True))
            routing = "one cell" if num_cells == 1 else (
                "prefix + load" if prefix_routing else "load only")
            hit_rows.append([str(num_kv_blocks), str(num_cells), str(num_workers // num_cells),
                             routing, f"{hit_rate:.3f}",
                             f"{hit_rate / reference[num_kv_blocks]:.2f}", per_cell,
                             f"{duration_s:.1f}"])
            print(hit_rows[-1], flush=True)
            if ("b" in args.tables and num_cells > 1 and prefix_routing
                    and num_kv_blocks == NUM_KV_BLOCKS):
                model = client.model_info().model
                times, reasons, num_blocks = asyncio.run(
                    _route_times_ms(cluster, model, prompts, args.route_samples))
                route_rows.append([str(num_cells), str(num_blocks)] + [
                    f"{percentile(times[name], q):.3f}"
                    for name in ("hash", "lookup", "route") for q in (0.5, 0.9, 0.99)]
                    + [", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))])
                print(route_rows[-1], flush=True)
    if "a" in args.tables:
        print_table(f"(a) prefix hit rate, {args.systems} system prompts of {args.system_len} "
                    f"tokens x {args.users} users (+{args.suffix_len} tokens, 8 out), "
                    f"{len(prompts)} requests, {args.concurrency} in flight, "
                    f"{num_workers} simulated workers ({args.step_ms:g} ms steps)",
                    ["KV blocks per worker", "cells", "workers per cell", "routing", "hit rate",
                     "/ one cell", "requests per cell", "run s"], hit_rows)
    if route_rows:
        print_table(f"(b) routing cost per request, ms, {args.route_samples} requests of "
                    f"(a) in turn (their prefixes held); route = EngineCells._route "
                    "(hash + lookup + choose_cell)",
                    ["cells", "blocks hashed", "hash p50", "hash p90", "hash p99", "lookup p50",
                     "lookup p90", "lookup p99", "route p50", "route p90", "route p99",
                     "route reasons"], route_rows)


# ---------------------------------------------------------------- (c) CPU per token


Group = tuple[str, LocalCluster, Client]  # a label for its cells, the cluster, its client


def _routed(groups: list[Group]) -> dict[str, int]:
    return {f"{label}{cell}": n for label, _, client in groups
            for cell, n in routed_by_cell(client).items()}


async def _run_groups(groups: list[Group], prompts: list[list[int]], output_len: int
                      ) -> list[api_pb2.GenerateResponse]:
    """Each cluster its share of ``prompts`` (128 a cell), all at once."""
    runs, first = [], 0
    for _, cluster, _ in groups:
        num = PER_CELL_REQUESTS * len(cluster.schedulers)
        runs.append(run_final(cluster.address, prompts[first:first + num], output_len, num))
        first += num
    return [r for responses in await asyncio.gather(*runs) for r in responses]


def _num_steps(metrics_url: str) -> int:
    """Steps a scheduler has run so far (the count of its iteration-tokens histogram)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return int(sum(float(line.rsplit(None, 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:iteration_tokens_total_count")))


def _cpu_run(groups: list[Group], pids: dict[str, int], metrics_urls: dict[str, str],
             prompts: list[list[int]], output_len: int) -> tuple[dict, dict, dict, dict, float]:
    """Requests routed to each cell, each scheduler's CPU seconds, its CPU seconds
    over as long a quiet spell after, its steps, and the run's seconds."""
    routed_before = _routed(groups)
    steps_before = {cell: _num_steps(url) for cell, url in metrics_urls.items()}
    cpu_before = {cell: _cpu_s(pid) for cell, pid in pids.items()}
    t0 = time.perf_counter()
    responses = asyncio.run(_run_groups(groups, prompts, output_len))
    duration_s = time.perf_counter() - t0
    cpu_s = {cell: _cpu_s(pid) - cpu_before[cell] for cell, pid in pids.items()}
    routed = {cell: n - routed_before.get(cell, 0) for cell, n in _routed(groups).items()}
    steps = {cell: _num_steps(url) - steps_before[cell] for cell, url in metrics_urls.items()}
    num_tokens = sum(len(r.outputs[0].token_ids) for r in responses)
    assert num_tokens == len(responses) * output_len, num_tokens
    idle_before = {cell: _cpu_s(pid) for cell, pid in pids.items()}
    time.sleep(duration_s)
    idle_s = {cell: _cpu_s(pid) - idle_before[cell] for cell, pid in pids.items()}
    return routed, cpu_s, idle_s, steps, duration_s


def table_c(args: argparse.Namespace) -> None:
    # The same load on each scheduler whatever the number of cells: a worker and
    # 128 requests per cell. Two one-cell clusters side by side load the two
    # cores as two cells do, with no work between them: the control.
    prompt_len, output_len = 64, 128
    rng = random.Random(2)
    # Fresh prompts for each run: no run hits what an earlier one left cached.
    prompt_sets = [[random_tokens(rng, prompt_len) for _ in range(2 * PER_CELL_REQUESTS)]
                   for _ in range(args.repeats + 1)]
    rows = []
    for name, cells_per_cluster in (("1 cell", [1]), ("2 cells", [2]),
                                    ("2 clusters of 1 cell at once", [1, 1])):
        with ExitStack() as stack:
            groups: list[Group] = []
            for i, num_cells in enumerate(cells_per_cluster):
                label = f"{'AB'[i]}/" if len(cells_per_cluster) > 1 else ""
                groups.append((label, *start_cells(stack, num_cells, num_cells, args.step_ms)))
            pids = {f"{label}cell-{i}": s.pid for label, cluster, _ in groups
                    for i, s in enumerate(cluster.schedulers)}
            metrics_urls = {f"{label}cell-{i}": s.urls["metrics"] for label, cluster, _ in groups
                            for i, s in enumerate(cluster.schedulers)}
            asyncio.run(_run_groups(groups, prompt_sets[-1], 4))  # warm-up
            runs = [_cpu_run(groups, pids, metrics_urls, prompts, output_len)
                    for prompts in prompt_sets[:-1]]
            routed, cpu_s, idle_s, steps, duration_s = min(
                runs, key=lambda run: sum(run[1].values()))
            for cell in pids:
                cell_tokens = routed[cell] * output_len
                rows.append([name, cell, str(routed[cell]), str(cell_tokens),
                             f"{cpu_s[cell]:.2f}", f"{cpu_s[cell] * 1e3 / cell_tokens:.3f}",
                             f"{idle_s[cell]:.2f}",
                             f"{(cpu_s[cell] - idle_s[cell]) * 1e3 / cell_tokens:.3f}",
                             str(steps[cell]), f"{cpu_s[cell] * 1e3 / steps[cell]:.2f}",
                             f"{duration_s:.1f}"])
                print(rows[-1], flush=True)
    print_table(f"(c) scheduler CPU per 1,000 generated tokens: {PER_CELL_REQUESTS} requests of "
                f"{prompt_len} + {output_len} tokens per cell at once, one simulated worker "
                f"({args.step_ms:g} ms steps) per cell; the run of least CPU of {args.repeats}",
                ["cluster", "scheduler", "requests", "tokens", "CPU s", "CPU s / 1k tok",
                 "idle CPU s (as long)", "(CPU - idle) s / 1k tok", "steps", "CPU ms / step",
                 "run s"], rows)


# ---------------------------------------------------------------- (d) SIGKILL


async def _streams_with_kill(address: str, prompts: list[list[int]], max_tokens: int,
                             kill=None, kill_after_tokens: int = 0
                             ) -> tuple[list[Stream], float | None]:
    """Every prompt as a DELTA stream; ``kill()`` once each has ``kill_after_tokens``
    tokens. Returns the streams and when the kill happened (perf_counter)."""
    streams = [Stream() for _ in prompts]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(_stream(stub, p, max_tokens, s))
                 for p, s in zip(prompts, streams)]
        killed_at = None
        if kill is not None:
            while min(len(s.token_ids) for s in streams) < kill_after_tokens:
                if all(t.done() for t in tasks):
                    raise RuntimeError("every stream ended before the kill")
                await asyncio.sleep(0.005)
            killed_at = time.perf_counter()
            await asyncio.to_thread(kill)
        await asyncio.gather(*tasks)
    return streams, killed_at


def table_d(args: argparse.Namespace) -> None:
    num_streams, prompt_len, max_tokens, kill_after = 64, 64, args.kill_max_tokens, 20
    rng = random.Random(4)
    prompts = [random_tokens(rng, prompt_len) for _ in range(num_streams)]
    with ExitStack() as stack:
        cluster, client = start_cells(stack, 2, 2, args.kill_step_ms)
        reference, _ = asyncio.run(_streams_with_kill(cluster.address, prompts, max_tokens))
        assert not [s.error for s in reference if s.error], reference[0].error
        undisturbed_s = max(s.finished_s for s in reference) - min(
            s.token_times_s[0] for s in reference)
        victim = cluster.schedulers[0]

        def kill() -> None:
            victim.signal(signal.SIGKILL)
            victim.popen.wait(10)

        streams, killed_at = asyncio.run(_streams_with_kill(
            cluster.address, prompts, max_tokens, kill, kill_after))
        resubmitted = sum(c.routed_requests.get("resubmit", 0) for c in client.stats().cells)
    lost = [s.error for s in streams if s.error]
    running = [s for s in streams if not s.error and s.finished_s > killed_at]
    # Resumed: the chunk after the stream's longest silence since the kill (tokens
    # already on their way to this client arrive first, then the gap, if any).
    resume_s = []
    for s in running:
        times_s = [killed_at] + [t for t in s.token_times_s if t > killed_at]
        gap, after = max((b - a, b) for a, b in zip(times_s, times_s[1:]))
        resume_s.append(after - killed_at)
    # Only a dead cell's request waits the 1 s grace; the others' silences are this
    # machine's (2 shared cores: the live cell takes the dead one's requests).
    moved = [r for r in resume_s if r >= 1.0]
    stayed = [r for r in resume_s if r < 1.0]
    all_done_s = max(s.finished_s for s in streams) - killed_at
    changed = sum(s.token_ids != r.token_ids for s, r in zip(streams, reference))
    row = [str(num_streams), str(len(lost)), str(len(running)), str(resubmitted),
           f"{max(resume_s):.2f}", str(len(moved)),
           f"{statistics.median(moved):.2f}" if moved else "-",
           f"{max(stayed):.2f}" if stayed else "-", f"{all_done_s:.2f}",
           f"{undisturbed_s:.2f}", str(changed)]
    print_table(f"(d) SIGKILL of cell-0's scheduler once all {num_streams} greedy streams "
                f"({prompt_len} + {max_tokens} tokens) have {kill_after} tokens; 2 cells of 1 "
                f"simulated worker ({args.kill_step_ms:g} ms steps), --cell-grace-s 1; "
                "seconds from the kill",
                ["streams", "lost", "running at kill", "resubmitted", "all resumed",
                 "resumed >= 1 s", "their median", "others: slowest", "all finished",
                 "undisturbed run", "changed outputs"], [row])
    if lost:
        print("errors:", sorted(set(lost)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", nargs="+", choices="abcd", default=list("abcd"))
    p.add_argument("--quick", action="store_true", help="(a), (b): 4 system prompts x 16 users")
    p.add_argument("--systems", type=int, default=8, help="(a): system prompts")
    p.add_argument("--users", type=int, default=64, help="(a): users per system prompt")
    p.add_argument("--system-len", type=int, default=512, help="(a): tokens of a system prompt")
    p.add_argument("--suffix-len", type=int, default=32, help="(a): tokens of a user's own")
    p.add_argument("--concurrency", type=int, default=16, help="(a): requests in flight")
    p.add_argument("--step-ms", type=float, default=2.0, help="(a) to (c): simulated step")
    p.add_argument("--route-samples", type=int, default=1000, help="(b): requests timed")
    p.add_argument("--repeats", type=int, default=3, help="(c): runs, the least CPU shown")
    p.add_argument("--kill-step-ms", type=float, default=5.0, help="(d): simulated step")
    p.add_argument("--kill-max-tokens", type=int, default=200, help="(d): tokens per stream")
    args = p.parse_args()
    if args.quick:
        args.systems, args.users, args.route_samples = 4, 16, 300
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split(
        "Model name:")[1].splitlines()[0].strip(), f"({os.cpu_count()} CPUs)")
    if {"a", "b"} & set(args.tables):
        tables_ab(args)
    if "c" in args.tables:
        table_c(args)
    if "d" in args.tables:
        table_d(args)


if __name__ == "__main__":
    main()
