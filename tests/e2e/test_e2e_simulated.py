"""Simulated workers in a real cluster say exactly what the in-process engine says.

``--simulate`` is a measurement tool: this proves its outputs can be compared
across modes (gRPC against in-process), which the control-plane benchmark
relies on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.client import Client
from kvmesh.offline import LLM
from services.common.sampling_params import SamplingParams
from tests.e2e.helpers import SCHEDULING_MODES, tiny_cluster_config

PROMPTS = [f"Request {i}: " + "tell me something " * (i % 5) for i in range(12)]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=list(SCHEDULING_MODES))
def cluster(make_cluster, tiny_model_dir, tmp_path_factory, request):
    config = tiny_cluster_config(tiny_model_dir, tmp_path_factory.mktemp("logs"), num_workers=2)
    config.worker_args.append("--simulate")
    config.scheduler_args += SCHEDULING_MODES[request.param]
    return make_cluster(config)


def test_simulated_cluster_equals_in_process(cluster, tiny_model_dir):
    def generate(prompt: str) -> list[int]:
        with Client(cluster.address, timeout_s=60) as client:
            return [t for chunk in client.generate(prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0.0)
                    for output in chunk.outputs for t in output.token_ids]

    with ThreadPoolExecutor(6) as pool:
        over_grpc = list(pool.map(generate, PROMPTS))
    for async_scheduling in (True, False):
        llm = LLM(model=str(tiny_model_dir), simulate=True, max_model_len=256,
                  async_scheduling=async_scheduling)
        in_process = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)]
        assert over_grpc == in_process
    assert all(len(tokens) == MAX_TOKENS for tokens in over_grpc)
