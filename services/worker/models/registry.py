"""Architecture name (config.json ``architectures[0]``) -> model class."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import torch
from torch import nn

from services.worker.config import ModelConfig
from services.worker.models.llama import LlamaForCausalLM

# Mistral and Qwen2 differ from Llama only by what ModelConfig captures
# (sliding window, q/k/v biases), so one implementation serves all three.
MODEL_REGISTRY: MappingProxyType[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
})


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``; ValueError naming it otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(MODEL_REGISTRY)}") from None


def get_model(model_config: ModelConfig, dtype: torch.dtype | None = None,
              device: torch.device | str = "cpu") -> nn.Module:
    """An instance for ``model_config`` on ``device``, weights not yet loaded.

    ``dtype`` overrides ``model_config.dtype`` when given.
    """
    if dtype is not None and dtype != model_config.dtype:
        model_config = dataclasses.replace(model_config, dtype=dtype)
    return get_model_class(model_config.architecture)(model_config, device)
