"""The real model through real processes: greedy answers over gRPC equal transformers'.

SmolLM2-135M-Instruct (the default model) served by a local cluster; the
oracle is Hugging Face transformers' greedy ``generate`` on the same weights
and the same prompt token ids.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvmesh.client import Client
from tests.e2e.helpers import SCHEDULING_MODES

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
)


@pytest.fixture(scope="module", params=list(SCHEDULING_MODES))
def client(make_cluster, tmp_path_factory, request):
    from kvmesh.cluster import ClusterConfig

    # float32 pinned: the oracle below is transformers in float32, and greedy ids
    # must then be identical (the CPU default, bfloat16, is checked against
    # transformers' bfloat16 in tests/worker/test_cpu_dtypes.py).
    cluster = make_cluster(ClusterConfig(max_model_len=512, log_dir=tmp_path_factory.mktemp("logs"),
                                         worker_args=["--dtype", "float32"],
                                         scheduler_args=SCHEDULING_MODES[request.param],
                                         startup_timeout_s=300.0))
    with Client(cluster.address, timeout_s=120) as client:
        yield client


def transformers_greedy(model_dir, prompts: list[list[int]], eos_token_id: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                       do_sample=False, max_new_tokens=MAX_TOKENS,
                                       eos_token_id=eos_token_id, pad_token_id=eos_token_id)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def test_greedy_chat_answers_equal_transformers(client, default_model_dir):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [client.tokenize(messages=c) for c in conversations]
    (eos_token_id,) = client.model_info().eos_token_ids
    with ThreadPoolExecutor(len(conversations)) as pool:
        responses = list(pool.map(
            lambda c: client.complete(messages=c, temperature=0.0, max_tokens=MAX_TOKENS),
            conversations))
    assert [list(r.prompt_token_ids) for r in responses] == prompts
    expected = transformers_greedy(default_model_dir, prompts, eos_token_id)
    assert [list(r.outputs[0].token_ids) for r in responses] == expected
    assert responses[0].outputs[0].text == "The capital of France is Paris."
    assert responses[0].outputs[0].finish_reason == "stop"
