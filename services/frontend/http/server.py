"""uvicorn serving the HTTP app on the frontend's own event loop, beside grpc.aio.

The socket is bound in ``start()``, so a taken port fails there and port 0
is resolved at once. uvicorn is kept away from the process's signals: the
frontend's main handles SIGTERM / SIGINT and stops both servers itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from services.common.security import TlsConfig

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would install its own SIGINT/SIGTERM handlers (and re-raise
        # the signal when done); the frontend process owns its signals.
        yield


class HttpServer:
    """Serves ``app`` on ``host:port`` (0: a free port; ``port`` tells which once started),
    over TLS when ``tls`` names a certificate and key."""

    def __init__(self, app: FastAPI, host: str, port: int, tls: TlsConfig | None = None) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"http_port is {port}, must be in [0, 65535]")
        self.app = app
        self.host = host
        self.port = port
        self.tls = tls
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"could not bind the HTTP port {self.host}:{self.port}: {e}") from e
        self.port = sock.getsockname()[1]
        # Access logs would be one INFO line per request; the app logs its own events.
        tls = self.tls
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=None,
                                ssl_certfile=tls.cert_file if tls else None,
                                ssl_keyfile=tls.key_file if tls else None)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it
        logger.info("event=http_listening url=%s", self.url)

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stops accepting; open responses get ``grace_s`` to finish, then are cancelled."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        await self._task
        self._server = self._task = None
