"""A local kvmesh cluster: Redis, schedulers (cells), workers and frontends as child processes.

What ``kvmesh up`` runs, and what the end-to-end tests start. Every service
listens on loopback on a free port; each child runs in its own process group
(session) so stopping it also stops anything it started, and so a Ctrl-C in
the terminal reaches only the CLI, which then stops the children in order:
frontends, workers, schedulers, Redis; each with SIGTERM first, SIGKILL after
a grace period. Each child also gets SIGTERM if the process that started it
dies, so no service outlives a killed ``kvmesh up``. ``supervise()``
restarts a child that exited on its own, with backoff, on the same address.

With several schedulers each is a cell (``--cell-id cell-<i>``); workers are
spread over them round-robin, each given its own cell's address, and every
frontend gets all of them. The embedded Redis requires a password made for
the run; children get the Redis URL (and with it the password) and the
cluster secret through the environment, never on their command line.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

from kvmesh.healthcheck import check_health
from services.common.process import with_parent_death_signal
from services.common.redis_server import EmbeddedRedis, free_port
from services.common.security import CLUSTER_SECRET_ENV, REDIS_URL_ENV, redacted_url

# (name, host, port) -> the child's command line and what else it serves
# ({"http": url, "metrics": url}).
ArgvFactory = Callable[[str, str, int], tuple[list[str], dict[str, str]]]
# Called with a service's name and a line saying where it serves, once it does.
ReadyCallback = Callable[[str, str], None]
_POLL_INTERVAL_S = 0.2
_LOG_TAIL_BYTES = 4000
_MIN_RESTART_BACKOFF_S = 1.0
_MAX_RESTART_BACKOFF_S = 30.0
_RESTART_RESET_S = 60.0


@dataclass(kw_only=True)
class ClusterConfig:
    """What to start. ``model`` None is the default model (SmolLM2-135M-Instruct).

    ``frontend_port`` 0 picks a free port (the first frontend's; others always
    get free ports); ``frontend_http_port`` likewise for the first frontend's
    HTTP API (None: no HTTP API). With ``metrics``, each scheduler and each
    worker serve Prometheus ``/metrics`` on a free port (frontends serve it on
    their HTTP port). ``redis_url`` None starts an embedded valkey-server
    (with a password made for the run). ``num_schedulers`` cells, at most
    one per worker (a cell without a worker serves nothing).
    ``max_model_len`` goes to workers and frontends alike. The ``*_args``
    lists are extra command-line flags for every process of that kind (e.g.
    ``worker_args=["--num-kv-blocks", "64"]``). ``log_dir`` None lets the
    children write to this process's stdout/stderr; otherwise each writes
    ``<log_dir>/<name>.log``; ``log_level`` None keeps each service's default
    (INFO). ``env`` adds environment variables. ``cluster_secret`` None makes
    a fresh one for each start: the children get it through the environment,
    so nobody else on the machine can join or read the internal plane.
    """

    model: str | None = None
    num_schedulers: int = 1
    num_workers: int = 1
    num_frontends: int = 1
    frontend_port: int = 0
    frontend_http_port: int | None = 0
    metrics: bool = True
    host: str = "127.0.0.1"
    redis_url: str | None = None
    max_model_len: int | None = None
    scheduler_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    frontend_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    log_level: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cluster_secret: str | None = None
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if self.num_schedulers < 1:
            raise ValueError(f"num_schedulers is {self.num_schedulers}, must be >= 1")
        if self.num_workers < 0:
            raise ValueError(f"num_workers is {self.num_workers}, must be >= 0")
        if 0 < self.num_workers < self.num_schedulers:
            raise ValueError(f"num_workers is {self.num_workers}, must be >= num_schedulers "
                             f"({self.num_schedulers}): a cell without a worker serves nothing")
        if self.num_frontends < 0:
            raise ValueError(f"num_frontends is {self.num_frontends}, must be >= 0")


class ServiceProcess:
    """One child service: its command, the address its gRPC health answers on, its log,
    and the URLs of what else it serves (``urls["http"]``, ``urls["metrics"]``)."""

    def __init__(self, name: str, argv: list[str], health_address: str,
                 log_path: Path | None, env: dict[str, str],
                 urls: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.health_address = health_address
        self.urls = urls or {}
        self.log_path = log_path
        self.env = env
        self.num_restarts = 0
        self.started_at = time.monotonic()
        self.popen = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        log: IO[bytes] | None = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            return subprocess.Popen(
                with_parent_death_signal(self.argv), stdout=log,
                stderr=subprocess.STDOUT if log else None,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()

    def restart(self) -> None:
        """Starts the same command again (the child exited)."""
        self.num_restarts += 1
        self.started_at = time.monotonic()
        self.popen = self._spawn()

    def restart_due(self, now: float) -> bool:
        """Whether a dead child may be restarted now: 1 s after it started, doubling
        with each restart up to 30 s; a child that ran a minute starts afresh."""
        if now - self.started_at > _RESTART_RESET_S:
            self.num_restarts = 0
        backoff_s = min(_MIN_RESTART_BACKOFF_S * 2 ** self.num_restarts, _MAX_RESTART_BACKOFF_S)
        return now - self.started_at >= backoff_s

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the child's whole process group."""
        if self.alive():
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL if still running after ``grace_s``."""
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait()
        # Anything the child left in its group (it should leave nothing).
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")

    def wait_serving(self, deadline: float) -> None:
        """Waits for gRPC health SERVING; raises RuntimeError if the child dies,
        TimeoutError at ``deadline`` (time.monotonic())."""
        status = ""
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.popen.returncode} before serving\n"
                    f"{self.log_tail()}"
                )
            status = check_health(self.health_address, timeout_s=1.0)
            if status == "SERVING":
                return
            time.sleep(_POLL_INTERVAL_S)
        raise TimeoutError(
            f"{self.name} at {self.health_address} not SERVING (last: {status})\n{self.log_tail()}"
        )


class LocalCluster:
    """Starts and stops a whole cluster; use as a context manager.

    ``start()`` returns once every service answers health SERVING (workers:
    registered with their cell's scheduler; frontends: streaming to the
    schedulers); ``on_ready`` hears of each service as it gets there
    (``kvmesh up`` prints a line).
    """

    def __init__(self, config: ClusterConfig, on_ready: ReadyCallback | None = None) -> None:
        self.config = config
        self._on_ready = on_ready or (lambda name, detail: None)
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis_url
        self.schedulers: list[ServiceProcess] = []
        self.workers: list[ServiceProcess] = []
        self.frontends: list[ServiceProcess] = []
        self.cluster_secret = config.cluster_secret or secrets.token_urlsafe(32)

    @property
    def scheduler(self) -> ServiceProcess | None:
        """The first scheduler (the only one of a one-cell cluster)."""
        return self.schedulers[0] if self.schedulers else None

    @property
    def scheduler_address(self) -> str:
        return self.schedulers[0].health_address

    @property
    def scheduler_addresses(self) -> list[str]:
        return [s.health_address for s in self.schedulers]

    @property
    def frontend_addresses(self) -> list[str]:
        return [f.health_address for f in self.frontends]

    @property
    def address(self) -> str:
        """The first frontend's address (what clients dial)."""
        return self.frontends[0].health_address

    @property
    def http_url(self) -> str:
        """The first frontend's HTTP API (``/v1``, ``/metrics``, ``/dashboard`` under it)."""
        return self.frontends[0].urls["http"]

    def metrics_urls(self) -> dict[str, str]:
        """Every service's Prometheus endpoint, by service name."""
        processes = [*self.schedulers, *self.workers, *self.frontends]
        return {p.name: p.urls["metrics"] for p in processes if "metrics" in p.urls}

    def start(self) -> LocalCluster:
        try:
            if self.redis_url is None:
                self.redis = EmbeddedRedis(password=secrets.token_urlsafe(24))
                self.redis_url = self.redis.url
            self._on_ready("redis", redacted_url(self.redis_url))
            num_schedulers = self.config.num_schedulers
            for index in range(num_schedulers):
                name = "scheduler" if num_schedulers == 1 else f"scheduler-{index}"
                make_argv = partial(self._scheduler_argv, cell_id=f"cell-{index}")
                self.schedulers.append(self._spawn(name, make_argv))
            self._wait_serving(self.schedulers)
            # Frontends start beside the workers: they need only the schedulers, and
            # their start-up (imports, tokenizer) overlaps the workers' warm-up.
            self._spawn_workers(self.config.num_workers)
            for index in range(self.config.num_frontends):
                self._spawn_frontend(self.config.frontend_port if index == 0 else 0)
            self._wait_serving([*self.workers, *self.frontends])
        except BaseException:
            self.stop()
            raise
        return self

    def supervise(self) -> list[str]:
        """Restarts, with backoff, every child that exited on its own and the
        embedded Redis; returns what was restarted (call it every second or so)."""
        restarted = []
        now = time.monotonic()
        for process in [*self.schedulers, *self.workers, *self.frontends]:
            if not process.alive() and process.restart_due(now):
                exit_code = process.popen.returncode
                process.restart()
                restarted.append(f"{process.name} (had exited with code {exit_code}; "
                                 f"restart {process.num_restarts})")
        if self.redis is not None and not self.redis.alive():
            self.redis.stop()
            self.redis = EmbeddedRedis(port=self.redis.port, password=self.redis.password)
            restarted.append("redis")
        return restarted

    def stop(self) -> None:
        """Stops every child (frontends, workers, schedulers), then Redis; safe to call twice."""
        grace_s = self.config.stop_grace_s
        for group in (self.frontends, self.workers, self.schedulers):
            stop_all(group, grace_s)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ commands

    def _spawn_workers(self, num_workers: int) -> None:
        """Starts ``num_workers`` workers, each given one cell's scheduler in turn
        (worker-k joins cell (k - 1) mod the number of cells), without waiting for them."""
        for index in range(num_workers):
            cell = self.schedulers[index % len(self.schedulers)]
            make_argv = partial(self._worker_argv, scheduler_address=cell.health_address)
            self.workers.append(self._spawn(f"worker-{index + 1}", make_argv))

    def _spawn_frontend(self, port: int) -> None:
        """Starts a frontend on ``port`` (0: a free one) without waiting for it."""
        self.frontends.append(self._spawn(f"frontend-{len(self.frontends)}",
                                          self._frontend_argv, port))

    def _wait_serving(self, processes: Sequence[ServiceProcess]) -> None:
        """Waits for each of ``processes`` to serve, all within one start-up timeout,
        and reports each as it does."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        for process in processes:
            process.wait_serving(deadline)
            serves = [f"{kind} {url}" for kind, url in process.urls.items()]
            self._on_ready(process.name, "  ".join([f"grpc {process.health_address}", *serves]))

    def _spawn(self, name: str, make_argv: ArgvFactory, port: int = 0) -> ServiceProcess:
        """Starts ``make_argv(name, host, port)`` on ``port`` (0: a free one)."""
        host = self.config.host
        port = port or free_port()
        argv, urls = make_argv(name, host, port)
        if self.config.log_level is not None:
            argv += ["--log-level", self.config.log_level]
        log_dir = self.config.log_dir
        log_path = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            log_path = log_dir / f"{name}.log"
        env = {**self.config.env, CLUSTER_SECRET_ENV: self.cluster_secret}
        if self.redis_url is not None:
            env[REDIS_URL_ENV] = self.redis_url
        return ServiceProcess(name, argv, f"{host}:{port}", log_path, env, urls)

    def _metrics_args(self, host: str) -> tuple[list[str], dict[str, str]]:
        if not self.config.metrics:
            return [], {}
        port = free_port()
        return ["--metrics-port", str(port)], {"metrics": f"http://{host}:{port}/metrics"}

    def _model_args(self) -> list[str]:
        args = []
        if self.config.model is not None:
            args += ["--model", self.config.model]
        if self.config.max_model_len is not None:
            args += ["--max-model-len", str(self.config.max_model_len)]
        return args

    def _scheduler_argv(self, name: str, host: str, port: int, *, cell_id: str
                        ) -> tuple[list[str], dict[str, str]]:
        # The Redis URL comes by the environment (it may carry a password).
        argv = [sys.executable, "-m", "services.scheduler.server", "--host", host,
                "--port", str(port), "--cell-id", cell_id]
        if self.config.model is not None:
            argv += ["--model", self.config.model]
        metrics_args, urls = self._metrics_args(host)
        return argv + metrics_args + list(self.config.scheduler_args), urls

    def _worker_argv(self, name: str, host: str, port: int, *, scheduler_address: str
                     ) -> tuple[list[str], dict[str, str]]:
        # A worker dials its cell's scheduler; ``port`` is where it serves its health.
        argv = [sys.executable, "-m", "services.worker.server",
                "--scheduler-address", scheduler_address, "--worker-id", name,
                "--health-host", host, "--health-port", str(port), *self._model_args()]
        metrics_args, urls = self._metrics_args(host)
        return argv + metrics_args + list(self.config.worker_args), urls

    def _frontend_argv(self, name: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
        argv = [sys.executable, "-m", "services.frontend.server", "--host", host,
                "--port", str(port), "--scheduler-address", ",".join(self.scheduler_addresses),
                *self._model_args()]
        http_port = self.config.frontend_http_port
        if http_port is not None and self.frontends:
            http_port = 0  # only the first frontend gets the configured port
        urls: dict[str, str] = {}
        if http_port is None:
            argv.append("--no-http")
        else:
            http_port = http_port or free_port()
            argv += ["--http-port", str(http_port)]
            urls = {"http": f"http://{host}:{http_port}",
                    "metrics": f"http://{host}:{http_port}/metrics"}
        return argv + list(self.config.frontend_args), urls


def stop_all(processes: Sequence[ServiceProcess], grace_s: float) -> None:
    """Stops ``processes`` together: SIGTERM to all, then waits (SIGKILL stragglers)."""
    for process in processes:
        process.signal(signal.SIGTERM)
    for process in processes:
        process.stop(grace_s)
