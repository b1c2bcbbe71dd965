"""Tool-call parsing: the Hermes/SmolLM2 parser, its streaming contract, and
the tools / tool_choice checks and forced-call schema."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.validation import ValidationError
from services.frontend.tool_parsers import (
    ExtractedToolCalls,
    HermesToolParser,
    ToolCallStreamer,
    get_tool_parser,
)
from services.frontend.tool_parsers.tool_choice import (
    ForcedToolCallStreamer,
    forced_tool_calls,
    forces_tool_calls,
    tool_call_schema,
    validate_tools,
)

START, END = "<tool_call>", "</tool_call>"
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Streamed:
    content: str
    names: list[str]
    ids: list[str]
    arguments: list[str]
    tools_called: bool


def run_stream(streamer: ToolCallStreamer, pieces: list[str]) -> Streamed:
    """Feeds the pieces and checks each call's header comes first and once, in index order."""
    deltas = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    names: list[str] = []
    ids: list[str] = []
    arguments: list[str] = []
    for delta in (d for step in deltas for d in step.tool_calls):
        if delta.id is not None:
            assert delta.index == len(names) and delta.arguments == "" and delta.name is not None
            names.append(delta.name)
            ids.append(delta.id)
            arguments.append("")
        else:
            assert delta.name is None and delta.index == len(names) - 1 and delta.arguments
            arguments[delta.index] += delta.arguments
    return Streamed("".join(d.content for d in deltas), names, ids, arguments,
                    streamer.tools_called)


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_stream_matches(parser: HermesToolParser, text: str,
                          cuts: list[int]) -> ExtractedToolCalls:
    extracted = parser.extract_tool_calls(text)
    streamed = run_stream(parser.streamer(), split(text, cuts))
    assert streamed.content == (extracted.content or "")
    assert streamed.names == [call.name for call in extracted.tool_calls]
    assert streamed.arguments == [call.arguments for call in extracted.tool_calls]
    assert streamed.tools_called == bool(extracted.tool_calls)
    assert all(CALL_ID.fullmatch(i) for i in streamed.ids)
    assert len(set(streamed.ids)) == len(streamed.ids)
    return extracted


# --- the non-streaming parse -------------------------------------------------------------


def test_hermes_single_call_with_leading_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    result = get_tool_parser("hermes").extract_tool_calls(text)
    assert result.content == "Let me check.\n"
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert CALL_ID.fullmatch(result.tool_calls[0].id)


def test_smollm2_list_and_several_blocks():
    text = ('<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
            '</tool_call>\n<tool_call>{"name": "h", "arguments": {"y": [1, 2]}}</tool_call>')
    result = get_tool_parser("smollm2").extract_tool_calls(text)
    assert result.content is None  # only the newline between blocks
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("f", '{"x": 1}'), ("g", "{}"), ("h", '{"y": [1, 2]}')]
    assert len({c.id for c in result.tool_calls}) == 3


def test_plain_answer_is_all_content():
    result = HermesToolParser().extract_tool_calls("Just text, no <tool calls> here.")
    assert result == ExtractedToolCalls("Just text, no <tool calls> here.", [])


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>[1, 2]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call>',  # trailing comma
    '<tool_call>{"name": "f", "arguments": {"x": 1}} junk</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1',  # cut off
])
def test_invalid_block_stays_content(text):
    result = HermesToolParser().extract_tool_calls(text + " after")
    assert result == ExtractedToolCalls(text + " after", [])


def test_invalid_block_then_valid_block():
    text = 'a<tool_call>oops</tool_call>b<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    result = HermesToolParser().extract_tool_calls(text)
    assert result.content == "a<tool_call>oops</tool_call>b"
    assert [c.name for c in result.tool_calls] == ["f"]


def test_unclosed_final_block_is_a_call():
    # Generation may stop on the closing tag as a stop string.
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}\n'
    result = HermesToolParser().extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"a": 1}')]


def test_arguments_forms():
    parser = HermesToolParser()
    as_string = parser.extract_tool_calls(
        '<tool_call>{"name": "f", '
        '"arguments": "{\\"q\\": \\"caf\\u00e9 \\\\\\"x\\\\\\"\\"}"}</tool_call>')
    assert as_string.tool_calls[0].arguments == '{"q": "café \\"x\\""}'
    assert json.loads(as_string.tool_calls[0].arguments) == {"q": 'café "x"'}
    missing = parser.extract_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert missing.tool_calls[0].arguments == "{}"
    first = parser.extract_tool_calls(
        '<tool_call>{"arguments": {"n": "x"}, "id": 7, "name": "f"}</tool_call>')
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("f", '{"n": "x"}')]


def test_empty_list_means_no_calls():
    result = HermesToolParser().extract_tool_calls("<tool_call>[]</tool_call>")
    assert result == ExtractedToolCalls(None, [])


def test_registry():
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="hermes, smollm2"):
        get_tool_parser("llama3_json")


