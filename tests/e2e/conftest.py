"""End-to-end fixtures: whole clusters of REAL processes on loopback ports.

Clusters start through ``kvmesh.cluster.LocalCluster``, the code behind
``kvmesh up``. Each test module shares its cluster (starting one costs a few
seconds of process start-up); each process logs to a file under the
module's tmp dir, and a failed start shows that log's tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvmesh.cluster import ClusterConfig, LocalCluster


@pytest.fixture(scope="module")
def make_cluster() -> Iterator[Callable[[ClusterConfig], LocalCluster]]:
    """Starts clusters for one module; every one is stopped at the module's end.
    ``make_cluster.clusters`` lists them (a failed test shows their logs)."""
    clusters: list[LocalCluster] = []

    def make(config: ClusterConfig) -> LocalCluster:
        cluster = LocalCluster(config)
        clusters.append(cluster)
        return cluster.start()

    make.clusters = clusters  # type: ignore[attr-defined]
    yield make
    for cluster in clusters:
        cluster.stop()
