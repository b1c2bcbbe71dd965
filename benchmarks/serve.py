"""Online serving benchmark (like ``vllm bench serve``): gRPC, HTTP and in-process.

Sends one workload through each ``--backends`` in turn and prints their
tables side by side with each one's throughput against the first:

- ``grpc``: the public gRPC API (Generate, DELTA streaming);
- ``openai``: the OpenAI-compatible HTTP API, ``/v1/completions`` streamed as
  server-sent events through the official ``openai`` client (AsyncOpenAI),
  with the same token-id prompts, so the very same tokens are computed;
- ``openai-chat``: ``/v1/chat/completions`` streamed, each prompt's token ids
  decoded to text as one user message (the chat template and re-tokenizing
  change the prompt lengths a little);
- ``in-process``: the offline engine (``LLMEngine``: scheduler and worker in
  this process, no network).

The local cluster's worker and the in-process engine run on ``--device``
(CUDA where there is one), each on its own share of the GPU's free memory.

Workload: ``--num-prompts`` prompts of random token ids (input and output
lengths drawn uniformly within ``--range-ratio`` of ``--input-len`` /
``--output-len``), greedy, ``ignore_eos`` so every request produces exactly
its output length. Every run is as cold as the first: it sends its prompts
under a cache salt of its own, so no run hits prefix-cache blocks that an
earlier run (of any backend) left behind. Arrivals are a Poisson process at
``--request-rate`` requests/s (``inf``: all at once), capped at
``--max-concurrency`` requests in flight. Reported: request throughput,
output tokens/s, total tokens/s and TTFT / TPOT / ITL mean, p50, p90, p99.

    .venv/bin/python benchmarks/serve.py --num-prompts 64 --max-concurrency 32 --repeats 3
    .venv/bin/python benchmarks/serve.py --backends grpc openai openai-chat --repeats 3
    .venv/bin/python benchmarks/serve.py --address 127.0.0.1:50051 \
        --http-url http://127.0.0.1:8000 --backends grpc openai   # a running cluster
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import openai
from kvmesh.v1 import api_pb2, api_pb2_grpc, engine_pb2

# Token ids drawn for random prompts: past the special tokens, inside the vocab.
_TOKEN_ID_RANGE = (1000, 40000)


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float  # offset from the start of the run


@dataclass(slots=True)
class RequestResult:
    start_s: float
    token_times_s: list[float] = field(default_factory=list)  # one per chunk with tokens
    num_output_tokens: int = 0
    end_s: float = 0.0
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.end_s - self.token_times_s[0]) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return list(np.diff(self.token_times_s))


def make_workload(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        low = max(1, math.floor(mean * (1 - args.range_ratio)))
        return rng.randint(low, max(low, math.ceil(mean * (1 + args.range_ratio))))

    arrival_s = 0.0
    workload = []
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(*_TOKEN_ID_RANGE) for _ in range(length(args.input_len))]
        workload.append(BenchRequest(prompt, length(args.output_len), arrival_s))
        if math.isfinite(args.request_rate):
            arrival_s += rng.expovariate(args.request_rate)
    return workload


# ---------------------------------------------------------------- gRPC


async def _grpc_one(stub, request: BenchRequest, index: int, cache_salt: str,
                    output_kind: int = engine_pb2.DELTA) -> RequestResult:
    params = engine_pb2.SamplingParams(
        n=1, temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=request.output_len,
        ignore_eos=True, detokenize=True, skip_special_tokens=True, output_kind=output_kind,
    )
    message = api_pb2.GenerateRequest(request_id=f"bench-{index}", sampling_params=params,
                                      cache_salt=cache_salt)
    message.token_ids.ids.extend(request.prompt_token_ids)
    result = RequestResult(start_s=time.perf_counter())
    try:
        async for chunk in stub.Generate(message):
            num_tokens = sum(len(o.token_ids) for o in chunk.outputs)
            if num_tokens:
                result.token_times_s.append(time.perf_counter())
                result.num_output_tokens += num_tokens
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    result.end_s = time.perf_counter()
    return result


async def run_grpc(address: str, workload: list[BenchRequest], max_concurrency: int,
                   cache_salt: str, output_kind: int = engine_pb2.DELTA
                   ) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(max_concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        warm_up = BenchRequest(workload[0].prompt_token_ids, 2, 0.0)
        await _grpc_one(stub, warm_up, -1, "warm-up")
        t0 = time.perf_counter()

        async def timed(index: int, request: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
            async with semaphore:
                return await _grpc_one(stub, request, index, cache_salt, output_kind)

        results = await asyncio.gather(*(timed(i, r) for i, r in enumerate(workload)))
        return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------- OpenAI HTTP API


async def _openai_one(client: openai.AsyncOpenAI, model: str, request: BenchRequest,
                      prompt_text: str | None, cache_salt: str) -> RequestResult:
    """One streamed request; ``prompt_text`` None: completions with token ids, else chat."""
    options = dict(model=model, max_tokens=request.output_len, temperature=0.0, stream=True,
                   extra_body={"ignore_eos": True, "return_token_ids": True,
                               "cache_salt": cache_salt})
    result = RequestResult(start_s=time.perf_counter())
    try:
        if prompt_text is None:
            stream = await client.completions.create(prompt=request.prompt_token_ids, **options)
        else:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt_text}], **options)
        async for chunk in stream:
            num_tokens = sum(len(c.model_extra["token_ids"]) for c in chunk.choices)
            if num_tokens:
                result.token_times_s.append(time.perf_counter())
                result.num_output_tokens += num_tokens
    except openai.APIError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.end_s = time.perf_counter()
    return result


async def run_openai(url: str, workload: list[BenchRequest], max_concurrency: int, chat: bool,
                     cache_salt: str) -> tuple[list[RequestResult], float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=3600)
    async with client:
        model = (await client.models.list()).data[0].id
        texts: list[str | None] = [None] * len(workload)
        if chat:
            texts = [await _detokenize(client, url, r.prompt_token_ids) for r in workload]
        warm_up = BenchRequest(workload[0].prompt_token_ids, 2, 0.0)
        await _openai_one(client, model, warm_up, texts[0], "warm-up")
        semaphore = asyncio.Semaphore(max_concurrency)
        t0 = time.perf_counter()

        async def timed(index: int, request: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
            async with semaphore:
                return await _openai_one(client, model, request, texts[index], cache_salt)

        results = await asyncio.gather(*(timed(i, r) for i, r in enumerate(workload)))
        return list(results), time.perf_counter() - t0


async def _detokenize(client: openai.AsyncOpenAI, url: str, token_ids: list[int]) -> str:
    # The server's own POST /detokenize (vLLM's), through the client's connection pool.
    response = await client.post(f"{url}/detokenize", body={"tokens": token_ids},
                                 cast_to=object)
    return response["prompt"]


# ---------------------------------------------------------------- in-process


def run_inprocess(engine, workload: list[BenchRequest], max_concurrency: int, cache_salt: str,
                  output_kind: str = "DELTA") -> tuple[list[RequestResult], float]:
    """The same arrivals through LLMEngine.step(), timing outputs as they come
    (``output_kind``: a RequestOutputKind name)."""
    from services.common.sampling_params import RequestOutputKind, SamplingParams

    def add(index: int) -> None:
        request = workload[index]
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True,
                                output_kind=RequestOutputKind[output_kind])
        results[index] = RequestResult(start_s=time.perf_counter())
        engine.add_request(str(index), request.prompt_token_ids, params, cache_salt=cache_salt)

    results: list[RequestResult | None] = [None] * len(workload)
    next_index = 0
    t0 = time.perf_counter()
    while next_index < len(workload) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while (next_index < len(workload) and workload[next_index].arrival_s <= now
               and engine.get_num_unfinished_requests() < max_concurrency):
            add(next_index)
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, workload[next_index].arrival_s - now))
            continue
        for output in engine.step():
            result = results[int(output.request_id)]
            num_tokens = sum(len(o.token_ids) for o in output.outputs)
            if num_tokens:
                result.token_times_s.append(time.perf_counter())
                result.num_output_tokens += num_tokens
            if output.finished:
                result.end_s = time.perf_counter()
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------- report


def summarize(results: list[RequestResult], duration_s: float, workload: list[BenchRequest]
              ) -> dict[str, float]:
    ok = [r for r in results if not r.error and r.token_times_s]
    num_input = sum(len(w.prompt_token_ids) for w, r in zip(workload, results) if r in ok)
    num_output = sum(r.num_output_tokens for r in ok)
    summary = {
        "successful requests": len(ok),
        "failed requests": len(results) - len(ok),
        "duration (s)": duration_s,
        "request throughput (req/s)": len(ok) / duration_s,
        "output token throughput (tok/s)": num_output / duration_s,
        "total token throughput (tok/s)": (num_input + num_output) / duration_s,
    }
    series = {
        "TTFT (ms)": [r.ttft_s for r in ok],
        "TPOT (ms)": [r.tpot_s for r in ok if r.tpot_s is not None],
        "ITL (ms)": [itl for r in ok for itl in r.itls_s],
    }
    for name, values in series.items():
        values_ms = np.asarray(values or [math.nan]) * 1000.0
        summary[f"mean {name}"] = float(np.mean(values_ms))
        for q in (50, 90, 99):
            summary[f"p{q} {name}"] = float(np.percentile(values_ms, q))
    return summary


def print_table(columns: dict[str, dict[str, float]]) -> None:
    names = list(columns)
    rows = list(next(iter(columns.values())))
    width = max(len(r) for r in rows)
    print(f"{'':<{width}}  " + "  ".join(f"{n:>12}" for n in names))
    for row in rows:
        cells = []
        for name in names:
            value = columns[name][row]
            cells.append(f"{value:>12.0f}" if row.endswith("requests") else f"{value:>12.2f}")
        print(f"{row:<{width}}  " + "  ".join(cells))


# ---------------------------------------------------------------- main

BACKENDS = ("grpc", "openai", "openai-chat", "in-process")
THROUGHPUT = "output token throughput (tok/s)"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["grpc", "in-process"],
                   help="what to run the workload through, compared with the first")
    p.add_argument("--address", default=None,
                   help="a running frontend's gRPC address; default: start a local cluster")
    p.add_argument("--http-url", default=None,
                   help="with --address: its HTTP API, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (inf: all at 0)")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--device", default=None,
                   help="the workers' and the in-process engine's device (default: cuda if "
                        "there is one, else cpu)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache on the CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="on CUDA, each engine's share of the free memory: the cluster's "
                        "worker and the in-process engine hold theirs at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="alternate the backends' runs this many times; report each one's best")
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.address and not args.http_url and {"openai", "openai-chat"} & set(args.backends):
        p.error("--backends openai / openai-chat with --address need --http-url")
    return args


def start_cluster(args: argparse.Namespace, stack: ExitStack) -> tuple[str, str]:
    """A local cluster like the in-process engine: same model, length and KV size.

    Returns its gRPC address and HTTP URL.
    """
    from kvmesh.cluster import ClusterConfig, LocalCluster

    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
    config = ClusterConfig(
        model=args.model, max_model_len=args.max_model_len, log_dir=log_dir,
        worker_args=["--device", args.device, "--kv-cache-gib", str(args.kv_cache_gib),
                     "--gpu-memory-utilization", str(args.gpu_memory_utilization)],
    )
    print(f"starting a local cluster (logs in {log_dir})...", flush=True)
    cluster = stack.enter_context(LocalCluster(config))
    return cluster.address, cluster.http_url


def make_inprocess_engine(args: argparse.Namespace, workload: list[BenchRequest]):
    from kvmesh.offline import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, max_model_len=args.max_model_len, device=args.device,
        kv_cache_gib=args.kv_cache_gib, gpu_memory_utilization=args.gpu_memory_utilization,
    ))
    run_inprocess(engine, workload[:1], 1, "warm-up")
    return engine


def run_backend(backend: str, repeat: int, args: argparse.Namespace,
                workload: list[BenchRequest], address: str, http_url: str, engine
                ) -> dict[str, float]:
    concurrency = args.max_concurrency
    salt = f"{backend}-{repeat}"
    if backend == "grpc":
        results, duration_s = asyncio.run(run_grpc(address, workload, concurrency, salt))
    elif backend == "in-process":
        results, duration_s = run_inprocess(engine, workload, concurrency, salt)
    else:
        chat = backend == "openai-chat"
        results, duration_s = asyncio.run(run_openai(http_url, workload, concurrency, chat,
                                                     salt))
    return summarize(results, duration_s, workload)


def main() -> None:
    args = parse_args()
    workload = make_workload(args)
    runs: dict[str, list[dict[str, float]]] = {backend: [] for backend in args.backends}
    with ExitStack() as stack:
        address, http_url = args.address, args.http_url
        if not address and set(args.backends) - {"in-process"}:
            address, http_url = start_cluster(args, stack)
        engine = (make_inprocess_engine(args, workload) if "in-process" in args.backends
                  else None)
        # Alternating runs see the same background load; noise only slows a
        # run down, so the best of each is compared (as timeit does).
        for repeat in range(args.repeats):
            for backend in args.backends:
                runs[backend].append(run_backend(backend, repeat, args, workload, address,
                                                 http_url, engine))
            print(f"repeat {repeat}: " + ", ".join(
                f"{name} {r[-1][THROUGHPUT]:.1f} tok/s" for name, r in runs.items()), flush=True)

    best = {name: max(r, key=lambda s: s[THROUGHPUT]) for name, r in runs.items()}
    print(f"\n{args.num_prompts} prompts, input {args.input_len}, output {args.output_len} "
          f"(range ratio {args.range_ratio}), rate {args.request_rate} req/s, "
          f"max concurrency {args.max_concurrency}, greedy, ignore_eos, on {args.device}; "
          f"best of {args.repeats} run(s)\n")
    print_table(best)
    first, *others = args.backends
    for name in others:
        ratio = best[name][THROUGHPUT] / best[first][THROUGHPUT]
        print(f"{name} / {first} output throughput: {ratio:.1%}")


if __name__ == "__main__":
    main()
