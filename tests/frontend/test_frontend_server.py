"""The frontend gRPC service over real gRPC, with the real scheduler and worker services.

Scheduler, worker and frontend run in-process on free loopback ports, on one
asyncio loop in a background thread; tests call the frontend through the
synchronous ``kvmesh.client.Client``, like a user. The model is a tiny random
Llama carrying SmolLM2's tokenizer, so assertions compare runs with each
other (and exact token ids of the real tokenizer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from kvmesh.v1 import api_pb2, api_pb2_grpc

from kvmesh.client import Client
from kvmesh.healthcheck import check_health
from services.common.redis_server import free_port
from services.frontend.config import FrontendServiceConfig
from services.frontend.server import FrontendServer, serve_frontend
from services.scheduler.config import SchedulingOptions
from services.scheduler.server import SchedulerServer
from tests.e2e.tiny_model import save_tiny_llama
from tests.grpc_utils import (
    LIMITS,
    MAX_MODEL_LEN,
    RunningWorker,
    get_stats,
    reflection_services,
    start_scheduler,
    start_worker,
    wait_for_workers,
)

MAX_NUM_SEQS = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` executes a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)


@dataclass
class Stack:
    loop: LoopThread
    scheduler: SchedulerServer
    worker: RunningWorker
    frontend: FrontendServer
    client: Client

    def stats(self):
        return self.loop.run(get_stats(self.scheduler.address))

    def blocks_all_free(self) -> bool:
        (worker,) = self.stats().workers
        return (worker.num_free_blocks == worker.num_total_blocks
                and worker.num_running_reqs == worker.num_waiting_reqs == 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="module")
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


def frontend_config(model_dir: Path, scheduler_address: str, **overrides) -> FrontendServiceConfig:
    return FrontendServiceConfig(port=0, scheduler_address=scheduler_address, model=str(model_dir),
                                 max_model_len=MAX_MODEL_LEN, **overrides)


@pytest.fixture(scope="module")
def stack(loop, model_dir):
    async def start() -> tuple[SchedulerServer, RunningWorker, FrontendServer]:
        limits = dataclasses.replace(LIMITS, max_num_seqs=MAX_NUM_SEQS)
        scheduler = await start_scheduler(SchedulingOptions(limits=limits))
        worker = start_worker(scheduler.address, model_dir, "w0", worker=dict(limits=limits))
        await wait_for_workers(scheduler.address, ["w0"])
        frontend = await serve_frontend(frontend_config(model_dir, scheduler.address))
        return scheduler, worker, frontend

    scheduler, worker, frontend = loop.run(start())
    client = Client(frontend.address, timeout_s=30)
    wait_for(lambda: check_health(frontend.address) == "SERVING")
    yield Stack(loop, scheduler, worker, frontend, client)
    client.close()

    async def stop() -> None:
        await frontend.stop(1.0)
        await scheduler.stop(1.0)  # drains the worker
        await asyncio.wait_for(worker.task, 10)

    loop.run(stop())


async def health_becomes(address: str, status: str, timeout_s: float = 10.0) -> str:
    """Polls the frontend's health until it reports ``status``; returns the last seen."""
    deadline = time.monotonic() + timeout_s
    seen = ""
    while time.monotonic() < deadline:
        seen = await asyncio.to_thread(check_health, address)
        if seen == status:
            break
        await asyncio.sleep(0.1)
    return seen


def final(client: Client, prompt: str | None = None, **kwargs):
    return client.complete(prompt, **kwargs)


