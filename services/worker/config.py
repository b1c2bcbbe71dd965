"""The worker's configs: the checkpoint (`ModelConfig`), the worker (`WorkerConfig`)
and its service (`WorkerServiceConfig`).

`ModelConfig` is read from a Hugging Face directory's ``config.json`` (plus
``generation_config.json`` for the end-of-sequence ids). Both RoPE spellings are
understood: the transformers 5 ``rope_parameters`` dict and the older top-level
``rope_theta`` with an optional ``rope_scaling`` dict.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from services.common.limits import SchedulingLimits
from services.common.max_model_len import get_sliding_window, max_model_len_limit
from services.common.scheduler_addresses import parse_scheduler_addresses
from services.common.security import TlsConfig
from services.common.speculative import SpeculativeConfig
from services.worker.cudagraph import CUDAGraphMode, default_capture_sizes
from services.worker.cpu_capability import CpuCapability, detect_cpu_capability
from services.worker.cudagraph.dispatcher import DEFAULT_MAX_CAPTURE_SIZE
from services.worker.sample import ThinkingConfig

_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
})
# Values of WorkerConfig.quantization.
QUANTIZATION_METHODS = (None, "int8", "w8a8", "gguf")
# Keys of a RoPE dict that are not scaling parameters.
_ROPE_NON_SCALING_KEYS = ("rope_theta", "rope_type", "type")
_DEFAULT_ROPE_THETA = 10000.0
# For configs without "architectures" (a GGUF converted by transformers has none).
_ARCHITECTURE_BY_MODEL_TYPE = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
})


def parse_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None = None,
                device: torch.device | str = "cpu", cpu: CpuCapability | None = None) -> torch.dtype:
    """Maps a dtype argument to a torch dtype.

    ``"auto"`` on CUDA is the checkpoint's dtype (``checkpoint_dtype``, as
    written in config.json), or float32 when the checkpoint does not say. On
    the CPU it is bfloat16 where ``cpu`` (default: the running CPU) computes
    bfloat16 natively, float32 otherwise, whatever the checkpoint says:
    emulated half precision is slower than float32 there.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; allowed: float32, bfloat16, float16")
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        if torch.device(device).type == "cpu":
            native_bf16 = (cpu or detect_cpu_capability()).native_bfloat16
            return torch.bfloat16 if native_bf16 else torch.float32
        return parse_dtype(checkpoint_dtype) if checkpoint_dtype else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def parse_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``"auto"`` is the model's dtype; otherwise float32, bfloat16 or float16."""
    if kv_cache_dtype.lower() == "auto":
        return model_dtype
    try:
        return parse_dtype(kv_cache_dtype)
    except ValueError:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; allowed: auto, "
                         f"{', '.join(_DTYPES)}") from None


@dataclass(slots=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder.

    ``rope_scaling`` is None for plain RoPE, else a dict holding ``rope_type``
    and that type's parameters. ``sliding_window`` is the window written in the
    checkpoint when the architecture actually uses it; attention here is always
    full, which equals windowed attention while sequences fit the window, so
    ``max_model_len`` is capped at it.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    dtype: torch.dtype
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def max_model_len(self) -> int:
        """The checkpoint's own limit (see services.common.max_model_len)."""
        return max_model_len_limit(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype = "auto",
                        device: torch.device | str = "cpu",
                        cpu: CpuCapability | None = None) -> ModelConfig:
        """Reads ``model_dir/config.json`` (and ``generation_config.json`` if present);
        ``dtype`` is resolved for ``device`` as ``parse_dtype`` says."""
        model_dir = Path(model_dir)
        hf = json.loads((model_dir / "config.json").read_text())
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
        return cls.from_hf_dict(hf, generation, dtype, device, cpu)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None,
                     dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu",
                     cpu: CpuCapability | None = None) -> ModelConfig:
        """Builds a config from parsed config.json / generation_config.json dicts."""
        architecture = _architecture(hf)
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(hf)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_size=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf["max_position_embeddings"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=_eos_token_ids(hf, generation or {}),
            dtype=parse_dtype(dtype, hf.get("dtype") or hf.get("torch_dtype"), device, cpu),
            hidden_act=hf.get("hidden_act", "silu"),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's
            # attention_bias covers all four projections.
            qkv_bias=is_qwen2 or hf.get("attention_bias", False),
            o_proj_bias=not is_qwen2 and hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            sliding_window=get_sliding_window(hf),
        )


def _architecture(hf: dict[str, Any]) -> str:
    """``architectures[0]``, else the architecture implied by ``model_type``."""
    if hf.get("architectures"):
        return hf["architectures"][0]
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURE_BY_MODEL_TYPE:
        raise ValueError(f"config.json has no 'architectures' and model_type {model_type!r} is not "
                         f"one of {', '.join(_ARCHITECTURE_BY_MODEL_TYPE)}")
    return _ARCHITECTURE_BY_MODEL_TYPE[model_type]


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config spelling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    scaling = {k: v for k, v in params.items() if k not in _ROPE_NON_SCALING_KEYS}
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        # transformers falls back the same way when the key is missing.
        scaling.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return float(theta), scaling


