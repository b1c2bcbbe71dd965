"""oneDNN-prepacked linear layers: the same products as F.linear, eager and compiled,
and a model whose every float linear and head is packed computes the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch._inductor.utils import fresh_cache, run_and_get_code

from services.worker.compilation import compile_piece, cpp_compiler_available
from services.worker.layers.packed_linear import PackedLinear, can_pack, pack_linears_
from services.worker.layers.quantization import Int8Linear
from services.worker.model_loader import load_model
from tests.worker.test_models import save_tiny_hf_model
from tests.worker.test_quantization import perplexity

CPU = torch.device("cpu")
DTYPES = [d for d in (torch.float32, torch.bfloat16) if can_pack(d, CPU)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="torch has no oneDNN on this CPU")


def _layer(dtype: torch.dtype, bias: bool) -> tuple[torch.nn.Linear, PackedLinear]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40, bias=bias).to(dtype)
    return linear, PackedLinear(linear.weight, linear.bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3, 64])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool, num_rows: int) -> None:
    linear, packed = _layer(dtype, bias)
    x = torch.randn(2, num_rows, 48).to(dtype)
    out = packed(x)
    assert out.shape == (2, num_rows, 40) and out.dtype == dtype
    # oneDNN sums in another order than MKL's float32 GEMM; bfloat16 rounds its output.
    atol = 1e-5 if dtype is torch.float32 else 0.05
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), atol=atol, rtol=0.01)


@pytest.mark.skipif(not cpp_compiler_available(), reason="inductor needs a C++ compiler")
def test_compiled_graphs_call_the_packed_kernel() -> None:
    """Inductor lowers the custom op to oneDNN's kernel (its own lowering of that
    kernel refuses a weight that is a graph input)."""
    linear, packed = _layer(DTYPES[-1], bias=True)

    def mlp(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        return F.silu(layer(x)) * 2

    compiled = compile_piece(mlp)
    codes_seen = []
    # A fresh cache: a graph cached before the lowering existed would still call the body.
    with torch.inference_mode(), fresh_cache():
        for num_rows in (1, 5, 9):  # batch of one, then the dynamic graph twice
            x = torch.randn(num_rows, 48).to(linear.weight.dtype)
            out, codes = run_and_get_code(compiled, packed, x)
            # Equal up to float32 rounding: inductor fuses the silu its own way.
            torch.testing.assert_close(out, mlp(packed, x))
            codes_seen += codes
    # The graphs call oneDNN itself, not the custom op's Python body.
    code = "\n".join(codes_seen)
    assert "torch.ops.mkldnn._linear_pointwise.default(" in code
    assert "torch.ops.kvmesh.onednn_linear.default(" not in code


def test_pack_linears_replaces_what_it_can() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4)),
                                torch.nn.Linear(4, 4).half(), torch.nn.LayerNorm(4))
    assert pack_linears_(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert isinstance(model[2], torch.nn.Linear)  # float16: oneDNN's packed linear does not serve it


def test_packed_linear_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match=r"PackedLinear needs a 2-D CPU weight.*float16 \(4, 4\)"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.float16), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_model_computes_the_same_logits(tmp_path: Path, dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float linear and the tied head packed; an int8 model keeps its int8 layers.
    Bfloat16 shapes measured in oneDNN's favour (test_bf16_linear.py has the others)."""
    monkeypatch.setattr("services.worker.models.llama.bf16_max_rows_by_shape",
                        lambda weights: {})
    save_tiny_hf_model(tmp_path, transformers.LlamaConfig, tie_word_embeddings=True)
    dtype_name = str(dtype).removeprefix("torch.")
    model, config = load_model(tmp_path, dtype_name, "cpu")
    token_ids = list(range(3, 40))
    before = perplexity(model, config, token_ids)
    assert model.pack_weights_() == 4 * config.num_layers + 1
    assert isinstance(model.lm_head, PackedLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.model.embed_tokens.weight.layout is torch.strided  # the lookup keeps its table
    assert perplexity(model, config, token_ids) == pytest.approx(before, rel=1e-4)

    int8_model, _ = load_model(tmp_path, dtype_name, "cpu", quantization="int8")
    assert int8_model.pack_weights_() == 0
    assert isinstance(int8_model.lm_head, Int8Linear)
