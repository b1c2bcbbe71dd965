"""The measured choice between kvmesh's bfloat16 kernel and oneDNN: the rule on
injected timings, the measurement's early stop, and the per-machine cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.cpu_extension import has_cpu_kernel
from kernels.row_groups import PREFETCH_MODES, row_group_prefetch, set_row_group_prefetch
from services.worker.layers import linear_choice
from services.worker.layers.bf16_linear import UNBOUNDED_ROWS
from services.worker.layers.linear_choice import (ONEDNN, ONEDNN_PLAIN, OURS,
                                                  bf16_max_rows_by_shape, choose_max_rows,
                                                  measure_row_timings, rival)
from services.worker.layers.packed_linear import can_pack

needs_kernel = pytest.mark.skipif(not has_cpu_kernel("bf16_linear_dispatch"),
                                  reason="kvmesh's CPU kernels are built for AVX-512 and AVX2")


# What ours is measured against here: oneDNN prepacked, or plain where oneDNN has no
# native bfloat16 (AVX2-only CPUs).
RIVAL = rival()


def _timings(ours_us: dict[int, float], onednn_us: float = 100.0,
             theirs: str = ONEDNN) -> dict[int, dict[str, float]]:
    return {rows: {OURS: us * 1e-6, theirs: onednn_us * 1e-6} for rows, us in ours_us.items()}


def test_the_rival_is_what_onednn_runs_here() -> None:
    assert RIVAL == (ONEDNN if can_pack(torch.bfloat16, torch.device("cpu")) else ONEDNN_PLAIN)


@pytest.mark.parametrize(("ours_us", "expected"), [
    ({1: 50, 2: 60, 4: 70}, UNBOUNDED_ROWS),  # won at the largest count too
    ({1: 150, 2: 60}, 0),  # lost at one row: never ours
    ({1: 50, 2: 60, 4: 99, 8: 120, 16: 90}, 4),  # the first loss ends it; a later win counts not
    ({1: 50, 2: 110, 4: 60}, UNBOUNDED_ROWS),  # within 10% is a tie, and a tie is ours
    ({1: 50, 2: 111}, 1),  # more than 10% slower: a loss
    ({4: 50, 1: 50, 2: 200}, 1),  # counts are read in order, however given
])
def test_choose_max_rows(ours_us: dict[int, float], expected: int) -> None:
    assert choose_max_rows(_timings(ours_us)) == expected


def test_measurement_stops_after_a_confirmed_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss is timed twice (the faster of the two counts): a loss that the second
    timing undoes goes on; a confirmed one stops the measurement."""
    monkeypatch.setattr(linear_choice.WeightCopies, "make", classmethod(lambda cls, n, k: None))
    # ours' us per timing: a stall at one row that the second timing undoes, a
    # confirmed loss at four.
    sequence = {1: [150, 60], 2: [70], 4: [150, 140], 8: [60]}
    calls = []

    def fake_time_rows(copies, num_rows: int, kernels) -> dict[str, float]:
        calls.append(num_rows)
        return {OURS: sequence[num_rows].pop(0) * 1e-6, RIVAL: 100e-6}

    monkeypatch.setattr(linear_choice, "time_rows", fake_time_rows)
    timings = measure_row_timings(64, 64, num_rows=(1, 2, 4, 8))
    assert calls == [1, 1, 2, 4, 4]  # 8 never measured
    assert timings[1][OURS] == pytest.approx(60e-6)
    assert choose_max_rows(timings, theirs=RIVAL) == 2


@needs_kernel
def test_real_measurement_times_each_kernel() -> None:
    kernels = {OURS, ONEDNN_PLAIN, RIVAL}  # oneDNN prepacked only where it runs bfloat16
    timings = measure_row_timings(64, 64, num_rows=(1, 3), kernels=kernels,
                                  stop_at_first_loss=False)
    assert sorted(timings) == [1, 3]
    assert all(0 < s < 1 for t in timings.values() for s in t.values())
    assert all(set(t) == kernels for t in timings.values())


