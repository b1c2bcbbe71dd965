"""``kvmesh up`` as a user runs it: a process that starts the cluster, serves, and on
SIGTERM stops every child it started (no orphans)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

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


def test_kvmesh_up_serves_then_stops_every_child_on_sigterm(tiny_model_dir, tmp_path):
    cli = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "up", "--model", str(tiny_model_dir), "--port", "0",
         "--workers", "1", "--max-model-len", str(TINY_MAX_MODEL_LEN), "--log-dir", str(tmp_path),
         "--demo"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(cli.stdout, lines), daemon=True).start()
    try:
        serving = next_line_with(lines, "kvmesh: serving on ")
        address = serving.split("serving on ")[1].split()[0]
        next_line_with(lines, "user: What is the capital of France?")
        assert next_line_with(lines, "assistant: ").startswith("assistant: ")
        with Client(address, timeout_s=30) as client:
            response = client.complete("Hello there", max_tokens=5, **GREEDY)
            assert len(response.outputs[0].token_ids) == 5
        # Redis, the scheduler, the worker and the frontend.
        children = child_pids(cli.pid)
        assert len(children) == 4
    finally:
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(60) == 0
    next_line_with(lines, "kvmesh: stopped", timeout_s=5)
    wait_for(lambda: not any(alive(pid) for pid in children), timeout_s=5, what="children gone")


def up_argv(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", "up", "--model", str(tiny_model_dir),
            "--port", "0", "--workers", "1", "--max-model-len", str(TINY_MAX_MODEL_LEN),
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