def _eos_token_ids(hf: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    """Union of both files' eos_token_id (int or list), config.json's first."""
    ids: list[int] = []
    for source in (hf, generation):
        value = source.get("eos_token_id")
        for token_id in [value] if isinstance(value, int) else (value or []):
            if token_id not in ids:
                ids.append(token_id)
    return ids


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """How long one step of the simulated worker (``--simulate``) takes.

    ``base_ms`` plus ``us_per_token`` per scheduled token plus
    ``us_per_context_token`` per token attention reads. The defaults are the
    real worker's decode steps on an H200 (SmolLM2-135M bfloat16,
    FULL_AND_PIECEWISE graphs; ``benchmarks/control_plane.py --tables f``,
    2026-11-28), fitted within 14% from batch 1 to 256 and context 53 to
    267k tokens. The step is bound by fixed costs around the graph replay,
    hence the large base. Prefill steps longer than the largest captured
    graph run eagerly and take 2-3x what this model says. The H100 roofline
    (0.080 ms of weight reads, 0.27 us a token, 0.0069 us a context token)
    was the default before; it was 3 to 35 times faster than the real worker.
    Benchmarks of the control plane set ``base_ms`` (1, 2 or 5 ms steps).
    """

    base_ms: float = 3.2
    us_per_token: float = 1.8
    us_per_context_token: float = 0.012

    def __post_init__(self) -> None:
        for name in ("base_ms", "us_per_token", "us_per_context_token"):
            value = getattr(self, name)
            if not 0.0 <= value <= 60_000.0:
                raise ValueError(f"{name} is {value}, allowed range is [0, 60000]")

    def step_seconds(self, num_scheduled_tokens: int, num_context_tokens: int) -> float:
        return (self.base_ms * 1e-3 + self.us_per_token * 1e-6 * num_scheduled_tokens
                + self.us_per_context_token * 1e-6 * num_context_tokens)


@dataclass(slots=True, kw_only=True)
class WorkerConfig:
    """How a worker loads its model and sizes its batch and KV cache.

    ``model`` None is the default model (SmolLM2-135M-Instruct). ``dtype``:
    "auto" (see ``parse_dtype``: bfloat16 on a CPU that computes it natively,
    else float32; the checkpoint's on CUDA), "float32", "bfloat16", "float16".
    ``limits`` size the batch buffers; the worker reports them when it
    registers, and no step ever exceeds them.
    ``max_model_len`` None is min(the model's limit, 2048). ``num_kv_blocks``
    overrides the memory-based KV sizing (tests use tiny pools).
    ``logits_processors`` are plugin names or ``module:Class`` paths;
    ``thinking`` names the think start/end tokens for ``thinking_token_budget``.
    ``num_threads`` sets torch's intra-op threads (None: torch's default, one
    per physical core).
    ``kv_cache_dtype``: "auto" (the model's dtype), "float32", "bfloat16",
    "float16". ``quantization``: None, or "int8" for weight-only int8 with
    per-output-channel scales on every linear layer and the LM head
    (activations stay in ``dtype``; CPU only), "w8a8" for the same weights
    with decode activations quantized to int8 per token (faster, coarser;
    CPU only), or "gguf" for a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks as
    stored (CPU only).
    ``compile_pieces``: compile the forward pass between attention calls with
    ``torch.compile`` (inductor), the CPU counterpart of piecewise CUDA
    graphs; on CUDA the graphs then capture the compiled (fused) kernels.
    None is on for the CPU and off for CUDA (not yet measured there).
    Compiled artefacts are cached in ``compile_cache_dir`` (None: ``<kvmesh
    cache>/inductor``) so a restart does not compile again.
    ``simulate``: no model weights and no KV memory; each step waits as
    ``LatencyModel`` says and samples deterministic tokens (``simulated.py``).
    ``cudagraph_mode``: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or
    FULL_AND_PIECEWISE; None is FULL_AND_PIECEWISE on CUDA and NONE on the CPU
    (where any other mode is an error). Graphs are captured for
    ``cudagraph_capture_sizes`` token counts, by default 1, 2, 4, 8, then steps
    of 8 (16 past 256) up to ``max_cudagraph_capture_size`` (default
    min(512, 2 * max_num_seqs, max_num_batched_tokens)).
    ``speculative_config``: draft and verify tokens (speculative decoding;
    None: off); the worker registers its draft budget with the scheduler.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    limits: SchedulingLimits = field(default_factory=SchedulingLimits)
    max_model_len: int | None = None
    logits_processors: list[str] = field(default_factory=list)
    thinking: ThinkingConfig | None = None
    num_threads: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    compile_pieces: bool | None = None
    compile_cache_dir: str | None = None
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    simulate: LatencyModel | None = None
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.simulate is not None and torch.device(self.device).type != "cpu":
            raise ValueError(f"simulate runs on the CPU (its model is a modelled wait), "
                             f"not on {self.device!r}")
        if self.simulate is not None and self.speculative_config is not None:
            raise ValueError("speculative_config needs the model: the simulated worker "
                             "samples no distribution to verify drafts against")
        if self.block_size < 1:
            raise ValueError(f"block_size is {self.block_size}, must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads is {self.num_threads}, must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len is {self.max_model_len}, must be >= 2")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization is {self.quantization!r}; allowed: None, "
                             f"{', '.join(m for m in QUANTIZATION_METHODS if m)}")
        if self.quantization is not None and torch.device(self.device).type != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU only, "
                             f"not on {self.device!r}")
        parse_kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # raises naming the field
        mode = self.resolved_cudagraph_mode()
        if mode is not CUDAGraphMode.NONE and torch.device(self.device).type != "cuda":
            raise ValueError(f"cudagraph_mode {mode.name} needs a CUDA device, not "
                             f"{self.device!r}; allowed on the CPU: NONE")
        sizes = list(self.cudagraph_capture_sizes or [])
        if self.max_cudagraph_capture_size is not None:
            sizes.append(self.max_cudagraph_capture_size)
        max_num_batched_tokens = self.limits.max_num_batched_tokens
        bad = [s for s in sizes if not 1 <= s <= max_num_batched_tokens]
        if bad:
            raise ValueError(f"CUDA graph capture sizes {bad} are out of range; allowed range is "
                             f"[1, {max_num_batched_tokens}] (max_num_batched_tokens)")

    def resolved_cudagraph_mode(self) -> CUDAGraphMode:
        """The mode asked for, or the device's default when none was."""
        if self.cudagraph_mode is not None:
            return CUDAGraphMode.parse(self.cudagraph_mode)
        is_cuda = torch.device(self.device).type == "cuda"
        return CUDAGraphMode.FULL_AND_PIECEWISE if is_cuda else CUDAGraphMode.NONE

    def resolved_compile_pieces(self) -> bool:
        """Whether the pieces between attention run compiled (see the class docstring)."""
        if self.compile_pieces is not None:
            return self.compile_pieces
        return torch.device(self.device).type == "cpu"

    def resolved_capture_sizes(self) -> list[int]:
        """The token counts to capture graphs for (see the class docstring)."""
        if self.cudagraph_capture_sizes is not None:
            return sorted(set(self.cudagraph_capture_sizes))
        largest = self.max_cudagraph_capture_size or min(
            DEFAULT_MAX_CAPTURE_SIZE, 2 * self.limits.max_num_seqs,
            self.limits.max_num_batched_tokens)
        return default_capture_sizes(largest)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True, kw_only=True)
