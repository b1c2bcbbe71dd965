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
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cli import main
from kvmesh.client import Client
from kvmesh.v1 import api_pb2, scheduler_pb2_grpc
from services.common.security import CLUSTER_SECRET_ENV, REDIS_URL_ENV, secret_metadata
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


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def child_running(parent_pid: int, module: str) -> int:
    """The pid of ``parent_pid``'s child running ``python -m module``."""
    return next(pid for pid in child_pids(parent_pid) if module in cmdline(pid))


def assert_no_redis_password_on_command_lines(parent_pid: int) -> None:
    """The children got the Redis URL (with a password made for the run) through
    their environment: no command line shows it."""
    scheduler_pid = child_running(parent_pid, "services.scheduler.server")
    redis_url = environ(scheduler_pid)[REDIS_URL_ENV]
    password = urllib.parse.urlsplit(redis_url).password
    assert password and len(password) >= 16
    for pid in child_pids(parent_pid):
        argv = cmdline(pid)
        assert not any(password in arg for arg in argv), argv
        assert not any(arg.startswith("--redis-url") for arg in argv), argv


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
        redis_line = next_line_with(lines, " ready ")
        assert "kvmesh: redis" in redis_line and ":***@127.0.0.1:" in redis_line
        for name in ("scheduler", "worker-1", "frontend-0"):
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
        assert_no_redis_password_on_command_lines(cli.pid)
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


@pytest.mark.parametrize(("counts", "error"), [
    (["--schedulers", "0"], "--schedulers is 0, must be >= 1"),
    (["--schedulers", "3", "--workers", "2"], "--workers is 2, must be >= --schedulers (3)"),
    (["--frontends", "0"], "--frontends is 0, must be >= 1"),
])
def test_kvmesh_up_refuses_counts_that_leave_a_cell_without_a_worker(counts, error, capsys):
    assert main(["up", "--port", "0", "--http-port", "0", *counts]) == 2
    assert error in capsys.readouterr().err


def scheduler_stats(address: str, secret: str) -> api_pb2.ClusterStats:
    with grpc.insecure_channel(address) as channel:
        return scheduler_pb2_grpc.EngineCoreStub(channel).GetStats(
            api_pb2.GetStatsRequest(), timeout=30, metadata=secret_metadata(secret))


def test_kvmesh_up_runs_a_cell_per_scheduler_with_the_workers_spread(tiny_model_dir, tmp_path):
    argv = up_argv(tiny_model_dir, tmp_path)
    argv[argv.index("--workers") + 1] = "2"
    cli = subprocess.Popen([*argv, "--schedulers", "2", "--frontends", "1"],
                           stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(cli.stdout, lines), daemon=True).start()
    try:
        assert "2 scheduler(s), 2 worker(s) and 1 frontend(s)" in next_line_with(
            lines, "kvmesh: starting ")
        ready = {}
        for _ in range(6):  # redis, 2 schedulers, 2 workers, a frontend
            line = next_line_with(lines, " ready ")
            ready[line.split()[1]] = line
        assert set(ready) == {"redis", "scheduler-0", "scheduler-1", "worker-1", "worker-2",
                              "frontend-0"}
        scheduler_addresses = [ready[f"scheduler-{i}"].split("grpc ")[1].split()[0]
                               for i in range(2)]
        address = next_line_with(lines, "kvmesh: serving on ").split("serving on ")[1].split()[0]
        # Each scheduler, each worker and the frontend serve /metrics.
        assert len(next_line_with(lines, "kvmesh: metrics ").split()[2:]) == 5
        assert len(child_pids(cli.pid)) == 6
        assert_no_redis_password_on_command_lines(cli.pid)
        secret = environ(child_running(cli.pid, "services.scheduler.server"))[CLUSTER_SECRET_ENV]
        for index, scheduler_address in enumerate(scheduler_addresses):
            stats = scheduler_stats(scheduler_address, secret)
            assert stats.cell_id == f"cell-{index}"
            # Worker k dials cell (k - 1) mod 2: one worker in each.
            assert [w.worker_id for w in stats.workers] == [f"worker-{index + 1}"]
        with Client(address, timeout_s=60) as client:
            response = client.complete("Hello there", max_tokens=5, **GREEDY)
            assert len(response.outputs[0].token_ids) == 5
    finally:
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(60) == 0
