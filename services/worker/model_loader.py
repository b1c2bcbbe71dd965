"""Load a model and its config from a Hugging Face directory (or the default GGUF)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.common.model_files import resolve_gguf_path, resolve_model_dir
from services.worker.config import QUANTIZATION_METHODS, ModelConfig
from services.worker.cpu_capability import CpuCapability
from services.worker.gguf_weights import read_quantized_linears
from services.worker.layers.quantization import use_dynamic_activations_
from services.worker.models import get_model

_INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those named by the shard index, else every
    ``*.safetensors`` in the directory."""
    index = model_dir / _INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one file at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model: str | Path | None = None, dtype: str | torch.dtype = "auto",
               device: torch.device | str = "cpu", quantization: str | None = None,
               cpu: CpuCapability | None = None) -> tuple[nn.Module, ModelConfig]:
    """Builds the model for ``model`` (see ``resolve_model_dir``; None = SmolLM2)
    on ``device`` with weights cast to ``dtype`` (resolved for ``device`` and
    ``cpu`` as ``parse_dtype`` says), in eval mode without gradients.

    ``quantization="int8"``: the weights are loaded in float32, every linear
    layer and the LM head quantized to weight-only int8, the rest cast to ``dtype``.
    ``quantization="w8a8"``: the same, and their activations are quantized to
    int8 per token at decode (``Int8Linear.use_dynamic_activations``).
    ``quantization="gguf"``: ``model`` is a GGUF file (None: the default one);
    every linear layer and the LM head stored there in Q4_0, Q4_1 or Q8_0 serve
    those blocks as they are (``GGUFLinear``), the rest is loaded in ``dtype``.
    """
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {quantization!r} is not supported; allowed: "
                         f"{', '.join(str(m) for m in QUANTIZATION_METHODS)}")
    gguf_path = resolve_gguf_path(model) if quantization == "gguf" else None
    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_pretrained(model_dir, dtype, device, cpu)
    int8 = quantization in ("int8", "w8a8")
    net = get_model(config, dtype=torch.float32 if int8 else None, device=device)
    net.load_weights(iter_safetensors_weights(model_dir))
    if int8:
        net.quantize_int8_(config.dtype)
        if quantization == "w8a8":
            use_dynamic_activations_(net)
    elif gguf_path is not None:
        net.use_gguf_weights_(read_quantized_linears(
            gguf_path, config.num_layers, config.num_heads, config.num_kv_heads))
    net.requires_grad_(False).eval()
    return net, config