class WorkerServiceConfig:
    """Where the scheduler is, who this worker is, and how it runs its model.

    ``health_port`` None serves no health endpoint; 0 picks a free port
    (``WorkerService.health_port`` tells which). ``metrics_port`` serves
    Prometheus ``/metrics`` on ``health_host`` the same way (None: off).
    ``connect_timeout_s`` None waits for the scheduler forever. ``tls``
    (client certificate and CA) and ``cluster_secret`` authenticate the
    worker to the scheduler.

    ``scheduler_address`` is ``HOST:PORT[,HOST:PORT...]``, or a DNS name that
    resolves to one address per scheduler: one cell each. With one scheduler
    the worker only ever dials that one. With several it joins the live cell
    with the fewest workers; a worker that lost its scheduler dials it again
    for ``rejoin_grace_s``, then chooses again; every ``rebalance_interval_s``
    (jittered by +-50%, 0: never) an idle worker of a cell with 2 or more
    workers than the smallest moves there.
    """

    scheduler_address: str = "127.0.0.1:50052"
    worker_id: str = field(default_factory=default_worker_id)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    health_host: str = "127.0.0.1"
    health_port: int | None = None
    metrics_port: int | None = None
    connect_timeout_s: float | None = None
    tls: TlsConfig | None = None
    cluster_secret: str | None = None
    rejoin_grace_s: float = 5.0
    rebalance_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id is empty, must be a non-empty string")
        try:
            parse_scheduler_addresses(self.scheduler_address)
        except ValueError as e:
            raise ValueError(f"scheduler_address: {e}") from e
        for name in ("rejoin_grace_s", "rebalance_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} is {getattr(self, name)}, must be >= 0")
        for name in ("health_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} is {value}, must be in [0, 65535]")
