"""The kernels' prefetch mode the worker measures at start
(services/worker/layers/prefetch_choice.py)."""

from __future__ import annotations

import time

import pytest

from kernels.row_groups import PREFETCH_MODES, row_group_prefetch
from services.worker.layers.prefetch_choice import choose_row_group_prefetch
from tests.kernels.test_row_groups import needs_prefetch_switch, restore_the_mode  # noqa: F401

pytestmark = needs_prefetch_switch


@pytest.mark.parametrize("fastest", PREFETCH_MODES)
def test_the_mode_whose_step_is_fastest_is_kept(fastest: str):
    """A step that takes 2 ms in its fastest mode and 12 ms in the others."""
    def step():
        time.sleep(0.002 if row_group_prefetch() == fastest else 0.012)

    medians = choose_row_group_prefetch(step)
    assert row_group_prefetch() == fastest
    assert set(medians) == set(PREFETCH_MODES)
    assert min(medians, key=medians.__getitem__) == fastest
