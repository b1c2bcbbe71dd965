"""Stop strings: where they cut, which one wins, and what reaches the client."""

from __future__ import annotations

import pytest

from services.common.engine import EngineCoreOutput, FinishReason
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.stop_strings import find_stop_string, num_held_back_chars

TEXT = "The capital of France is Paris. It is big."
# 'The' ' capital' ' of' ' France' ' is' ' Paris' '.' ' It' ' is' ' big' '.'
TEXT_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 657, 314, 2066, 30]
EOS = 2


def test_text_ids_fixture(tokenizer):
    assert tokenizer.encode(TEXT, add_special_tokens=False) == TEXT_IDS


# ------------------------------------------------------------------ pure functions


def test_find_stop_string_earliest_end_wins_over_list_order():
    text = "abc Paris. It is"
    assert find_stop_string(text, 0, ["It is", "Paris"], False) == ("Paris", 4)
    assert find_stop_string(text, 0, ["It is", "Paris"], True) == ("Paris", 9)


def test_find_stop_string_equal_ends_prefer_the_longer_match():
    assert find_stop_string("xabc", 0, ["bc", "abc"], False) == ("abc", 1)


def test_find_stop_string_only_matches_ending_in_new_text():
    # "ab" ended before new_text_start=3: already searched, not reported again.
    assert find_stop_string("ab-ab", 3, ["ab"], False) == ("ab", 3)
    assert find_stop_string("ab-x", 3, ["ab"], False) is None
    # A match may start in old text as long as it ends in the new text.
    assert find_stop_string("xxab", 3, ["ab"], False) == ("ab", 2)


def test_held_back_chars_are_only_a_possible_stop_prefix():
    assert num_held_back_chars("Hello wor", ["world"]) == 3
    assert num_held_back_chars("Hello", ["\n\nUser:"]) == 0
    assert num_held_back_chars("Hello\n", ["\n\nUser:"]) == 1
    assert num_held_back_chars("Hello\n\nUser", ["\n\nUser:", "Use"]) == 6
    # Never the whole stop string: that would already be a match.
    assert num_held_back_chars("aa", ["aa"]) == 1


# ------------------------------------------------------------------ through OutputProcessor


def add(input_processor, output_processor, params: SamplingParams, prompt="Tell me."):
    request = input_processor.process_inputs("req", prompt, params)
    output_processor.add_request(request, prompt)
    return request.request_id


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_stop_string_across_two_tokens_never_leaks(
    input_processor, output_processor, stream, kind
):
    params = SamplingParams(stop=["Paris."], output_kind=kind, max_tokens=64)
    rid = add(input_processor, output_processor, params)
    outputs = stream(output_processor, rid, TEXT_IDS)

    final = outputs[-1].outputs[0]
    assert outputs[-1].finished
    assert final.finish_reason == "stop" and final.stop_reason == "Paris."
    texts = [o.outputs[0].text for o in outputs]
    assert all("Paris" not in t and "It" not in t for t in texts)
    if kind == RequestOutputKind.DELTA:
        # "Paris" is held back while it could still become "Paris.".
        assert texts == ["The", " capital", " of", " France", " is", " ", ""]
        assert "".join(texts) == "The capital of France is "
    else:
        assert final.text == "The capital of France is "
    assert not output_processor.has_unfinished_requests()


def test_finished_by_stop_string_lands_in_reqs_to_abort(input_processor, output_processor):
    rid = add(input_processor, output_processor, SamplingParams(stop=["France"]))
    for token_id in TEXT_IDS[:3]:
        result = output_processor.process_outputs([EngineCoreOutput(rid, [token_id])])
        assert result.reqs_to_abort == []
    result = output_processor.process_outputs([EngineCoreOutput(rid, [TEXT_IDS[3]])])
    assert result.reqs_to_abort == [rid]
    assert result.request_outputs[0].outputs[0].text == "The capital of "
    # The engine may still send a token before the abort lands: ignored.
    late = output_processor.process_outputs([EngineCoreOutput(rid, [TEXT_IDS[4]])])
    assert late.request_outputs == [] and late.reqs_to_abort == []


