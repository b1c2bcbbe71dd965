"""Bf16Linear: kvmesh's bfloat16 kernel up to max_rows rows, oneDNN above; the same
products as F.linear on either side of the threshold, eager and compiled, and a
bfloat16 model served by it computes the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch._inductor.utils import fresh_cache, run_and_get_code

from kernels.cpu_extension import has_cpu_kernel
from services.worker.compilation import compile_piece, cpp_compiler_available
from services.worker.layers.bf16_linear import UNBOUNDED_ROWS, Bf16Linear
from services.worker.layers.packed_linear import PackedLinear, can_pack, cpu_linear
from services.worker.model_loader import load_model
from tests.worker.test_models import save_tiny_hf_model
from tests.worker.test_quantization import perplexity

pytestmark = pytest.mark.skipif(not has_cpu_kernel("bf16_linear_dispatch"),
                                reason="kvmesh's CPU kernels (AVX-512 or AVX2) are needed")
# Where oneDNN has no native bfloat16 (AVX2-only CPUs) it packs no bfloat16 weight.
NATIVE_BF16 = can_pack(torch.bfloat16, torch.device("cpu"))
needs_native_bf16 = pytest.mark.skipif(not NATIVE_BF16,
                                       reason="oneDNN has no native bfloat16 on this CPU")
IN_FEATURES, OUT_FEATURES = 96, 44


def _operands(num_rows: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen).bfloat16()
    b = torch.randn(OUT_FEATURES, generator=gen).bfloat16() if bias else None
    return torch.randn(num_rows, IN_FEATURES, generator=gen).bfloat16(), weight, b


def _assert_close_to_float32(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> None:
    """Float32 sums of exact products, rounded to bfloat16 once (twice with a bias on
    our kernel's side): within 2 bfloat16 ulps of the float32 result."""
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, rtol=2**-6,
                               atol=1e-3 * float(expected.abs().max()))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("max_rows", [1, 4, UNBOUNDED_ROWS])
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 64])
def test_each_side_of_the_threshold_matches_f_linear(bias: bool, max_rows: int,
                                                     num_rows: int) -> None:
    """Rows below, at and above max_rows: our kernel up to it (bit for bit), oneDNN
    above (bit for bit F.linear), both within rounding of the float32 product."""
    x, weight, b = _operands(num_rows, bias, seed=num_rows)
    out = Bf16Linear(weight, b, max_rows)(x)
    if num_rows <= max_rows:
        ours = torch.ops.kvmesh.bf16_linear_cpu(x, weight)
        assert torch.equal(out, ours if b is None else ours + b)
    else:
        assert torch.equal(out, F.linear(x, weight, b))
    _assert_close_to_float32(out, x, weight, b)


@needs_native_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 4, 5, 64])
def test_above_the_threshold_a_packed_layer_runs_onednn_prepacked(bias: bool,
                                                                  num_rows: int) -> None:
    """With a packed copy, rows above max_rows go to oneDNN's prepacked linear (bit for
    bit a PackedLinear's); rows up to it still to our kernel on the plain weight."""
    x, weight, b = _operands(num_rows, bias, seed=num_rows)
    layer = Bf16Linear(weight, b, 4, packed=True)
    out = layer(x)
    if num_rows <= 4:
        ours = torch.ops.kvmesh.bf16_linear_cpu(x, weight)
        assert torch.equal(out, ours if b is None else ours + b)
    else:
        assert torch.equal(out, PackedLinear(weight, b)(x))
    _assert_close_to_float32(out, x, weight, b)


@pytest.mark.parametrize("num_rows", [3, 4, 5])  # below, at and above max_rows
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_native_bf16)])
def test_nan_stays_in_its_row(num_rows: int, packed: bool) -> None:
    x, weight, _ = _operands(num_rows, bias=False, seed=7)
    x[1, 17] = float("nan")
    out = Bf16Linear(weight, None, 4, packed=packed)(x)
    assert out[1].isnan().all()
    others = [i for i in range(num_rows) if i != 1]
    assert out[others].isfinite().all()
    _assert_close_to_float32(out[others], x[others], weight, None)


def test_leading_dimensions_are_rows() -> None:
    x, weight, b = _operands(6, bias=True)
    layer = Bf16Linear(weight, b, 4)
    out = layer(x.view(2, 3, IN_FEATURES))
    assert out.shape == (2, 3, OUT_FEATURES)
    assert torch.equal(out.view(6, OUT_FEATURES), layer(x))  # 6 rows: oneDNN either way


def test_a_contiguous_weight_is_shared_not_copied() -> None:
    """A tied LM head on Bf16Linear reads the embedding's table itself."""
    _, weight, _ = _operands(1, bias=False)
    assert Bf16Linear(weight, None, 1).weight.data_ptr() == weight.data_ptr()


def test_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match=r"Bf16Linear needs .* got torch.float32 \(4, 64\)"):
        Bf16Linear(torch.zeros(4, 64), None, 1)
    with pytest.raises(ValueError, match=r"multiple of 32 .* got torch.bfloat16 \(4, 48\)"):
        Bf16Linear(torch.zeros(4, 48, dtype=torch.bfloat16), None, 1)
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        Bf16Linear(torch.zeros(4, 64, dtype=torch.bfloat16), None, 0)
    if not NATIVE_BF16:
        with pytest.raises(ValueError, match="packed needs oneDNN's native bfloat16"):
            Bf16Linear(torch.zeros(4, 64, dtype=torch.bfloat16), None, 1, packed=True)


