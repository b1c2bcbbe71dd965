"""The CPU worker against transformers and llama.cpp on SmolLM2-135M, in one run (issue 13).

Tables, every system measured in the same process and the same run:
  * generation tok/s: three single-stream prompts one after another, then 64 prompts
    at once; 128 output tokens each, greedy, EOS ignored. kvmesh float32 / bfloat16 /
    int8 (the engine loop: scheduler + worker in-process), transformers ``generate()``
    float32 / bfloat16 (batched, left-padded), llama.cpp (llama-cpp-python on the
    default model's own GGUF, Q4_1, 2 threads; single stream only), vLLM's CPU build
    bfloat16 / float32 (issue 24: its own venv ``.venv-vllm``, one process per dtype
    after the others, its repeats inside it; see ``benchmarks/peers/vllm_cpu.py``),
    all on the same token-id prompts; kvmesh's prefix caching is off, as vLLM's;
  * prefill tok/s of one 1,000-token prompt: kvmesh's step against transformers'
    forward pass at the same dtype, and llama.cpp's prompt evaluation;
  * per-layer decode attention at contexts 128 / 1,024 / 4,096 (batch 1 and 64):
    the CPU path (kvmesh's C++ kernel, reading K/V in place) against the reference
    (the path before issue 13: gather the history, attend in float32);
  * worker start-up (load, KV cache, warm-up) with compilation off, with empty
    caches (inductor's and the C++ kernels') and with warm ones, each in a fresh
    process.

    .venv/bin/python -m benchmarks.cpu_throughput --threads 2 --repeats 3

llama.cpp needs the optional ``bench`` extra (``make bench`` installs it), vLLM the
venv ``benchmarks/peers/setup_vllm_cpu.sh`` makes (``make bench`` runs it). The
machine is shared: in-process systems alternate within each repeat and medians
are quoted. The CPU's model name and its vector flags (from ``lscpu``) head the
output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.peers.vllm_cpu import SETUP_SCRIPT, VllmResult, run_vllm, vllm_python
from benchmarks.worker_throughput import greedy, hf_generate_tok_s, make_prompts, step
from kernels.paged_attention import paged_attention_ref
from kernels.paged_attention_cpu import paged_attention_cpu, plan_paged_attention_cpu
from kvmesh.offline import EngineCore
from services.common.limits import SchedulingLimits
from services.common.model_files import default_gguf_path, resolve_model_dir
from services.scheduler.config import SchedulingOptions
from services.worker.config import WorkerConfig
from services.worker.cpu_capability import detect_cpu_capability

KVMESH_VARIANTS = {"kvmesh float32": ("float32", None), "kvmesh bfloat16": ("bfloat16", None),
                   "kvmesh int8": ("bfloat16", "int8"), "kvmesh w8a8": ("bfloat16", "w8a8"),
                   "kvmesh w8a8 float32": ("float32", "w8a8"),
                   "kvmesh gguf Q4_1 float32": ("float32", "gguf")}
HF_VARIANTS = {"transformers float32": torch.float32, "transformers bfloat16": torch.bfloat16}
LLAMA_CPP = "llama.cpp Q4_1"
VLLM_VARIANTS = {"vLLM CPU bfloat16": "bfloat16", "vLLM CPU float32": "float32"}
PREFILL_LEN = 1000


# ------------------------------------------------------------------ generation
def make_kvmesh(dtype: str, quantization: str | None, max_num_seqs: int) -> EngineCore:
    """The offline engine as every table here measures it. Prefix caching is off, as
    the vLLM runner builds vLLM: the repeats send the same prompts again, and cache
    hits would spare kvmesh prefill work that its peers do."""
    limits = SchedulingLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    config = WorkerConfig(dtype=dtype, quantization=quantization, kv_cache_gib=1.0,
                          limits=limits, max_model_len=2048)
    options = SchedulingOptions(limits=limits, enable_prefix_caching=False)
    return EngineCore.create(config, options)


def kvmesh_tok_s(engine: EngineCore, prompts: list[list[int]], output_len: int, tag: str) -> float:
    for i, prompt in enumerate(prompts):
        engine.scheduler.add_request(greedy(f"{tag}{i}", prompt, output_len))
    start = time.perf_counter()
    while engine.scheduler.has_requests():
        step(engine.scheduler, engine.worker)
    return len(prompts) * output_len / (time.perf_counter() - start)


def llama_cpp_model(n_threads: int):
    """llama.cpp on the default GGUF. Where the CPU reports AMX, without its "extra
    buffer types" (weights repacked for AMX tiles): in this benchmark's VM (a Xeon
    with AMX, 2026-11-28) its AMX kernel died of SIGILL at its first tile load,
    although AMX itself ran there (a C test of tdpbf16ps, and oneDNN). Its AVX-512
    kernels serve instead; llama-cpp-python exposes the switch only in the model's
    default parameters."""
    import llama_cpp.llama_cpp as llama_cpp_c
    from llama_cpp import Llama

    default_params = llama_cpp_c.llama_model_default_params

    def params_without_extra_buffers():
        params = default_params()
        params.use_extra_bufts = False
        return params

    if detect_cpu_capability().amx:
        llama_cpp_c.llama_model_default_params = params_without_extra_buffers
    try:
        return Llama(model_path=str(default_gguf_path()), n_threads=n_threads,
                     n_threads_batch=n_threads, n_ctx=2048, n_batch=1024, n_ubatch=1024,
                     verbose=False)
    finally:
        llama_cpp_c.llama_model_default_params = default_params


def llama_cpp_tok_s(llm, prompt: list[int], output_len: int) -> float:
    """Greedy (top_k=1), EOS ignored: the generator runs until we stop it."""
    start = time.perf_counter()
    for n, _ in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                       reset=True), start=1):
        if n == output_len:
            break
    return output_len / (time.perf_counter() - start)


def single_stream(run_one: Callable[[list[int]], float], prompts: list[list[int]]) -> float:
    """Output tok/s over the prompts run one after another (total tokens / total time)."""
    seconds = [1.0 / run_one(p) for p in prompts]
    return len(prompts) / sum(seconds)


# --------------------------------------------------------------------- prefill
def kvmesh_prefill_tok_s(engine: EngineCore, prompt: list[int], tag: str) -> float:
    engine.scheduler.add_request(greedy(tag, prompt, 1))
    seconds, tokens = 0.0, 0
    while engine.scheduler.has_requests():
        elapsed, num_tokens = step(engine.scheduler, engine.worker)
        if num_tokens > 1:
            seconds, tokens = seconds + elapsed, tokens + num_tokens
    return tokens / seconds


def hf_prefill_tok_s(hf, prompt: list[int]) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        hf(torch.tensor([prompt]), use_cache=False)
        return len(prompt) / (time.perf_counter() - start)


def llama_cpp_prefill_tok_s(llm, prompt: list[int]) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


# ------------------------------------------------------------------------ vLLM
def run_vllm_peers(args, model_dir, prompts: list[list[int]]) -> dict[str, VllmResult]:
    """vLLM's CPU build per dtype on the same prompts, each in its own process after the
    in-process systems (its engine and OpenMP threads never beside theirs). Empty when
    skipped or ``.venv-vllm`` is missing; a dtype whose runner fails is reported and
    left out."""
    if args.skip_vllm:
        return {}
    if vllm_python() is None:
        print(f"vLLM peer skipped: no finished .venv-vllm; make it with {SETUP_SCRIPT}")
        return {}
    results = {}
    for name, dtype in VLLM_VARIANTS.items():
        try:
            results[name] = run_vllm(model_dir, dtype, prompts[: args.num_single], prompts,
                                     args.output_len, args.repeats, args.threads)
        except RuntimeError as err:
            print(f"{name} failed, left out: {err}")
            continue
        print(f"{name}: start-up {results[name].startup_s:.1f} s, single "
              f"{results[name].single_tok_s}, batched {results[name].batched_tok_s}", flush=True)
    return results


# ------------------------------------------------------------------- attention
@torch.inference_mode()  # as the worker runs it (grad mode is part of what torch.compile guards)
def attention_ms(batch: int, context: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Median ms of one layer's decode attention: (CPU path, reference)."""
    block_size, num_heads, num_kv_heads, head_size = 16, 9, 3, 64
    blocks_per_req = context // block_size
    num_blocks = batch * blocks_per_req + 1
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    block_table = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    block_table = block_table.view(batch, blocks_per_req)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_size, generator=gen).to(dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    args = (query, kv[0], kv[1], block_table, qsl, seq_lens, head_size ** -0.5, batch, batch, 1,
            context)
    plan = plan_paged_attention_cpu(block_table, qsl, seq_lens, batch, batch, block_size,
                                    num_kv_heads, head_size)
    times = []
    for fn in (lambda: paged_attention_cpu(*args, plan=plan), lambda: paged_attention_ref(*args)):
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples) * 1e3)
    return times[0], times[1]