# --- streaming ---------------------------------------------------------------------------


def test_stream_deltas_in_order():
    text = 'Hi <tool_call>[{"name": "f", "arguments": {"x": "ab"}}]</tool_call>'
    streamer = HermesToolParser().streamer()
    first = streamer.feed('Hi <tool_c')
    assert first.content == "Hi " and not first.tool_calls  # the tag prefix is held
    header = streamer.feed('all>[{"name": "f", "arg')
    assert [(d.index, d.name, d.arguments) for d in header.tool_calls] == [(0, "f", "")]
    assert streamer.tools_called
    fragment = streamer.feed('uments": {"x": "a')
    assert [(d.index, d.id, d.arguments) for d in fragment.tool_calls] == [(0, None, '{"x": "a')]
    rest = streamer.feed(text[len('Hi <tool_call>[{"name": "f", "arguments": {"x": "a'):])
    assert [d.arguments for d in rest.tool_calls] == ['b"}']
    assert streamer.finish().content == ""


def test_unfinished_tag_prefix_is_flushed_as_content():
    streamer = HermesToolParser().streamer()
    assert streamer.feed("x <tool_ca").content == "x "
    assert streamer.finish().content == "<tool_ca"


def test_string_arguments_stream_decoded_for_every_split():
    text = ('<tool_call>{"name": "f", '
            '"arguments": "{\\"s\\": \\"\\u00e9\\ud83d\\ude00\\\\n\\"}"}</tool_call>')
    parser = HermesToolParser()
    expected = parser.extract_tool_calls(text).tool_calls[0].arguments
    assert expected == '{"s": "é😀\\n"}' and json.loads(expected) == {"s": "é😀\n"}
    for cut in range(len(text) + 1):
        assert run_stream(parser.streamer(), split(text, [cut])).arguments == [expected]
    assert run_stream(parser.streamer(), list(text)).arguments == [expected]


def test_malformed_after_a_call_keeps_the_call():
    # A stream cannot take back an announced call: the rest of the block is dropped.
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call> after'
    streamed = run_stream(HermesToolParser().streamer(), list(text))
    assert (streamed.names, streamed.arguments, streamed.content) == (["f"], ['{"a": 1}'], " after")


json_leaves = (st.none() | st.booleans() | st.integers(-10**6, 10**6)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6))
json_values = st.recursive(
    json_leaves,
    lambda children: (st.lists(children, max_size=3)
                      | st.dictionaries(st.text(max_size=4), children, max_size=3)),
    max_leaves=6)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
# Characters that come close to the tags, so held-back prefixes are exercised.
content_text = st.text(alphabet="<>/_tolcax \n{}\"[]", max_size=12).filter(lambda s: START not in s)


@st.composite
def tool_call_texts(draw) -> tuple[str, tuple[str, str]]:
    """One call object as a model might write it, and its (name, arguments)."""
    name = draw(names)
    arguments = json.dumps(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
                           ensure_ascii=draw(st.booleans()),
                           indent=draw(st.sampled_from([None, 2])))
    form = draw(st.sampled_from(["object", "string", "missing"]))
    colon = draw(st.sampled_from([": ", ":", " : "]))
    members = [f'"name"{colon}{json.dumps(name)}']
    if form == "object":
        members.append(f'"arguments"{colon}{arguments}')
    elif form == "string":
        quoted = json.dumps(arguments, ensure_ascii=draw(st.booleans()))
        members.append(f'"arguments"{colon}{quoted}')
    else:
        arguments = "{}"
    if draw(st.booleans()):
        members.append(f'"extra"{colon}{json.dumps(draw(json_values))}')
    members = draw(st.permutations(members))
    return "{" + draw(st.sampled_from([", ", ",", ",\n  "])).join(members) + "}", (name, arguments)


@st.composite
def answers(draw) -> tuple[str, str, list[tuple[str, str]]]:
    """(text, its content, its calls): content and <tool_call> blocks interleaved."""
    contents = [draw(content_text)]
    text = contents[0]
    calls: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(0, 3))):
        objects = draw(st.lists(tool_call_texts(), min_size=1, max_size=3))
        if len(objects) == 1 and draw(st.booleans()):
            body = objects[0][0]
        else:
            body = "[" + draw(st.sampled_from([", ", ",\n"])).join(o for o, _ in objects) + "]"
        pad = draw(st.sampled_from(["", "\n", " "]))
        text += START + pad + body + pad + END
        calls.extend(call for _, call in objects)
        contents.append(draw(content_text))
        text += contents[-1]
    return text, "".join(contents), calls


@SETTINGS
@given(answers(), st.data())
def test_stream_equals_extract_for_any_split(answer, data):
    text, content, calls = answer
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    extracted = assert_stream_matches(HermesToolParser(), text, cuts)
    assert extracted.content == (content if content.strip() else None)
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == calls


