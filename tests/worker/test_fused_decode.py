"""The fused decode step (``FusedDecodeStep`` in services/worker/models/llama.py): a
bfloat16 or float32 CPU model's small decode-only steps as one C++ op (its linear
layers bfloat16, w8a8 or GGUF blocks), with the logits of the eager forward pass,
and only where the op serves the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kernels import cpu_extension, gguf_quants
from kernels.gguf_linear_cpu import pack_rows
from services.worker.layers.bf16_linear import UNBOUNDED_ROWS
from services.worker.layers.gguf_linear import GGUFLinear
from services.worker.layers.quantization import DEFAULT_KERNEL_MAX_ROWS
from services.worker.model_loader import load_model
from services.worker.models import llama
from tests.worker.test_huge_pages import anon_huge_bytes_at, needs_thp
from tests.worker.test_models import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    final_token_ids,
    make_kv_caches,
    run_paged_schedule,
    save_tiny_hf_model,
)

pytestmark = pytest.mark.skipif(not cpu_extension.has_cpu_kernel("llama_decode_cpu"),
                                reason="kvmesh's C++ CPU kernels could not be built here")
# Heads of 32, the smallest the CPU attention kernel serves (tests/worker/test_models.py's
# TINY has 16).
HEAD_32 = dict(hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
# The rows the fused step serves: a quantized layer's kernel takes its default rows
# here (nothing measured), kvmesh's bfloat16 kernel what the test chooses.
QUANTIZED_ROWS = min(llama.FUSED_MAX_ROWS, DEFAULT_KERNEL_MAX_ROWS)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-head-32")
    save_tiny_hf_model(path, transformers.LlamaConfig, **HEAD_32)
    return path


def _packed_model(path: Path, dtype: str, max_rows: int, monkeypatch: pytest.MonkeyPatch,
                  quantization: str | None = None):
    """The model with its CPU kernels as the worker sets them up, kvmesh's bfloat16
    kernel chosen up to ``max_rows`` rows for every shape (0: oneDNN for all), a
    quantized one's kernel up to its default rows (nothing measured)."""
    monkeypatch.setattr("services.worker.models.llama.bf16_max_rows_by_shape",
                        lambda weights: {tuple(w.shape): max_rows for w in weights})
    monkeypatch.setattr("services.worker.models.llama.set_kernel_max_rows_",
                        lambda model, dtype: None)
    model, config = load_model(path, dtype, "cpu", None if quantization == "gguf" else quantization)
    if quantization == "gguf":
        _to_gguf_blocks(model)
    model.pack_weights_()
    return model, config


