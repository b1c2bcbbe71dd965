"""max_model_len: the worker and the frontend reach the same answer by one rule."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from services.common.max_model_len import (
    get_sliding_window,
    max_model_len_from_hf_config,
    resolve_max_model_len,
)
from services.frontend.config import FrontendServiceConfig, read_model_info
from services.worker.config import WorkerConfig
from services.worker.worker import Worker

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)


def test_default_is_the_model_limit_capped_at_2048() -> None:
    assert resolve_max_model_len(8192, None) == 2048
    assert resolve_max_model_len(512, None) == 512
    assert resolve_max_model_len(512, 300) == 300


@pytest.mark.parametrize("requested", [1, 513])
def test_out_of_range_names_the_range(requested: int) -> None:
    with pytest.raises(ValueError, match=rf"max_model_len is {requested}; allowed range is \[2, 512\]"):
        resolve_max_model_len(512, requested)


def test_sliding_window_applies_unless_qwen2_turns_it_off() -> None:
    mistral = {"architectures": ["MistralForCausalLM"], "sliding_window": 64}
    assert get_sliding_window(mistral) == 64
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert get_sliding_window(qwen2) is None
    assert get_sliding_window({**qwen2, "use_sliding_window": True}) == 64
    assert get_sliding_window({"model_type": "qwen2", "sliding_window": 64}) is None


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@pytest.mark.parametrize("requested", [None, 48])
def test_worker_and_frontend_agree(tmp_path, arch: str, requested: int | None) -> None:
    """A sliding window of 64 caps a Mistral's length on both sides; a Qwen2's is unused."""
    if arch == "mistral":
        config = MistralConfig(**TINY, sliding_window=64, architectures=["MistralForCausalLM"])
    else:
        config = Qwen2Config(**TINY, sliding_window=64, use_sliding_window=False,
                             architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)

    worker = Worker(WorkerConfig(model=str(tmp_path), dtype="float32", max_model_len=requested))
    worker.load_model()
    frontend = read_model_info(tmp_path, FrontendServiceConfig(max_model_len=requested), [])
    expected = requested or (64 if arch == "mistral" else 2048)
    assert worker.max_model_len == frontend.max_model_len == expected
    assert max_model_len_from_hf_config(config.to_dict(), requested) == expected