def test_cpu_linear_follows_the_table() -> None:
    """Bfloat16 shapes with rows of our kernel get Bf16Linear, with a prepacked copy
    for oneDNN's rows where oneDNN runs bfloat16 natively and has rows; 0 rows and a
    shape not in the table get oneDNN's PackedLinear where oneDNN runs bfloat16
    natively, else None (nn.Linear stays); float32 gets PackedLinear."""
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    layer = cpu_linear(weight, None, {(8, 64): 16})
    assert isinstance(layer, Bf16Linear) and layer.max_rows == 16
    assert (layer.packed_weight is not None) == NATIVE_BF16
    layer = cpu_linear(weight, None, {(8, 64): UNBOUNDED_ROWS})
    assert isinstance(layer, Bf16Linear) and layer.packed_weight is None
    unserved = PackedLinear if NATIVE_BF16 else type(None)
    assert isinstance(cpu_linear(weight, None, {(8, 64): 0}), unserved)
    assert isinstance(cpu_linear(weight, None, {(8, 32): 16}), unserved)
    assert isinstance(cpu_linear(weight.float(), None, {(8, 64): 16}), PackedLinear)


@pytest.mark.parametrize("max_rows", [0, UNBOUNDED_ROWS])
def test_without_native_bf16_our_kernel_serves_or_nn_linear_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_rows: int) -> None:
    """Where oneDNN cannot pack bfloat16 (as on AVX2-only CPUs), a bfloat16 model's
    layers with rows of our kernel become Bf16Linear and the others stay nn.Linear:
    none is packed."""
    save_tiny_hf_model(tmp_path, transformers.LlamaConfig, tie_word_embeddings=False)
    monkeypatch.setattr("services.worker.layers.packed_linear.can_pack",
                        lambda dtype, device: dtype is not torch.bfloat16)
    monkeypatch.setattr("services.worker.models.llama.bf16_max_rows_by_shape",
                        lambda weights: {tuple(w.shape): max_rows for w in weights})
    model, config = load_model(tmp_path, "bfloat16", "cpu")
    served = model.pack_weights_()
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    layers += [m for m in model.modules() if isinstance(m, Bf16Linear)]
    expected = Bf16Linear if max_rows else torch.nn.Linear
    assert layers and all(type(m) is expected for m in layers)
    assert served == (4 * config.num_layers + 1 if max_rows else 0)


@pytest.mark.skipif(not cpp_compiler_available(), reason="inductor needs a C++ compiler")
def test_compiled_graphs_choose_inside_one_op() -> None:
    """The batch-of-one graph and the dynamic one both call the C++ dispatch op, and
    the dynamic graph serves row counts on both sides of max_rows (on the prepacked
    copy where oneDNN has native bfloat16): no Python body, no graph break, no
    recompilation at the threshold."""
    _, weight, b = _operands(1, bias=True)
    layer = Bf16Linear(weight, b, 4, packed=NATIVE_BF16)

    def mlp(layer: Bf16Linear, x: torch.Tensor) -> torch.Tensor:
        return F.silu(layer(x)) * 2

    inputs = [_operands(num_rows, bias=False, seed=num_rows)[0] for num_rows in (1, 3, 9, 4, 5)]
    compiled = compile_piece(mlp)
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        for x in inputs:
            assert torch.equal(compiled(layer, x), mlp(layer, x))
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # one row, any rows
    # A fresh cache: a graph cached before would not show its code.
    with torch.inference_mode(), fresh_cache():
        code = "\n".join(run_and_get_code(compile_piece(mlp), layer, x)[1][0] for x in inputs[:2])
    assert "torch.ops.kvmesh.bf16_linear_dispatch.default(" in code


@pytest.mark.parametrize("max_rows", [2, UNBOUNDED_ROWS])  # the prefill on oneDNN, on ours
def test_bf16_model_on_kvmesh_kernel_computes_the_same_logits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_rows: int) -> None:
    """Every bfloat16 linear and the tied head on Bf16Linear, as the table says."""
    save_tiny_hf_model(tmp_path, transformers.LlamaConfig, tie_word_embeddings=True)
    monkeypatch.setattr("services.worker.models.llama.bf16_max_rows_by_shape",
                        lambda weights: {tuple(w.shape): max_rows for w in weights})
    model, config = load_model(tmp_path, "bfloat16", "cpu")
    token_ids = list(range(3, 40))
    before = perplexity(model, config, token_ids)
    assert model.pack_weights_() == 4 * config.num_layers + 1
    assert isinstance(model.lm_head, Bf16Linear)
    assert all(isinstance(m, Bf16Linear) for m in model.modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear, Bf16Linear)))
    # The tied head shares the embedding's table (a PackedLinear holds a copy).
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Summation order differs from MKL's; bfloat16 roundings then part slightly.
    assert perplexity(model, config, token_ids) == pytest.approx(before, rel=1e-2)
    hidden = torch.randn(3, config.hidden_size).bfloat16()
    out = torch.empty(3, config.vocab_size, dtype=torch.bfloat16)
    assert torch.equal(model.compute_logits(hidden, out=out), model.lm_head(hidden))
