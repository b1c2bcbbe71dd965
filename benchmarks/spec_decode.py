"""Prompt-lookup speculative decoding on the CPU worker against llama.cpp's (issue 26).

Tables, every system in the same process and run, on SmolLM2-135M-Instruct:
  * batch 1, input-grounded prompts (repeat a paragraph correcting its spelling,
    quote a text's key sentences, rename a function's variables) and
    free-writing ones (stories): output tok/s of kvmesh in float32, bfloat16
    (the default dtype is bfloat16 on a CPU that computes it natively, else
    float32) and int8, with and without ``--speculative-config``, and of
    llama.cpp (llama-cpp-python, the default model's own Q4_1 GGUF) with and
    without its prompt-lookup decoding (``LlamaPromptLookupDecoding``); kvmesh's
    mean acceptance length (tokens per verified draft, the sampled one included);
    the same ratios at each system's fastest weight format, as the issue's goals
    state them; each kvmesh worker's measured draft costs (calibration.py);
  * batch 8 and 64: kvmesh with and without drafts, showing where drafting
    switches itself off (``disable_by_batch_size``).
Greedy, at most OUTPUT_TOKENS tokens, stopping at the end of the answer, so
each system says what it says; tok/s counts the tokens each produced.

    .venv/bin/python -m benchmarks.spec_decode --repeats 3

llama.cpp needs the ``bench`` extra (``make bench``). Batch 1: medians over
the repeats, the systems alternating within each; batches: ``--batch-repeats``
(default 1: 64 requests of 160 tokens take a while on two cores).
"""

from __future__ import annotations

import argparse
import statistics
import time

from transformers import AutoTokenizer

from kvmesh.offline import EngineCore
from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.model_files import default_gguf_path, resolve_model_dir
from services.common.sampling_params import SamplingParams
from services.common.speculative import SpeculativeConfig
from services.scheduler.config import SchedulingOptions
from services.worker.config import WorkerConfig

OUTPUT_TOKENS = 160
# vLLM's lookup window (5) with shorter matches allowed: a copy starts paying sooner.
LOOKUP_MIN, LOOKUP_MAX = 2, 5
PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He cleand the "
    "great lens, trimmed the wick and lit the lamp, then sat by the window with his log "
    "book, writting down the ships that passed, the colour of the sea and the strenght of "
    "the wind. In winter the storms shook the tower and salt crusted the glass, but the "
    "light never failed, and the fishermen of the village said they could set there "
    "clocks by its first flash.")
CODE = '''def f(a, b):
    c = []
    for d in a:
        if d not in b:
            c.append(d)
    return c'''
GROUNDED = (
    f"Repeat this paragraph, correcting its spelling:\n\n{PARAGRAPH}",
    f"Summarise this text, quoting its key sentences word for word:\n\n{PARAGRAPH}",
    f"Rewrite this Python function with descriptive variable names:\n\n{CODE}",
)
FREE = (
    "Write a short story about a dragon who learns to cook.",
    "Write a short story about a robot lost in a city.",
    "Write a short story about the last day of summer.",
)
WORKLOADS = {"input-grounded": GROUNDED, "free-writing": FREE}
KVMESH_VARIANTS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None),
                   "int8": ("bfloat16", "int8")}


def chat_prompts(tokenizer, questions) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in questions]


# ---------------------------------------------------------------------- kvmesh
def make_kvmesh(dtype: str, quantization: str | None, spec: SpeculativeConfig | None,
                max_num_seqs: int) -> EngineCore:
    limits = SchedulingLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    config = WorkerConfig(dtype=dtype, quantization=quantization, kv_cache_gib=1.0,
                          limits=limits, max_model_len=2048, speculative_config=spec)
    return EngineCore.create(config, SchedulingOptions(limits=limits))


def kvmesh_tok_s(engine: EngineCore, prompts: list[list[int]], eos: int, tag: str) -> float:
    """All prompts at once (one batch); output tokens / wall time."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"{tag}{i}", prompt, params, eos_token_id=eos))
    tokens = 0
    start = time.perf_counter()
    while engine.has_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step().outputs)
    return tokens / (time.perf_counter() - start)


def single_stream(run_one, prompts: list[list[int]]) -> float:
    """tok/s over the prompts one after another (total tokens / total time)."""
    tokens = seconds = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        n = run_one(prompt)
        seconds += time.perf_counter() - start
        tokens += n
    return tokens / seconds


def kvmesh_single(engine: EngineCore, eos: int, tag: str):
    def run_one(prompt: list[int]) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS)
        engine.add_request(EngineCoreRequest(tag + str(time.monotonic_ns()), prompt, params,
                                             eos_token_id=eos))
        n = 0
        while engine.has_requests():
            n += sum(len(o.new_token_ids) for o in engine.step().outputs)
        return n
    return run_one


# ------------------------------------------------------------------- llama.cpp
def make_llama_cpp(num_pred: int, threads: int):
    """llama.cpp on the default GGUF; ``num_pred`` > 0 drafts that many tokens by prompt
    lookup (llama-cpp-python's LlamaPromptLookupDecoding)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = (LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_MAX, num_pred_tokens=num_pred)
             if num_pred else None)
    return Llama(model_path=str(default_gguf_path()), n_threads=threads,
                 n_threads_batch=threads, n_ctx=2048, draft_model=draft, verbose=False)


