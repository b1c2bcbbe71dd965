"""Chat answers of reasoning models: reasoning_content apart from content, whole and
streamed, with tool calls read from the content; constraints start after the reasoning."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.sampling_params import SamplingParams, StructuredOutputsParams
from services.frontend.http.chat_reasoning import ChatReasoning, constrain_after_reasoning
from services.frontend.http.responses import ChatFormat
from services.frontend.http.tool_calls import ChatToolCalls
from services.frontend.outputs import CompletionOutput
from services.frontend.reasoning import get_reasoning_parser
from services.frontend.server import FrontendServer, serve_frontend
from services.frontend.tool_parsers import get_tool_parser
from services.frontend.tokenizer import load_tokenizer
from tests.frontend.http.conftest import HttpStack
from tests.frontend.test_frontend_server import frontend_config

ANSWER = ("The user wants the weather.</think>Let me check."
          '<tool_call>[{"name": "weather", "arguments": {"city": "Paris"}}]</tool_call>')


def chat_format() -> ChatFormat:
    return ChatFormat(None, ChatToolCalls(get_tool_parser("hermes")),
                      ChatReasoning(get_reasoning_parser("deepseek_r1")))


def test_a_whole_answer_splits_into_reasoning_content_and_calls():
    choice = chat_format().choice(CompletionOutput(0, ANSWER, [], finish_reason="stop"))
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("weather", {"city": "Paris"})]
    assert choice["finish_reason"] == "tool_calls"


@given(st.lists(st.integers(0, len(ANSWER)), max_size=12))
def test_streamed_pieces_add_up_to_the_whole_answer(cuts):
    fmt = chat_format()
    bounds = [0, *sorted(cuts), len(ANSWER)]
    reasoning = content = arguments = ""
    finish = None
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = i == len(bounds) - 2
        choice = fmt.chunk_choice(CompletionOutput(0, ANSWER[a:b], [],
                                                   finish_reason="stop" if last else None))
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content", "")
        content += delta["content"]
        arguments += "".join(c["function"]["arguments"] for c in delta.get("tool_calls", ()))
        finish = choice["finish_reason"]
    assert reasoning == "The user wants the weather."
    assert content == "Let me check."
    assert json.loads(arguments) == {"city": "Paris"}
    assert finish == "tool_calls"


def test_a_constraint_starts_after_the_reasoning(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    constrain_after_reasoning(params, get_reasoning_parser("deepseek_r1"), tokenizer)
    end = params.structured_outputs.reasoning_end_token_ids
    assert tokenizer.decode(end) == "</think>"

    # A model that opens its reasoning itself, if at all: constrained from the start.
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    constrain_after_reasoning(params, get_reasoning_parser("think"), tokenizer)
    assert params.structured_outputs.reasoning_end_token_ids is None


@pytest.fixture(scope="module")
def reasoning_frontend(http_stack: HttpStack, http_model_dir) -> Iterator[FrontendServer]:
    """A frontend with --reasoning-parser deepseek_r1 on the HTTP stack's scheduler."""
    async def start() -> FrontendServer:
        frontend = await serve_frontend(frontend_config(
            http_model_dir, http_stack.scheduler.address, http_port=0,
            reasoning_parser="deepseek_r1"))
        await frontend.engine_core.wait_connected(10)
        return frontend

    frontend = http_stack.loop.run(start())
    yield frontend
    http_stack.loop.run(frontend.stop(1.0))


def test_through_the_server_thinking_is_reasoning_content_and_free(
        http_stack: HttpStack, reasoning_frontend: FrontendServer):
    """deepseek_r1: answers start inside the thinking. The random model never closes
    it, so everything is reasoning_content, and a constraint has not begun: the
    thinking is free (without the parser the same request answers in digits)."""
    client = openai.OpenAI(base_url=f"{reasoning_frontend.http.url}/v1", api_key="none",
                           max_retries=0)
    plain = http_stack.openai()
    kwargs = dict(model=http_stack.model, messages=[{"role": "user", "content": "Think."}],
                  temperature=0.0, max_tokens=12,
                  extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})

    answer = client.chat.completions.create(**kwargs)
    stream = list(client.chat.completions.create(**kwargs, stream=True))
    without_parser = plain.chat.completions.create(**kwargs)

    message = answer.choices[0].message
    assert message.content == "" and message.reasoning_content
    assert not message.reasoning_content.isdigit()
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                       for c in stream)
    assert streamed == message.reasoning_content
    assert re.fullmatch("[0-9]{3}", without_parser.choices[0].message.content)
