"""LLMEngine over the real in-process Scheduler + Worker, on a tiny random Llama.

The model is random (fixed seed) but carries SmolLM2's tokenizer, so text,
stop strings and aborts go through the whole stack quickly. What the tiny
model says is meaningless; the assertions compare runs with each other.
"""

from __future__ import annotations

import gc
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvmesh.offline import EngineArgs, LLMEngine
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.outputs import RequestOutput

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.25,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(default_model_dir) / name, path / name)
    return path


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    args = EngineArgs(model=str(tiny_model_dir), dtype="float32", device="cpu",
                      num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
    return LLMEngine.from_engine_args(args)


def run_to_completion(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("requests did not finish in 200 steps")


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def final_text(engine: LLMEngine, prompt: str, params: SamplingParams) -> RequestOutput:
    params.output_kind = RequestOutputKind.FINAL_ONLY
    engine.add_request("ref", prompt, params)
    (output,) = run_to_completion(engine)
    return output


def test_delta_streaming_matches_the_final_output(engine):
    reference = final_text(engine, "Hello there", greedy())
    engine.add_request("s", "Hello there", greedy(output_kind=RequestOutputKind.DELTA))
    chunks = run_to_completion(engine)

    assert len(chunks) == 12 and chunks[-1].finished
    assert "".join(c.outputs[0].text for c in chunks) == reference.outputs[0].text
    assert [t for c in chunks for t in c.outputs[0].token_ids] == reference.outputs[0].token_ids
    assert reference.outputs[0].finish_reason == "length"
    assert engine.engine_core.scheduler.get_num_unfinished_requests() == 0


def test_stop_string_aborts_the_request_in_the_scheduler(engine):
    text = final_text(engine, "Tell me", greedy(max_tokens=16)).outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 2]
    expected = text[: text.index(stop)]

    engine.add_request("s", "Tell me", greedy(max_tokens=16, stop=[stop]))
    scheduler = engine.engine_core.scheduler
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
        # The step that found the stop string also aborted it in the engine core.
        assert scheduler.get_num_unfinished_requests() == int(engine.has_unfinished_requests())

    final = outputs[-1].outputs[0]
    assert (final.text, final.stop_reason, final.finish_reason) == (expected, stop, "stop")
    assert len(final.token_ids) < 16


def test_n2_fan_out_and_abort_by_client_id(engine):
    params = SamplingParams(n=2, seed=3, max_tokens=30, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    parent_id = engine.add_request("fan", "Once", params)
    scheduler = engine.engine_core.scheduler
    assert sorted(scheduler.requests) == [f"0_{parent_id}", f"1_{parent_id}"]

    first = engine.step() + engine.step()
    assert {o.outputs[0].index for o in first} == {0, 1}
    assert all(o.request_id == "fan" and not o.finished for o in first)

    engine.abort_request(["fan"])
    assert not engine.has_unfinished_requests()
    assert scheduler.get_num_unfinished_requests() == 0
    assert engine.step() == []


def test_rejected_request_leaves_nothing_behind(engine):
    with pytest.raises(ValueError):
        engine.add_request("bad", "Hi", SamplingParams(max_tokens=300))
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.scheduler.get_num_unfinished_requests() == 0


def test_a_dropped_engine_frees_its_worker_and_stops_its_step_thread(tiny_model_dir):
    """With asynchronous scheduling the worker runs on a StepPipeline thread; dropping
    the engine must end that thread and free the model and KV cache (on a GPU,
    ``del llm`` is how a script gets its memory back)."""
    args = EngineArgs(model=str(tiny_model_dir), dtype="float32", device="cpu",
                      num_kv_blocks=16, max_model_len=64, async_scheduling=True)
    before = set(threading.enumerate())
    engine = LLMEngine.from_engine_args(args)
    engine.add_request("r", "Hello", greedy(4))
    run_to_completion(engine)
    worker = weakref.ref(engine.engine_core.worker)
    threads = [t for t in set(threading.enumerate()) - before if t.name == "kvmesh-step-pipeline"]
    assert threads
    del engine
    gc.collect()
    assert worker() is None
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
