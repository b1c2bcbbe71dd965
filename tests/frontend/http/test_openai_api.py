"""The OpenAI-compatible HTTP API against a live stack, through the official ``openai``
client (and raw HTTP where a client would hide what is on the wire).

The model is a tiny random Llama with SmolLM2's tokenizer: what it says is
meaningless, so answers are compared with each other and with the gRPC API.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import openai
import pytest

from services.common.limits import SchedulingLimits
from services.frontend.server import FrontendServer, serve_frontend
from services.scheduler.config import SchedulingOptions
from services.scheduler.server import SchedulerServer
from tests.frontend.http.conftest import HttpStack
from tests.frontend.test_frontend_server import frontend_config, wait_for
from tests.grpc_utils import (
    RunningWorker,
    get_stats,
    start_scheduler,
    start_worker,
    wait_for_workers,
)

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
WITH_TOKEN_IDS = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def post(url: str, path: str, body: object, headers: dict[str, str] | None = None
         ) -> tuple[int, dict, dict[str, str]]:
    """(status, JSON body, headers) of a POST with a JSON body."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", path, data, {"Content-Type": "application/json",
                                                **(headers or {})})
        response = connection.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if payload else {}, dict(response.headers)
    finally:
        connection.close()


def get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


# ---------------------------------------------------------------- model, health, tokenizer


def test_models_health_and_version(http_stack: HttpStack, http_model_dir):
    client = http_stack.openai()
    (model,) = client.models.list().data
    assert (model.id, model.owned_by) == (str(http_model_dir), "kvmesh")
    assert get(http_stack.url, "/health") == (200, b"")
    status, body = get(http_stack.url, "/version")
    assert status == 200 and json.loads(body)["version"]


