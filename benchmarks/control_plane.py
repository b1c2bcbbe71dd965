"""What the scheduler <-> worker split costs when the accelerator is fast (issue 12).

The worker is the simulated one (``--simulate``): the real worker service,
batch, block tables and slot mapping, with the model replaced by a wait of
fixed length, so every microsecond above that wait is control plane. Tables:

(a) control-plane time per step with 1, 64, 256 and 1,024 requests decoding,
    each part timed in one process: ``schedule()``, the step message's encode
    and decode, the worker's own work around the model (batch update, inputs,
    sampling metadata, outputs; a zero-time latency model), the output
    message's encode and decode, ``update_from_output()`` (with an in-memory
    KV mirror), and the gRPC transport of those two messages (a bidirectional
    stream on loopback echoing messages of the same sizes);
(b) output tokens/s of the gRPC cluster and of the in-process engine, both on
    the simulated worker with 1 ms and 5 ms steps, 256 concurrent streams,
    DELTA and FINAL_ONLY, asynchronous scheduling on and off; "ideal" is 256
    tokens per step time;
(c) tokens/s as one scheduler drives 1, 2, 4, 8 and 16 simulated workers (2 ms
    steps, 128 requests each), sent to the scheduler's FrontendStream
    directly so that no frontend's detokenizing is in the way;
(d) the tiny random-weight Llama (2 layers, hidden 64, the SmolLM2 tokenizer)
    through ``benchmarks/serve.py``, gRPC against in-process, with
    ``OMP_NUM_THREADS=1`` and with the default threads;
(e) the default model in-process (``LLM.generate``), asynchronous scheduling
    against synchronous: what the offline default costs or gains on the CPU.
(f) on a GPU, the real worker: (f1) its step times (decode batches of 1 to 256
    at short and long context, and whole prefills) against the simulated
    worker's default ``LatencyModel``, and the model fitted to them; (f2) the
    default model's gRPC cluster against the in-process engine through
    ``benchmarks/serve.py``.

    .venv/bin/python -m benchmarks.control_plane                 # tables (a) to (d)
    .venv/bin/python -m benchmarks.control_plane --tables a b    # some
    .venv/bin/python -m benchmarks.control_plane --tables f      # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from benchmarks.serve import BenchRequest, run_grpc, run_inprocess
from kvmesh.v1 import engine_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.convert import (
    add_request_message,
    engine_core_output_from_proto,
    runner_output_message,
    scheduler_message_from_proto,
    step_message,
    worker_message_from_proto,
)
from services.common.engine import EngineCoreRequest
from services.common.limits import SchedulingLimits
from services.common.sampling_params import SamplingParams
from services.common.security import secret_metadata
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.kv_store import InMemoryKVStore
from services.scheduler.scheduler import Scheduler
from services.worker.config import LatencyModel, WorkerConfig
from services.worker.worker import Worker

PROMPT_LEN = 64
_TOKEN_IDS = (1000, 40000)


def prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*_TOKEN_IDS) for _ in range(length)] for _ in range(num)]


def fixed_step(step_ms: float) -> list[str]:
    """Worker flags for a simulated step of ``step_ms`` whatever the batch."""
    return ["--simulate", "--simulate-base-ms", str(step_ms), "--simulate-us-per-token", "0",
            "--simulate-us-per-context-token", "0"]


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).rjust(w) for c, w in zip(row, widths)) + " |")
    sys.stdout.flush()


# ---------------------------------------------------------------- (a) per step


class _Echo:
    """A loopback bidi stream answering each message with ``reply`` bytes."""

    def __init__(self) -> None:
        self.reply = b""

    async def handle(self, requests, context):
        async for _ in requests:
            yield self.reply


async def _transport_ms(step_bytes: bytes, reply_bytes: bytes, rounds: int) -> float:
    echo = _Echo()
    echo.reply = reply_bytes
    identity = (lambda b: b, lambda b: b)
    handler = grpc.method_handlers_generic_handler("bench.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(echo.handle, *identity)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/bench.Echo/Stream", *identity)()
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                await call.write(step_bytes)
                await call.read()
                times.append(time.perf_counter() - t0)
            call.cancel()
    finally:
        await server.stop(None)
    return statistics.median(times) * 1e3


def step_parts_ms(num_running: int, num_steps: int) -> dict[str, float]:
    """Median milliseconds of each control-plane part of one decode step."""
    limits = SchedulingLimits(max_num_seqs=max(num_running, 1), max_num_batched_tokens=8192)
    worker = Worker(WorkerConfig(device="cpu", max_model_len=1024, limits=limits,
                                 simulate=LatencyModel(0.0, 0.0, 0.0)))
    worker.load_model()
    worker.initialize_kv_cache()
    config = make_scheduler_config(SchedulingOptions(limits=limits), worker.registration_info(), 0)
    scheduler = Scheduler(config, InMemoryKVStore())
    for i, prompt in enumerate(prompts(num_running, PROMPT_LEN)):
        scheduler.add_request(EngineCoreRequest(
            f"r{i}", prompt, SamplingParams(max_tokens=10**6, ignore_eos=True)))
    parts: dict[str, list[float]] = {}
    sizes = (b"", b"")
    for step in range(num_steps + 20):
        t = [time.perf_counter()]
        scheduler_output = scheduler.schedule()
        t.append(time.perf_counter())
        step_bytes = step_message(scheduler_output).SerializeToString()
        t.append(time.perf_counter())
        received = scheduler_message_from_proto(
            scheduler_pb2.SchedulerMessage.FromString(step_bytes))
        t.append(time.perf_counter())
        worker_step = worker.prepare_step(received)  # hidden behind the device's previous step
        t.append(time.perf_counter())
        worker_step = worker.launch_step(worker_step)
        t.append(time.perf_counter())
        runner_output = worker.finish_step(worker_step)
        t.append(time.perf_counter())
        output_bytes = runner_output_message(runner_output).SerializeToString()
        t.append(time.perf_counter())
        answer = worker_message_from_proto(scheduler_pb2.WorkerMessage.FromString(output_bytes))
        t.append(time.perf_counter())
        scheduler.update_from_output(scheduler_output, answer)
        t.append(time.perf_counter())
        decoding = scheduler_output.total_num_scheduled_tokens == num_running
        if step >= 20 and decoding:  # prefill steps and warm-up left out
            names = ("schedule", "step encode", "step decode", "worker prepare", "worker launch",
                     "worker finish", "output encode", "output decode", "update")
            for name, t0, t1 in zip(names, t, t[1:]):
                parts.setdefault(name, []).append((t1 - t0) * 1e3)
            sizes = (step_bytes, output_bytes)
    result = {name: statistics.median(v) for name, v in parts.items()}
    result["transport"] = asyncio.run(_transport_ms(*sizes, rounds=200))
    result["total"] = sum(result.values())
    result["step bytes"], result["output bytes"] = len(sizes[0]), len(sizes[1])
    return result


def table_a(args: argparse.Namespace) -> None:
    columns = {n: step_parts_ms(n, args.steps) for n in (1, 64, 256, 1024)}
    names = list(next(iter(columns.values())))
    rows = [[name] + [f"{c[name]:.0f}" if "bytes" in name else f"{c[name]:.3f}"
                      for c in columns.values()] for name in names]
    print_table("(a) control-plane time per decode step, ms (median)",
                ["part"] + [f"{n} running" for n in columns], rows)


# ---------------------------------------------------------------- (b) gRPC vs in-process


def _workload(num: int, output_len: int) -> list[BenchRequest]:
    return [BenchRequest(p, output_len, 0.0) for p in prompts(num, PROMPT_LEN, seed=1)]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _grpc_run(cluster, workload: list[BenchRequest], concurrency: int, kind: str,
              salt: str) -> tuple[float, dict[str, float]]:
    """Output tok/s, and each process's CPU milliseconds per 1,000 output tokens
    (this process is the client)."""
    pids = {"client": os.getpid(), "frontend": cluster.frontends[0].pid,
            "scheduler": cluster.scheduler.pid, "worker": cluster.workers[0].pid}
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    results, duration_s = asyncio.run(run_grpc(cluster.address, workload, concurrency, salt,
                                               engine_pb2.RequestOutputKind.Value(kind)))
    assert not [r.error for r in results if r.error], results[0].error
    num_tokens = sum(r.num_output_tokens for r in results)
    cpu_ms = {name: (_cpu_s(pid) - before[name]) * 1e6 / num_tokens for name, pid in pids.items()}
    return num_tokens / duration_s, cpu_ms


def _inprocess_tok_s(step_ms: float, async_scheduling: bool, workload: list[BenchRequest],
                     concurrency: int, kind: str) -> float:
    from kvmesh.offline import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        simulate=LatencyModel(step_ms, 0.0, 0.0), max_num_seqs=concurrency,
        max_model_len=1024, async_scheduling=async_scheduling))
    run_inprocess(engine, workload[:1], 1, "warm-up", kind)
    results, duration_s = run_inprocess(engine, workload, concurrency, "run", kind)
    return sum(r.num_output_tokens for r in results) / duration_s


def _simulated_cluster(stack: ExitStack, step_ms: float, async_scheduling: bool,
                       max_num_seqs: int, num_workers: int = 1, num_frontends: int = 1):
    from kvmesh.cluster import ClusterConfig, LocalCluster

    seqs = ["--max-num-seqs", str(max_num_seqs)]
    config = ClusterConfig(
        num_workers=num_workers, num_frontends=num_frontends, frontend_http_port=None,
        max_model_len=1024, log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-bench-")),
        worker_args=fixed_step(step_ms) + seqs,
        scheduler_args=seqs + ([] if async_scheduling else ["--no-async-scheduling"]),
    )
    return stack.enter_context(LocalCluster(config))


def table_b(args: argparse.Namespace) -> None:
    concurrency = 256
    workload = _workload(args.num_prompts, args.output_len)
    rows, cpu_rows = [], []
    for step_ms in (1.0, 5.0):
        ideal = concurrency / step_ms * 1e3
        for async_scheduling in (True, False):
            mode = "async" if async_scheduling else "sync"
            with ExitStack() as stack:
                cluster = _simulated_cluster(stack, step_ms, async_scheduling, concurrency)
                _grpc_run(cluster, workload[:4], 4, "DELTA", "warm-up")
                for kind in ("DELTA", "FINAL_ONLY"):
                    grpc_tok_s, cpu_ms = _grpc_run(cluster, workload, concurrency, kind,
                                                   f"{mode}-{kind}")
                    cpu_rows.append([f"{step_ms:g} ms", mode, kind]
                                    + [f"{ms:.0f}" for ms in cpu_ms.values()])
                    local_tok_s = _inprocess_tok_s(step_ms, async_scheduling, workload,
                                                   concurrency, kind)
                    rows.append([f"{step_ms:g} ms", mode, kind, f"{ideal:,.0f}",
                                 f"{local_tok_s:,.0f}", f"{grpc_tok_s:,.0f}",
                                 f"{grpc_tok_s / local_tok_s:.2f}", f"{grpc_tok_s / ideal:.1%}"])
                    print(rows[-1], flush=True)
    print_table(f"(b) output tok/s, simulated worker, {concurrency} concurrent streams, "
                f"{args.num_prompts} requests of {PROMPT_LEN} + {args.output_len} tokens",
                ["step", "scheduling", "output", "ideal", "in-process", "gRPC",
                 "gRPC / in-process", "gRPC / ideal"], rows)
    print_table("(b') CPU milliseconds per 1,000 output tokens in each process of the gRPC runs",
                ["step", "scheduling", "output", "client", "frontend", "scheduler", "worker"],
                cpu_rows)


# ---------------------------------------------------------------- (c) workers per scheduler


async def _drive_scheduler(address: str, secret: str, num_requests: int, output_len: int
                           ) -> float:
    """Sends every request at once on one FrontendStream; output tokens/s until all finish."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = scheduler_pb2_grpc.EngineCoreStub(channel).FrontendStream(
            metadata=secret_metadata(secret))
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts(num_requests, PROMPT_LEN, seed=2)):
            await call.write(add_request_message(EngineCoreRequest(f"c{i}", prompt, params)))
        num_tokens = num_finished = 0
        async for message in call:
            for proto in message.outputs:
                output = engine_core_output_from_proto(proto)
                num_tokens += len(output.new_token_ids)
                num_finished += output.finished
            if num_finished == num_requests:
                break
        duration_s = time.perf_counter() - t0
        call.cancel()
    return num_tokens / duration_s


