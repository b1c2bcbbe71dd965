"""The live dashboard: a static page and the JSON it polls.

``GET /dashboard`` is the page (``static/``: plain HTML, JS and CSS, no build
step, nothing fetched from elsewhere). ``GET /stats`` is the scheduler's
GetStats with every worker's block map, as JSON:

    {"time": <unix seconds>, "model": "<name>",
     "workers": [{"worker_id": "w0", "num_total_blocks": 63, "num_free_blocks": 60,
                  "num_cached_blocks": 5, "num_cached_free_blocks": 2,
                  "num_running_reqs": 1, "num_waiting_reqs": 0,
                  "kv_cache_usage": 0.05, "prefix_cache_queries": 120,
                  "prefix_cache_hits": 64, "prefix_cache_hit_rate": 0.53,
                  "num_preemptions": 0, "num_evicted_blocks": 3,
                  "num_generation_tokens": 800,
                  "generation_tokens_per_s": [0.0, 12.5, ...], "history_interval_s": 2.0,
                  "block_map": "<base64: one byte per cell, 0 free, 1 cached and free, 2 used>",
                  "blocks_per_cell": 1, "cell_id": "cell-0"}],
     "cells": [{"cell_id": "cell-0", "address": "10.0.0.5:50052", "connected": true,
                "generation": 3, "num_workers": 1, "load_tokens": 480,
                "routed_requests": {"prefix": 12, "load": 30}}]}

Counters are cumulative; the page turns them into rates between polls.
Field meanings are those of ``kvmesh.v1.WorkerStats`` and ``CellStats`` (the
cells this frontend routes between; see engine_cells.py).
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

from kvmesh.v1 import api_pb2

STATIC_DIR = Path(__file__).parent / "static"
DASHBOARD_PAGE = STATIC_DIR / "dashboard.html"


def worker_stats_to_json(stats: api_pb2.WorkerStats) -> dict[str, Any]:
    """Every WorkerStats field by its proto name; bytes as base64, int64 as numbers."""
    result: dict[str, Any] = {}
    for field in stats.DESCRIPTOR.fields:
        value = getattr(stats, field.name)
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode()
        elif field.is_repeated:
            value = list(value)
        result[field.name] = value
    return result


def cell_stats_to_json(stats: api_pb2.CellStats) -> dict[str, Any]:
    return {"cell_id": stats.cell_id, "address": stats.address, "connected": stats.connected,
            "generation": stats.generation, "num_workers": stats.num_workers,
            "load_tokens": stats.load_tokens, "routed_requests": dict(stats.routed_requests)}


def cluster_stats_to_json(stats: api_pb2.ClusterStats, model_name: str) -> dict[str, Any]:
    return {"time": time.time(), "model": model_name,
            "workers": [worker_stats_to_json(w) for w in stats.workers],
            "cells": [cell_stats_to_json(c) for c in stats.cells]}
