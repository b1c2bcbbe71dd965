"""RequestOutput.add and the collector that merges outputs a slow consumer has not taken."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.frontend.async_llm import RequestFailedError, RequestOutputCollector
from services.frontend.outputs import CompletionOutput, Logprob, RequestOutput


def delta(index: int, text: str, token_ids: list[int], finish_reason: str | None = None,
          with_logprobs: bool = True) -> RequestOutput:
    logprobs = ([{t: Logprob(-float(t), 1)} for t in token_ids] if with_logprobs else None)
    completion = CompletionOutput(index, text, token_ids, cumulative_logprob=-float(sum(token_ids)),
                                  logprobs=logprobs, finish_reason=finish_reason)
    return RequestOutput("r", "p", [9], None, [completion], finished=finish_reason is not None)


def test_delta_outputs_concatenate_per_sequence():
    first, second = delta(0, "Hel", [1]), delta(0, "lo", [2, 3], finish_reason="stop")
    callers_list = first.outputs
    first.add(second, aggregate=True)
    (merged,) = first.outputs
    assert (merged.text, merged.token_ids, merged.finish_reason) == ("Hello", [1, 2, 3], "stop")
    assert [list(p) for p in merged.logprobs] == [[1], [2], [3]]
    assert merged.cumulative_logprob == -5.0 and first.finished
    assert callers_list[0].text == "Hel"  # what the caller handed over is untouched


def test_sequences_of_n_keep_their_index_and_cumulative_outputs_replace():
    first = delta(0, "a", [1])
    first.add(delta(1, "b", [2]), aggregate=True)
    first.add(delta(0, "c", [3], with_logprobs=False), aggregate=True)
    assert [(c.index, c.text, c.token_ids) for c in first.outputs] == [(0, "ac", [1, 3]),
                                                                       (1, "b", [2])]
    cumulative = delta(0, "a", [1])
    cumulative.add(delta(0, "ab", [1, 2]), aggregate=False)
    assert [(c.text, c.token_ids) for c in cumulative.outputs] == [("ab", [1, 2])]


def test_collector_merges_what_the_consumer_has_not_taken():
    async def scenario():
        collector = RequestOutputCollector(aggregate=True)
        collector.put(delta(0, "a", [1]))
        first = await collector.get()
        for i, text in enumerate("bcd", start=2):
            collector.put(delta(0, text, [i]))
        merged = await collector.get()
        collector.put(delta(0, "e", [5]))
        collector.put(RequestFailedError(grpc.StatusCode.UNAVAILABLE, "lost"))
        last = await collector.get()
        with pytest.raises(RequestFailedError, match="lost"):
            await collector.get()
        return first, merged, last

    first, merged, last = asyncio.run(scenario())
    assert first.outputs[0].token_ids == [1]
    assert (merged.outputs[0].text, merged.outputs[0].token_ids) == ("bcd", [2, 3, 4])
    assert last.outputs[0].token_ids == [5]
