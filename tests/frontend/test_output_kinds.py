"""Output kinds, stream interval, finish reasons and logprobs of RequestOutputs."""

from __future__ import annotations

import pytest

from services.common.engine import EngineCoreOutput, FinishReason, Logprobs
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.output_processor import OutputProcessor
from services.frontend.outputs import Logprob

TEXT = "Bonjour 🤗! 你好 café.\ndef f(): pass  # 😀"
EOS = 2


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def run(input_processor, processor, stream, kind, token_ids, stop=(), external_id="r"):
    params = SamplingParams(output_kind=kind, stop=list(stop), max_tokens=100)
    request = input_processor.process_inputs(external_id, "Say something.", params)
    processor.add_request(request, "Say something.")
    return stream(processor, request.request_id, [*token_ids, EOS], FinishReason.STOP)


@pytest.mark.parametrize("stop", [(), ("zz", "\n\n")])
def test_delta_chunks_concatenate_to_the_final_only_output(
    input_processor, output_processor, stream, text_ids, stop
):
    final_only = run(input_processor, output_processor, stream,
                     RequestOutputKind.FINAL_ONLY, text_ids, stop)
    delta = run(input_processor, output_processor, stream, RequestOutputKind.DELTA, text_ids, stop)

    assert len(final_only) == 1 and final_only[0].finished
    final = final_only[0].outputs[0]
    assert final.text == TEXT
    assert final.token_ids == [*text_ids, EOS]
    assert len(delta) == len(text_ids) + 1
    assert [o.finished for o in delta] == [False] * len(text_ids) + [True]
    assert "".join(o.outputs[0].text for o in delta) == final.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == final.token_ids
    assert all(len(o.outputs[0].token_ids) == 1 for o in delta)


def test_cumulative_grows_monotonically(input_processor, output_processor, stream, text_ids):
    outputs = run(input_processor, output_processor, stream, RequestOutputKind.CUMULATIVE, text_ids)
    assert len(outputs) == len(text_ids) + 1
    for previous, current in zip(outputs, outputs[1:]):
        prev, cur = previous.outputs[0], current.outputs[0]
        assert cur.text.startswith(prev.text)
        assert cur.token_ids[: len(prev.token_ids)] == prev.token_ids
        assert len(cur.token_ids) == len(prev.token_ids) + 1
    assert outputs[-1].outputs[0].text == TEXT
    assert all(o.request_id == "r" for o in outputs)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stream_interval_sends_first_token_then_every_k(
    tokenizer, input_processor, stream, text_ids, kind
):
    processor = OutputProcessor(tokenizer, stream_interval=4)
    token_ids = text_ids[:10]
    outputs = run(input_processor, processor, stream, kind, token_ids)
    # 11 tokens with EOS: sent after token 1, 5, 9, and at the finish (11).
    sizes = [len(o.outputs[0].token_ids) for o in outputs]
    assert sizes == ([1, 4, 4, 2] if kind == RequestOutputKind.DELTA else [1, 5, 9, 11])
    assert outputs[-1].finished


def test_length_and_abort_finish_reasons(input_processor, output_processor):
    request = input_processor.process_inputs("r", "Hi", SamplingParams(max_tokens=2))
    output_processor.add_request(request, "Hi")
    result = output_processor.process_outputs(
        [EngineCoreOutput(request.request_id, [504], num_cached_tokens=16),
         EngineCoreOutput("unknown-id", [1])]
    )
    assert result.request_outputs[0].num_cached_tokens == 16
    result = output_processor.process_outputs(
        [EngineCoreOutput(request.request_id, [6376], finish_reason=FinishReason.LENGTH)]
    )
    completion = result.request_outputs[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        "The sky", "length", None)
    assert result.reqs_to_abort == []

    request = input_processor.process_inputs("r2", "Hi", SamplingParams())
    output_processor.add_request(request, "Hi")
    result = output_processor.process_outputs(
        [EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)]
    )
    assert result.request_outputs[0].outputs[0].finish_reason == "abort"
    assert not output_processor.has_unfinished_requests()


def test_ignored_request_carries_the_engine_message(input_processor, output_processor):
    request = input_processor.process_inputs("r", "Hi", SamplingParams())
    output_processor.add_request(request, "Hi")
    message = "prompt needs 300 blocks, the KV cache has 10"
    result = output_processor.process_outputs([EngineCoreOutput(
        request.request_id, [], finish_reason=FinishReason.LENGTH, finish_message=message)])
    completion = result.request_outputs[0].outputs[0]
    assert (completion.finish_reason, completion.finish_message, completion.text) == (
        "length", message, "")


def logprob_rows(rows: list[tuple[int, float, int, list[tuple[int, float]]]]) -> Logprobs:
    """Engine rows: (chosen id, its logprob, its rank, top-N [(id, logprob)])."""
    return Logprobs(
        token_ids=[[chosen, *(t for t, _ in top)] for chosen, _, _, top in rows],
        logprobs=[[lp, *(l for _, l in top)] for _, lp, _, top in rows],
        sampled_token_ranks=[rank for _, _, rank, _ in rows],
    )


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_logprobs_and_prompt_logprobs(input_processor, output_processor, kind):
    params = SamplingParams(logprobs=2, prompt_logprobs=1, output_kind=kind)
    request = input_processor.process_inputs("r", [504, 6376, 314], params)
    output_processor.add_request(request, None)
    rid = request.request_id
    # Step 1: the prompt (2 rows: " sky" | "The", " is" | "The sky") and the first sample.
    prompt_rows = logprob_rows([(6376, -3.0, 7, [(3575, -1.0)]), (314, -0.5, 1, [(314, -0.5)])])
    first = output_processor.process_outputs([EngineCoreOutput(
        rid, [4461], new_logprobs=logprob_rows([(4461, -0.25, 2, [(2066, -0.2), (4461, -0.25)])]),
        new_prompt_logprobs=prompt_rows)]).request_outputs[0]
    second = output_processor.process_outputs([EngineCoreOutput(
        rid, [30], new_logprobs=logprob_rows([(30, -0.5, 1, [(30, -0.5), (2066, -3.0)])]),
        finish_reason=FinishReason.LENGTH)]).request_outputs[0]

    position_0 = {4461: Logprob(-0.25, 2, " blue"), 2066: Logprob(-0.2, 1, " big")}
    position_1 = {30: Logprob(-0.5, 1, "."), 2066: Logprob(-3.0, 2, " big")}
    assert first.prompt_logprobs == [
        None, {6376: Logprob(-3.0, 7, " sky"), 3575: Logprob(-1.0, 1, " capital")},
        {314: Logprob(-0.5, 1, " is")}]
    assert first.outputs[0].logprobs == [position_0]
    assert first.outputs[0].cumulative_logprob == -0.25
    assert list(first.outputs[0].logprobs[0]) == [4461, 2066]  # the chosen token first
    assert second.outputs[0].cumulative_logprob == -0.75
    if kind == RequestOutputKind.DELTA:
        assert second.outputs[0].logprobs == [position_1]
        assert second.prompt_logprobs is None  # already sent
    else:
        assert second.outputs[0].logprobs == [position_0, position_1]
        assert second.prompt_logprobs == first.prompt_logprobs


def test_no_logprobs_unless_asked(input_processor, output_processor, stream):
    request = input_processor.process_inputs("r", "Hi", SamplingParams())
    output_processor.add_request(request, "Hi")
    out = stream(output_processor, request.request_id, [504], FinishReason.LENGTH)[-1]
    assert out.prompt_logprobs is None
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