@needs_kernel
def test_ours_counts_in_its_fastest_prefetch_mode_and_the_mode_in_force_stays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen_modes = []
    ours_us = {"whole_group": 90.0, "first_lines": 70.0, "none": 40.0, "ahead": 60.0}

    def fake_fastest_call_s(calls, *args) -> dict[str, float]:
        fastest = {}
        for name, call in calls.items():
            call(0)
            mode = row_group_prefetch()
            seen_modes.append(mode)
            fastest[name] = (ours_us[mode] if name.startswith(OURS) else 50.0) * 1e-6
        return fastest

    monkeypatch.setattr(linear_choice, "fastest_call_s", fake_fastest_call_s)
    set_row_group_prefetch("first_lines")
    try:
        copies = linear_choice.WeightCopies.make(64, 64)
        timings = linear_choice.time_rows(copies, 1, (OURS, ONEDNN_PLAIN))
        assert row_group_prefetch() == "first_lines"
    finally:
        set_row_group_prefetch(PREFETCH_MODES[0])
    assert set(seen_modes) == set(PREFETCH_MODES)
    assert timings == {OURS: pytest.approx(40e-6), ONEDNN_PLAIN: pytest.approx(50e-6)}


@pytest.fixture
def fake_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A cache under ``tmp_path``; measurement replaced by one whose result is 8 rows
    for every shape; returns the shapes measured, in order."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    measured = []

    def fake_measure(out_features: int, in_features: int,
                     theirs: str | None = None) -> dict[int, dict[str, float]]:
        measured.append((out_features, in_features))
        return _timings({1: 50, 8: 60, 16: 150}, theirs=RIVAL)

    monkeypatch.setattr(linear_choice, "measure_row_timings", fake_measure)
    return measured


def _weights(*shapes: tuple[int, int]) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]


@needs_kernel
def test_each_shape_is_measured_once_then_read(fake_measurement: list) -> None:
    weights = _weights((64, 96), (32, 64), (64, 96))
    assert bf16_max_rows_by_shape(weights) == {(32, 64): 8, (64, 96): 8}
    assert fake_measurement == [(32, 64), (64, 96)]  # one measurement per shape
    assert bf16_max_rows_by_shape(weights) == {(32, 64): 8, (64, 96): 8}
    assert len(fake_measurement) == 2  # the second time, from the files
    stored = json.loads((linear_choice.cache_dir() / "64x96.json").read_text())
    assert stored["max_rows"] == 8 and stored["timings_us"]["16"] == {OURS: 150.0, RIVAL: 100.0}


@needs_kernel
def test_only_weights_the_kernel_serves_are_measured(fake_measurement: list) -> None:
    weights = [torch.empty(8, 64), torch.empty(8, 48, dtype=torch.bfloat16)]  # float32; K % 32
    assert bf16_max_rows_by_shape(weights) == {}
    assert fake_measurement == []


@needs_kernel
@pytest.mark.parametrize("content", ["{not json", '{"max_rows": -1}', '{"max_rows": "8"}',
                                     '{"max_rows": true}', '["max_rows"]', "{}"])
def test_a_bad_cache_file_is_measured_anew(fake_measurement: list, content: str) -> None:
    path = linear_choice.cache_dir() / "32x64.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert bf16_max_rows_by_shape(_weights((32, 64))) == {(32, 64): 8}
    assert fake_measurement == [(32, 64)]
    assert json.loads(path.read_text())["max_rows"] == 8  # replaced


@needs_kernel
def test_an_edited_cache_file_overrides_the_choice(fake_measurement: list) -> None:
    """0 rows in the file: oneDNN only for that shape on this machine, unmeasured."""
    path = linear_choice.cache_dir() / "32x64.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"max_rows": 0}')
    assert bf16_max_rows_by_shape(_weights((32, 64))) == {(32, 64): 0}
    assert fake_measurement == []


def test_the_cache_is_per_thread_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_choice.cache_dir()
        torch.set_num_threads(2)
        two = linear_choice.cache_dir()
    finally:
        torch.set_num_threads(threads)
    assert one != two and one.parent == two.parent == tmp_path / "linear_choice"
