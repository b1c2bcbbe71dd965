"""The bundled tool-aware SmolLM2 chat template: identical to the model's own
without tools, and rendering tools, calls and results in SmolLM2's format."""

from __future__ import annotations

import json

import pytest

from services.frontend.chat_templates import bundled_chat_templates, load_chat_template
from services.frontend.tool_parsers import get_tool_parser

TEMPLATE = load_chat_template("smollm2_tools")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Café? 😀\n{% raw %}"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""},
     {"role": "assistant", "content": "  spaced \n"}],
    [{"role": "assistant", "content": "I start."}, {"role": "developer", "content": "x"}],
]

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "18C, rain"},
]


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=TEMPLATE, **kwargs)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_renders_like_the_model_template(tokenizer, messages, add_generation_prompt):
    expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    assert render(tokenizer, messages, add_generation_prompt=add_generation_prompt) == expected
    assert render(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                  tools=[]) == expected


def test_tools_go_in_the_default_system_turn(tokenizer):
    text = render(tokenizer, [{"role": "user", "content": "Weather?"}], tools=[WEATHER, NOW],
                  add_generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    tools_block = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in tools_block.split("\n")] == [
        WEATHER["function"], NOW["function"]]
    assert '<tool_call>[{"name": ' in system
    assert text.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_follow_a_given_system_prompt(tokenizer):
    text = render(tokenizer, [{"role": "system", "content": "Be terse."},
                              {"role": "user", "content": "Hi"}], tools=[NOW])
    assert text.startswith("<|im_start|>system\nBe terse.\n\n")
    assert '"name": "now"' in text and text.count("<|im_start|>system") == 1


def test_calls_and_results_render_in_smollm2_format(tokenizer):
    text = render(tokenizer, TOOL_CONVERSATION, tools=[WEATHER], add_generation_prompt=True)
    assert ('<|im_start|>assistant\n<tool_call>['
            '{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Lyon"}}'
            ']</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n21C, sunny\n</tool_response>\n"
            "<tool_response>\n18C, rain\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text


def test_rendered_calls_parse_back(tokenizer):
    # What the template shows the model is what the parser reads from it.
    text = render(tokenizer, TOOL_CONVERSATION[:2], tools=[WEATHER])
    answer = text.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    calls = get_tool_parser("smollm2").extract_tool_calls(answer).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]


def test_assistant_text_before_calls(tokenizer):
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [call]}]
    assert ('<|im_start|>assistant\nChecking.\n'
            '<tool_call>[{"name": "now", "arguments": {}}]</tool_call>'
            in render(tokenizer, messages, tools=[NOW]))


def test_token_ids(tokenizer):
    text = render(tokenizer, TOOL_CONVERSATION, tools=[WEATHER], add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[WEATHER],
                                        add_generation_prompt=True, chat_template=TEMPLATE,
                                        tokenize=True, return_dict=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 5  # system, user, assistant, user (results), generation prompt


def test_load_chat_template(tmp_path):
    assert "smollm2_tools" in bundled_chat_templates()
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="smollm2_tools"):
        load_chat_template("no_such_template")
