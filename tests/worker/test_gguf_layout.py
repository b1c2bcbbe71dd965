"""The measured choice of a GGUF weight's layout (the file's rows, or packed by
eight): the real measurement, the per-machine cache, and the layer that obeys it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import gguf_quants
from kernels.cpu_extension import has_cpu_kernel
from kernels.gguf_quants import GGMLQuantizationType
from services.worker.layers import gguf_layout
from services.worker.layers.gguf_layout import PACKED, PLAIN, measure_layouts, packed_layout_wins
from services.worker.layers.gguf_linear import GGUFLinear
from services.worker.layers.linear_choice import cache_dir

needs_kernel = pytest.mark.skipif(not has_cpu_kernel("gguf_linear_packed_cpu"),
                                  reason="kvmesh's C++ kernels are not built on this machine")
Q4_1 = GGMLQuantizationType.Q4_1


@needs_kernel
def test_real_measurement_times_both_layouts() -> None:
    timings = measure_layouts(int(Q4_1), shape=(64, 96))
    assert set(timings) == {PLAIN, PACKED} and all(0 < s < 1 for s in timings.values())


@pytest.fixture
def fake_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A cache under ``tmp_path`` and none in the process; measurement replaced by one
    in which the packed layout wins; yields the block types measured, in order."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    measured = []

    def fake_measure(quant_type: int) -> dict[str, float]:
        measured.append(quant_type)
        return {PLAIN: 2e-5, PACKED: 1e-5}

    monkeypatch.setattr(gguf_layout, "measure_layouts", fake_measure)
    packed_layout_wins.cache_clear()
    yield measured
    packed_layout_wins.cache_clear()


@needs_kernel
def test_each_block_type_is_measured_once_then_read(fake_measurement: list) -> None:
    assert packed_layout_wins(int(Q4_1)) and packed_layout_wins(int(Q4_1))
    packed_layout_wins.cache_clear()
    assert packed_layout_wins(int(Q4_1))  # from the file this time
    assert fake_measurement == [int(Q4_1)]
    stored = json.loads((cache_dir("gguf_layout") / "Q4_1.json").read_text())
    assert stored == {"packed": True, "timings_us": {PLAIN: 20.0, PACKED: 10.0}}


@needs_kernel
@pytest.mark.parametrize("content", ["{not json", '{"packed": 1}', "{}", "[]"])
def test_a_bad_cache_file_is_measured_anew(fake_measurement: list, content: str) -> None:
    path = cache_dir("gguf_layout") / "Q4_1.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert packed_layout_wins(int(Q4_1))
    assert fake_measurement == [int(Q4_1)]
    assert json.loads(path.read_text())["packed"] is True  # replaced


@needs_kernel
def test_an_edited_cache_file_overrides_the_choice(fake_measurement: list) -> None:
    path = cache_dir("gguf_layout") / "Q4_1.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"packed": false}')
    assert not packed_layout_wins(int(Q4_1))
    assert fake_measurement == []


@needs_kernel
def test_layers_are_packed_as_measured_when_their_rows_allow(fake_measurement: list) -> None:
    def layer(out_features: int) -> GGUFLinear:
        return GGUFLinear(gguf_quants.quantize(torch.randn(out_features, 64), Q4_1), Q4_1, 64)

    assert layer(16).packed and layer(16).weight_format == "Q4_1 packed"
    assert not layer(12).packed and layer(12).weight_format == "Q4_1"  # not whole groups of 8


def test_without_the_packed_kernel_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_layout, "has_cpu_kernel", lambda name: False)
    packed_layout_wins.cache_clear()
    try:
        assert not packed_layout_wins(int(Q4_1))
    finally:
        packed_layout_wins.cache_clear()