def test_tokenize_and_detokenize_match_the_grpc_api(http_stack: HttpStack):
    status, body, _ = post(http_stack.url, "/tokenize", {"prompt": "Hello world"})
    assert (status, body["tokens"], body["count"]) == (200, [19556, 905], 2)
    messages = [{"role": "user", "content": "hi"}]
    _, chat, _ = post(http_stack.url, "/tokenize", {"messages": messages})
    assert chat["tokens"] == http_stack.grpc.tokenize(messages=messages)
    status, body, _ = post(http_stack.url, "/detokenize", {"tokens": [19556, 905]})
    assert (status, body) == (200, {"prompt": "Hello world"})
    status, body, _ = post(http_stack.url, "/detokenize", {"tokens": [49152]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert "tokens must hold token ids in [0, 49152), got 49152" in body["error"]["message"]


# ---------------------------------------------------------------- generation


def test_greedy_completion_equals_the_grpc_api_token_for_token(http_stack: HttpStack):
    prompt = "The quick brown fox"
    expected = http_stack.grpc.complete(prompt, max_tokens=24, temperature=0.0,
                                        ignore_eos=True).outputs[0]
    response = http_stack.openai().completions.create(
        model=http_stack.model, prompt=prompt, max_tokens=24, **WITH_TOKEN_IDS)
    (choice,) = response.choices
    assert choice.model_extra["token_ids"] == list(expected.token_ids)
    assert (choice.text, choice.finish_reason) == (expected.text, "length")
    assert response.usage.completion_tokens == 24
    # Streamed, the same tokens arrive in pieces.
    stream = http_stack.openai().completions.create(
        model=http_stack.model, prompt=prompt, max_tokens=24, stream=True, **WITH_TOKEN_IDS)
    streamed = [t for chunk in stream for c in chunk.choices for t in c.model_extra["token_ids"]]
    assert streamed == list(expected.token_ids)


def test_greedy_chat_equals_the_grpc_api_token_for_token(http_stack: HttpStack):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = http_stack.grpc.complete(messages=messages, max_tokens=16, temperature=0.0,
                                        ignore_eos=True).outputs[0]
    response = http_stack.openai().chat.completions.create(
        model=http_stack.model, messages=messages, max_completion_tokens=16, **WITH_TOKEN_IDS)
    (choice,) = response.choices
    assert choice.model_extra["token_ids"] == list(expected.token_ids)
    assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
    assert response.model_extra["prompt_token_ids"] == http_stack.grpc.tokenize(messages=messages)



def test_chat_streams_the_same_answer_with_usage_last(http_stack: HttpStack):
    client = http_stack.openai()
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(messages=messages, max_tokens=20,
                                           model=http_stack.model, **GREEDY)
    chunks = list(client.chat.completions.create(
        messages=messages, max_tokens=20, model=http_stack.model, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n2_seeded_sampling_reproduces_and_differs_per_choice(http_stack: HttpStack):
    client = http_stack.openai()
    sample = dict(prompt="Pick a word", max_tokens=8, n=2, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(model=http_stack.model, seed=7, **sample)
    again = client.completions.create(model=http_stack.model, seed=7, **sample)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text
    assert first.usage.completion_tokens == 16
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=http_stack.model, seed=7, stream=True,
                                           **sample):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]
    chat = client.chat.completions.create(
        model=http_stack.model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
        seed=3, temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 8


def test_logprobs_in_completions_and_chat(http_stack: HttpStack):
    client = http_stack.openai()
    completion = client.completions.create(model=http_stack.model, prompt="Hello there",
                                           max_tokens=4, logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [0, *_running_sum(len(t) for t in logprobs.tokens)][:4]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs):
        # Greedy: the sampled token is the most likely one, listed in the top 2.
        assert len(top) == 2 and top[token] == logprob == max(top.values())
    chat = client.chat.completions.create(
        model=http_stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for position in content:
        assert [t.logprob for t in position.top_logprobs] == sorted(
            (t.logprob for t in position.top_logprobs), reverse=True)
        assert len(position.top_logprobs) == 3
        assert position.top_logprobs[0].token == position.token
        assert bytes(position.bytes).decode() == position.token


def _running_sum(values: Iterator[int]) -> list[int]:
    total, sums = 0, []
    for value in values:
        total += value
        sums.append(total)
    return sums


def test_sampling_parameters_reach_the_engine(http_stack: HttpStack):
    client = http_stack.openai()
    # A huge bias on one token makes greedy decoding pick it every time.
    biased = client.completions.create(model=http_stack.model, prompt="Hello", max_tokens=5,
                                       logit_bias={"19556": 100.0}, **WITH_TOKEN_IDS)
    assert biased.choices[0].model_extra["token_ids"] == [19556] * 5
    text = client.completions.create(model=http_stack.model, prompt="Tell me", max_tokens=16,
                                     **GREEDY).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    stopped = client.completions.create(model=http_stack.model, prompt="Tell me", max_tokens=16,
                                        stop=stop, **GREEDY).choices[0]
    assert (stopped.text, stopped.finish_reason) == (text[:text.index(stop)], "stop")
    assert stopped.model_extra["stop_reason"] == stop
    # Every other sampling field is accepted and honoured without error.
    response = client.completions.create(
        model=http_stack.model, prompt="Once", max_tokens=6, temperature=0.8, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5, user="tenant-42",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6,
                    "ignore_eos": False})
    assert response.usage.completion_tokens == 6


def test_repeated_prompt_reports_cached_tokens(http_stack: HttpStack):
    client = http_stack.openai()
    prompt = random_prompt(seed=11, length=80)
    first, second = (client.completions.create(model=http_stack.model, prompt=prompt,
                                               max_tokens=2, **GREEDY) for _ in range(2))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 80
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Whole blocks of 16 tokens, the last prompt token always computed.
    assert second.usage.prompt_tokens_details.cached_tokens == 64


def test_request_id_header_names_the_request(http_stack: HttpStack):
    status, body, headers = post(http_stack.url, "/v1/completions",
                                 {"prompt": "hi", "max_tokens": 2},
                                 headers={"X-Request-Id": "my-trace-7"})
    assert (status, body["id"], headers["x-request-id"]) == (200, "cmpl-my-trace-7", "my-trace-7")
    _, other, headers = post(http_stack.url, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert other["id"] == "chatcmpl-" + headers["x-request-id"]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature",
     "temperature must be >= 0, got -1"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature",
     "temperature: Input should be a valid number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, "max_tokens",
     "prompt has 1 tokens and max_tokens is 300, but max_model_len is 256"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "send one request per prompt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias",
     "logit_bias keys must be token ids, got 'x'"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", "echo is not supported"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt: Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be >= 1, got 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "top_logprobs", "needs logprobs set to true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0,
                              "stream": True}, "n", "n must be in [1, 128], got 0"),
])
def test_bad_requests_are_400_naming_the_parameter(http_stack: HttpStack, path, body, param,
                                                   message):
    status, response, _ = post(http_stack.url, path, body)
    assert status == 400, response
    error = response["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert message in error["message"]
    assert http_stack.frontend.servicer.engine.num_unfinished_requests == 0


def test_official_client_raises_its_own_error_types(http_stack: HttpStack):
    client = http_stack.openai()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=http_stack.model, prompt="hi", top_p=1.5)
    assert bad.value.param == "top_p" and "top_p must be in (0, 1]" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):  # also while streaming: before the stream
        list(client.chat.completions.create(model=http_stack.model, messages=[],
                                            stream=True))


