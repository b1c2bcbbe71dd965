"""`EngineArgs`: every setting of an in-process engine, as flat keyword arguments.

As vLLM's EngineArgs, this is the argument surface (``LLM(max_num_seqs=8)``);
it builds the configs each service defines (``SchedulingLimits``,
``SchedulingOptions``, ``WorkerConfig``) and holds no rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.limits import SchedulingLimits
from services.common.speculative import SpeculativeConfig
from services.common.validation import DEFAULT_MAX_LOGPROBS
from services.scheduler.config import SchedulingOptions
from services.worker.config import LatencyModel, WorkerConfig

_DEFAULT_LIMITS = SchedulingLimits()


@dataclass(slots=True, kw_only=True)
class EngineArgs:
    """Everything needed to start an in-process engine; defaults suit the CPU.

    ``model`` None is the default model (SmolLM2-135M-Instruct); ``device``
    None picks CUDA when available. ``num_kv_blocks`` overrides the KV cache
    sizing by memory (``kv_cache_gib`` on CPU, ``gpu_memory_utilization`` on CUDA).
    ``dtype``, ``kv_cache_dtype``, ``quantization`` and ``compile_pieces`` are
    WorkerConfig's (auto is bfloat16 on a CPU with native bfloat16).
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    compile_pieces: bool | None = None
    device: str | None = None
    block_size: int = 16
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = _DEFAULT_LIMITS.max_num_seqs
    max_num_batched_tokens: int = _DEFAULT_LIMITS.max_num_batched_tokens
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    scheduling_policy: str = "fcfs"
    logits_processors: list[str] = field(default_factory=list)
    stream_interval: int = 1
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    cudagraph_mode: str | None = None
    # Speculative decoding (vLLM's speculative_config): a SpeculativeConfig or its
    # fields as a dict, e.g. {"method": "ngram", "num_speculative_tokens": 5}.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # True, or the LatencyModel to wait: the simulated worker (no model).
    simulate: bool | LatencyModel = False

    def scheduling_limits(self) -> SchedulingLimits:
        return SchedulingLimits(max_num_seqs=self.max_num_seqs,
                                max_num_batched_tokens=self.max_num_batched_tokens)

    def scheduling_options(self) -> SchedulingOptions:
        return SchedulingOptions(
            limits=self.scheduling_limits(),
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
            enable_prefix_caching=self.enable_prefix_caching,
            async_scheduling=self.async_scheduling,
        )

    def worker_config(self) -> WorkerConfig:
        use_cuda = torch.cuda.is_available() and not self.simulate
        device = self.device or ("cuda" if use_cuda else "cpu")
        return WorkerConfig(
            model=self.model, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization, compile_pieces=self.compile_pieces,
            device=device, block_size=self.block_size,
            kv_cache_gib=self.kv_cache_gib, gpu_memory_utilization=self.gpu_memory_utilization,
            num_kv_blocks=self.num_kv_blocks, limits=self.scheduling_limits(),
            max_model_len=self.max_model_len, logits_processors=list(self.logits_processors),
            cudagraph_mode=self.cudagraph_mode,
            simulate=LatencyModel() if self.simulate is True else self.simulate or None,
            speculative_config=self.resolved_speculative_config(),
        )

    def resolved_speculative_config(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        return SpeculativeConfig.from_dict(spec) if isinstance(spec, dict) else spec
