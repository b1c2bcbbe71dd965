"""End-to-end fixtures: whole clusters of REAL processes on loopback ports.

Clusters start through ``kvmesh.cluster.LocalCluster``, the code behind
``kvmesh up``. Each test module shares its cluster (starting one costs a few
seconds of process start-up); each process logs to a file under the
module's tmp dir, and a failed start shows that log's tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmesh.cluster import ClusterConfig, LocalCluster
from tests.e2e.tiny_model import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="module")
def make_cluster() -> Iterator[Callable[[ClusterConfig], LocalCluster]]:
    """Starts clusters for one module; every one is stopped at the module's end."""
    clusters: list[LocalCluster] = []

    def make(config: ClusterConfig) -> LocalCluster:
        cluster = LocalCluster(config)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()