def llama_cpp_single(llm, eos: int):
    def run_one(prompt: list[int]) -> int:
        n = 0
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            if token == eos:
                break
            n += 1
            if n == OUTPUT_TOKENS:
                break
        return n
    return run_one


# ------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--batch-repeats", type=int, default=1,
                        help="repeats of each batched run (64 requests take a while)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    args = parser.parse_args()
    spec = SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens,
                             prompt_lookup_min=LOOKUP_MIN, prompt_lookup_max=LOOKUP_MAX)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    eos = tokenizer.eos_token_id
    prompts = {name: chat_prompts(tokenizer, qs) for name, qs in WORKLOADS.items()}

    single: dict[tuple[str, str], list[float]] = {}
    engines = {}
    for variant, (dtype, quantization) in KVMESH_VARIANTS.items():
        for drafts in (None, spec):
            label = f"kvmesh {variant}" + (" + ngram" if drafts else "")
            engines[label] = make_kvmesh(dtype, quantization, drafts, max_num_seqs=64)
    systems = {label: kvmesh_single(engine, eos, label) for label, engine in engines.items()}
    if not args.skip_llama_cpp:
        systems["llama.cpp Q4_1"] = llama_cpp_single(make_llama_cpp(0, args.threads), eos)
        systems["llama.cpp Q4_1 + prompt lookup"] = llama_cpp_single(
            make_llama_cpp(args.num_speculative_tokens, args.threads), eos)
    for run_one in systems.values():  # warm-up: compilation, first allocations
        run_one(prompts["free-writing"][0][:32])
    for _ in range(args.repeats):
        for workload, workload_prompts in prompts.items():
            for label, run_one in systems.items():
                single.setdefault((workload, label), []).append(
                    single_stream(run_one, workload_prompts))

    print(f"\n## batch 1 (median of {args.repeats}), output tok/s\n")
    print("| system | " + " | ".join(WORKLOADS) + " |")
    print("|---|" + "---|" * len(WORKLOADS))
    for label in systems:
        cells = [f"{statistics.median(single[(w, label)]):.1f}" for w in WORKLOADS]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print_ratios(single, systems)
    print()
    for label, engine in engines.items():
        stats = engine.scheduler.make_stats().spec_decoding
        if stats is not None:
            costs = engine.worker.model_runner.drafter.step_costs or []
            print(f"{label}: mean acceptance length {stats.mean_acceptance_length:.2f} "
                  f"({stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts accepted); "
                  f"step cost with 0..k drafts {', '.join(f'{c:.2f}' for c in costs)}")

    batched(engines, prompts, eos, args)


def print_ratios(single, systems) -> None:
    def median(workload: str, label: str) -> float:
        return statistics.median(single[(workload, label)])

    def fastest(workload: str, labels: list[str]) -> tuple[float, str]:
        return max((median(workload, label), label) for label in labels)

    plain = [f"kvmesh {v}" for v in KVMESH_VARIANTS]
    groups = {"kvmesh + ngram": [f"{label} + ngram" for label in plain], "kvmesh": plain}
    for peer in ("llama.cpp Q4_1 + prompt lookup", "llama.cpp Q4_1"):
        if peer in systems:
            groups[peer] = [peer]
    print("\n| ratio, each at its fastest weight format | " + " | ".join(WORKLOADS) + " |")
    print("|---|" + "---|" * len(WORKLOADS))
    for other in list(groups)[1:]:
        cells = []
        for workload in WORKLOADS:
            ours, our_label = fastest(workload, groups["kvmesh + ngram"])
            theirs, their_label = fastest(workload, groups[other])
            cells.append(f"{ours / theirs:.2f}x ({our_label.removeprefix('kvmesh ')} / "
                         f"{their_label.removeprefix('kvmesh ')})")
        print(f"| kvmesh + ngram / {other} | " + " | ".join(cells) + " |")
    print("\n| drafts on / off, same format | " + " | ".join(WORKLOADS) + " |")
    print("|---|" + "---|" * len(WORKLOADS))
    for label in plain:
        cells = [f"{median(w, label + ' + ngram') / median(w, label):.2f}x" for w in WORKLOADS]
        print(f"| {label} | " + " | ".join(cells) + " |")


def batched(engines, prompts, eos, args) -> None:
    print("\n## batches, output tok/s (median)\n")
    print("| format | batch | workload | without drafts | with drafts | ratio |")
    print("|---|---|---|---|---|---|")
    for variant in ("float32", "bfloat16"):
        for batch in args.batches:
            for workload, workload_prompts in prompts.items():
                batch_prompts = [workload_prompts[i % len(workload_prompts)]
                                 for i in range(batch)]
                labels = (f"kvmesh {variant}", f"kvmesh {variant} + ngram")
                runs: dict[str, list[float]] = {label: [] for label in labels}
                for r in range(args.batch_repeats):
                    for label in labels:
                        runs[label].append(kvmesh_tok_s(engines[label], batch_prompts, eos,
                                                        f"b{batch}{workload}{r}{label}"))
                plain, spec = (statistics.median(runs[label]) for label in labels)
                print(f"| {variant} | {batch} | {workload} | {plain:.1f} | {spec:.1f} | "
                      f"{spec / plain:.2f}x |")


if __name__ == "__main__":
    main()
