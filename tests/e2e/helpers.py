"""Helpers for the end-to-end tests: tiny-model cluster configs, waiting, stats,
greedy streams run side by side."""

from __future__ import annotations

import random
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from kvmesh.client import Client
from kvmesh.cluster import ClusterConfig, LocalCluster, ServiceProcess

TINY_MAX_MODEL_LEN = 256
TINY_NUM_KV_BLOCKS = 64  # including the null block
TINY_MAX_NUM_SEQS = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Long enough that a fault injected after the first token lands mid-generation.
STREAM_MAX_TOKENS = 150
# Clusters built for both ways of scheduling; the flag each one gives the scheduler.
SCHEDULING_MODES = {"async": [], "sync": ["--no-async-scheduling"]}


def tiny_cluster_config(model_dir: Path, log_dir: Path, **overrides) -> ClusterConfig:
    """A cluster on the tiny model: small KV pools and batches, one torch thread
    per worker (the machine has 2 cores for everything)."""
    fields = dict(
        model=str(model_dir),
        max_model_len=TINY_MAX_MODEL_LEN,
        log_dir=log_dir,
        scheduler_args=["--max-num-seqs", str(TINY_MAX_NUM_SEQS)],
        worker_args=["--dtype", "float32", "--num-kv-blocks", str(TINY_NUM_KV_BLOCKS),
                     "--max-num-seqs", str(TINY_MAX_NUM_SEQS), "--num-threads", "1"],
        startup_timeout_s=120.0,
    )
    fields.update(overrides)
    return ClusterConfig(**fields)


def wait_for(
    predicate: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met in {timeout_s}s")
        time.sleep(0.05)


def sigkill_a_busy_worker(cluster: LocalCluster, client: Client) -> ServiceProcess:
    """SIGKILLs a worker that is running requests now; returns it, reaped."""
    running = {w.worker_id: w.num_running_reqs for w in client.stats().workers}
    victim = next(w for w in cluster.workers if running.get(w.name, 0) > 0)
    victim.signal(signal.SIGKILL)
    victim.popen.wait(10)
    return victim


def all_blocks_free(client: Client) -> bool:
    """Every worker idle with its whole pool free (cached blocks count as free)."""
    return all(
        w.num_free_blocks == w.num_total_blocks and w.num_running_reqs == w.num_waiting_reqs == 0
        for w in client.stats().workers
    )


def metric_sum(url: str, name: str) -> float:
    """The sum of a metric's samples (every label set) on a Prometheus /metrics page."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(value) for value in
               re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def prompts(seed: int, count: int) -> list[list[int]]:
    """``count`` random token-id prompts of 8 to 40 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(8, 40))] for _ in range(count)]


def reference(client: Client, token_prompts: list[list[int]],
              max_tokens: int = STREAM_MAX_TOKENS) -> list[list[int]]:
    """Each prompt's greedy output, undisturbed (run side by side)."""
    with ThreadPoolExecutor(len(token_prompts)) as pool:
        return list(pool.map(
            lambda p: list(client.complete(token_ids=p, max_tokens=max_tokens, **GREEDY)
                           .outputs[0].token_ids), token_prompts))


class Streams:
    """Greedy DELTA streams run in threads; ``started`` is set once each has a token."""

    def __init__(self, client: Client, token_prompts: list[list[int]],
                 max_tokens: int = STREAM_MAX_TOKENS) -> None:
        self.tokens: list[list[int]] = [[] for _ in token_prompts]
        self.errors: list[grpc.StatusCode | None] = [None] * len(token_prompts)
        self._max_tokens = max_tokens
        self._num_started = 0
        self._lock = threading.Lock()
        self.started = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(client, i, p))
                         for i, p in enumerate(token_prompts)]
        for thread in self._threads:
            thread.start()

    def _run(self, client: Client, index: int, prompt: list[int]) -> None:
        try:
            for chunk in client.generate(token_ids=prompt, max_tokens=self._max_tokens,
                                         **GREEDY):
                first = not self.tokens[index]
                self.tokens[index].extend(chunk.outputs[0].token_ids)
                if first:
                    with self._lock:
                        self._num_started += 1
                        if self._num_started == len(self.tokens):
                            self.started.set()
        except grpc.RpcError as e:
            self.errors[index] = e.code()
            self.started.set()

    def join(self, timeout_s: float = 60) -> None:
        for thread in self._threads:
            thread.join(timeout_s)