def table_c(args: argparse.Namespace) -> None:
    step_ms, per_worker = 2.0, 128
    rows = []
    for num_workers in args.workers:
        with ExitStack() as stack:
            cluster = _simulated_cluster(stack, step_ms, True, per_worker, num_workers,
                                         num_frontends=0)
            tok_s = asyncio.run(_drive_scheduler(cluster.scheduler_address,
                                                 cluster.cluster_secret,
                                                 per_worker * num_workers, args.output_len))
        ideal = num_workers * per_worker / step_ms * 1e3
        rows.append([str(num_workers), f"{ideal:,.0f}", f"{tok_s:,.0f}", f"{tok_s / ideal:.1%}",
                     f"{tok_s / num_workers:,.0f}"])
        print(rows[-1], flush=True)
    print_table(f"(c) one scheduler, simulated workers with {step_ms:g} ms steps, {per_worker} "
                f"requests each ({PROMPT_LEN} + {args.output_len} tokens), async scheduling",
                ["workers", "ideal tok/s", "tok/s", "of ideal", "tok/s per worker"], rows)


# ---------------------------------------------------------------- (d) tiny real model


def save_tiny_llama(directory: Path) -> Path:
    """A random 2-layer Llama with hidden size 64 and SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from services.common.model_files import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _serve(serve_args: list[str], env: dict[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """Runs ``benchmarks.serve`` (gRPC against in-process) in a fresh process;
    {metric: (gRPC value, in-process value)} for throughput and TPOT."""
    command = [sys.executable, "-m", "benchmarks.serve", *serve_args]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    values = {}
    for line in out.splitlines():
        if line.startswith(("output token throughput", "mean TPOT")):
            name, grpc_value, local_value = line.rsplit(None, 2)
            values[name.strip()] = (float(grpc_value), float(local_value))
    return values


def table_d(args: argparse.Namespace) -> None:
    model_dir = save_tiny_llama(Path(tempfile.mkdtemp(prefix="kvmesh-tiny-")))
    rows = []
    for threads in ("1", None):
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        if threads:
            env["OMP_NUM_THREADS"] = threads
        values = _serve(["--model", str(model_dir), "--num-prompts", "128", "--input-len", "64",
                         "--output-len", "128", "--max-concurrency", "64",
                         "--repeats", str(args.repeats)], env)
        (grpc_tok_s, local_tok_s) = values["output token throughput (tok/s)"]
        (grpc_tpot, local_tpot) = values["mean TPOT (ms)"]
        rows.append([f"OMP_NUM_THREADS={threads}" if threads else "default threads",
                     f"{local_tok_s:,.0f}", f"{grpc_tok_s:,.0f}", f"{grpc_tok_s / local_tok_s:.2f}",
                     f"{local_tpot:.1f}", f"{grpc_tpot:.1f}"])
        print(rows[-1], flush=True)
    print_table("(d) tiny random Llama (2 layers, hidden 64), 128 prompts of 64 + 128 tokens, "
                f"64 concurrent, best of {args.repeats}",
                ["threads", "in-process tok/s", "gRPC tok/s", "gRPC / in-process",
                 "in-process TPOT ms", "gRPC TPOT ms"], rows)


def table_e(args: argparse.Namespace) -> None:
    from kvmesh.offline import LLM
    from services.common.sampling_params import SamplingParams as Params

    requests = [{"prompt_token_ids": p} for p in prompts(32, PROMPT_LEN, seed=3)]
    params = Params(temperature=0.0, max_tokens=64, ignore_eos=True)
    llms = {mode: LLM(async_scheduling=mode == "async") for mode in ("async", "sync")}
    rates: dict[str, list[float]] = {mode: [] for mode in llms}
    tokens = {}
    for mode, llm in llms.items():
        llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
    for _ in range(args.repeats + 1):
        for mode, llm in llms.items():  # alternating: both see the same background load
            t0 = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            rates[mode].append(len(requests) * 64 / (time.perf_counter() - t0))
            tokens[mode] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["async"] == tokens["sync"]
    best = {mode: max(r) for mode, r in rates.items()}
    print_table(f"(e) SmolLM2-135M-Instruct in-process, 32 prompts of {PROMPT_LEN} + 64 tokens, "
                f"best of {args.repeats + 1}, identical tokens",
                ["async tok/s", "sync tok/s", "async / sync"],
                [[f"{best['async']:.0f}", f"{best['sync']:.0f}",
                  f"{best['async'] / best['sync']:.2f}"]])


# ---------------------------------------------------------------- (f) the real worker on CUDA

# Decode batches measured for the latency model, each at a short and a long prompt.
_F_BATCHES = (1, 16, 64, 256)
_F_PROMPT_LENS = (32, 1024)
# Prefill steps measured: (requests, prompt tokens each), all in one step.
_F_PREFILLS = ((1, 512), (4, 1024), (16, 1024))


def _prefill_step_s(worker: Worker, scheduler: Scheduler, num_reqs: int, prompt_len: int,
                    rng: random.Random) -> float:
    """Seconds of one step that prefills ``num_reqs`` fresh random prompts whole
    (its scheduled tokens are its context tokens); the requests then finish."""
    from benchmarks.cudagraphs import engine_step

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(num_reqs):
        prompt = [rng.randrange(*_TOKEN_IDS) for _ in range(prompt_len)]
        scheduler.add_request(EngineCoreRequest(f"p{prompt_len}x{num_reqs}-{i}", prompt, params))
    seconds, num_tokens = engine_step(scheduler, worker)
    if num_tokens != num_reqs * prompt_len:  # a refused or split prefill would skew the fit
        raise RuntimeError(f"the prefill step scheduled {num_tokens} tokens, not "
                           f"{num_reqs} x {prompt_len}")
    while scheduler.has_requests():
        engine_step(scheduler, worker)
    return seconds


Point = tuple[int, int, float]  # (scheduled tokens, context tokens, measured ms)


def latency_points(args: argparse.Namespace) -> tuple[list[Point], list[Point]]:
    """Real CUDA steps in the worker's default graph mode: (the decode batches at
    each prompt length, the prefills, each the faster of two runs after one that
    warms up)."""
    from benchmarks.cudagraphs import decode_worker, time_decode_steps

    longest = max(_F_PROMPT_LENS + tuple(length for _, length in _F_PREFILLS))
    sizing = argparse.Namespace(batch_sizes=list(_F_BATCHES), prompt_len=longest, warmup_steps=4,
                                decode_steps=args.steps, dtype="bfloat16", device="cuda",
                                compile_pieces=None)
    worker, scheduler = decode_worker(None, sizing, "FULL_AND_PIECEWISE")
    rng = random.Random(5)
    decodes, prefills = [], []
    for prompt_len in _F_PROMPT_LENS:
        timing = argparse.Namespace(**{**vars(sizing), "prompt_len": prompt_len})
        # The timed steps' requests hold prompt + warm-up + about half the timed tokens.
        per_request = prompt_len + timing.warmup_steps + args.steps // 2 + 1
        for batch in _F_BATCHES:
            ms = time_decode_steps(worker, scheduler, batch, timing, rng)
            decodes.append((batch, batch * per_request, ms))
    for num_reqs, prompt_len in _F_PREFILLS:
        runs = [_prefill_step_s(worker, scheduler, num_reqs, prompt_len, rng) for _ in range(3)]
        tokens = num_reqs * prompt_len
        prefills.append((tokens, tokens, min(runs[1:]) * 1e3))
    return decodes, prefills


def fit_latency_model(points: list[Point]) -> LatencyModel:
    """Least squares of ms = base + tokens x per-token + context x per-context-token
    (each coefficient clipped at zero, the range ``LatencyModel`` allows)."""
    import numpy as np

    a = np.array([[1.0, tokens * 1e-3, context * 1e-3] for tokens, context, _ in points])
    b = np.array([ms for _, _, ms in points])
    base_ms, us_per_token, us_per_context = np.linalg.lstsq(a, b, rcond=None)[0]
    return LatencyModel(base_ms=max(float(base_ms), 0.0), us_per_token=max(float(us_per_token), 0.0),
                        us_per_context_token=max(float(us_per_context), 0.0))


def table_f(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        print("(f) needs a CUDA device; skipped")
        return
    gpu = torch.cuda.get_device_name()
    decodes, prefills = latency_points(args)
    points = decodes + prefills
    default = LatencyModel()
    # Fitted to the decode steps alone (what the defaults are) and to every step.
    fits = {"decode": fit_latency_model(decodes), "all": fit_latency_model(points)}
    rows = []
    for tokens, context, ms in points:
        model_ms = default.step_seconds(tokens, context) * 1e3
        rows.append([str(tokens), f"{context:,}", f"{ms:.3f}", f"{model_ms:.3f}",
                     f"{model_ms / ms:.2f}",
                     *(f"{fit.step_seconds(tokens, context) * 1e3:.3f}" for fit in fits.values())])
    print_table(f"(f1) real worker steps on {gpu} (SmolLM2-135M bfloat16, FULL_AND_PIECEWISE, "
                f"execute_model to its output; decode medians of {args.steps} steps, prefill "
                "best of 2) against the simulated worker's LatencyModel",
                ["tokens", "context tokens", "measured ms", "default model ms", "default / measured",
                 "decode fit ms", "all fit ms"], rows)
    print(f"default:    {default}", flush=True)
    for name, fit in fits.items():
        print(f"{name + ' fit:':<11} {fit}", flush=True)
    values = _serve(["--device", "cuda", "--num-prompts", "256", "--input-len", "128",
                     "--output-len", "128", "--max-concurrency", "256",
                     "--repeats", str(args.repeats)])
    (grpc_tok_s, local_tok_s) = values["output token throughput (tok/s)"]
    (grpc_tpot, local_tpot) = values["mean TPOT (ms)"]
    print_table(f"(f2) SmolLM2-135M-Instruct on {gpu}: 256 prompts of 128 + 128 tokens, 256 "
                f"concurrent, best of {args.repeats}",
                ["in-process tok/s", "gRPC tok/s", "gRPC / in-process", "in-process TPOT ms",
                 "gRPC TPOT ms"],
                [[f"{local_tok_s:,.0f}", f"{grpc_tok_s:,.0f}", f"{grpc_tok_s / local_tok_s:.2f}",
                  f"{local_tpot:.2f}", f"{grpc_tpot:.2f}"]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", nargs="+", choices="abcdef", default=list("abcd"))
    p.add_argument("--steps", type=int, default=100, help="(a): timed decode steps per case")
    p.add_argument("--num-prompts", type=int, default=512, help="(b): requests per run")
    p.add_argument("--output-len", type=int, default=64, help="(b), (c): tokens per request")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="(c)")
    p.add_argument("--repeats", type=int, default=2, help="(d), (e): runs of each")
    args = p.parse_args()
    tables = {"a": table_a, "b": table_b, "c": table_c, "d": table_d, "e": table_e,
              "f": table_f}
    for name in args.tables:
        tables[name](args)


if __name__ == "__main__":
    main()
