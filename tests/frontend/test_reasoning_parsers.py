"""Reasoning parsing: <think> ... </think> split into reasoning_content and
content, whole or streamed in any split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.reasoning import ReasoningParser, get_reasoning_parser


def stream(parser: ReasoningParser, pieces: list[str], started_in_think: bool) -> tuple[str, str]:
    streamer = parser.streamer(started_in_think)
    outputs = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    return "".join(r for r, _ in outputs), "".join(c for _, c in outputs)


@pytest.mark.parametrize("text, started, expected", [
    ("<think>plan</think>answer", False, ("plan", "answer")),
    ("intro <think>plan</think> answer", False, ("plan", "intro  answer")),
    ("no thinking here", False, (None, "no thinking here")),
    ("stray </think> tag", False, (None, "stray </think> tag")),
    ("<think>cut off while thinking", False, ("cut off while thinking", None)),
    ("<think></think>", False, (None, None)),
    ("plan</think>answer", True, ("plan", "answer")),
    ("<think>plan</think>answer", True, ("plan", "answer")),  # repeated opening tag dropped
    ("still thinking", True, ("still thinking", None)),
    ("</think>answer", True, (None, "answer")),
    ("a</think>b</think>c<think>d", True, ("a", "b</think>c<think>d")),
    ("", False, (None, None)),
])
def test_extract_reasoning(text, started, expected):
    parser = ReasoningParser()
    assert parser.extract_reasoning(text, started_in_think=started) == expected
    assert stream(parser, list(text), started) == tuple(part or "" for part in expected)


def test_stream_holds_only_a_possible_tag():
    streamer = ReasoningParser().streamer(started_in_think=False)
    assert streamer.feed("Hello <th") == ("", "Hello ")
    assert streamer.feed("ink>I think") == ("I think", "")
    assert streamer.in_reasoning
    assert streamer.feed(" more</th") == (" more", "")
    assert streamer.feed("ink>\n\nDone") == ("", "\n\nDone")
    assert not streamer.in_reasoning
    assert streamer.finish() == ("", "")


def test_unfinished_tag_is_flushed_as_text():
    streamer = ReasoningParser().streamer(started_in_think=True)
    assert streamer.feed("x</thi") == ("x", "")
    assert streamer.finish() == ("</thi", "")


def test_custom_tags_and_prompt_detection():
    parser = ReasoningParser("<reasoning>", "</reasoning>")
    assert parser.extract_reasoning("<reasoning>r</reasoning>c") == ("r", "c")
    assert parser.end_token_text == "</reasoning>"
    think = ReasoningParser()
    assert think.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not think.prompt_opens_reasoning("<think>old</think><|im_start|>assistant\n")
    assert not think.prompt_opens_reasoning("<|im_start|>assistant\n")


def test_registry():
    r1 = get_reasoning_parser("deepseek_r1")
    assert r1.end_token_text == "</think>" and r1.started_in_think  # R1's template opens <think>
    assert r1.extract_reasoning("plan</think>answer") == ("plan", "answer")
    assert not get_reasoning_parser("think").started_in_think
    with pytest.raises(ValueError, match="deepseek_r1, think"):
        get_reasoning_parser("qwen3")


# Pieces that build texts full of whole, partial and misplaced tags.
PIECES = ["<think>", "</think>", "<th", "</", "ink>", "k>", "<", "a", " ", "\n"]
texts = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(texts, st.booleans(), st.data())
def test_stream_equals_extract_for_any_split(text, started, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=8))))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    parser = ReasoningParser()
    reasoning, content = parser.extract_reasoning(text, started_in_think=started)
    assert stream(parser, pieces, started) == (reasoning or "", content or "")