def _to_gguf_blocks(model: torch.nn.Module) -> None:
    """Every decoder layer's linear layers as GGUF blocks (``GGUFLinear``), the formats
    mixed as a GGUF file may mix them: Q4_1 packed by eight, Q4_0 and Q8_0 in the
    file's rows."""
    formats = [(gguf_quants.GGMLQuantizationType.Q4_1, True),
               (gguf_quants.GGMLQuantizationType.Q4_0, False),
               (gguf_quants.GGMLQuantizationType.Q8_0, False)]
    for i, layer in enumerate(model.model.layers):
        for j, (owner, name) in enumerate([(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                           (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]):
            quant_type, packed = formats[(i + j) % len(formats)]
            weight = getattr(owner, name).weight.detach().float()
            blocks = gguf_quants.quantize(weight, quant_type)
            setattr(owner, name, GGUFLinear(pack_rows(blocks, quant_type) if packed else blocks,
                                            quant_type, weight.shape[1], packed=packed))


@pytest.mark.parametrize(("dtype", "quantization"), [
    ("bfloat16", None), ("bfloat16", "w8a8"), ("bfloat16", "gguf"),
    ("float32", "w8a8"), ("float32", "gguf"),
])
def test_fused_step_matches_the_eager_forward_pass(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                   dtype: str, quantization: str | None) -> None:
    """SCHEDULE's two decode-only steps (three requests each) take the op; its mixed
    steps do not. The logits agree with eager, the last step's through the K/V the op
    wrote the step before: bfloat16, w8a8 and GGUF-block linear layers, bfloat16 and
    float32 activations."""
    eager, config = _packed_model(tiny_llama, dtype, UNBOUNDED_ROWS, monkeypatch, quantization)
    fused, _ = _packed_model(tiny_llama, dtype, UNBOUNDED_ROWS, monkeypatch, quantization)
    kv_caches = make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    assert fused.fuse_decode_step(kv_caches) == (llama.FUSED_MAX_ROWS if quantization is None
                                                 else QUANTIZED_ROWS)
    calls = []
    op = llama.llama_decode_cpu

    def counted(hidden: torch.Tensor, *args) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return op(hidden, *args)

    monkeypatch.setattr(llama, "llama_decode_cpu", counted)
    token_ids = final_token_ids(config.vocab_size)
    expected = run_paged_schedule(eager, config, token_ids)
    actual = run_paged_schedule(fused, config, token_ids, kv_caches=kv_caches)
    assert calls == [3, 3]
    # The norms and rotations round once per tensor here, per op in eager; under w8a8
    # and GGUF blocks an activation one bfloat16 step apart may quantize to the
    # neighbouring int8. float32 differs in summation order only.
    atol = 1e-3 if dtype == "float32" else 0.05 if quantization is None else 0.15
    for ours, theirs in zip(actual, expected):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


@pytest.mark.parametrize(("dtype", "quantization", "max_rows", "fused_rows"), [
    ("bfloat16", None, 2, 2),  # up to what the layers' kernel serves
    ("bfloat16", None, UNBOUNDED_ROWS, llama.FUSED_MAX_ROWS),
    ("bfloat16", None, 0, 0),  # oneDNN's layers (or nn.Linear where it cannot pack bfloat16)
    ("float32", None, UNBOUNDED_ROWS, 0),  # float32 layers are oneDNN's
    ("bfloat16", "w8a8", UNBOUNDED_ROWS, QUANTIZED_ROWS),
    ("float32", "w8a8", UNBOUNDED_ROWS, QUANTIZED_ROWS),  # float32 activations too
    ("bfloat16", "int8", UNBOUNDED_ROWS, 0),  # weight-only int8: no fused kind
    ("bfloat16", "gguf", UNBOUNDED_ROWS, QUANTIZED_ROWS),
    ("float32", "gguf", UNBOUNDED_ROWS, QUANTIZED_ROWS),
])
def test_fused_only_where_the_op_serves(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                        dtype: str, quantization: str | None, max_rows: int,
                                        fused_rows: int) -> None:
    model, config = _packed_model(tiny_llama, dtype, max_rows, monkeypatch, quantization)
    assert model.fuse_decode_step(make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)) == fused_rows


def test_heads_the_attention_kernel_lacks_are_not_fused(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    save_tiny_hf_model(tmp_path, transformers.LlamaConfig, tie_word_embeddings=True)  # heads of 16
    model, config = _packed_model(tmp_path, "bfloat16", UNBOUNDED_ROWS, monkeypatch)
    assert model.fuse_decode_step(make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)) == 0


def test_more_rows_than_the_op_serves_take_the_pieces(tiny_llama: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With the op serving two rows, SCHEDULE's three-request decode steps do not call it."""
    model, config = _packed_model(tiny_llama, "bfloat16", 2, monkeypatch)
    kv_caches = make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    assert model.fuse_decode_step(kv_caches) == 2

    def refuse(*args) -> torch.Tensor:
        raise AssertionError("called for more rows than it serves")

    monkeypatch.setattr(llama, "llama_decode_cpu", refuse)
    run_paged_schedule(model, config, final_token_ids(config.vocab_size), kv_caches=kv_caches)


@needs_thp
@pytest.mark.parametrize("quantization", [None, "w8a8", "gguf"])
def test_the_fused_steps_weights_and_the_head_move_onto_huge_pages(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None) -> None:
    """In one buffer on huge pages, the layers' in the order the step reads them; a
    tied head still shares the embedding's bytes. (The logits test above runs the
    moved weights.)"""
    model, config = _packed_model(tiny_llama, "bfloat16", UNBOUNDED_ROWS, monkeypatch, quantization)
    assert model.fuse_decode_step(make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)) > 0
    weights = model.model.fused_decode.weights
    embedding = model.model.embed_tokens.weight
    head = [t for t in model.lm_head.buffers() if t.layout == torch.strided]
    moved = list({t.data_ptr(): t for t in [*weights, *head, embedding]}.values())  # shared once
    span = max(t.data_ptr() + t.numel() * t.element_size() for t in moved) - weights[0].data_ptr()
    assert span <= sum(t.numel() * t.element_size() + 64 for t in moved)  # 64-byte aligned slots
    in_order = list(dict.fromkeys(t.data_ptr() for t in weights))
    assert in_order == sorted(in_order)
    assert anon_huge_bytes_at(weights[0].data_ptr()) > 0
    if quantization is None:  # the tied head is kvmesh's bfloat16 layer on the table
        assert model.lm_head.weight.data_ptr() == embedding.data_ptr()


def test_choosing_the_prefetch_mode_leaves_the_kv_caches_as_they_were(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, config = _packed_model(tiny_llama, "bfloat16", UNBOUNDED_ROWS, monkeypatch)
    kv_caches = [torch.randn_like(kv) for kv in make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)]
    before = [kv.clone() for kv in kv_caches]
    timed = []
    monkeypatch.setattr(llama, "choose_row_group_prefetch", lambda step: timed.append(step()))
    assert model.fuse_decode_step(kv_caches) > 0
    assert len(timed) == 1 and timed[0].shape == (1, config.hidden_size)
    assert all(torch.equal(kv, b) for kv, b in zip(kv_caches, before))