def test_unknown_route_and_malformed_json_are_openai_errors(http_stack: HttpStack):
    status, body = get(http_stack.url, "/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    status, response, _ = post(http_stack.url, "/v1/completions", b"{not json")
    assert status == 400 and response["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- disconnects


def _open_request(url: str, body: dict) -> socket.socket:
    """Sends a request on a raw socket and reads until the response has begun."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(http_stack: HttpStack, stream):
    http_stack.wait_idle()
    sock = _open_request(http_stack.url, {"prompt": "Count with me", "max_tokens": 200,
                                          "temperature": 0, "ignore_eos": True,
                                          "stream": stream})
    engine = http_stack.frontend.servicer.engine
    wait_for(lambda: engine.num_unfinished_requests == 1)
    wait_for(lambda: http_stack.stats().workers[0].num_running_reqs == 1)
    if stream:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()
    http_stack.wait_idle()


# ---------------------------------------------------------------- queue full, no worker


def test_no_worker_is_503_and_a_full_queue_is_429(http_stack: HttpStack, http_model_dir):
    """A scheduler of its own: one request runs, one waits, the next one is refused."""
    limits = SchedulingLimits(max_num_seqs=1, max_num_batched_tokens=256)
    loop = http_stack.loop

    async def start() -> tuple[SchedulerServer, FrontendServer]:
        scheduler = await start_scheduler(SchedulingOptions(limits=limits, max_num_waiting=1))
        frontend = await serve_frontend(frontend_config(http_model_dir, scheduler.address,
                                                        http_port=0))
        await frontend.engine_core.wait_connected(10)
        return scheduler, frontend

    async def add_worker() -> RunningWorker:
        worker = start_worker(scheduler.address, http_model_dir, "w-small",
                              worker=dict(limits=limits))
        await wait_for_workers(scheduler.address, ["w-small"])
        return worker

    def num(field: str) -> int:
        return sum(getattr(w, field) for w in loop.run(get_stats(scheduler.address)).workers)

    scheduler, frontend = loop.run(start())
    url = frontend.http.url
    sockets = []
    try:
        status, body, _ = post(url, "/v1/completions", {"prompt": "hi"})
        assert status == 503 and "no worker is registered" in body["error"]["message"]
        assert body["error"]["type"] == "service_unavailable_error"
        loop.run(add_worker())
        long_request = {"prompt": "Count", "max_tokens": 240, "ignore_eos": True, "stream": True}
        sockets.append(_open_request(url, long_request))
        wait_for(lambda: num("num_running_reqs") == 1)
        sockets.append(_open_request(url, long_request))
        wait_for(lambda: num("num_waiting_reqs") == 1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as full:
            client.completions.create(model=http_stack.model, prompt="one more", max_tokens=2)
        assert "waiting queue is full" in full.value.message
    finally:
        for sock in sockets:
            sock.close()

        async def stop() -> None:
            await frontend.stop(1.0)
            await scheduler.stop(1.0)  # drains the worker

        loop.run(stop())