# -------------------------------------------------------------------- start-up
_STARTUP = """
import sys, time, torch
start = time.perf_counter()
from services.worker.config import WorkerConfig
from services.worker.worker import Worker
torch.set_num_threads({threads})
w = Worker(WorkerConfig(dtype="bfloat16", compile_pieces={compile}, compile_cache_dir={cache!r},
                        kv_cache_gib=0.25, max_model_len=2048))
w.load_model(); w.initialize_kv_cache()
print(time.perf_counter() - start)
"""


def startup_s(threads: int, compile_pieces: bool, cache_dir: str) -> float:
    """Seconds to a warmed-up worker in a fresh process whose compile caches (inductor's,
    and the C++ kernels' build) live under ``cache_dir``."""
    code = _STARTUP.format(threads=threads, compile=compile_pieces, cache=cache_dir)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.path.join(cache_dir, "extensions")}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env=env)
    return float(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ main
def median_table(results: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in results.items() if values}


def run_generation(args, tokenizer, prompts: list[list[int]], model_dir) -> tuple[dict, dict, dict]:
    singles = prompts[: args.num_single]
    prefill_prompt = [2000 + i % 30000 for i in range(PREFILL_LEN)]
    engines = {name: make_kvmesh(dtype, quant, args.num_prompts)
               for name, (dtype, quant) in KVMESH_VARIANTS.items()}
    hfs = {name: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
           for name, dtype in HF_VARIANTS.items()}
    single: dict[str, list[float]] = {n: [] for n in [*engines, *hfs, LLAMA_CPP]}
    batched: dict[str, list[float]] = {n: [] for n in [*engines, *hfs]}
    prefill: dict[str, list[float]] = {n: [] for n in [*engines, *hfs, LLAMA_CPP]}
    for r in range(args.repeats):
        for name, engine in engines.items():
            single[name].append(single_stream(
                lambda p: kvmesh_tok_s(engine, [p], args.output_len, f"s{r}-"), singles))
            batched[name].append(kvmesh_tok_s(engine, prompts, args.output_len, f"b{r}-"))
            prefill[name].append(kvmesh_prefill_tok_s(engine, [r + 1] + prefill_prompt[1:], f"p{r}"))
        for name, hf in hfs.items():
            single[name].append(single_stream(
                lambda p: hf_generate_tok_s(hf, tokenizer, [p], args.output_len), singles))
            batched[name].append(hf_generate_tok_s(hf, tokenizer, prompts, args.output_len))
            prefill[name].append(hf_prefill_tok_s(hf, prefill_prompt))
        if not args.skip_llama_cpp:
            # Loaded only for its own turn: a live llama.cpp context starved torch's
            # threads measured beside it (single-stream kvmesh at a tenth of its speed).
            llm = llama_cpp_model(args.threads)
            single[LLAMA_CPP].append(single_stream(
                lambda p: llama_cpp_tok_s(llm, p, args.output_len), singles))
            prefill[LLAMA_CPP].append(llama_cpp_prefill_tok_s(llm, prefill_prompt))
            llm.close()
            del llm
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{name} {single[name][-1]:.1f} / {batched[name][-1] if name in batched else 0:.1f}"
            f" / {prefill[name][-1]:.0f}" for name in single if single[name]), flush=True)
    return median_table(single), median_table(batched), median_table(prefill)


