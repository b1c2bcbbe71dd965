"""``kvmesh up`` as a user runs it: a process that starts the cluster, prints a status
line per service and the addresses (gRPC, HTTP, dashboard, metrics), serves,
and on SIGTERM stops every child it started (no orphans); the children's logs
go to the directory it names, not to the terminal."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import Client
from tests.e2e.helpers import GREEDY, TINY_MAX_MODEL_LEN, wait_for


def child_pids(pid: int) -> set[int]:
    """Direct children of ``pid`` (from /proc)."""
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Field 4 is the parent pid; the command name (field 2) may hold spaces.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.add(int(entry.name))
    return children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def next_line_with(lines: queue.Queue, marker: str, timeout_s: float = 120.0) -> str:
    while True:
        line = lines.get(timeout=timeout_s)
        if marker in line:
            return line


def scrape(url: str) -> dict[str, float]:
    """Each sample name's value, summed over its series."""
    totals: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=30) as response:
        for family in text_string_to_metric_families(response.read().decode()):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_kvmesh_up_serves_then_stops_every_child_on_sigterm(tiny_model_dir):
    cli = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "up", "--model", str(tiny_model_dir), "--port", "0",
         "--http-port", "0", "--workers", "1", "--max-model-len", str(TINY_MAX_MODEL_LEN),
         "--demo"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(cli.stdout, lines), daemon=True).start()
    try:
        log_dir = Path(next_line_with(lines, "kvmesh: starting ").split("logs in ")[1].split()[0])
        # One status line per service, then the addresses.
        for name in ("redis", "scheduler", "worker-1", "frontend-0"):
            assert f"kvmesh: {name}" in next_line_with(lines, " ready ")
        serving = next_line_with(lines, "kvmesh: serving on ")
        address = serving.split("serving on ")[1].split()[0]
        http_url = serving.split(" and ")[1].split()[0].removesuffix("/v1")
        dashboard = next_line_with(lines, "kvmesh: dashboard ").split()[-1]
        metrics_urls = next_line_with(lines, "kvmesh: metrics ").split()[2:]
        next_line_with(lines, "user: What is the capital of France?")
        assert next_line_with(lines, "assistant: ").startswith("assistant: ")
        with Client(address, timeout_s=30) as client:
            response = client.complete("Hello there", max_tokens=5, **GREEDY)
            assert len(response.outputs[0].token_ids) == 5
        completion = openai.OpenAI(base_url=f"{http_url}/v1", api_key="none").completions.create(
            model=str(tiny_model_dir), prompt="Hello there", max_tokens=5, temperature=0.0,
            extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 5
        with urllib.request.urlopen(dashboard, timeout=30) as page:
            assert b"dashboard.js" in page.read()
        # The frontend, the scheduler and the worker each serve /metrics.
        assert len(metrics_urls) == 3
        samples = [scrape(url) for url in metrics_urls]
        assert any(s.get("vllm:request_success_total", 0) >= 2 for s in samples)
        assert any("vllm:num_requests_running" in s for s in samples)
        assert any("kvmesh:worker_scheduled_tokens_total" in s for s in samples)
        # Redis, the scheduler, the worker and the frontend.
        children = child_pids(cli.pid)
        assert len(children) == 4
    finally:
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(60) == 0
    next_line_with(lines, "kvmesh: stopped", timeout_s=5)
    wait_for(lambda: not any(alive(pid) for pid in children), timeout_s=5, what="children gone")
    # The children logged to files, not to the terminal.
    assert {p.name for p in log_dir.iterdir()} == {
        "scheduler.log", "worker-1.log", "frontend-0.log"}
    assert "event=frontend_loaded" in (log_dir / "frontend-0.log").read_text()
    while not lines.empty():
        assert "event=" not in lines.get_nowait()
    shutil.rmtree(log_dir)


def up_argv(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", "up", "--model", str(tiny_model_dir),
            "--port", "0", "--http-port", "0", "--workers", "1",
            "--max-model-len", str(TINY_MAX_MODEL_LEN),
            "--log-dir", str(tmp_path)]


def start_up(tiny_model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, queue.Queue, str]:
    cli = subprocess.Popen(up_argv(tiny_model_dir, tmp_path), stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(cli.stdout, lines), daemon=True).start()
    serving = next_line_with(lines, "kvmesh: serving on ")
    return cli, lines, serving.split("serving on ")[1].split()[0]


def test_children_stop_when_kvmesh_up_is_killed_outright(tiny_model_dir, tmp_path):
    cli, _, _ = start_up(tiny_model_dir, tmp_path)
    children = child_pids(cli.pid)
    assert len(children) == 4
    cli.kill()  # SIGKILL: no chance to stop anything itself
    cli.wait(10)
    wait_for(lambda: not any(alive(pid) for pid in children), timeout_s=15, what="orphans gone")


def test_kvmesh_up_stops_when_its_output_is_closed(tiny_model_dir, tmp_path):
    cli = subprocess.Popen(up_argv(tiny_model_dir, tmp_path), stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    while "kvmesh: serving on " not in cli.stdout.readline():
        pass
    children = child_pids(cli.pid)
    cli.stdout.close()  # the reader goes away, as `kvmesh up | head -1` does
    assert cli.wait(30) == 0
    wait_for(lambda: not any(alive(pid) for pid in children), timeout_s=5, what="children gone")