def test_later_stop_string_in_list_completing_first_wins(input_processor, output_processor):
    params = SamplingParams(
        stop=["big", "It is", "France"], output_kind=RequestOutputKind.FINAL_ONLY)
    rid = add(input_processor, output_processor, params)
    # All tokens in ONE engine step: the earliest completion must still win,
    # and the tokens after it are dropped.
    result = output_processor.process_outputs([EngineCoreOutput(rid, TEXT_IDS)])
    completion = result.request_outputs[0].outputs[0]
    assert completion.stop_reason == "France"
    assert completion.text == "The capital of "
    assert completion.token_ids == TEXT_IDS[:4]
    assert result.reqs_to_abort == [rid]


@pytest.mark.parametrize(
    "include, stop, expected",
    [
        (False, "Paris", "The capital of France is "),
        (True, "Paris", "The capital of France is Paris"),
        # The stop string ends inside the token " Paris": the rest is cut.
        (True, "Par", "The capital of France is Par"),
        (False, "Par", "The capital of France is "),
    ],
)
def test_include_stop_str_in_output(
    input_processor, output_processor, stream, include, stop, expected
):
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    rid = add(input_processor, output_processor, params)
    final = stream(output_processor, rid, TEXT_IDS)[-1].outputs[0]
    assert (final.text, final.stop_reason, final.token_ids) == (expected, stop, TEXT_IDS[:6])


def test_stop_string_and_eos_in_the_same_step(input_processor, output_processor):
    rid = add(input_processor, output_processor, SamplingParams(stop=["Paris"]))
    output_processor.process_outputs([EngineCoreOutput(rid, TEXT_IDS[:5])])
    result = output_processor.process_outputs(
        [EngineCoreOutput(rid, [7042, EOS], finish_reason=FinishReason.STOP)]
    )
    completion = result.request_outputs[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "Paris")
    assert completion.text == "The capital of France is "
    assert completion.token_ids == TEXT_IDS[:6]
    # The engine already finished the request: nothing to abort.
    assert result.reqs_to_abort == []


def test_eos_alone_is_not_a_stop_string(input_processor, output_processor, stream):
    rid = add(input_processor, output_processor, SamplingParams(stop=["zzz"]))
    final = stream(output_processor, rid, [*TEXT_IDS[:7], EOS], FinishReason.STOP)[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", None)
    assert final.text == "The capital of France is Paris."
    assert final.token_ids == [*TEXT_IDS[:7], EOS]


def test_stop_token_text_excluded_unless_asked(input_processor, output_processor, stream):
    # The engine stopped on the stop token "." (id 30): its text is left out.
    params = SamplingParams(stop_token_ids=[30])
    rid = add(input_processor, output_processor, params)
    final = stream(output_processor, rid, TEXT_IDS[:7], FinishReason.STOP, 30)[-1].outputs[0]
    assert (final.text, final.stop_reason) == ("The capital of France is Paris", 30)

    params = SamplingParams(stop_token_ids=[30], include_stop_str_in_output=True)
    rid = add(input_processor, output_processor, params)
    final = stream(output_processor, rid, TEXT_IDS[:7], FinishReason.STOP, 30)[-1].outputs[0]
    assert final.text == "The capital of France is Paris."


def test_no_stop_string_within_min_tokens(input_processor, output_processor, stream):
    # " is" completes at token 5 (within min_tokens=5) and is ignored; the
    # second " is" (token 9) stops the request.
    params = SamplingParams(stop=[" is"], min_tokens=5, max_tokens=16)
    rid = add(input_processor, output_processor, params)
    final = stream(output_processor, rid, TEXT_IDS)[-1].outputs[0]
    assert final.text == "The capital of France is Paris. It"
    assert final.token_ids == TEXT_IDS[:9]


def test_streaming_holds_back_only_a_possible_stop_prefix(
    input_processor, output_processor, stream, tokenizer
):
    ids = tokenizer.encode("Answer: 42\n\nUser: hi", add_special_tokens=False)
    params = SamplingParams(stop=["\n\nUser:"], output_kind=RequestOutputKind.DELTA)
    rid = add(input_processor, output_processor, params)
    texts = [o.outputs[0].text for o in stream(output_processor, rid, ids)]
    # 'Answer' ':' ' ' '4' '2' go out at once; each '\n' waits; "User:" ends it.
    assert texts == ["Answer", ":", " ", "4", "2", "", "", "", ""]
    assert "".join(texts) == "Answer: 42"