@SETTINGS
@given(answers(), st.data())
def test_one_character_per_delta(answer, data):
    text = answer[0]
    assert_stream_matches(HermesToolParser(), text, list(range(len(text))))


@SETTINGS
@given(st.sampled_from([
    "<tool_call>not json</tool_call> after",
    '<tool_call>{"arguments": {"a": 1}}</tool_call>x',
    '<tool_call>{"name": 3}</tool_call>',
    "<tool_call>[1]</tool_call>",
    "<tool_call></tool_call><tool_call>",
    '<tool_call>{"name"',
    "before <tool_ca",
    "<tool_call>[]</tool_call>hi",
    "<tool_call>[]</tool_",
    "<tool_call>[] x</tool_call>",
    'a</tool_call>b<tool_call>{"name": "f"}</tool_call>c',
    '<tool_call>oops</tool_call><tool_call>{"name": "f", "arguments": {"x": "}"}}',
]), st.data())
def test_malformed_before_any_call_streams_as_extract(text, data):
    assert_stream_matches(HermesToolParser(), text,
                          data.draw(st.lists(st.integers(0, len(text)), max_size=8)))


# --- tools and tool_choice ----------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize("tools, tool_choice, field", [
    ({"type": "function"}, None, "tools"),
    ([], None, "tools"),
    ([WEATHER, "now"], None, "tools[1]"),
    ([{"type": "tool", "function": {"name": "f"}}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([WEATHER, NOW, {"type": "function", "function": {"name": "bad name"}}], None,
     "tools[2].function.name"),
    ([{"type": "function", "function": {"description": "no name"}}], None,
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None,
     "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None,
     "tools[0].function.parameters"),
    ([NOW, NOW], None, "tools[1].function.name"),
    (None, "auto", "tool_choice"),
    ([WEATHER], "always", "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "now"}}, "tool_choice.function.name"),
])
def test_bad_tools_name_the_field(tools, tool_choice, field):
    with pytest.raises(ValidationError) as error:
        validate_tools(tools, tool_choice)
    assert error.value.field == field
    assert field.split(".")[0].split("[")[0] in str(error.value)


@pytest.mark.parametrize("tool_choice", [None, "none", "auto", "required",
                                         {"type": "function", "function": {"name": "now"}}])
def test_good_tools_pass(tool_choice):
    validate_tools([WEATHER, NOW], tool_choice)
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    assert forces_tool_calls(tool_choice) == forced


def schema_accepts(schema: dict, answer: object) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(answer)


def test_required_schema():
    schema = tool_call_schema([WEATHER, NOW], "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema_accepts(schema, [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                   {"name": "now", "arguments": {}}])
    for wrong in ([], [{"name": "get_weather", "arguments": {"town": "Paris"}}],
                  [{"name": "other", "arguments": {}}], [{"name": "now"}],
                  [{"name": "now", "arguments": {}, "extra": 1}], {"name": "now", "arguments": {}}):
        assert not schema_accepts(schema, wrong), wrong


def test_named_schema_forces_exactly_that_tool():
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = tool_call_schema([WEATHER, NOW], named)
    jsonschema.Draft202012Validator.check_schema(schema)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert schema_accepts(schema, [call])
    assert not schema_accepts(schema, [call, call])
    assert not schema_accepts(schema, [{"name": "now", "arguments": {}}])
    with pytest.raises(ValueError, match="auto"):
        tool_call_schema([WEATHER], "auto")


def test_schema_definitions_move_to_the_root():
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": {"type": "object", "required": ["x"],
                            "properties": {"x": {"type": "number"}}}}}}}
    schema = tool_call_schema([tool, NOW], "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema_accepts(schema, [{"name": "move", "arguments": {"to": {"x": 1}}}])
    assert not schema_accepts(schema, [{"name": "move", "arguments": {"to": {"y": 1}}}])
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"point": {"type": "string"}}}}}
    with pytest.raises(ValidationError) as error:
        tool_call_schema([tool, clash], "required")
    assert error.value.field == "tools[1].function.parameters.$defs.point"


def test_forced_tool_calls():
    calls = forced_tool_calls('[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                              '{"name": "now", "arguments": {}}]')
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Rome"}'), ("now", "{}")]
    for bad in ('[{"name": "now", "arguments": {}', '{"name": "now"}', "[1]", "nothing"):
        with pytest.raises(ValueError):
            forced_tool_calls(bad)


@SETTINGS
@given(st.lists(tool_call_texts(), min_size=1, max_size=3), st.data())
def test_forced_stream_equals_forced_calls(objects, data):
    text = "[" + ", ".join(o for o, _ in objects) + "]"
    calls = forced_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [call for _, call in objects]
    streamed = run_stream(ForcedToolCallStreamer(),
                          split(text, data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    assert (streamed.content, streamed.names, streamed.arguments) == (
        "", [c.name for c in calls], [c.arguments for c in calls])
