"""A worker: loads the model, sizes and allocates the KV cache, executes steps.

The gRPC service wraps this class; tests and benchmarks drive it in-process.
Lifecycle: ``load_model()`` -> ``initialize_kv_cache()`` (returns the number of
KV blocks, null block included, that the scheduler's pool must use) ->
``execute_model(scheduler_output)`` once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from services.common.model_files import DEFAULT_MODEL_NAME, resolve_model_dir
from services.common.outputs import ModelRunnerOutput
from services.common.registration import WorkerRegistration
from services.common.scheduler_output import SchedulerOutput
from services.worker.config import ModelConfig
from services.worker.cudagraph import CUDAGraphMode, default_capture_sizes
from services.worker.cudagraph.dispatcher import DEFAULT_MAX_CAPTURE_SIZE
from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches, determine_num_blocks
from services.worker.model_loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.sample import ThinkingConfig

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(slots=True, kw_only=True)
class WorkerConfig:
    """How a worker loads its model and sizes its batch and KV cache.

    ``model`` None is the default model (SmolLM2-135M-Instruct). ``dtype``:
    "auto" (the checkpoint's), "float32", "bfloat16", "float16".
    ``max_model_len`` None is min(the model's limit, 2048). ``num_kv_blocks``
    overrides the memory-based KV sizing (tests use tiny pools).
    ``logits_processors`` are plugin names or ``module:Class`` paths;
    ``thinking`` names the think start/end tokens for ``thinking_token_budget``.
    ``num_threads`` sets torch's intra-op threads (None: torch's default, one
    per physical core).
    ``cudagraph_mode``: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or
    FULL_AND_PIECEWISE; None is FULL_AND_PIECEWISE on CUDA and NONE on the CPU
    (where any other mode is an error). Graphs are captured for
    ``cudagraph_capture_sizes`` token counts, by default 1, 2, 4, 8, then steps
    of 8 (16 past 256) up to ``max_cudagraph_capture_size`` (default
    min(512, 2 * max_num_seqs, max_num_batched_tokens)).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    logits_processors: list[str] = field(default_factory=list)
    thinking: ThinkingConfig | None = None
    num_threads: int | None = None
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} is {value}, must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads is {self.num_threads}, must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len is {self.max_model_len}, must be >= 2")
        mode = self.resolved_cudagraph_mode()
        if mode is not CUDAGraphMode.NONE and torch.device(self.device).type != "cuda":
            raise ValueError(f"cudagraph_mode {mode.name} needs a CUDA device, not "
                             f"{self.device!r}; allowed on the CPU: NONE")
        sizes = list(self.cudagraph_capture_sizes or [])
        if self.max_cudagraph_capture_size is not None:
            sizes.append(self.max_cudagraph_capture_size)
        bad = [s for s in sizes if not 1 <= s <= self.max_num_batched_tokens]
        if bad:
            raise ValueError(f"CUDA graph capture sizes {bad} are out of range; allowed range is "
                             f"[1, {self.max_num_batched_tokens}] (max_num_batched_tokens)")

    def resolved_cudagraph_mode(self) -> CUDAGraphMode:
        """The mode asked for, or the device's default when none was."""
        if self.cudagraph_mode is not None:
            return CUDAGraphMode.parse(self.cudagraph_mode)
        is_cuda = torch.device(self.device).type == "cuda"
        return CUDAGraphMode.FULL_AND_PIECEWISE if is_cuda else CUDAGraphMode.NONE

    def resolved_capture_sizes(self) -> list[int]:
        """The token counts to capture graphs for (see the class docstring)."""
        if self.cudagraph_capture_sizes is not None:
            return sorted(set(self.cudagraph_capture_sizes))
        largest = self.max_cudagraph_capture_size or min(
            DEFAULT_MAX_CAPTURE_SIZE, 2 * self.max_num_seqs, self.max_num_batched_tokens)
        return default_capture_sizes(largest)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model: nn.Module | None = None
        self.model_config: ModelConfig | None = None
        self.model_name = ""
        self.max_model_len = 0
        self.num_blocks = 0
        self.model_runner: ModelRunner | None = None

    def load_model(self) -> None:
        """Loads the weights onto the device and fixes ``max_model_len``."""
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        model_dir = resolve_model_dir(self.config.model)
        self.model_name = self.config.model or DEFAULT_MODEL_NAME
        self.model, self.model_config = load_model(model_dir, self.config.dtype, self.device)
        limit = self.model_config.max_model_len
        requested = self.config.max_model_len
        if requested is None:
            self.max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        elif requested > limit:
            raise ValueError(f"max_model_len is {requested}; allowed range is [2, {limit}] for this model")
        else:
            self.max_model_len = requested

    def initialize_kv_cache(self) -> int:
        """Allocates the KV cache and the model runner; returns the number of blocks."""
        if self.model is None or self.model_config is None:
            raise RuntimeError("initialize_kv_cache() needs load_model() first")
        mc = self.model_config
        spec = KVCacheSpec(
            block_size=self.config.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_size=mc.head_size,
            dtype=mc.dtype,
            num_layers=mc.num_layers,
        )
        num_blocks = self.config.num_kv_blocks or determine_num_blocks(
            spec, self.device, self.config.gpu_memory_utilization, self.config.kv_cache_gib
        )
        kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self.num_blocks = num_blocks
        self.model_runner = ModelRunner(
            self.model,
            mc,
            kv_caches,
            block_size=self.config.block_size,
            max_num_reqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            device=self.device,
            logitsprocs=self.config.logits_processors,
            thinking=self.config.thinking,
            cudagraph_mode=self.config.resolved_cudagraph_mode(),
            cudagraph_capture_sizes=self.config.resolved_capture_sizes(),
        )
        self.model_runner.capture_model()
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.model_runner is None:
            raise RuntimeError("execute_model() needs initialize_kv_cache() first")
        return self.model_runner.execute_model(scheduler_output)

    def registration_info(self, worker_id: str = "") -> WorkerRegistration:
        """What this worker registers with the scheduler as ``worker_id``."""
        if self.model_config is None or self.model_runner is None:
            raise RuntimeError("registration_info() needs load_model() and initialize_kv_cache()")
        return WorkerRegistration(
            worker_id=worker_id,
            model=self.model_name,
            dtype=str(self.model_config.dtype).removeprefix("torch."),
            block_size=self.config.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )
