"""A tiny random-weight Llama saved as a Hugging Face directory, for fast service tests.

It carries SmolLM2's tokenizer (copied from the default model directory) so
text, chat templates and stop strings go through the real code paths; what
the model says is meaningless, so tests compare runs with each other (the
oracle tests against transformers use SmolLM2 itself). Its heads are 32 wide,
a size kvmesh's C++ decode attention serves, as it serves SmolLM2's: a worker
then runs the same kernel, with no compiled fallback to build at start.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_MAX_POSITIONS = 512


def save_tiny_llama(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Writes config.json + safetensors (fixed seed) + SmolLM2's tokenizer files to ``path``."""
    config = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_POSITIONS, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True, initializer_range=0.25,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path