def print_generation(single: dict, batched: dict, prefill: dict, args) -> None:
    print(f"\ngeneration: {args.output_len} output tokens, greedy, EOS ignored; "
          f"median of {args.repeats}")
    print(f"| system | single stream tok/s | {args.num_prompts} prompts tok/s | "
          f"prefill tok/s ({PREFILL_LEN} tokens) |")
    print("|---|---:|---:|---:|")
    for name in single:
        many = f"{batched[name]:.1f}" if name in batched else "—"
        first = f"{prefill[name]:.0f}" if name in prefill else "—"
        print(f"| {name} | {single[name]:.1f} | {many} | {first} |")
    hf32, hf16 = batched["transformers float32"], batched["transformers bfloat16"]
    print("\nratios (goals: int8 single >= 1.0x llama.cpp; bf16 single >= 0.6x llama.cpp; "
          "64 streams >= 2x transformers same dtype and >= 3x transformers float32)")
    same = {name: hf32 if dtype == "float32" else hf16
            for name, (dtype, _) in KVMESH_VARIANTS.items()}
    for name in KVMESH_VARIANTS:
        line = f"  {name}: 64 streams {batched[name] / same[name]:.2f}x transformers same dtype, " \
               f"{batched[name] / hf32:.2f}x transformers float32"
        if LLAMA_CPP in single:
            line += f"; single stream {single[name] / single[LLAMA_CPP]:.2f}x llama.cpp"
        print(line)


