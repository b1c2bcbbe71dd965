"""RMSNorm, SiluAndMul, RoPE and the paged Attention layer, against transformers and by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from services.worker.attention import Attention, AttentionMetadata
from services.worker.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary_emb
from services.worker.layers.rotary_embedding import compute_inv_freq

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_bitwise(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 32).to(dtype)
    residual = torch.randn(5, 32).to(dtype)
    ours, theirs = RMSNorm(32, eps=1e-5, dtype=dtype), LlamaRMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.linspace(0.5, 1.5, 32))
        theirs.weight.copy_(torch.linspace(0.5, 1.5, 32))
        assert torch.equal(ours(x), theirs(x))
        normed, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(normed, theirs(x + residual))


def test_rms_norm_by_hand() -> None:
    norm = RMSNorm(2, eps=0.0)
    # rms([3, 4]) = sqrt(12.5)
    expected = torch.tensor([[3.0, 4.0]]) / math.sqrt(12.5)
    torch.testing.assert_close(norm(torch.tensor([[3.0, 4.0]])), expected, atol=1e-7, rtol=0)


def test_silu_and_mul_by_hand() -> None:
    out = SiluAndMul()(torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    # [silu(0) * 2, silu(1) * 3], silu(1) = 1 / (1 + e^-1)
    torch.testing.assert_close(out, torch.tensor([[0.0, 3.0 / (1.0 + math.exp(-1.0))]]))


def test_inv_freq_by_hand() -> None:
    # theta^(-2i/d) for d=4, theta=100: [1, 1/10]
    torch.testing.assert_close(compute_inv_freq(4, 100.0, None), torch.tensor([1.0, 0.1]))


def test_inv_freq_matches_transformers() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert torch.equal(compute_inv_freq(16, 10000.0, None), LlamaRotaryEmbedding(config).inv_freq)

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                         rope_parameters={**LLAMA3_SCALING, "rope_theta": 10000.0})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = compute_inv_freq(16, 10000.0, LLAMA3_SCALING)
    assert torch.equal(ours, expected)
    default = compute_inv_freq(16, 10000.0, None)
    # head 16, original context 64: wavelengths 2pi/f are [6.3, 20, 63, 199, ...] against
    # the band [64/4, 64/1]: 6.3 is kept, 20 and 63 are smoothed, longer ones divided by 8.
    assert ours[0] == default[0]
    assert all(default[i] / 8 < ours[i] < default[i] for i in (1, 2))
    assert torch.equal(ours[3:], default[3:] / 8)


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    with pytest.raises(ValueError, match=f"'{rope_type}'.*default, llama3"):
        RotaryEmbedding(16, 32, 10000.0, {"rope_type": rope_type, "factor": 2.0}, torch.float32)


def test_rotary_by_hand() -> None:
    rope = RotaryEmbedding(2, 4, 10000.0, None, torch.float32)  # one pair, inv_freq = 1
    cos, sin = rope(torch.tensor([0, 1]))
    x = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])  # [tokens, heads, head_size]
    out = apply_rotary_emb(x, cos, sin)
    # position p rotates (x1, x2) by p radians
    torch.testing.assert_close(out, torch.tensor([[[1.0, 0.0]], [[math.cos(1.0), math.sin(1.0)]]]))


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_rotary_matches_transformers_bitwise(scaling: dict | None) -> None:
    torch.manual_seed(0)
    params = {"rope_type": "default"} if scaling is None else dict(scaling)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                         rope_parameters={**params, "rope_theta": 10000.0})
    positions = torch.tensor([5, 0, 17, 3, 127])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # transformers wants [batch, heads, seq, head_size]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)

    cos, sin = RotaryEmbedding(16, 128, 10000.0, scaling, torch.float32)(positions)
    assert torch.equal(apply_rotary_emb(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary_emb(k, cos, sin), hf_k[0].transpose(0, 1))


def test_attention_writes_slots_and_attends_causally() -> None:
    """One request of 6 tokens in blocks [3, 1] (block_size 4) plus one padding row."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 8, 4
    q = torch.randn(7, num_heads * head_size)
    k, v = torch.randn(7, num_kv_heads * head_size), torch.randn(7, num_kv_heads * head_size)
    kv_cache = torch.zeros(2, 5, block_size, num_kv_heads, head_size)
    metadata = AttentionMetadata(
        num_reqs=1, num_actual_tokens=6, max_query_len=6, max_seq_len=6,
        query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        block_table=torch.tensor([[3, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([12, 13, 14, 15, 4, 5, -1]),
    )
    attn = Attention(num_heads, head_size, head_size ** -0.5, num_kv_heads)
    out = attn(q, k, v, kv_cache, metadata)

    keys = k.view(7, num_kv_heads, head_size)
    values = v.view(7, num_kv_heads, head_size)
    assert torch.equal(kv_cache[0, 3], keys[0:4]) and torch.equal(kv_cache[1, 3], values[0:4])
    assert torch.equal(kv_cache[0, 1, :2], keys[4:6]) and torch.equal(kv_cache[1, 1, :2], values[4:6])
    # Nothing else written: the null block, block 2, block 4 and block 1's tail stay zero.
    assert torch.count_nonzero(kv_cache[:, [0, 2, 4]]) == 0
    assert torch.count_nonzero(kv_cache[:, 1, 2:]) == 0

    expected = F.scaled_dot_product_attention(
        q[:6].view(6, num_heads, head_size).transpose(0, 1), keys[:6].transpose(0, 1),
        values[:6].transpose(0, 1), is_causal=True, enable_gqa=True,
    ).transpose(0, 1).reshape(6, num_heads * head_size)
    assert out.shape == (7, num_heads * head_size)
    torch.testing.assert_close(out[:6], expected, atol=1e-5, rtol=0)
    assert torch.count_nonzero(out[6]) == 0


def test_attention_rejects_bad_gqa() -> None:
    with pytest.raises(ValueError, match="num_heads=6.*num_kv_heads=4"):
        Attention(6, 8, 1.0, 4)
