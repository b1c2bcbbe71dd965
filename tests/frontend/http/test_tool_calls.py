"""OpenAI ``tools`` / ``tool_choice`` on /v1/chat/completions through the ``openai`` client.

"required" and a named function are forced by a JSON schema built from the
tools, so even the tiny random model answers with valid calls; streamed
deltas (id and name once, then argument fragments) add up to the same calls.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.frontend.http.conftest import TENANT_KEYS, HttpStack

# Small: the stack's max_model_len is 256 and the tools are part of the prompt.
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"enum": ["Paris", "Rome"]}}}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "required": ["zone"], "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls) -> list[tuple[str, dict]]:
    """Each call's (name, arguments), after checking the arguments against its tool."""
    result = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        result.append((call.function.name, arguments))
    return result


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "time"}}])
def test_forced_tool_calls_validate_streamed_and_not(http_stack: HttpStack, tool_choice):
    client = http_stack.openai()
    kwargs = dict(model=http_stack.model, messages=QUESTION, tools=TOOLS,
                  tool_choice=tool_choice, parallel_tool_calls=False, temperature=0.0,
                  max_tokens=48)

    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True)

    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["time"]
    assert len(calls) == 1  # parallel_tool_calls=False
    streamed: dict[int, dict] = {}
    finish_reasons = []
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = streamed.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:  # the header comes once per call
                assert entry["id"] is None
                entry.update(id=delta.id, name=delta.function.name)
            entry["arguments"] += delta.function.arguments or ""
        finish_reasons.append(chunk.choices[0].finish_reason)
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == calls
    assert finish_reasons[-1] == "tool_calls"


def test_tool_choice_none_and_auto_answer_as_text(http_stack: HttpStack):
    client = http_stack.openai()
    for tool_choice in ("none", "auto"):
        answer = client.chat.completions.create(
            model=http_stack.model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
            temperature=0.0, max_tokens=8)
        # The random model writes no <tool_call> block: its text is the content.
        assert answer.choices[0].message.tool_calls is None
        assert answer.choices[0].message.content


def test_tools_and_earlier_calls_and_results_reach_the_prompt(http_stack: HttpStack):
    client = http_stack.openai()
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]

    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(
            model=http_stack.model, temperature=0.0, max_tokens=1, **kwargs).usage.prompt_tokens

    bare = prompt_tokens(messages=QUESTION)
    with_tools = prompt_tokens(messages=QUESTION, tools=TOOLS)
    with_turns = prompt_tokens(messages=messages)
    assert with_tools > bare + 50 and with_turns > bare + 20
    assert prompt_tokens(messages=QUESTION, tools=TOOLS, tool_choice="none") == bare


@pytest.mark.parametrize("extra, param", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]),
     "tools[0].function.name"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(http_stack: HttpStack, extra, param):
    client = http_stack.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=http_stack.model, messages=QUESTION,
                                       max_tokens=4, **extra)
    assert info.value.body["param"] == param


def test_auto_reads_the_calls_the_model_writes(http_stack: HttpStack):
    """The model's own <tool_call> block (made certain here by a grammar) becomes
    tool_calls, in the answer and in the stream, with the text before it as content."""
    answer = ('Ok.<tool_call>[{"name":"time","arguments":{"zone":"UTC"}},'
              '{"name":"weather","arguments":{"city":"Rome"}}]</tool_call>')
    grammar = "root ::= " + json.dumps(answer)
    # The frontend with the model's own template, which shows no tools: a short
    # prompt, room for the random model's many small tokens.
    client = http_stack.openai(http_stack.keyed, api_key=TENANT_KEYS[0])
    kwargs = dict(model=http_stack.model, messages=QUESTION, tools=TOOLS, tool_choice="auto",
                  temperature=0.0, max_tokens=200,
                  extra_body={"structured_outputs": {"grammar": grammar}})

    whole = client.chat.completions.create(**kwargs)
    stream = list(client.chat.completions.create(**kwargs, stream=True))

    message = whole.choices[0].message
    assert message.content == "Ok."
    expected = [("time", {"zone": "UTC"}), ("weather", {"city": "Rome"})]
    assert check_calls(message.tool_calls) == expected
    assert whole.choices[0].finish_reason == "tool_calls"
    content = "".join(c.choices[0].delta.content or "" for c in stream)
    names = [d.function.name for c in stream for d in c.choices[0].delta.tool_calls or ()
             if d.id is not None]
    assert (content, names) == ("Ok.", ["time", "weather"])
    assert stream[-1].choices[0].finish_reason == "tool_calls"
