"""CUDA graph modes on SmolLM2-135M-Instruct (bfloat16), with their baselines in the same run.

Two tables:
  * decode step latency: ``Worker.execute_model`` of pure decode steps at each
    batch size, one worker per CUDA graph mode, and each mode's speedup over
    NONE (eager);
  * end-to-end output tokens/s of the offline ``LLM`` on nano-vllm's workload
    (``--num-seqs`` prompts of random token ids, input and output lengths
    uniform in [100, 1024], ignore_eos, greedy) against transformers'
    left-padded, batched greedy ``generate()`` on the same prompts.

    .venv/bin/python benchmarks/cudagraphs.py
    .venv/bin/python benchmarks/cudagraphs.py --modes NONE,FULL_DECODE_ONLY --batch-sizes 1,64 --skip-e2e
    # the pieces between attention calls compiled by inductor (fewer, fused kernels):
    .venv/bin/python benchmarks/cudagraphs.py --modes FULL,FULL_AND_PIECEWISE --compile-pieces on --skip-e2e
    # CPU smoke run (graphs need CUDA, so only NONE):
    .venv/bin/python benchmarks/cudagraphs.py --device cpu --dtype float32 --modes NONE \\
        --batch-sizes 1,2 --num-seqs 4 --max-len 40
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import random
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from kvmesh.offline import LLM
from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.model_files import resolve_model_dir
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.worker import Worker

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
BASELINE_MODE = "NONE"
# nano-vllm's bench.py draws prompt token ids from [0, 10000].
MAX_RANDOM_TOKEN_ID = 10000
BLOCK_SIZE = 16

Workload = list[tuple[list[int], int]]  # (prompt token ids, output length) per sequence


def comma_list(item_type: Callable[[str], object]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        return [item_type(item) for item in text.split(",") if item]
    return parse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--modes", type=comma_list(str.upper),
                        default=list(MODES),
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--batch-sizes", type=comma_list(int), default=[1, 8, 32, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of decode requests")
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=64, help="timed decode steps (median)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="shortest input/output (capped at --max-len)")
    parser.add_argument("--max-len", type=int, default=1024, help="longest input/output")
    parser.add_argument("--e2e-mode", type=str.upper, default=None,
                        help="cudagraph_mode of the LLM (default FULL_AND_PIECEWISE on CUDA, NONE on CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="LLM's batch capacity")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="LLM's token budget")
    parser.add_argument("--hf-batch-size", type=int, default=256)
    parser.add_argument("--detokenize", action="store_true", help="LLM detokenizes (HF never does)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--compile-pieces", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile the forward pass between attention calls (the "
                             "worker's compile_pieces; auto: its device default, off on CUDA)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the timed steps at the smallest batch size in each mode "
                             "and print the ops that took the most host and device time")
    args = parser.parse_args()
    check_args(parser, args)
    args.compile_pieces = {"auto": None, "on": True, "off": False}[args.compile_pieces]
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes {args.modes}: each must be one of {', '.join(MODES)}")
    if args.e2e_mode is None:
        args.e2e_mode = "FULL_AND_PIECEWISE" if args.device.startswith("cuda") else "NONE"
    if args.e2e_mode not in MODES:
        parser.error(f"--e2e-mode {args.e2e_mode}: must be one of {', '.join(MODES)}")
    if not args.device.startswith("cuda") and set(args.modes + [args.e2e_mode]) != {"NONE"}:
        parser.error(f"CUDA graphs need a CUDA device; on {args.device} use --modes NONE --e2e-mode NONE")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes {args.batch_sizes}: each must be >= 1")
    for name in ("prompt_len", "decode_steps", "num_seqs", "min_len", "max_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is {getattr(args, name)}, must be >= 1")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Frees what the dropped engine held (KV cache, graph pools) before the next one starts."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_header(device: torch.device, dtype: str) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"SmolLM2-135M-Instruct {dtype} on {name} ({device}), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda or '-'}")


# -- decode step latency ------------------------------------------------------


def decode_worker(model_dir: str, args: argparse.Namespace, mode: str) -> tuple[Worker, Scheduler]:
    """A worker in ``mode`` sized for the largest batch, and a scheduler for its pool."""
    max_num_seqs = max(args.batch_sizes)
    tokens_per_seq = args.prompt_len + args.warmup_steps + args.decode_steps + 2
    # The KV pool holds the largest batch and no more: zeroing a pool sized to
    # 90% of the GPU would only slow down each mode's start.
    num_kv_blocks = max_num_seqs * math.ceil(tokens_per_seq / BLOCK_SIZE) + 1
    # The whole batch prefills in one step, so its requests decode in step and
    # finish together: a batch prefilled over several steps would end unevenly
    # and leave timed steps with fewer requests than the batch size.
    limits = SchedulingLimits(max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max(2048, max_num_seqs * args.prompt_len))
    config = WorkerConfig(
        model=model_dir, dtype=args.dtype, device=args.device, block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks, limits=limits, cudagraph_mode=mode,
        compile_pieces=args.compile_pieces,
    )
    worker = Worker(config)
    worker.load_model()
    start = time.perf_counter()
    worker.initialize_kv_cache()  # captures the graphs
    # The runner may downgrade the mode to what the attention backend supports.
    resolved = worker.model_runner.cudagraph_mode.name
    print(f"  {mode} (runs as {resolved}): KV cache + graph capture {time.perf_counter() - start:.1f} s")
    options = SchedulingOptions(limits=limits)
    return worker, Scheduler(make_scheduler_config(options, worker.registration_info(), 0))


def engine_step(scheduler: Scheduler, worker: Worker) -> tuple[float, int]:
    """One schedule -> execute_model -> update step; (execute_model seconds, tokens scheduled)."""
    scheduler_output = scheduler.schedule()
    synchronize(worker.device)
    start = time.perf_counter()
    runner_output = worker.execute_model(scheduler_output)
    synchronize(worker.device)
    elapsed = time.perf_counter() - start
    scheduler.update_from_output(scheduler_output, runner_output)
    return elapsed, scheduler_output.total_num_scheduled_tokens


def time_decode_steps(worker: Worker, scheduler: Scheduler, batch_size: int,
                      args: argparse.Namespace, rng: random.Random,
                      around_timed: contextlib.AbstractContextManager | None = None) -> float:
    """Median ms of ``--decode-steps`` pure decode steps of ``batch_size`` requests;
    ``around_timed`` (a profiler, say) is entered for the timed steps alone."""
    max_tokens = args.warmup_steps + args.decode_steps + 2
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch_size):
        # Random prompts: no prefix-cache hits between the requests.
        prompt = [rng.randint(0, MAX_RANDOM_TOKEN_ID) for _ in range(args.prompt_len)]
        scheduler.add_request(EngineCoreRequest(f"b{batch_size}-{i}", prompt, params))
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine_step(scheduler, worker)
    for _ in range(args.warmup_steps):
        engine_step(scheduler, worker)
    times_s = []
    with around_timed or contextlib.nullcontext():
        for _ in range(args.decode_steps):
            elapsed, num_tokens = engine_step(scheduler, worker)
            if num_tokens != batch_size:
                raise RuntimeError(f"a timed step scheduled {num_tokens} tokens, not one per request ({batch_size})")
            times_s.append(elapsed)
    while scheduler.has_requests():
        engine_step(scheduler, worker)
    return statistics.median(times_s) * 1e3


def bench_decode_mode(model_dir: str, args: argparse.Namespace, mode: str) -> dict[int, float]:
    """ms per decode step at each batch size, for one mode; frees the worker afterwards."""
    worker, scheduler = decode_worker(model_dir, args, mode)
    rng = random.Random(1)
    step_ms = {b: time_decode_steps(worker, scheduler, b, args, rng) for b in args.batch_sizes}
    if args.profile:
        print_profile(worker, scheduler, mode, args, rng)
    del worker, scheduler
    release_memory(torch.device(args.device))
    return step_ms


def print_profile(worker: Worker, scheduler: Scheduler, mode: str, args: argparse.Namespace,
                  rng: random.Random) -> None:
    """The ops of the timed steps at the smallest batch size, by host time and by device
    time: what a step spends around the forward pass, and in it."""
    batch_size = min(args.batch_sizes)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if worker.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    time_decode_steps(worker, scheduler, batch_size, args, rng, around_timed=profiler)
    events = profiler.key_averages()
    print(f"\n{mode}: {args.decode_steps} decode steps of batch {batch_size}, by host time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    if worker.device.type == "cuda":
        print(f"{mode}: the same steps by device time")
        print(events.table(sort_by="self_device_time_total", row_limit=15))


def print_decode_table(step_ms: dict[str, dict[int, float]], args: argparse.Namespace) -> None:
    modes = list(step_ms)
    baseline = BASELINE_MODE if BASELINE_MODE in step_ms else modes[0]
    print(f"\ndecode step (Worker.execute_model, prompt {args.prompt_len} tokens, median of "
          f"{args.decode_steps} steps after {args.warmup_steps} warm-up); ms/step and speedup over {baseline}")
    columns = [f"{mode} ms" for mode in modes] + [f"x{mode}" for mode in modes if mode != baseline]
    widths = [max(9, len(c)) for c in columns]
    print(f"{'batch':>6} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for batch_size in args.batch_sizes:
        base_ms = step_ms[baseline][batch_size]
        cells = [f"{step_ms[m][batch_size]:.3f}" for m in modes]
        cells += [f"{base_ms / step_ms[m][batch_size]:.2f}" for m in modes if m != baseline]
        print(f"{batch_size:>6} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))


# -- end-to-end throughput ----------------------------------------------------


def make_workload(num_seqs: int, min_len: int, max_len: int) -> Workload:
    """nano-vllm's bench workload, seeded: random prompts, then the output lengths."""
    rng = random.Random(0)
    low = min(min_len, max_len)
    prompts = [[rng.randint(0, MAX_RANDOM_TOKEN_ID) for _ in range(rng.randint(low, max_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(low, max_len) for _ in range(num_seqs)]
    return list(zip(prompts, output_lens))


def kvmesh_tok_s(model_dir: str, workload: Workload, args: argparse.Namespace) -> float:
    """Output tokens/s of ``LLM.generate`` on the workload (start-up and warm-up excluded)."""
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, cudagraph_mode=args.e2e_mode,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=2 * args.max_len, compile_pieces=args.compile_pieces)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=args.detokenize)
              for _, n in workload]
    llm.generate([list(range(100, 116))] * 2, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    device = torch.device(args.device)
    synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(n for _, n in workload)
    if num_tokens != expected:
        raise RuntimeError(f"kvmesh generated {num_tokens} tokens, the workload asked for {expected}")
    del llm, outputs
    release_memory(device)
    return num_tokens / elapsed


def hf_generate(hf, batch: Workload, pad_token_id: int, device: torch.device) -> None:
    """Greedy, left-padded generate() of one batch to its longest output length."""
    width = max(len(p) for p, _ in batch)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p, _ in batch], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
    num_new = max(n for _, n in batch)
    # min_new_tokens == max_new_tokens: EOS cannot end a sequence early.
    out = hf.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_new,
                      min_new_tokens=num_new, do_sample=False, pad_token_id=pad_token_id)
    if out.shape[1] != width + num_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens per row, asked for {num_new}")


