"""The measured row count up to which a quantized model's layers use their kernel:
the layers grouped as a step calls them, the measurement's early stop, the choice
set on every layer and cached per machine, and the width warm-up compiles for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels import gguf_quants
from kernels.gguf_quants import GGMLQuantizationType
from services.worker.layers import quantized_choice
from services.worker.layers.bf16_linear import UNBOUNDED_ROWS
from services.worker.layers.gguf_linear import GGUFLinear
from services.worker.layers.linear_choice import MAX_MEASURED_OUT_FEATURES
from services.worker.layers.quantization import DEFAULT_KERNEL_MAX_ROWS, Int8Linear
from services.worker.layers.quantized_choice import (DEQUANTIZE, KERNEL, layer_groups,
                                                     measure_model_rows, set_kernel_max_rows_,
                                                     wide_rows)


def _int8(out_features: int, in_features: int = 64, w8a8: bool = False) -> Int8Linear:
    gen = torch.Generator().manual_seed(out_features)
    layer = Int8Linear.from_float(torch.randn(out_features, in_features, generator=gen),
                                  torch.randn(out_features, generator=gen), torch.float32)
    if w8a8:
        assert layer.use_dynamic_activations()
    return layer


def _model() -> torch.nn.Module:
    """Two int8 layers of one shape, a w8a8 one of the same shape, and a tall head."""
    return torch.nn.ModuleList([_int8(32), _int8(32), _int8(32, w8a8=True),
                                _int8(MAX_MEASURED_OUT_FEATURES * 3)])


def test_layers_are_grouped_by_format_and_shape_and_a_tall_one_narrowed() -> None:
    model = _model()
    groups = layer_groups(quantized_choice.quantized_layers(model))
    assert {key: count for key, (_, count) in groups.items()} == {
        "Int8Linear:int8:32x64": 2, "Int8Linear:w8a8:32x64": 1,
        f"Int8Linear:int8:{MAX_MEASURED_OUT_FEATURES * 3}x64": 3}
    (narrowed,), _ = groups[f"Int8Linear:int8:{MAX_MEASURED_OUT_FEATURES * 3}x64"]
    assert narrowed.out_features == MAX_MEASURED_OUT_FEATURES
    assert narrowed.qweight.data_ptr() == model[3].qweight.data_ptr()  # a view, not a copy


@pytest.mark.parametrize("make", [
    lambda: _int8(40),
    lambda: _int8(40, in_features=128, w8a8=True),
    lambda: GGUFLinear(gguf_quants.quantize(torch.randn(40, 64), GGMLQuantizationType.Q4_1),
                       GGMLQuantizationType.Q4_1, 64, torch.randn(40)),
])
def test_forward_takes_the_kernel_up_to_kernel_max_rows(make) -> None:
    """At up to ``kernel_max_rows`` rows the layer's output is its kernel's, above it
    the dequantized GEMM's; both with the bias, and narrowing keeps the kernel's
    values for the channels kept."""
    layer = make()
    layer.kernel_max_rows = 3
    x = torch.randn(5, layer.in_features)
    assert torch.equal(layer(x[:3]), layer.kernel_linear(x[:3]) + layer.bias)
    assert torch.equal(layer(x), layer.dequantized_linear(x) + layer.bias)
    torch.testing.assert_close(layer.narrow(7).kernel_linear(x), layer.kernel_linear(x)[:, :7])


def test_measurement_sums_a_step_and_stops_after_a_confirmed_loss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group's fastest call counts as many times as it has layers; a loss is
    timed twice (the faster counts); a confirmed one stops the measurement."""
    # The 32x64 pair's kernel us per timing, by rows: a stall at one row that the
    # retry undoes, a confirmed loss at four (by more than a tie's 10%).
    pair_us = {1: [400, 60], 2: [70], 4: [200, 190], 8: [60]}
    calls = []

    def fake_time_group(layers, num_rows: int, dtype) -> dict[str, float]:
        calls.append(num_rows)
        kernel_us = pair_us[num_rows].pop(0) if len(layers) == 2 else 10
        return {KERNEL: kernel_us * 1e-6, DEQUANTIZE: 100e-6}

    monkeypatch.setattr(quantized_choice, "time_group", fake_time_group)
    model = torch.nn.ModuleList([_int8(32), _int8(32), _int8(16)])
    timings = measure_model_rows(quantized_choice.quantized_layers(model), torch.float32,
                                 num_rows=(1, 2, 4, 8))
    assert calls == [1, 1, 1, 1, 2, 2, 4, 4, 4, 4]  # two groups a timing; 8 never measured
    assert timings[1][KERNEL] == pytest.approx((2 * 60 + 10) * 1e-6)
    assert timings[1][DEQUANTIZE] == pytest.approx(300e-6)
    assert timings[4][KERNEL] == pytest.approx(390e-6)


def test_real_measurement_times_both_ways() -> None:
    timings = measure_model_rows(quantized_choice.quantized_layers(_model()), torch.float32,
                                 num_rows=(1, 40), stop_at_first_loss=False)
    assert set(timings) == {1, 40}
    assert all(0 < s < 1 for by_way in timings.values() for s in by_way.values())


def test_choice_is_set_on_every_layer_and_cached(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    fake = {1: {KERNEL: 1e-6, DEQUANTIZE: 5e-6}, 2: {KERNEL: 2e-6, DEQUANTIZE: 5e-6},
            4: {KERNEL: 6e-6, DEQUANTIZE: 5e-6}}
    monkeypatch.setattr(quantized_choice, "measure_model_rows", lambda layers, dtype: fake)
    model = _model()
    assert set_kernel_max_rows_(model, torch.float32) == 2
    assert {layer.kernel_max_rows for layer in model} == {2}
    assert wide_rows(model) == 3
    (path,) = tmp_path.glob("linear_choice/quantized_*/*.json")
    assert json.loads(path.read_text())["max_rows"] == 2

    # The next start reads the file; an edited one overrides the choice.
    measured = []
    monkeypatch.setattr(quantized_choice, "measure_model_rows",
                        lambda layers, dtype: measured.append(dtype) or fake)
    path.write_text(json.dumps({"max_rows": 0}))
    model = _model()
    assert set_kernel_max_rows_(model, torch.float32) == 0 and not measured
    assert {layer.kernel_max_rows for layer in model} == {0}
    # Activations of another dtype (or another model) are another file, measured anew.
    assert set_kernel_max_rows_(model, torch.bfloat16) == 2 and measured == [torch.bfloat16]
    assert len(list(tmp_path.glob("linear_choice/quantized_*/*.json"))) == 2


def test_wide_rows() -> None:
    model = _model()
    assert model[0].kernel_max_rows == DEFAULT_KERNEL_MAX_ROWS
    model[1].kernel_max_rows = 7
    assert wide_rows(model) == 8  # where the first layer dequantizes
    for layer in model:
        layer.kernel_max_rows = UNBOUNDED_ROWS
    assert wide_rows(model) is None
    assert wide_rows(torch.nn.Linear(4, 4)) is None
    assert set_kernel_max_rows_(torch.nn.Linear(4, 4), torch.float32) is None
