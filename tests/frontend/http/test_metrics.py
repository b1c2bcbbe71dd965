"""Prometheus ``/metrics`` of the frontend, the scheduler and the worker, scraped around
a known workload and parsed with prometheus_client's own text parser: every
counter must move by exactly what the workload did."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from tests.frontend.http.conftest import HttpStack
from tests.frontend.http.test_openai_api import random_prompt
from tests.frontend.test_frontend_server import wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Prompt lengths with no full block in common with anything sent before (random ids).
PROMPT_LENS = (20, 33, 47)
MAX_TOKENS = 7


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the series whose labels include ``labels``."""
    return sum(v for (n, series), v in samples.items()
               if n == name and set(labels.items()) <= set(series))


def test_vllm_metric_names_and_labels_on_every_service(http_stack: HttpStack):
    names = {
        f"{http_stack.url}/metrics": [
            "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
            "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:request_success_total",
            "vllm:request_time_per_output_token_seconds_count",
            "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
            "kvmesh:cell_load_tokens", "kvmesh:cell_num_workers", "kvmesh:cell_connected",
            "kvmesh:cell_routed_requests_total"],
        http_stack.scheduler.metrics_server.url: [
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:num_preemptions_total", "vllm:iteration_tokens_total_count",
            "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
            "vllm:request_decode_time_seconds_count", "kvmesh:step_time_seconds_count",
            "kvmesh:placements_total", "kvmesh:redis_mirror_lag_seconds",
            "kvmesh:redis_mirror_errors_total", "kvmesh:kv_cache_evicted_blocks_total"],
        http_stack.worker.service.metrics_server.url: [
            "kvmesh:worker_scheduled_tokens_total", "kvmesh:worker_execute_time_seconds_count"],
    }
    http_stack.openai().completions.create(model=http_stack.model, prompt="hi", max_tokens=2)
    for url, expected in names.items():
        samples = scrape(url)
        for name in expected:
            series = [dict(labels) for n, labels in samples if n == name]
            assert series, f"{name} missing from {url}"
            assert all(labels["model_name"] == http_stack.model for labels in series)
            if url != f"{http_stack.url}/metrics" and name != "kvmesh:placements_total":
                assert all(labels["worker_id"] == "w0" for labels in series), name


def test_counters_move_by_what_the_workload_did(http_stack: HttpStack):
    http_stack.wait_idle()
    urls = {"frontend": f"{http_stack.url}/metrics",
            "scheduler": http_stack.scheduler.metrics_server.url,
            "worker": http_stack.worker.service.metrics_server.url}
    before = {name: scrape(url) for name, url in urls.items()}

    client = http_stack.openai()

    def stream_to_the_end(index: int) -> None:
        prompt = random_prompt(1000 + index, PROMPT_LENS[index])
        for _ in client.completions.create(model=http_stack.model, prompt=prompt,
                                           max_tokens=MAX_TOKENS, stream=True, temperature=0.0,
                                           extra_body={"ignore_eos": True}):
            pass

    with ThreadPoolExecutor(len(PROMPT_LENS)) as pool:
        list(pool.map(stream_to_the_end, range(len(PROMPT_LENS))))
    http_stack.wait_idle()
    after = {name: scrape(url) for name, url in urls.items()}

    def delta(service: str, name: str, **labels: str) -> float:
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    num_requests = len(PROMPT_LENS)
    num_prompt_tokens = sum(PROMPT_LENS)
    num_output_tokens = num_requests * MAX_TOKENS
    # Every token is computed once but the last one sampled of each request.
    num_computed_tokens = num_prompt_tokens + num_requests * (MAX_TOKENS - 1)
    expected = {
        ("frontend", "vllm:request_success_total"): num_requests,
        ("frontend", "vllm:prompt_tokens_total"): num_prompt_tokens,
        ("frontend", "vllm:generation_tokens_total"): num_output_tokens,
        ("frontend", "vllm:time_to_first_token_seconds_count"): num_requests,
        ("frontend", "vllm:inter_token_latency_seconds_count"): num_output_tokens - num_requests,
        ("frontend", "vllm:e2e_request_latency_seconds_count"): num_requests,
        ("frontend", "vllm:request_time_per_output_token_seconds_count"): num_requests,
        ("frontend", "vllm:request_prompt_tokens_sum"): num_prompt_tokens,
        ("frontend", "vllm:request_generation_tokens_sum"): num_output_tokens,
        ("scheduler", "vllm:prefix_cache_queries_total"): num_prompt_tokens,
        ("scheduler", "vllm:prefix_cache_hits_total"): 0,
        ("scheduler", "vllm:num_preemptions_total"): 0,
        ("scheduler", "vllm:iteration_tokens_total_sum"): num_computed_tokens,
        ("scheduler", "vllm:request_queue_time_seconds_count"): num_requests,
        ("scheduler", "vllm:request_prefill_time_seconds_count"): num_requests,
        ("scheduler", "vllm:request_decode_time_seconds_count"): num_requests,
        ("scheduler", "kvmesh:placements_total"): num_requests,
        ("worker", "kvmesh:worker_scheduled_tokens_total"): num_computed_tokens,
    }
    moved = {key: delta(*key) for key in expected}
    assert moved == expected
    assert delta("frontend", "vllm:request_success_total", finished_reason="length") == 3
    assert value(after["scheduler"], "vllm:num_requests_running") == 0
    assert value(after["scheduler"], "vllm:kv_cache_usage_perc") == 0
    # Steps that computed tokens: one histogram observation each, on both sides.
    assert delta("scheduler", "kvmesh:step_time_seconds_count") == delta(
        "scheduler", "vllm:iteration_tokens_total_count") > 0


def test_gauges_and_counters_move_during_a_request_and_its_abort(http_stack: HttpStack):
    http_stack.wait_idle()
    worker_url = http_stack.worker.service.metrics_server.url
    counters = {f"{http_stack.url}/metrics": "vllm:generation_tokens_total",
                http_stack.scheduler.metrics_server.url: "vllm:iteration_tokens_total_sum",
                worker_url: "kvmesh:worker_scheduled_tokens_total"}
    frontend_url, scheduler_url, _ = counters
    aborted_before = value(scrape(frontend_url), "vllm:request_success_total",
                           finished_reason="abort")
    stream = http_stack.openai().completions.create(
        model=http_stack.model, prompt="Count with me", max_tokens=240, stream=True,
        temperature=0.0, extra_body={"ignore_eos": True})
    next(iter(stream))
    scheduler = scrape(scheduler_url)
    assert value(scheduler, "vllm:num_requests_running") == 1
    assert value(scheduler, "vllm:kv_cache_usage_perc") > 0
    # Tokens keep coming: each service's counter moves while the request runs.
    for url, name in counters.items():
        before = value(scrape(url), name)
        wait_for(lambda: value(scrape(url), name) > before)
    stream.close()  # the client leaves: the request is aborted, and counted so
    http_stack.wait_idle()
    assert value(scrape(frontend_url), "vllm:request_success_total",
                 finished_reason="abort") == aborted_before + 1
