"""`ModelConfig`: what the worker needs to know about a checkpoint.

Read from a Hugging Face directory's ``config.json`` (plus ``generation_config.json``
for the end-of-sequence ids). Both RoPE spellings are understood: the
transformers 5 ``rope_parameters`` dict and the older top-level ``rope_theta`` with
an optional ``rope_scaling`` dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
})
# Keys of a RoPE dict that are not scaling parameters.
_ROPE_NON_SCALING_KEYS = ("rope_theta", "rope_type", "type")
_DEFAULT_ROPE_THETA = 10000.0
# For configs without "architectures" (a GGUF converted by transformers has none).
_ARCHITECTURE_BY_MODEL_TYPE = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
})


def parse_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None = None) -> torch.dtype:
    """Maps a dtype argument to a torch dtype.

    ``"auto"`` is the checkpoint's dtype (``checkpoint_dtype``, as written in
    config.json), or float32 when the checkpoint does not say.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; allowed: float32, bfloat16, float16")
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        return parse_dtype(checkpoint_dtype) if checkpoint_dtype else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


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
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype = "auto") -> ModelConfig:
        """Reads ``model_dir/config.json`` (and ``generation_config.json`` if present)."""
        model_dir = Path(model_dir)
        hf = json.loads((model_dir / "config.json").read_text())
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
        return cls.from_hf_dict(hf, generation, dtype)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None,
                     dtype: str | torch.dtype = "auto") -> ModelConfig:
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
            dtype=parse_dtype(dtype, hf.get("dtype") or hf.get("torch_dtype")),
            hidden_act=hf.get("hidden_act", "silu"),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's
            # attention_bias covers all four projections.
            qkv_bias=is_qwen2 or hf.get("attention_bias", False),
            o_proj_bias=not is_qwen2 and hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            sliding_window=_sliding_window(hf, is_qwen2),
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


def _sliding_window(hf: dict[str, Any], is_qwen2: bool) -> int | None:
    # Qwen2 checkpoints carry a sliding_window value that only applies with
    # use_sliding_window; Mistral applies it whenever it is set.
    if is_qwen2 and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window")
