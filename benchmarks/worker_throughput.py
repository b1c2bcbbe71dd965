"""Worker throughput on SmolLM2-135M (float32), side by side with transformers.

Measures, in one run and on the same weights:
  * decode step time (Worker.execute_model only) at several batch sizes;
  * prefill tokens/s (full-budget steps of prompt tokens only);
  * end-to-end output tokens/s for a fixed set of prompts x output length
    (ignore_eos), driven by the real Scheduler, against transformers'
    batched, left-padded greedy generate() on the same prompts;
  * batch-1 generation against transformers' batch 1.

    .venv/bin/python benchmarks/worker_throughput.py [--threads 1 --repeats 2]

On a shared machine pin --threads (oversubscribed OpenMP threads stall) and
take the best of a few --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh.offline import EngineCore
from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.model_files import resolve_model_dir
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulingOptions
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.worker import Worker

TOPICS = (
    "the sea", "a lighthouse", "autumn leaves", "a lost key", "the moon", "a busy market",
    "an old library", "a mountain trail", "rainy Sundays", "a city at night", "a small cat",
    "the first snow", "a train journey", "a garden", "a violin", "a desert", "coffee",
    "a bridge", "a storm", "a clock tower", "a river", "the stars", "a bakery", "a fox",
    "a paper boat", "the wind", "a chess game", "a lantern", "an island", "a forest",
    "a kite", "a museum", "a letter", "a harbor", "a comet", "a village", "a glacier",
    "a robot", "a map", "a festival", "a candle", "an orchard", "a canyon", "a sailboat",
    "a piano", "a meadow", "a volcano", "a seashell", "a bicycle", "a castle", "a waterfall",
    "a telescope", "a fountain", "a owl", "a painter", "a windmill", "a snowman", "a beehive",
    "a subway", "a postcard", "a sunrise", "a bookstore", "a rainbow", "a tea kettle",
)


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a short story about {topic}."}],
            add_generation_prompt=True, tokenize=False,
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def make_engine(model_dir, max_num_seqs: int, kv_cache_gib: float,
                max_num_batched_tokens: int = 2048) -> tuple[Worker, Scheduler]:
    limits = SchedulingLimits(max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens)
    engine_core = EngineCore.create(
        WorkerConfig(model=str(model_dir), dtype="float32", kv_cache_gib=kv_cache_gib,
                     limits=limits, max_model_len=1024),
        SchedulingOptions(limits=limits),
    )
    return engine_core.worker, engine_core.scheduler


def greedy(req_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params)


def step(scheduler: Scheduler, worker: Worker) -> tuple[float, int]:
    """One engine step; returns (execute_model seconds, tokens computed)."""
    scheduler_output = scheduler.schedule()
    start = time.perf_counter()
    runner_output = worker.execute_model(scheduler_output)
    elapsed = time.perf_counter() - start
    scheduler.update_from_output(scheduler_output, runner_output)
    return elapsed, scheduler_output.total_num_scheduled_tokens


def bench_decode_step(worker: Worker, scheduler: Scheduler, prompt: list[int],
                      batch_size: int, num_steps: int) -> float:
    """Median execute_model time (s) of a pure decode step with ``batch_size`` requests."""
    for i in range(batch_size):
        scheduler.add_request(greedy(f"d{batch_size}-{i}", prompt, num_steps + 4))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or scheduler.waiting:
        step(scheduler, worker)
    times = [step(scheduler, worker)[0] for _ in range(num_steps)]
    while scheduler.has_requests():
        step(scheduler, worker)
    return statistics.median(times)


def bench_prefill(worker: Worker, scheduler: Scheduler, prompt_len: int, num_prompts: int) -> float:
    """Prompt tokens/s of steps that hold nothing but prefill."""
    base = list(range(1000, 1000 + prompt_len))
    total_s, total_tokens = 0.0, 0
    for i in range(num_prompts):
        # A distinct first token per prompt: no prefix-cache hits.
        scheduler.add_request(greedy(f"p{i}", [2000 + i] + base[1:], 1))
    while scheduler.has_requests():
        elapsed, num_tokens = step(scheduler, worker)
        if num_tokens > 1:
            total_s += elapsed
            total_tokens += num_tokens
    return total_tokens / total_s


def bench_generate(worker: Worker, scheduler: Scheduler, prompts: list[list[int]],
                   output_len: int, tag: str) -> float:
    """Output tokens/s of the whole engine loop (scheduler included)."""
    for i, prompt in enumerate(prompts):
        scheduler.add_request(greedy(f"{tag}{i}", prompt, output_len))
    start = time.perf_counter()
    while scheduler.has_requests():
        step(scheduler, worker)
    return len(prompts) * output_len / (time.perf_counter() - start)


def hf_generate_tok_s(hf, tokenizer, prompts: list[list[int]], output_len: int) -> float:
    """transformers generate(): batched, left-padded, greedy, EOS ignored."""
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(**batch, max_new_tokens=output_len, min_new_tokens=output_len,
                          do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - batch["input_ids"].shape[1] == output_len
    return len(prompts) * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--decode-context", type=int, default=128, help="prompt length of decode steps")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=1, help="generation runs; the best counts")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, args.num_prompts)
    max_seqs = max(max(args.batch_sizes), args.num_prompts)
    worker, scheduler = make_engine(model_dir, max_seqs, kv_cache_gib=2.0)
    print(f"SmolLM2-135M float32, CPU, torch threads {torch.get_num_threads()}, "
          f"{worker.num_blocks} KV blocks")

    decode_prompt = list(range(1000, 1000 + args.decode_context))
    print(f"\ndecode step (execute_model, context {args.decode_context}, median of {args.decode_steps})")
    print(f"{'batch':>6} {'step ms':>9} {'tok/s':>9}")
    for batch_size in args.batch_sizes:
        seconds = bench_decode_step(worker, scheduler, decode_prompt, batch_size, args.decode_steps)
        print(f"{batch_size:>6} {seconds * 1e3:>9.1f} {batch_size / seconds:>9.1f}")

    prefill_tok_s = bench_prefill(worker, scheduler, prompt_len=256, num_prompts=16)
    print(f"\nprefill: {prefill_tok_s:.0f} prompt tokens/s (256-token prompts, 2048-token steps)")

    hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    # Best of --repeats, kvmesh and transformers alternating, so that a burst of
    # load from other processes does not decide the ratio.
    best: dict[tuple[str, int], float] = {}
    for repeat in range(args.repeats):
        for subset in (prompts[:1], prompts):
            n = len(subset)
            tok_s = bench_generate(worker, scheduler, subset, args.output_len, f"g{repeat}-{n}-")
            best["kvmesh", n] = max(best.get(("kvmesh", n), 0.0), tok_s)
            if hf is not None:
                tok_s = hf_generate_tok_s(hf, tokenizer, subset, args.output_len)
                best["hf", n] = max(best.get(("hf", n), 0.0), tok_s)
    print(f"\ngeneration, {args.output_len} output tokens per prompt, ignore_eos, greedy, "
          f"best of {args.repeats}")
    print(f"{'prompts':>8} {'kvmesh tok/s':>13} {'HF tok/s':>10} {'ratio':>7}")
    for n in (1, len(prompts)):
        ours = best["kvmesh", n]
        if hf is None:
            print(f"{n:>8} {ours:>13.1f}")
        else:
            theirs = best["hf", n]
            print(f"{n:>8} {ours:>13.1f} {theirs:>10.1f} {ours / theirs:>6.2f}x")

if __name__ == "__main__":
    main()
