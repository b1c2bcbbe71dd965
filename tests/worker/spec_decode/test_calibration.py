"""The worker measures what verifying drafts costs before it registers."""

from __future__ import annotations

from services.common.speculative import SpeculativeConfig
from services.worker.spec_decode.calibration import measure_step_costs
from tests.worker.helpers import make_worker


def test_costs_are_measured_at_start_and_leave_the_worker_empty(tiny_model_dir):
    worker = make_worker(tiny_model_dir, num_kv_blocks=64,
                         speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    runner = worker.model_runner
    costs = runner.drafter.step_costs
    assert costs is not None and len(costs) == 4 and costs[0] == 1.0
    assert all(a <= b for a, b in zip(costs, costs[1:]))
    assert not runner.requests and runner.input_batch.num_reqs == 0
    # Too small a pool for the probe: no costs, every proposal is drafted.
    assert measure_step_costs(runner, 16, 3, 3) is None
