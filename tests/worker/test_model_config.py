"""ModelConfig from config.json / generation_config.json in both RoPE spellings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from services.worker.config import ModelConfig, parse_dtype, parse_kv_cache_dtype
from services.worker.cpu_capability import CpuCapability, detect_cpu_capability

# Injected capabilities: the auto dtype rule is tested whatever this CPU has.
BF16_CPU = CpuCapability("AVX512", avx512_bf16=True, amx=False)
AMX_CPU = CpuCapability("AVX512", avx512_bf16=False, amx=True)
PLAIN_CPU = CpuCapability("AVX2", avx512_bf16=False, amx=False)

LLAMA31_CONFIG = {  # Llama 3.1 8B as written by transformers 4.x (legacy RoPE keys)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16", "hidden_act": "silu",
}


def write_model_dir(path: Path, config: dict, generation: dict | None = None) -> Path:
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_legacy_llama31_config(tmp_path: Path) -> None:
    write_model_dir(tmp_path, LLAMA31_CONFIG, {"eos_token_id": [128009, 128006]})
    config = ModelConfig.from_pretrained(tmp_path, device="cuda")
    assert config == ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_size=128, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        eos_token_ids=[128001, 128008, 128009, 128006], dtype=torch.bfloat16,
    )
    assert config.max_model_len == 131072


def test_transformers5_rope_parameters_roundtrip(tmp_path: Path) -> None:
    hf_config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, eos_token_id=3,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                         "original_max_position_embeddings": 32},
        architectures=["LlamaForCausalLM"],
    )
    hf_config.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path, "float32")
    assert config.rope_theta == 5000.0
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 2.0, "original_max_position_embeddings": 32}
    assert (config.head_size, config.num_kv_heads, config.eos_token_ids) == (16, 2, [3])


def test_default_rope_is_none_and_theta_defaults(tmp_path: Path) -> None:
    base = {k: v for k, v in LLAMA31_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    config = ModelConfig.from_hf_dict(base)
    assert (config.rope_theta, config.rope_scaling) == (10000.0, None)
    config = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default",
                                                                   "rope_theta": 1e6}})
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)
    # Legacy "type" key, a scaling kind the model rejects later by name.
    config = ModelConfig.from_hf_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_qwen2_biases_and_unused_sliding_window(tmp_path: Path) -> None:
    transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
        sliding_window=64, use_sliding_window=False, architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == (True, False, False)
    assert (config.sliding_window, config.max_model_len) == (None, 512)


def test_mistral_sliding_window_caps_max_model_len_and_explicit_head_dim() -> None:
    config = ModelConfig.from_hf_dict({
        "architectures": ["MistralForCausalLM"], "hidden_size": 5120, "intermediate_size": 14336,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 32768,
        "sliding_window": 4096, "eos_token_id": 2,
    }, device="cuda")
    assert (config.head_size, config.sliding_window, config.max_model_len) == (128, 4096, 4096)
    assert (config.qkv_bias, config.o_proj_bias, config.dtype) == (False, False, torch.float32)


def test_llama_attention_bias_covers_all_projections() -> None:
    config = ModelConfig.from_hf_dict({**LLAMA31_CONFIG, "attention_bias": True, "mlp_bias": True})
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == (True, True, True)


def test_architecture_from_model_type_when_missing() -> None:
    base = {k: v for k, v in LLAMA31_CONFIG.items() if k != "architectures"}
    assert ModelConfig.from_hf_dict(base).architecture == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="model_type 'gpt2'.*llama, mistral, qwen2"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})


def test_heads_must_group_evenly() -> None:
    with pytest.raises(ValueError, match="num_heads=32 must be a multiple of num_kv_heads=6"):
        ModelConfig.from_hf_dict({**LLAMA31_CONFIG, "num_key_value_heads": 6})


@pytest.mark.parametrize(("arg", "checkpoint", "expected"), [
    ("auto", "bfloat16", torch.bfloat16),
    ("auto", None, torch.float32),
    ("float32", "bfloat16", torch.float32),
    ("float16", None, torch.float16),
    ("bfloat16", None, torch.bfloat16),
    ("half", None, torch.float16),
    (torch.bfloat16, "float32", torch.bfloat16),
])
def test_parse_dtype_on_cuda(arg, checkpoint, expected) -> None:
    """On CUDA, auto is the checkpoint's dtype."""
    assert parse_dtype(arg, checkpoint, "cuda") is expected


@pytest.mark.parametrize(("arg", "checkpoint", "cpu", "expected"), [
    ("auto", "float32", BF16_CPU, torch.bfloat16),
    ("auto", None, AMX_CPU, torch.bfloat16),
    ("auto", "bfloat16", PLAIN_CPU, torch.float32),
    ("auto", "float16", PLAIN_CPU, torch.float32),
    ("float32", None, BF16_CPU, torch.float32),  # an explicit dtype wins
    ("bfloat16", None, PLAIN_CPU, torch.bfloat16),
    ("float16", "bfloat16", BF16_CPU, torch.float16),
])
def test_parse_dtype_on_cpu(arg, checkpoint, cpu, expected) -> None:
    """On the CPU, auto is bfloat16 where it is native (AVX512-BF16 or AMX), else float32."""
    assert parse_dtype(arg, checkpoint, "cpu", cpu) is expected


def test_auto_dtype_on_this_cpu() -> None:
    """The default capability is what torch reports for this machine."""
    native = detect_cpu_capability().native_bfloat16
    assert parse_dtype("auto") is (torch.bfloat16 if native else torch.float32)
    assert detect_cpu_capability().isa == torch.backends.cpu.get_cpu_capability()


def test_model_config_auto_dtype_with_injected_cpu() -> None:
    for cpu, expected in ((BF16_CPU, torch.bfloat16), (PLAIN_CPU, torch.float32)):
        config = ModelConfig.from_hf_dict(LLAMA31_CONFIG, device="cpu", cpu=cpu)
        assert config.dtype is expected


@pytest.mark.parametrize(("arg", "model_dtype", "expected"), [
    ("auto", torch.bfloat16, torch.bfloat16),
    ("auto", torch.float32, torch.float32),
    ("float32", torch.bfloat16, torch.float32),
    ("bfloat16", torch.float32, torch.bfloat16),
])
def test_kv_cache_dtype_follows_the_model_unless_set(arg, model_dtype, expected) -> None:
    assert parse_kv_cache_dtype(arg, model_dtype) is expected


def test_kv_cache_dtype_rejects() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported; allowed: auto"):
        parse_kv_cache_dtype("fp8", torch.float32)


@pytest.mark.parametrize("arg", ["int8", torch.float64])
def test_parse_dtype_rejects(arg) -> None:
    with pytest.raises(ValueError, match="not supported; allowed: .*float32.*bfloat16.*float16"):
        parse_dtype(arg)


@pytest.mark.slow
def test_smollm2_config(default_model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(default_model_dir, device="cuda")  # the checkpoint dtype
    assert config == ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_size=64, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rope_scaling=None,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=True, eos_token_ids=[2],
        dtype=torch.float32,
    )
    assert config.rms_norm_eps == pytest.approx(1e-5)
