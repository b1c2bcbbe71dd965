"""kvmesh and vLLM's CPU build in turns, a fresh process each (issue 24).

This guest's speed drifts by tens of percent within minutes, so a comparison of
two systems measured one after the other in one window can say more about the
window than about the systems. Here each round starts a fresh kvmesh process,
then a fresh vLLM runner (``benchmarks/peers/vllm_cpu_runner.py``), on the same
token-id prompts; the table gives every round's figures, their medians and the
ratio of the medians::

    .venv/bin/python -m benchmarks.cpu_in_turns --rounds 3 --dtype bfloat16
    .venv/bin/python -m benchmarks.cpu_in_turns --rounds 3 --quantization w8a8

Both sides speak the runner's protocol: a JSON spec on stdin, one JSON line with
``startup_s``, ``single_tok_s`` and ``batched_tok_s`` (one value per repeat) on
stdout, measured the same way (single stream: the single prompts one after
another; batched: all prompts at once; 128 greedy tokens, EOS ignored, prefill
included; untimed warm-up calls first). Prefix caching is off on both, as the
runner builds vLLM, so repeats of the same prompts hit no cache on either side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_START_S = time.perf_counter()

from benchmarks.peers.vllm_cpu import REPO_ROOT, run_vllm  # noqa: E402


def kvmesh_child() -> None:
    """The kvmesh side: reads the runner's spec, prints the runner's result line."""
    import torch

    from benchmarks.cpu_throughput import kvmesh_tok_s, make_kvmesh, single_stream

    spec = json.load(sys.stdin)
    torch.set_num_threads(spec["threads"])
    singles, batch, output_len = spec["single_prompts"], spec["batch_prompts"], spec["output_len"]
    engine = make_kvmesh(spec["dtype"], spec["quantization"], len(batch))
    startup_s = time.perf_counter() - _START_S
    kvmesh_tok_s(engine, singles[:1], 4, "warm-single-")
    kvmesh_tok_s(engine, batch, 4, "warm-batch-")
    single, batched = [], []
    for r in range(spec["repeats"]):
        single.append(single_stream(
            lambda p: kvmesh_tok_s(engine, [p], output_len, f"s{r}-"), singles))
        batched.append(kvmesh_tok_s(engine, batch, output_len, f"b{r}-"))
    print(json.dumps({"startup_s": startup_s, "single_tok_s": single, "batched_tok_s": batched}),
          flush=True)


def run_kvmesh(spec: dict, timeout_s: float = 1800.0) -> dict:
    """One fresh kvmesh process on ``spec``; raises RuntimeError with its log's tail."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cpu_in_turns", "--child"],
                          input=json.dumps(spec), text=True, capture_output=True,
                          cwd=REPO_ROOT, timeout=timeout_s)
    results = [line for line in proc.stdout.splitlines() if line.startswith('{"startup_s"')]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"kvmesh child exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(results[-1])


def print_table(rounds: dict[str, list[dict]], num_prompts: int) -> None:
    """Every round's figures (repeats within a round joined by commas, rounds by
    semicolons), the medians over all of them and kvmesh's ratio to vLLM."""
    medians = {}
    print(f"| system | single stream tok/s | {num_prompts} streams tok/s |\n|---|---|---|")
    for name, results in rounds.items():
        cells = []
        for key in ("single_tok_s", "batched_tok_s"):
            values = [v for result in results for v in result[key]]
            medians[name, key] = statistics.median(values)
            per_round = "; ".join(", ".join(f"{v:.1f}" for v in result[key]) for result in results)
            cells.append(f"{per_round} (median {medians[name, key]:.1f})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    ours, theirs = rounds
    print(f"\nkvmesh / vLLM by medians: single stream "
          f"{medians[ours, 'single_tok_s'] / medians[theirs, 'single_tok_s']:.2f}x, "
          f"{num_prompts} streams "
          f"{medians[ours, 'batched_tok_s'] / medians[theirs, 'batched_tok_s']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind per process")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--quantization", choices=["int8", "w8a8", "gguf"], default=None,
                        help="kvmesh's weights (vLLM's stay in --dtype)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-single", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if args.child:
        kvmesh_child()
        return
    from transformers import AutoTokenizer

    from benchmarks.cpu_throughput import cpu_description
    from benchmarks.worker_throughput import make_prompts
    from services.common.model_files import resolve_model_dir

    model_dir = str(resolve_model_dir(None))
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    spec = {"model_dir": model_dir, "dtype": args.dtype, "single_prompts": prompts[:args.num_single],
            "batch_prompts": prompts, "output_len": args.output_len, "repeats": args.repeats,
            "threads": args.threads, "quantization": args.quantization}
    ours = f"{args.quantization} " if args.quantization else ""
    names = (f"kvmesh {ours}{args.dtype}", f"vLLM CPU {args.dtype}")
    print(f"{cpu_description()}\n{names[0]} against {names[1]}, {args.threads} threads, "
          f"{args.rounds} rounds")
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        rounds[names[0]].append(run_kvmesh(spec))
        vllm = run_vllm(model_dir, args.dtype, spec["single_prompts"], prompts, args.output_len,
                        args.repeats, args.threads)
        rounds[names[1]].append({"single_tok_s": vllm.single_tok_s,
                                 "batched_tok_s": vllm.batched_tok_s})
        print(f"round {r + 1}: " + "; ".join(
            f"{name} {rounds[name][-1]['single_tok_s']} / {rounds[name][-1]['batched_tok_s']}"
            for name in names), flush=True)
    print()
    print_table(rounds, args.num_prompts)


if __name__ == "__main__":
    main()