def hf_tok_s(model_dir: str, workload: Workload, args: argparse.Namespace) -> float:
    """transformers' output tokens/s, counting only the tokens each sequence asked for."""
    device = torch.device(args.device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
    pad_token_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    with torch.inference_mode():
        hf_generate(hf, [(list(range(100, 116)), 8)] * 2, pad_token_id, device)
        synchronize(device)
        start = time.perf_counter()
        for i in range(0, len(workload), args.hf_batch_size):
            hf_generate(hf, workload[i:i + args.hf_batch_size], pad_token_id, device)
        synchronize(device)
        elapsed = time.perf_counter() - start
    del hf
    release_memory(device)
    return sum(n for _, n in workload) / elapsed


def print_e2e_table(workload: Workload, ours: float, theirs: float | None, args: argparse.Namespace) -> None:
    num_out = sum(n for _, n in workload)
    num_in = sum(len(p) for p, _ in workload)
    print(f"\nend to end: {len(workload)} seqs, input/output lengths uniform in "
          f"[{min(args.min_len, args.max_len)}, {args.max_len}] ({num_in} prompt, {num_out} output tokens), "
          f"greedy, ignore_eos")
    print(f"kvmesh LLM: cudagraph_mode {args.e2e_mode}, max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, detokenize {args.detokenize}")
    print(f"transformers: generate() in batches of {args.hf_batch_size}, left-padded, each batch run "
          f"to its longest output; only the tokens each sequence asked for are counted")
    print(f"{'kvmesh tok/s':>13} {'HF tok/s':>10} {'ratio':>7}")
    if theirs is None:
        print(f"{ours:>13.1f}")
    else:
        print(f"{ours:>13.1f} {theirs:>10.1f} {ours / theirs:>6.2f}x")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    model_dir = str(resolve_model_dir(None))
    print_header(device, args.dtype)
    if not args.skip_decode:
        print("\nstarting one worker per mode:")
        step_ms = {mode: bench_decode_mode(model_dir, args, mode) for mode in args.modes}
        print_decode_table(step_ms, args)
    if not args.skip_e2e:
        workload = make_workload(args.num_seqs, args.min_len, args.max_len)
        ours = kvmesh_tok_s(model_dir, workload, args)
        theirs = None if args.skip_hf else hf_tok_s(model_dir, workload, args)
        print_e2e_table(workload, ours, theirs, args)


if __name__ == "__main__":
    main()
