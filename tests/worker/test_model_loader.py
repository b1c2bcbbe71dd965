"""load_model: shard discovery, fused-weight mapping, dtypes and bad checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from services.worker.cpu_capability import CpuCapability
from services.worker.model_loader import load_model, safetensors_files
from services.worker.models import LlamaForCausalLM, get_model_class

BF16_CPU = CpuCapability("AVX512", avx512_bf16=True, amx=False)
PLAIN_CPU = CpuCapability("AVX2", avx512_bf16=False, amx=False)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def save_tiny_llama(path: Path, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, **overrides) -> dict[str, torch.Tensor]:
    """Saves a random tiny Llama; returns its state dict (float32)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(path, **kwargs)
    return {k: v.float() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_maps_to_fused_parameters(tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path, max_shard_size="60KB", tie_word_embeddings=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_names = sorted(set(index["weight_map"].values()))
    assert len(shard_names) > 1
    assert [p.name for p in safetensors_files(tmp_path)] == shard_names

    model, config = load_model(tmp_path, "float32", "cpu")
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    ours = dict(model.named_parameters())
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert torch.equal(ours[f"{attn}.qkv_proj.weight"], torch.cat(
            [hf[f"{attn}.{p}_proj.weight"] for p in "qkv"]))
        assert torch.equal(ours[f"{mlp}.gate_up_proj.weight"], torch.cat(
            [hf[f"{mlp}.gate_proj.weight"], hf[f"{mlp}.up_proj.weight"]]))
        assert torch.equal(ours[f"{attn}.o_proj.weight"], hf[f"{attn}.o_proj.weight"])
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])
    assert not torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_tied_head_shares_the_embedding(tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model, _ = load_model(tmp_path, "float32", "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf["model.embed_tokens.weight"])


def test_auto_dtype_on_the_cpu_follows_the_cpu(tmp_path: Path) -> None:
    """auto on the CPU: bfloat16 where the CPU has it natively, float32 elsewhere,
    whatever the checkpoint says (both branches, through an injected capability)."""
    save_tiny_llama(tmp_path, dtype=torch.bfloat16)
    for cpu, expected in ((BF16_CPU, torch.bfloat16), (PLAIN_CPU, torch.float32)):
        model, config = load_model(tmp_path, "auto", "cpu", cpu=cpu)
        assert config.dtype is expected
        assert {p.dtype for p in model.parameters()} == {expected}


def test_explicit_dtype_wins(tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path, dtype=torch.bfloat16)
    model, config = load_model(tmp_path, "bfloat16", "cpu", cpu=PLAIN_CPU)
    assert config.dtype is torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, config = load_model(tmp_path, "float16", "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    # bf16 -> fp16 is exact for these small values.
    assert torch.equal(model.model.norm.weight.float(), hf["model.norm.weight"])


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = ("'GPT2LMHeadModel' is not supported; supported: "
                "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM")
    with pytest.raises(ValueError, match=expected):
        load_model(tmp_path, "float32", "cpu")
    with pytest.raises(ValueError, match=expected):
        get_model_class("GPT2LMHeadModel")


def _rewrite_weights(path: Path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, str(path / "model.safetensors"))


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    _rewrite_weights(tmp_path, lambda w: w.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.self_attn\.qkv_proj\.weight\[v\]"):
        load_model(tmp_path, "float32", "cpu")


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    _rewrite_weights(tmp_path, lambda w: w.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="'model.extra.weight' matches no parameter of LlamaForCausalLM"):
        load_model(tmp_path, "float32", "cpu")


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    _rewrite_weights(tmp_path, lambda w: w.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(63,\), expected \(64,\)"):
        load_model(tmp_path, "float32", "cpu")


def test_no_weights(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path, "float32", "cpu")


@pytest.mark.slow
def test_default_model_loads(default_model_dir: Path) -> None:
    model, config = load_model(None, "bfloat16", "cpu")
    assert config.architecture == "LlamaForCausalLM" and config.dtype is torch.bfloat16
    # 49152 x 576 tied embedding + 30 layers of (576 x 960 qkv, 576 x 576 o, 576 x 3072
    # gate_up, 1536 x 576 down, 2 norms) + final norm
    per_layer = 576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576 + 2 * 576
    assert sum(p.numel() for p in model.parameters()) == 49152 * 576 + 30 * per_layer + 576


def test_unsupported_activation_is_named(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported; supported: silu"):
        load_model(tmp_path, "float32", "cpu")