def print_vllm_ratios(single: dict, batched: dict) -> None:
    """kvmesh over vLLM at 1 stream (bfloat16 against bfloat16) and at 64 streams (each
    at its best dtype), beside the issue's goals; silent without vLLM rows."""
    vllm = [name for name in VLLM_VARIANTS if name in batched]
    if not vllm:
        return
    print("\nratios kvmesh / vLLM CPU (goals: single stream bfloat16 >= 1.5x vLLM bfloat16; "
          "64 streams >= 1.3x, each at its best dtype)")
    if "vLLM CPU bfloat16" in single:
        print(f"  single stream, bfloat16: "
              f"{single['kvmesh bfloat16'] / single['vLLM CPU bfloat16']:.2f}x")
    ours = max(KVMESH_VARIANTS, key=lambda name: batched[name])
    theirs = max(vllm, key=lambda name: batched[name])
    print(f"  64 streams, best against best ({ours} / {theirs}): "
          f"{batched[ours] / batched[theirs]:.2f}x")
    for name in KVMESH_VARIANTS:
        print(f"  {name}: single stream " + ", ".join(
            f"{single[name] / single[peer]:.2f}x" for peer in vllm) + "; 64 streams " + ", ".join(
            f"{batched[name] / batched[peer]:.2f}x" for peer in vllm) + f" ({' / '.join(vllm)})")


def print_vllm_startup(results: dict[str, VllmResult]) -> None:
    if not results:
        return
    print("\nvLLM CPU start-up (fresh process: import, load, KV cache, compilation, warm-up; "
          "vLLM's compile cache as this machine left it)")
    print("| dtype | seconds |\n|---|---:|")
    for name, result in results.items():
        print(f"| {name} | {result.startup_s:.1f} |")


def print_attention(args) -> None:
    print(f"\nper-layer decode attention, 9 query / 3 KV heads of 64, bfloat16 cache; "
          f"median ms of {args.attention_repeats}")
    print("| batch | context | CPU path ms | reference ms | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for batch in (1, 64):
        for context in (128, 1024, 4096):
            ours, ref = attention_ms(batch, context, torch.bfloat16, args.attention_repeats)
            print(f"| {batch} | {context} | {ours:.3f} | {ref:.3f} | {ref / ours:.1f}x |")


def print_startup(args) -> None:
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = startup_s(args.threads, True, cache_dir)
        warm = startup_s(args.threads, True, cache_dir)
        eager = startup_s(args.threads, False, cache_dir)
    print("\nworker start-up (fresh process: load, KV cache, warm-up), bfloat16")
    print("| compilation | seconds |\n|---|---:|")
    print(f"| on, empty caches (C++ kernels built, graphs compiled) | {cold:.1f} |\n"
          f"| on, warm caches | {warm:.1f} |\n| off (C++ kernels already built) | {eager:.1f} |")


def cpu_description() -> str:
    """``lscpu``'s model name and the flags that pick kernels: AVX2, AVX-512, AMX,
    VNNI, bfloat16."""
    fields = dict(line.split(":", 1) for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines() if ":" in line)
    flags = [flag for flag in fields.get("Flags", "").split()
             if flag == "avx2" or flag.startswith(("avx512", "amx")) or "vnni" in flag
             or "bf16" in flag]
    return f"CPU: {fields.get('Model name', '?').strip()}; flags: {' '.join(flags) or 'none'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-single", type=int, default=3, help="single-stream prompts")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-repeats", type=int, default=20)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true",
                        help="leave out vLLM's CPU build (in .venv-vllm)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    print(f"SmolLM2-135M-Instruct, CPU {torch.backends.cpu.get_cpu_capability()}, "
          f"torch {torch.__version__}, {args.threads} threads")
    print(cpu_description())
    if not args.skip_generation:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(tokenizer, args.num_prompts)
        single, batched, prefill = run_generation(args, tokenizer, prompts, model_dir)
        vllm = run_vllm_peers(args, model_dir, prompts)
        for name, result in vllm.items():
            single[name] = statistics.median(result.single_tok_s)
            batched[name] = statistics.median(result.batched_tok_s)
        print_generation(single, batched, prefill, args)
        print_vllm_ratios(single, batched)
        print_vllm_startup(vllm)
    print_attention(args)
    if not args.skip_startup:
        print_startup(args)


if __name__ == "__main__":
    main()
