"""GGUFLinear: a GGUF file's blocks served as they are, against their dequantized
weights; the default model with ``quantization="gguf"``, its quality against the
same model's floats (the chat answer is checked in test_cpu_dtypes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from kernels import gguf_quants
from kernels.gguf_linear_cpu import gguf_linear_ref, pack_rows
from kernels.gguf_quants import GGMLQuantizationType
from services.worker.layers import quantization
from services.worker.layers.gguf_linear import GGUFLinear
from services.worker.layers.quantization import DEFAULT_KERNEL_MAX_ROWS
from services.worker.model_loader import load_model
from tests.worker.test_quantization import TEXT, perplexity

# The block kernel quantizes activations to int8 per block of 32: perplexity may
# exceed that of the same floats by at most this fraction (measured: 0.01% in
# float32, 0.13% in bfloat16).
MAX_PERPLEXITY_INCREASE = 0.01


# Both layouts, whichever this machine measured faster (services/worker/layers/gguf_layout.py).
LAYOUTS = pytest.mark.parametrize("packed", [False, True], ids=["file", "packed"])


def _layer(quant_type: GGMLQuantizationType, bias_dtype: torch.dtype, packed: bool = False
           ) -> tuple[GGUFLinear, torch.Tensor]:
    """A layer of 40 x 64 random weights, with a bias (in the model's dtype), kept in
    the file's layout or packed by eight rows, and its weight dequantized."""
    gen = torch.Generator().manual_seed(int(quant_type))
    qweight = gguf_quants.quantize(torch.randn(40, 64, generator=gen), quant_type)
    layer = GGUFLinear(pack_rows(qweight, quant_type) if packed else qweight, quant_type, 64,
                       torch.randn(40, generator=gen).to(bias_dtype), packed=packed)
    assert torch.equal(layer.file_rows(0, 40), qweight)
    return layer, gguf_quants.dequantize(qweight, quant_type, 64)


@LAYOUTS
@pytest.mark.parametrize("quant_type", list(GGMLQuantizationType))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 5, DEFAULT_KERNEL_MAX_ROWS + 4])
def test_layer_computes_its_blocks_product(quant_type: GGMLQuantizationType, dtype: torch.dtype,
                                           num_rows: int, packed: bool) -> None:
    """Few rows: the block kernel's product (int8 activations); many rows: the
    GEMM on the dequantized weight; bias added either way, shape kept."""
    layer, weight = _layer(quant_type, dtype, packed)
    x = torch.randn(2, num_rows, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = layer(x)
    assert out.shape == (2, num_rows, 40) and out.dtype == dtype
    rows = x.reshape(-1, 64)
    if num_rows <= DEFAULT_KERNEL_MAX_ROWS:
        expected = (gguf_linear_ref(rows, layer.file_rows(0, 40), quant_type).float()
                    + layer.bias.float())
    else:
        expected = F.linear(rows.float(), weight, layer.bias.float())
    # bfloat16 rounds the output (values up to ~30 here) to 8 mantissa bits.
    tolerance = 1e-4 if dtype == torch.float32 else 0.25
    torch.testing.assert_close(out.reshape(-1, 40).float(), expected, atol=tolerance, rtol=0.01)


@LAYOUTS
def test_dequantized_gemm_in_chunks_of_output_channels(monkeypatch: pytest.MonkeyPatch,
                                                       packed: bool) -> None:
    layer, _ = _layer(GGMLQuantizationType.Q4_1, torch.float32, packed)
    x = torch.randn(DEFAULT_KERNEL_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(3))
    whole = layer(x)
    # Chunks of 7: packed, each unpacks the groups of eight it straddles.
    monkeypatch.setattr(quantization, "_DEQUANTIZE_CHUNK_BYTES", 7 * 64 * 4)
    # Equal up to float32 rounding: the GEMM's summation order may change with the
    # number of output channels (it does on an AVX2-only AMD EPYC).
    torch.testing.assert_close(layer(x), whole)


@pytest.mark.parametrize("out_features", [16, 7])
def test_a_packed_layer_narrows_to_its_first_rows(out_features: int) -> None:
    """Whole groups of eight stay packed and share storage; a partial one is unpacked."""
    layer, _ = _layer(GGMLQuantizationType.Q4_0, torch.float32, packed=True)
    narrowed = layer.narrow(out_features)
    assert narrowed.out_features == out_features and narrowed.bias is None
    assert narrowed.packed == (out_features == 16)
    assert (narrowed.qweight.data_ptr() == layer.qweight.data_ptr()) == (out_features == 16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(narrowed.kernel_linear(x), layer.kernel_linear(x)[:, :out_features])


def test_blocks_of_the_wrong_width_are_refused() -> None:
    qweight = gguf_quants.quantize(torch.randn(8, 64), GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match=r"qweight must be uint8 \[out_features, 40\] for Q4_1"):
        GGUFLinear(qweight, GGMLQuantizationType.Q4_1, 64)


def test_gguf_needs_a_gguf_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        load_model(tmp_path, "float32", "cpu", quantization="gguf")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_serves_its_own_blocks_within_a_stated_perplexity(
        dtype: str, default_model_dir: Path) -> None:
    token_ids = AutoTokenizer.from_pretrained(default_model_dir).encode(TEXT)
    floats, config = load_model(None, dtype, "cpu")
    model, _ = load_model(None, dtype, "cpu", quantization="gguf")
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 4 * config.num_layers + 1  # qkv, o, gate_up, down; the head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert {GGMLQuantizationType(m.quant_type).name for m in layers} == {"Q4_1", "Q8_0"}
    # The whole prompt through the block kernel, not the wide-batch GEMM.
    for layer in layers:
        layer.kernel_max_rows = len(token_ids)
    expected = perplexity(floats, config, token_ids)
    assert perplexity(model, config, token_ids) <= expected * (1 + MAX_PERPLEXITY_INCREASE)
