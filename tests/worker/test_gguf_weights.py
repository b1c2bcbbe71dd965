"""The default GGUF's own blocks, read under Hugging Face names: each dequantizes to
exactly the float weight transformers made of the same file (q/k rows unpermuted)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kernels import gguf_quants
from kernels.gguf_quants import GGMLQuantizationType
from services.common.model_files import default_gguf_path
from services.worker.gguf_weights import QuantizedWeight, fuse_quantized, read_quantized_linears
from services.worker.model_loader import iter_safetensors_weights


@pytest.mark.slow
def test_blocks_dequantize_to_the_checkpoints_floats(default_model_dir: Path) -> None:
    quantized = read_quantized_linears(default_gguf_path(), num_layers=30, num_heads=9,
                                       num_kv_heads=3)
    assert len(quantized) == 7 * 30 + 1  # seven linears a layer; the (tied) embedding
    checked = 0
    for name, tensor in iter_safetensors_weights(default_model_dir):
        if name in quantized:
            weight = quantized[name]
            assert torch.equal(gguf_quants.dequantize(weight.data, weight.quant_type,
                                                      weight.in_features), tensor), name
            checked += 1
    assert checked == len(quantized)


def _weight(rows: int, quant_type: GGMLQuantizationType, cols: int = 64) -> QuantizedWeight:
    return QuantizedWeight(gguf_quants.quantize(torch.randn(rows, cols), quant_type),
                           quant_type, cols)


def test_fused_parts_stack_by_rows_only_when_alike() -> None:
    q, k = _weight(8, GGMLQuantizationType.Q4_1), _weight(4, GGMLQuantizationType.Q4_1)
    fused = fuse_quantized([q, k])
    assert fused is not None and torch.equal(fused.data, torch.cat([q.data, k.data]))
    assert fuse_quantized([q, None]) is None  # a part stored otherwise stays float
    assert fuse_quantized([q, _weight(4, GGMLQuantizationType.Q8_0)]) is None
    assert fuse_quantized([q, _weight(4, GGMLQuantizationType.Q4_1, cols=96)]) is None


def test_a_gguf_of_another_architecture_is_refused(tmp_path: Path) -> None:
    """Only llama's converter permutes q/k rows: another architecture's would be
    read wrong, so it is refused, naming it."""
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="serves llama GGUF files; other.gguf is 'qwen2'"):
        read_quantized_linears(path, num_layers=1, num_heads=1, num_kv_heads=1)
