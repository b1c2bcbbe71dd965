"""The worker driven by the real Scheduler, checked against transformers' generate().

Tiny random-weight Llama and Qwen2 checkpoints (fixed seed, written with
save_pretrained) cover mixed prefill/decode batches, chunked prefill, prefix
cache hits, preemption and logprobs; SmolLM2 (slow) covers the real model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.worker.config import WorkerConfig
from services.worker.worker import Worker
from tests.worker.helpers import (
    VOCAB_SIZE,
    greedy_request,
    make_scheduler,
    make_worker,
    random_prompts,
    run_engine,
    save_tiny_model,
)


# --------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored (the oracle)."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------ tests
def test_worker_registration_and_kv_sizing(tiny_model_dir):
    # 2 layers x (K+V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB per block.
    worker = make_worker(tiny_model_dir, kv_cache_gib=1 / 1024)
    info = worker.registration_info()
    is_llama = tiny_model_dir.name.startswith("llama")
    assert (info.num_blocks, info.block_size, info.max_model_len) == (128, 16, 256)
    assert (info.vocab_size, info.dtype, info.limits.max_num_seqs) == (VOCAB_SIZE, "float32", 128)
    assert info.eos_token_ids == ([2] if is_llama else [])  # LlamaConfig's default eos
    assert info.model == str(tiny_model_dir)
    assert [tuple(c.shape) for c in worker.model_runner.kv_caches] == [(2, 128, 16, 2, 16)] * 2

    default_len = Worker(WorkerConfig(model=str(tiny_model_dir), dtype="float32"))
    default_len.load_model()
    assert default_len.max_model_len == 512  # min(max_position_embeddings, 2048)
    too_long = Worker(WorkerConfig(model=str(tiny_model_dir), max_model_len=513))
    with pytest.raises(ValueError, match=r"allowed range is \[2, 512\]"):
        too_long.load_model()
    with pytest.raises(RuntimeError, match="needs load_model"):
        Worker(WorkerConfig()).initialize_kv_cache()


def test_prepare_inputs_exact(tiny_model_dir):
    """Positions, input ids, query_start_loc, seq_lens and slot mapping of a mixed step."""
    worker = make_worker(tiny_model_dir, num_kv_blocks=16)
    runner = worker.model_runner
    greedy = SamplingParams(temperature=0.0)
    step1 = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("a", list(range(10, 30)), greedy, [5, 2], 0),  # 20-token prompt
            NewRequestData("b", [7, 8, 9], greedy, [9], 0),
        ],
        num_scheduled_tokens={"a": 20, "b": 3}, total_num_scheduled_tokens=23, step_id=1,
    )
    out1 = runner.execute_model(step1)
    assert out1.req_ids == ["a", "b"]
    a_token, b_token = out1.sampled_token_ids[0][0], out1.sampled_token_ids[1][0]

    # Step 2: "a" decodes at position 20 (block 2, offset 4); "c" arrives with a
    # 16-token prefix hit on block 5 and computes 4 tokens into new block 11;
    # "b" is not scheduled (preempted), so "c" takes row 1 after condense.
    step2 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("c", list(range(10, 30)), greedy, [5, 11], 16)],
        scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [20]),
        num_scheduled_tokens={"a": 1, "c": 4}, total_num_scheduled_tokens=5, step_id=2,
    )
    inputs = runner.prepare_step(step2).inputs
    batch = runner.input_batch
    assert batch.req_ids == ["a", "c"]
    assert "b" in runner.requests  # out of the batch, state kept
    md = inputs.attn_metadata
    assert inputs.positions.tolist() == [20, 16, 17, 18, 19]
    assert inputs.input_ids.tolist() == [a_token, 26, 27, 28, 29]
    assert md.query_start_loc.tolist() == [0, 1, 5]
    assert md.seq_lens.tolist() == [21, 20]
    assert md.slot_mapping.tolist() == [2 * 16 + 4, 11 * 16 + 0, 11 * 16 + 1, 11 * 16 + 2, 11 * 16 + 3]
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (2, 5, 4, 21)
    assert md.block_table[:, :2].tolist() == [[5, 2], [5, 11]]
    assert inputs.logits_indices.tolist() == [0, 4]

    # Step 3: "b" resumes from preemption with new blocks and its sampled token.
    step3 = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["b"], [True], [[3]], [0]),
        num_scheduled_tokens={"b": 4}, total_num_scheduled_tokens=4, step_id=3,
    )
    runner.finish_step(runner.launch_step(runner.prepare_step(step2)))
    inputs = runner.prepare_step(step3).inputs
    assert batch.req_ids == ["b"]
    assert inputs.input_ids.tolist() == [7, 8, 9, b_token]
    assert inputs.attn_metadata.slot_mapping.tolist() == [48, 49, 50, 51]


def test_prompt_logprobs_not_resent_after_preemption(tiny_model_dir):
    runner = make_worker(tiny_model_dir, num_kv_blocks=8).model_runner
    prompt = list(range(40, 50))
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    chunk = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", prompt, params, [3], 0)],
        num_scheduled_tokens={"a": 6}, total_num_scheduled_tokens=6, step_id=1,
    ))
    assert chunk.sampled_token_ids == [[]]  # mid-prompt: sample discarded
    assert [row[0] for row in chunk.prompt_logprobs["a"].token_ids] == prompt[1:7]
    # Preempted (not scheduled), then resumed and recomputed from position 0.
    assert runner.execute_model(SchedulerOutput(step_id=2)).req_ids == []
    resumed = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a"], [True], [[5]], [0]),
        num_scheduled_tokens={"a": 10}, total_num_scheduled_tokens=10, step_id=3,
    ))
    assert [row[0] for row in resumed.prompt_logprobs["a"].token_ids] == prompt[7:10]
    assert len(resumed.sampled_token_ids[0]) == 1
    decode = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [10]),
        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, step_id=4,
    ))
    assert decode.prompt_logprobs == {}


def test_mixed_prefill_decode_matches_hf(tiny_model_dir, hf_model):
    worker = make_worker(tiny_model_dir)
    scheduler = make_scheduler(worker)
    prompts = random_prompts([5, 17, 33, 50, 1], seed=1)
    max_tokens = [12, 9, 16, 10, 7]
    # Later arrivals prefill while the earlier requests decode.
    arrivals = [(step, greedy_request(f"r{i}", p, n))
                for i, (step, p, n) in enumerate(zip([0, 0, 2, 3, 5], prompts, max_tokens))]
    result = run_engine(scheduler, worker, arrivals)
    mixed = [s for s in result.scheduled_per_step if 1 in s.values() and max(s.values()) > 1]
    assert mixed, "no step mixed a prefill with a decode"
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert result.token_ids[f"r{i}"] == hf_greedy(hf_model, prompt, n)


def test_chunked_prefill_matches_hf(tiny_model_dir, hf_model):
    worker = make_worker(tiny_model_dir, limits=SchedulingLimits(max_num_batched_tokens=7))
    scheduler = make_scheduler(worker, long_prefill_token_threshold=5)
    prompts = random_prompts([23, 12, 3], seed=2)
    arrivals = [(0, greedy_request(f"r{i}", p, 8)) for i, p in enumerate(prompts)]
    result = run_engine(scheduler, worker, arrivals)
    assert result.scheduled_per_step[0] == {"r0": 5, "r1": 2}
    assert result.scheduled_per_step[1] == {"r0": 5, "r1": 2}
    assert result.num_steps_with_discarded_sample > 0
    for i, prompt in enumerate(prompts):
        assert result.token_ids[f"r{i}"] == hf_greedy(hf_model, prompt, 8)


@pytest.mark.triton_cpu
def test_triton_kernels_path_matches_hf(tiny_model_dir, hf_model, monkeypatch):
    """The same runner through the Triton kernels (interpreted on the CPU)."""
    monkeypatch.setenv("KVMESH_FORCE_TRITON", "1")
    worker = make_worker(tiny_model_dir, limits=SchedulingLimits(max_num_batched_tokens=16))
    scheduler = make_scheduler(worker, long_prefill_token_threshold=9)
    prompts = random_prompts([21, 4], seed=6)
    arrivals = [(0, greedy_request("r0", prompts[0], 6)), (2, greedy_request("r1", prompts[1], 6))]
    result = run_engine(scheduler, worker, arrivals)
    for i, prompt in enumerate(prompts):
        assert result.token_ids[f"r{i}"] == hf_greedy(hf_model, prompt, 6)


def test_prefix_cache_hit_matches_hf(tiny_model_dir, hf_model):
    worker = make_worker(tiny_model_dir)
    scheduler = make_scheduler(worker)
    prefix = random_prompts([32], seed=3)[0]
    first = prefix + [11, 12, 13, 14, 15]
    second = prefix + [40, 41, 42]
    result = run_engine(scheduler, worker, [(0, greedy_request("first", first, 6))])
    result2 = run_engine(scheduler, worker, [(0, greedy_request("second", second, 6))])
    assert result.num_cached_tokens["first"] == 0
    assert result2.num_cached_tokens["second"] == 32
    assert result2.scheduled_per_step[0] == {"second": 3}
    assert result.token_ids["first"] == hf_greedy(hf_model, first, 6)
    assert result2.token_ids["second"] == hf_greedy(hf_model, second, 6)


def test_preemption_and_resume_match_hf(tiny_model_dir, hf_model):
    # 6 usable blocks (96 slots) for three requests that each grow to 50 tokens.
    worker = make_worker(tiny_model_dir, num_kv_blocks=7)
    scheduler = make_scheduler(worker)
    prompts = random_prompts([30, 28, 26], seed=4)
    arrivals = [(0, greedy_request(f"r{i}", p, 20)) for i, p in enumerate(prompts)]
    result = run_engine(scheduler, worker, arrivals)
    assert scheduler.make_stats().num_preemptions > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    assert worker.model_runner.requests == {}
    assert worker.model_runner.input_batch.num_reqs == 0
    for i, prompt in enumerate(prompts):
        assert result.token_ids[f"r{i}"] == hf_greedy(hf_model, prompt, 20)


def test_logprobs_and_chunked_prompt_logprobs(tiny_model_dir, hf_model):
    worker = make_worker(tiny_model_dir, limits=SchedulingLimits(max_num_batched_tokens=8))
    scheduler = make_scheduler(worker, long_prefill_token_threshold=6)
    prompt = random_prompts([20], seed=5)[0]
    request = greedy_request("r", prompt, 4, logprobs=2, prompt_logprobs=3)
    result = run_engine(scheduler, worker, [(0, request)])
    generated = result.token_ids["r"]
    full = torch.tensor([prompt + generated])
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(full).logits[0].float(), dim=-1)

    prompt_lp = result.prompt_logprobs["r"]
    assert len(prompt_lp) == len(prompt) - 1  # tokens 1..P-1, across 4 chunks
    assert [row[0] for row in prompt_lp.token_ids] == prompt[1:]
    for p, (ids, lps) in enumerate(zip(prompt_lp.token_ids, prompt_lp.logprobs)):
        assert len(ids) == 4
        assert ids[1:] == torch.topk(ref[p], 3).indices.tolist()
        np.testing.assert_allclose(lps, ref[p, ids].tolist(), rtol=1e-4, atol=1e-4)

    sample_lp = result.logprobs["r"]
    assert len(sample_lp) == len(generated)
    for i, (ids, lps, rank) in enumerate(zip(sample_lp.token_ids, sample_lp.logprobs,
                                             sample_lp.sampled_token_ranks)):
        row = ref[len(prompt) - 1 + i]
        assert ids[0] == generated[i] and rank == 1  # greedy picks the top token
        assert ids[1:] == torch.topk(row, 2).indices.tolist()
        np.testing.assert_allclose(lps, row[ids].tolist(), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    worker = make_worker_default(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return worker, hf, tokenizer


def make_worker_default(model_dir: Path) -> Worker:
    worker = Worker(WorkerConfig(model=str(model_dir), dtype="float32", kv_cache_gib=0.25,
                                 max_model_len=1024))
    worker.load_model()
    worker.initialize_kv_cache()
    return worker


def chat_prompt(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(chat, add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_capital_of_france(smollm2):
    worker, hf, tokenizer = smollm2
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    eos = tokenizer.eos_token_id
    request = EngineCoreRequest(
        "france", prompt, SamplingParams(temperature=0.0, max_tokens=32), eos_token_id=eos
    )
    result = run_engine(make_scheduler(worker), worker, [(0, request)])
    ids = result.token_ids["france"]
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == "The capital of France is Paris."
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ids == ref[0, len(prompt):].tolist()


@pytest.mark.slow
def test_smollm2_batch_of_four(smollm2):
    worker, hf, tokenizer = smollm2
    texts = [
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Explain what a hash table is in one sentence.",
        "Translate 'good morning' into French.",
    ]
    prompts = [chat_prompt(tokenizer, t) for t in texts]
    arrivals = [(i, greedy_request(f"q{i}", p, 24)) for i, p in enumerate(prompts)]
    result = run_engine(make_scheduler(worker), worker, arrivals)
    for i, prompt in enumerate(prompts):
        assert result.token_ids[f"q{i}"] == hf_greedy(hf, prompt, 24), texts[i]


# Two rounding steps of a logit of magnitude ~4-8 (bfloat16 has 8 mantissa bits, float16 11).
HALF_PRECISION_TIE_MARGIN = {torch.bfloat16: 0.0625, torch.float16: 0.0078125}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_kv_cache_matches_hf(tiny_model_dir, dtype):
    """A bfloat16/float16 model keeps its KV cache in that dtype and decodes like transformers.

    Half precision rounds differently in the two attention implementations, so a
    near-tie may go either way: every token must be transformers' argmax given the
    same prefix, or within a rounding margin of it.
    """
    name = str(dtype).removeprefix("torch.")
    worker = make_worker(tiny_model_dir, dtype=name)
    assert {cache.dtype for cache in worker.model_runner.kv_caches} == {dtype}
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    prompts = random_prompts([13, 6, 21], seed=4)
    arrivals = [(i, greedy_request(f"r{i}", prompt, 8)) for i, prompt in enumerate(prompts)]
    result = run_engine(make_scheduler(worker), worker, arrivals)
    for i, prompt in enumerate(prompts):
        tokens = result.token_ids[f"r{i}"]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        shortfall = logits.max(-1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert len(tokens) == 8 and shortfall.max() <= HALF_PRECISION_TIE_MARGIN[dtype]