def error_of(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ---------------------------------------------------------------- discovery and model info


def test_health_serving_and_reflection_lists_generation(stack):
    address = stack.frontend.address
    assert check_health(address) == "SERVING"
    assert check_health(address, "kvmesh.v1.Generation") == "SERVING"
    assert stack.loop.run(reflection_services(address)) == [
        "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "kvmesh.v1.Generation",
    ]


def test_model_info(stack, model_dir):
    info = stack.client.model_info()
    assert (info.model, info.max_model_len, info.vocab_size, list(info.eos_token_ids)) == (
        str(model_dir), MAX_MODEL_LEN, 49152, [2])


def test_tokenize_and_detokenize_with_the_real_tokenizer(stack):
    client = stack.client
    assert client.tokenize("Hello world") == [19556, 905]
    chat_ids = client.tokenize(messages=[{"role": "user", "content": "hi"}])
    # SmolLM2's template: default system prompt, then the user turn, then the
    # assistant header (add_generation_prompt).
    assert chat_ids[:2] == [1, 9690]
    assert chat_ids[-10:] == [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]
    assert client.detokenize([19556, 905]) == "Hello world"
    assert client.detokenize([1, 19556, 2], skip_special_tokens=True) == "Hello"
    assert (client.detokenize([1, 19556, 2], skip_special_tokens=False)
            == "<|im_start|>Hello<|im_end|>")


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(prompt="hi", temperature=-1.0), "temperature must be >= 0, got -1.0"),
    (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(prompt="hi", top_k=-3), "top_k must be -1 or 0 (disabled) or >= 1, got -3"),
    (dict(prompt="hi", logprobs=21), "logprobs must be in [0, 20], got 21"),
    (dict(prompt="hi", stop=[""]), "stop strings must have 1 to 1024 characters"),
    (dict(token_ids=[5, 49152]), "prompt must hold token ids in [0, 49152), got 49152"),
    (dict(token_ids=[]), "prompt must not be empty"),
    (dict(prompt="hi", max_tokens=300),
     "prompt has 1 tokens and max_tokens is 300, but max_model_len is 256"),
    (dict(token_ids=[7] * 300), "prompt has 300 tokens, max_model_len is 256"),
    (dict(prompt="hi", extra_args={"a": [math.nan]}),
     "extra_args['a'][0] must be a finite number, got nan"),
    # Bounds checked before any expensive work (tokenization, fan-out).
    (dict(prompt="x" * 8_000_000), "prompt has 8000000 bytes of text, at most"),
    (dict(prompt="hi", n=4000), "n must be in [1, 128], got 4000"),
    (dict(prompt="hi", stop=["s"] * 20_000), "stop must hold at most 64 strings, got 20000"),
    (dict(prompt="hi", stop=["s" * 5000]), "stop strings must have 1 to 1024 characters"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "message role must be one of"),
    (dict(messages=[{"role": "user", "content": "hi"}] * 2000),
     "messages must hold at most 1024 messages, got 2000"),
    (dict(prompt="hi", request_id="r" * 10_000), "request_id must be a string of 1 to 256"),
    (dict(prompt="hi", cache_salt="s" * 10_000), "cache_salt must be a string of 0 to 256"),
    (dict(prompt="hi", output_kind=99), "output_kind must be one of CUMULATIVE (0), DELTA (1)"),
])
def test_invalid_requests_are_invalid_argument_naming_the_field(stack, kwargs, message):
    error = error_of(lambda: list(stack.client.generate(**kwargs)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    # Nothing reached the engine, and the frontend keeps serving.
    assert stack.frontend.servicer.engine.num_unfinished_requests == 0
    assert len(final(stack.client, "hi", max_tokens=2, **GREEDY).outputs[0].token_ids) == 2


def test_an_undecodable_body_is_invalid_argument_without_a_traceback(stack, caplog):
    with grpc.insecure_channel(stack.frontend.address) as channel:
        generate = channel.unary_stream("/kvmesh.v1.Generation/Generate")
        error = error_of(lambda: list(generate(b"\xff\xff\xff\xff not a GenerateRequest")))
        tokenize = channel.unary_unary("/kvmesh.v1.Generation/Tokenize")
        tokenize_error = error_of(lambda: tokenize(b"\xff\xff\xff\xff", timeout=10))
    for e in (error, tokenize_error):
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not be decoded" in e.details()
    assert "Traceback" not in caplog.text and "DecodeError" not in caplog.text


def test_a_huge_prompt_is_refused_before_it_stalls_other_streams(stack):
    """The 8 MB prompt is refused by its size, never tokenized; a stream running
    beside it is not held up (the tokenizer would take seconds)."""
    beside = stack.client.generate("Count with me", max_tokens=40, **GREEDY)
    first = next(beside)
    huge = error_of(lambda: stack.client.tokenize("word " * 2_000_000))
    rest = list(beside)
    assert huge.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes of text" in huge.details()
    assert len(first.outputs[0].token_ids) + sum(len(c.outputs[0].token_ids) for c in rest) == 40


def test_unset_sampling_fields_take_vllm_defaults_over_grpc(stack):
    """A grpcurl-style request: skip_special_tokens, temperature, n... all unset."""
    def generate(sampling_params: str) -> api_pb2.GenerateResponse:
        # Only <|im_start|> (id 1, a special token) may be sampled: any temperature gives it.
        request = json_format.Parse(
            '{"text": "hi", "sampling_params": {"max_tokens": 2, "ignore_eos": true,'
            ' "allowed_token_ids": [1], "output_kind": "FINAL_ONLY"' + sampling_params + "}}",
            api_pb2.GenerateRequest())
        with grpc.insecure_channel(stack.frontend.address) as channel:
            *_, last = api_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)
        return last

    default = generate(', "extra_args": {"plugin": {"level": 2}}').outputs
    assert [(list(o.token_ids), o.text) for o in default] == [([1, 1], "")]
    kept = generate(', "skip_special_tokens": false').outputs[0]
    assert (list(kept.token_ids), kept.text) == ([1, 1], "<|im_start|><|im_start|>")


def test_detokenize_out_of_vocab_is_invalid_argument(stack):
    error = error_of(lambda: stack.client.detokenize([49152]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids must hold token ids in [0, 49152), got 49152" in error.details()


# ---------------------------------------------------------------- streaming


def test_output_kinds_agree(stack):
    client = stack.client
    reference = final(client, "Hello there", max_tokens=12, **GREEDY)
    ref_out = reference.outputs[0]
    assert reference.finished and ref_out.finish_reason == "length" and len(ref_out.token_ids) == 12
    assert (reference.metrics.num_generation_tokens, reference.metrics.num_prompt_tokens) == (12, 2)

    delta = list(client.generate("Hello there", max_tokens=12, **GREEDY))
    assert "".join(c.outputs[0].text for c in delta) == ref_out.text
    assert [t for c in delta for t in c.outputs[0].token_ids] == list(ref_out.token_ids)
    # The prompt rides on the first chunk only, metrics on the last only.
    assert list(delta[0].prompt_token_ids) == [19556, 665]
    assert all(not c.prompt_token_ids for c in delta[1:])
    assert [c.HasField("metrics") for c in delta] == [False] * (len(delta) - 1) + [True]
    assert [c.finished for c in delta] == [False] * (len(delta) - 1) + [True]

    cumulative = list(client.generate("Hello there", max_tokens=12, output_kind="cumulative",
                                      **GREEDY))
    lengths = [len(c.outputs[0].token_ids) for c in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    assert cumulative[-1].outputs[0].text == ref_out.text


def test_stop_string_ends_the_request_and_frees_its_blocks(stack):
    client = stack.client
    text = final(client, "Tell me", max_tokens=16, **GREEDY).outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    out = final(client, "Tell me", max_tokens=16, stop=[stop], **GREEDY).outputs[0]
    assert (out.text, out.finish_reason, out.stop_str) == (expected, "stop", stop)
    with_stop = final(client, "Tell me", max_tokens=16, stop=[stop],
                      include_stop_str_in_output=True, **GREEDY).outputs[0]
    assert with_stop.text == expected + stop
    wait_for(stack.blocks_all_free)


def test_duplicate_client_request_ids_get_their_own_outputs(stack):
    client = stack.client
    prompts = ["Once upon a time", "The weather today"]
    expected = [final(client, p, max_tokens=10, **GREEDY).outputs[0].text for p in prompts]
    results: list[str] = ["", ""]

    def run(index: int) -> None:
        chunks = client.generate(prompts[index], request_id="same-id", max_tokens=10, **GREEDY)
        results[index] = "".join(c.outputs[0].text for c in chunks if c.request_id == "same-id")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected


def test_n2_merges_children_and_seeds_reproduce(stack):
    client = stack.client
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True, n=2)
    first = final(client, "Pick a word", seed=7, **sampled)
    assert sorted(o.index for o in first.outputs) == [0, 1]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in first.outputs)
    again = final(client, "Pick a word", seed=7, **sampled)
    other = final(client, "Pick a word", seed=8, **sampled)

    def by_index(response):
        return [list(o.token_ids) for o in sorted(response.outputs, key=lambda o: o.index)]

    assert by_index(again) == by_index(first)
    assert by_index(other) != by_index(first)
    assert by_index(first)[0] != by_index(first)[1]  # children get derived seeds
    # DELTA with n=2: each chunk names its sequence; per index they concatenate.
    chunks = list(client.generate("Pick a word", seed=7, **sampled))
    tokens = {0: [], 1: []}
    for chunk in chunks:
        for output in chunk.outputs:
            tokens[output.index].extend(output.token_ids)
    assert [tokens[0], tokens[1]] == by_index(first)


def test_logprobs_and_prompt_logprobs(stack):
    response = final(stack.client, "Hello there", max_tokens=4, logprobs=2, prompt_logprobs=1,
                     **GREEDY)
    out = response.outputs[0]
    assert len(out.logprobs) == 4
    for token_id, position in zip(out.token_ids, out.logprobs):
        # Greedy: the sampled token is the top-1, listed once; then the top-2.
        assert position.entries[0].token_id == token_id
        assert [e.rank for e in position.entries] == [1, 2]
    assert out.cumulative_logprob == pytest.approx(sum(p.entries[0].logprob for p in out.logprobs),
                                                   abs=1e-4)
    # Position 0 has nothing to condition on: an empty entry.
    assert [len(p.entries) for p in response.prompt_logprobs][0] == 0
    assert len(response.prompt_logprobs) == 2
    assert response.prompt_logprobs[1].entries[0].token_id == 665


# ---------------------------------------------------------------- cancellation


def test_cancelled_stream_aborts_and_frees_blocks(stack):
    stream = stack.client.generate("Count with me", max_tokens=200, **GREEDY)
    first_chunks = [next(stream), next(stream)]
    assert all(not c.finished for c in first_chunks)
    stream.close()  # cancels the call
    wait_for(lambda: stack.frontend.servicer.engine.num_unfinished_requests == 0)
    wait_for(stack.blocks_all_free)


def test_deadline_exceeded_aborts_and_frees_blocks(stack):
    error = error_of(lambda: list(stack.client.generate("Count with me", max_tokens=240,
                                                        timeout_s=0.3, **GREEDY)))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: stack.frontend.servicer.engine.num_unfinished_requests == 0)
    wait_for(stack.blocks_all_free)


# ---------------------------------------------------------------- scheduler stream


def test_no_worker_is_unavailable(loop, model_dir):
    async def scenario() -> tuple[grpc.RpcError, str]:
        scheduler = await start_scheduler()
        frontend = await serve_frontend(frontend_config(model_dir, scheduler.address))
        try:
            await frontend.engine_core.wait_connected(10)
            with Client(frontend.address) as client:
                error = await asyncio.to_thread(error_of, lambda: list(client.generate("hi")))
            return error, await asyncio.to_thread(check_health, frontend.address)
        finally:
            await frontend.stop(0.5)
            await scheduler.stop(0.5)

    error, health = loop.run(scenario())
    assert health == "NOT_SERVING"  # connected, but nothing can serve
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no worker is registered" in error.details()


def test_scheduler_restart_loses_nothing_greedy_and_seeded(loop, model_dir):
    port = free_port()
    seeded = dict(temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        frontend = await serve_frontend(frontend_config(model_dir, f"127.0.0.1:{port}"))
        client = Client(frontend.address, timeout_s=60)
        try:
            # No scheduler yet (never connected): NOT_SERVING, and requests fail fast.
            seen["health_before"] = await asyncio.to_thread(check_health, frontend.address)
            seen["before"] = await asyncio.to_thread(error_of, lambda: list(client.generate("hi")))
            scheduler = await start_scheduler(port=port)
            worker = start_worker(scheduler.address, model_dir, "w1")
            await wait_for_workers(scheduler.address, ["w1"])
            await frontend.engine_core.wait_connected(10)
            seen["health_connected"] = await health_becomes(frontend.address, "SERVING")
            for name, params in (("greedy", GREEDY), ("seeded", seeded)):
                seen[f"{name}_uninterrupted"] = await asyncio.to_thread(
                    final, client, "Count with me", max_tokens=120, **params)
            streams = {name: client.generate("Count with me", max_tokens=120, **params)
                       for name, params in (("greedy", GREEDY), ("seeded", seeded))}
            chunks = {name: [await asyncio.to_thread(next, stream)]
                      for name, stream in streams.items()}
            # The scheduler restarts with both requests in flight; the worker
            # dials the new one, the frontend resubmits what it holds.
            await scheduler.stop(0.0, drain_workers=False)
            seen["health_lost"] = await health_becomes(frontend.address, "NOT_SERVING")
            seen["liveness_lost"] = await asyncio.to_thread(
                check_health, frontend.address, "liveness")
            scheduler = await start_scheduler(port=port)
            await frontend.engine_core.wait_connected(10)
            seen["health_again"] = await health_becomes(frontend.address, "SERVING")
            for name, stream in streams.items():
                chunks[name] += await asyncio.to_thread(list, stream)
            seen["chunks"] = chunks
            await scheduler.stop(1.0)
            await asyncio.wait_for(worker.task, 10)
        finally:
            client.close()
            await frontend.stop(0.5)
        return seen

    seen = loop.run(scenario(), timeout_s=120)
    assert seen["health_before"] == "NOT_SERVING"
    assert seen["before"].code() == grpc.StatusCode.UNAVAILABLE
    assert seen["health_connected"] == "SERVING"
    assert seen["health_lost"] == "NOT_SERVING"
    assert seen["liveness_lost"] == "SERVING"  # not ready, but alive: not to be restarted
    assert seen["health_again"] == "SERVING"
    for name in ("greedy", "seeded"):
        chunks = seen["chunks"][name]
        expected = seen[f"{name}_uninterrupted"].outputs[0]
        assert [t for c in chunks for t in c.outputs[0].token_ids] == list(expected.token_ids)
        assert "".join(c.outputs[0].text for c in chunks) == expected.text
        assert chunks[-1].finished and len(expected.token_ids) == 120


def test_a_cell_left_without_workers_hands_its_streams_to_one_that_just_got_one(loop, model_dir):
    """Cell a's only worker dies while cell b has had a worker for a few ms, which
    this frontend's last look at b (about a second old) did not show. a refuses
    the stream (UNAVAILABLE, no worker left); it moves to b all the same, unchanged."""

    async def scenario() -> tuple[Any, list]:
        a, b = await start_scheduler(), await start_scheduler()
        w0 = start_worker(a.address, model_dir, "w0")
        await wait_for_workers(a.address, ["w0"])
        frontend = await serve_frontend(frontend_config(model_dir, f"{a.address},{b.address}"))
        client = Client(frontend.address, timeout_s=60)
        try:
            assert await health_becomes(frontend.address, "SERVING") == "SERVING"
            expected = await asyncio.to_thread(final, client, "Count with me", max_tokens=120,
                                               **GREEDY)
            stream = client.generate("Count with me", max_tokens=120, **GREEDY)
            chunks = [await asyncio.to_thread(next, stream)]
            w1 = start_worker(b.address, model_dir, "w1")
            await wait_for_workers(b.address, ["w1"])
            await w0.kill()
            chunks += await asyncio.to_thread(list, stream)
            await b.stop(1.0)
            await asyncio.wait_for(w1.task, 10)
        finally:
            client.close()
            await frontend.stop(0.5)
            await a.stop(0.5)
        return expected, chunks

    expected, chunks = loop.run(scenario(), timeout_s=120)
    assert [t for c in chunks for t in c.outputs[0].token_ids] == list(expected.outputs[0].token_ids)
    assert chunks[-1].finished and len(expected.outputs[0].token_ids) == 120


def test_requests_fail_unavailable_when_no_scheduler_returns_in_the_grace_period(loop, model_dir):
    port = free_port()

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        config = frontend_config(model_dir, f"127.0.0.1:{port}", resubmit_grace_s=1.0)
        frontend = await serve_frontend(config)
        client = Client(frontend.address, timeout_s=30)
        try:
            scheduler = await start_scheduler(port=port)
            await frontend.engine_core.wait_connected(10)
            # Connected, but no worker to serve: not SERVING.
            await asyncio.sleep(1.5)
            seen["health_no_worker"] = await asyncio.to_thread(check_health, frontend.address)
            worker = start_worker(scheduler.address, model_dir, "w1")
            await wait_for_workers(scheduler.address, ["w1"])
            seen["health_worker"] = await health_becomes(frontend.address, "SERVING")
            stream = client.generate("Count with me", max_tokens=240, **GREEDY)
            await asyncio.to_thread(next, stream)
            await scheduler.stop(0.0, drain_workers=False)
            await worker.kill()
            seen["in_flight"] = await asyncio.to_thread(error_of, lambda: list(stream))
            seen["during"] = await asyncio.to_thread(error_of, lambda: list(client.generate("hi")))
        finally:
            client.close()
            await frontend.stop(0.5)
        return seen

    seen = loop.run(scenario(), timeout_s=60)
    assert (seen["health_no_worker"], seen["health_worker"]) == ("NOT_SERVING", "SERVING")
    assert seen["in_flight"].code() == grpc.StatusCode.UNAVAILABLE
    assert "lost the scheduler stream" in seen["in_flight"].details()
    assert seen["during"].code() == grpc.StatusCode.UNAVAILABLE
