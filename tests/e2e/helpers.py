"""Helpers for the end-to-end tests: tiny-model cluster configs, waiting, stats."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.client import Client
from kvmesh.cluster import ClusterConfig

TINY_MAX_MODEL_LEN = 256
TINY_NUM_KV_BLOCKS = 64  # including the null block
TINY_MAX_NUM_SEQS = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)
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


def all_blocks_free(client: Client) -> bool:
    """Every worker idle with its whole pool free (cached blocks count as free)."""
    return all(
        w.num_free_blocks == w.num_total_blocks and w.num_running_reqs == w.num_waiting_reqs == 0
        for w in client.stats().workers
    )
