"""Per-request timing (TTFT, TPOT, ITL) and token counts on RequestOutput.metrics."""

from __future__ import annotations

import pytest

from services.common.engine import EngineCoreOutput, FinishReason
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.metrics import RequestStateStats


def test_metrics_through_the_output_processor(input_processor, output_processor):
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, max_tokens=10)
    request = input_processor.process_inputs("r", [5] * 20, params, arrival_time=100.0)
    output_processor.add_request(request, None)
    rid = request.request_id
    # t=100.5: a prefill chunk, no token yet. t=101.0: first token (prompt
    # done, 16 tokens were a prefix-cache hit). Then 2 tokens in one step, 1 more.
    steps = [(100.5, [], None), (101.0, [504], None), (101.25, [6376, 314], None),
             (102.0, [4461], FinishReason.LENGTH)]
    outputs = []
    for timestamp, tokens, finish in steps:
        outputs += output_processor.process_outputs(
            [EngineCoreOutput(rid, tokens, finish_reason=finish, num_cached_tokens=16)],
            engine_timestamp=timestamp).request_outputs

    assert len(outputs) == 1
    metrics = outputs[0].metrics
    assert outputs[0].num_cached_tokens == 16
    assert (metrics.num_prompt_tokens, metrics.num_cached_tokens,
            metrics.num_generation_tokens) == (20, 16, 4)
    assert metrics.ttft_s == pytest.approx(1.0)
    assert metrics.inter_token_latencies_s == pytest.approx([0.25, 0.75])
    assert metrics.tpot_s == pytest.approx(1.0 / 3)
    assert metrics.e2e_latency_s == pytest.approx(2.0)


def test_tokens_dropped_by_a_stop_string_are_not_counted(input_processor, output_processor):
    request = input_processor.process_inputs("r", "Hi", SamplingParams(stop=["sky"]),
                                             arrival_time=0.0)
    output_processor.add_request(request, "Hi")
    out = output_processor.process_outputs(
        [EngineCoreOutput(request.request_id, [504, 6376, 314, 4461])], engine_timestamp=0.5)
    metrics = out.request_outputs[0].metrics
    assert metrics.num_generation_tokens == 2  # "The sky"; " is blue" came after the stop
    assert (metrics.ttft_s, metrics.tpot_s) == (0.5, 0.0)


def test_stats_before_any_token():
    stats = RequestStateStats(arrival_time=5.0, num_prompt_tokens=3)
    stats.observe_tokens(0, 6.0)
    assert (stats.ttft_s, stats.tpot_s, stats.e2e_latency_s) == (None, None, None)
    stats.observe_tokens(1, 7.0)
    assert (stats.ttft_s, stats.tpot_s, stats.num_generation_tokens) == (2.0, None, 1)
