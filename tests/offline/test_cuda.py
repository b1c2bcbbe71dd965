"""The offline engine on a CUDA device, on the real SmolLM2-135M-Instruct (slow; needs CUDA).

float32 greedy decoding under every CUDA graph mode gives transformers' tokens
on the same device (prompts of different lengths, so steps mix prefill and
decode and graphs replay padded), with the pieces eager and compiled;
structured outputs and prompt-lookup speculative decoding give on CUDA the
tokens they give on the CPU.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh.offline import LLM, SamplingParams
from services.common.sampling_params import StructuredOutputsParams
from services.worker.cudagraph.wrapper import CUDAGraphWrapper
from tests.cuda import CUDA_MARKS
from tests.offline.test_spec_decode import GROUNDED, PARAGRAPH, SPEC, spec_stats

pytestmark = [
    pytest.mark.slow,
    *CUDA_MARKS,
]

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and say why each is prime.",
             "Explain in two sentences what a lighthouse is for."]
MAX_TOKENS = 40
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
SCHEMA = {"type": "object", "required": ["keeper", "duties"], "properties": {
    "keeper": {"type": "string", "maxLength": 40},
    "duties": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3}}}


def engine(device: str, **options) -> LLM:
    return LLM(device=device, dtype="float32", num_kv_blocks=256, max_num_seqs=8,
               max_num_batched_tokens=96, **options)


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params),
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def transformers_tokens(default_model_dir, prompts) -> list[list[int]]:
    """transformers' float32 greedy continuation of each prompt alone, on CUDA."""
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).cuda()
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS)
            answers.append(out[0, len(prompt):].tolist())
    del model
    torch.cuda.empty_cache()
    return answers


@pytest.mark.parametrize("mode", MODES)
def test_float32_greedy_equals_transformers_in_every_graph_mode(mode, prompts,
                                                                 transformers_tokens):
    llm = engine("cuda", cudagraph_mode=mode)
    assert greedy(llm, prompts) == transformers_tokens


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_compiled_pieces_captured_in_graphs_give_transformers_tokens(mode, prompts,
                                                                      transformers_tokens):
    """The pieces compiled by inductor (Triton on CUDA), then captured: under
    PIECEWISE the graph wrappers go around the compiled pieces (compiling after
    wrapping would have replaced them)."""
    llm = engine("cuda", cudagraph_mode=mode, compile_pieces=True)
    runner = llm.llm_engine.engine_core.worker.model_runner
    assert runner.compiled_pieces
    if mode == "PIECEWISE":
        assert all(isinstance(piece, CUDAGraphWrapper) for piece in runner.model.model.pieces)
    assert greedy(llm, prompts) == transformers_tokens


def test_structured_output_tokens_equal_the_cpu():
    prompt = [{"role": "user", "content":
               f"Describe the keeper of this story as JSON with his duties:\n\n{PARAGRAPH}"}]
    params = SamplingParams(temperature=0.0, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    answers = [engine(device).chat(prompt, params, use_tqdm=False)[0].outputs[0]
               for device in ("cpu", "cuda")]
    assert answers[1].token_ids == answers[0].token_ids
    jsonschema.validate(json.loads(answers[1].text), SCHEMA)


def test_speculative_decoding_tokens_equal_the_cpu():
    conversations = [[{"role": "user", "content": p}] for p in GROUNDED]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    answers = {}
    for device in ("cpu", "cuda"):
        llm = engine(device, speculative_config=SPEC)
        answers[device] = [o.outputs[0].token_ids
                           for o in llm.chat(conversations, params, use_tqdm=False)]
        assert spec_stats(llm).num_accepted_tokens > 0, (device, spec_stats(llm))
    plain = engine("cuda").chat(conversations, params, use_tqdm=False)
    assert answers["cuda"] == answers["cpu"] == [o.outputs[0].token_ids for o in plain]
