"""The project's docker-compose.yml under a real Docker engine, for the compose test:
the kvmesh image built from the project's Dockerfile on the local base image
(tests/deploy/images.py), a project brought up and down, and what it runs.

pip inside the build reaches the registries as this machine's pip does: with
the certificate authority pip's configuration names (passed as a build secret,
never into the image) and the local directory of wheels it names as find-links
(torch's CPU build), served over loopback to a build on the host's network.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tests.deploy.images import compose_command, docker_command

REPO = Path(__file__).resolve().parents[2]
KVMESH_IMAGE = "kvmesh-test/kvmesh:latest"
PYPI_INDEX = "https://pypi.org/simple"
WHEELS_PORT = 28461


@dataclass(frozen=True)
class BuiltImage:
    tag: str
    build_s: float
    size_bytes: int


def pip_setting(name: str) -> str | None:
    """pip's own setting ``name`` (``cert``, ``find-links``): its environment
    variable first, then its configuration files."""
    value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
    if value:
        return value
    result = subprocess.run([sys.executable, "-m", "pip", "config", "get", f"global.{name}"],
                            capture_output=True, text=True)
    return (result.stdout.strip() or None) if result.returncode == 0 else None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def served_directory(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on loopback (a find-links page), for the build. On a
    fixed port where it is free: the URL is a build argument, and a new one each
    time would rebuild every layer after it."""
    handler = partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def build_kvmesh_image(base_image: str, log_path: Path) -> BuiltImage:
    """Builds the project's Dockerfile as ``KVMESH_IMAGE`` on ``base_image``."""
    command = [*docker_command(), "build", "--network", "host", "--progress", "plain",
               "-t", KVMESH_IMAGE, "--build-arg", f"BASE_IMAGE={base_image}"]
    if cert := pip_setting("cert"):
        command += ["--secret", f"id=pip_cert,src={cert}"]
    wheels = pip_setting("find-links")
    local_wheels = Path(wheels.split()[0]) if wheels and Path(wheels.split()[0]).is_dir() else None
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if local_wheels is not None:  # torch's CPU build is there: PyPI for the rest
            url = stack.enter_context(served_directory(local_wheels))
            command += ["--build-arg", f"PIP_FIND_LINKS={url}",
                        "--build-arg", f"TORCH_INDEX_URL={pip_setting('index-url') or PYPI_INDEX}"]
        with log_path.open("w") as log:
            built = subprocess.run([*command, str(REPO)], stdout=log, stderr=subprocess.STDOUT,
                                   timeout=1800)
        if built.returncode != 0:
            raise RuntimeError(f"docker build failed ({log_path}):\n{log_path.read_text()[-4000:]}")
    build_s = time.monotonic() - started
    size = subprocess.run([*docker_command(), "image", "inspect", "-f", "{{.Size}}", KVMESH_IMAGE],
                          capture_output=True, text=True, check=True).stdout
    return BuiltImage(KVMESH_IMAGE, build_s, int(size))


def compose_objects(kind: str, label: str = "com.docker.compose.project") -> list[str]:
    """The ids of every ``kind`` (container, network, volume) carrying ``label``
    (``key`` or ``key=value``), stopped containers included."""
    return subprocess.run(
        [*docker_command(), kind, "ls", "-q", *(["-a"] if kind == "container" else []),
         "--filter", f"label={label}"], capture_output=True, text=True, check=True).stdout.split()


def remove_projects(prefix: str) -> None:
    """Removes the containers, networks and volumes of every compose project whose
    name starts with ``prefix``: what a killed test run left behind."""
    for kind in ("container", "network", "volume"):
        if not (listed := compose_objects(kind)):
            continue
        infos = json.loads(subprocess.run([*docker_command(), kind, "inspect", *listed],
                                          capture_output=True, text=True, check=True).stdout)
        stale = [info.get("Id") or info["Name"] for info in infos
                 if ((info.get("Config") or info).get("Labels") or {})
                 .get("com.docker.compose.project", "").startswith(prefix)]
        if stale:
            remove = ["rm", "-f"] if kind != "network" else ["rm"]
            subprocess.run([*docker_command(), kind, *remove, *stale], capture_output=True,
                           check=True)


@dataclass
class ComposeProject:
    """One ``docker compose -p <name>`` project of the repository's compose file."""

    name: str
    env: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, timeout_s: float = 900) -> str:
        command = [*compose_command(), "-f", str(REPO / "docker-compose.yml"), "-p", self.name, *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, **self.env}, cwd=REPO)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {result.stderr[-3000:]}")
        return result.stdout

    def docker(self, *args: str) -> str:
        return subprocess.run([*docker_command(), *args], capture_output=True, text=True,
                              check=True, timeout=120).stdout

    def container_ids(self, service: str | None = None) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.name}"]
        if service is not None:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.docker("ps", "-aq", "--no-trunc", *filters).split()

    def inspect(self, container_id: str) -> dict:
        return json.loads(self.docker("inspect", container_id))[0]

    def health(self) -> dict[str, str]:
        """Each container's name -> its healthcheck status (or its state)."""
        states = {}
        for container_id in self.container_ids():
            state = self.inspect(container_id)["State"]
            states[container_id[:12]] = state.get("Health", {}).get("Status", state["Status"])
        return states

    def wait_healthy(self, timeout_s: float) -> None:
        """Until every container of the project reports its healthcheck healthy."""
        deadline = time.monotonic() + timeout_s
        while set(self.health().values()) != {"healthy"}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every container healthy in {timeout_s}s: {self.health()}")
            time.sleep(1)

    def published_port(self, container_id: str, port: int) -> int:
        bindings = self.inspect(container_id)["NetworkSettings"]["Ports"][f"{port}/tcp"]
        return int(bindings[0]["HostPort"])

    def logs(self, container_id: str) -> str:
        result = subprocess.run([*docker_command(), "logs", container_id], capture_output=True,
                                text=True, timeout=60)
        return result.stdout + result.stderr

    def leftovers(self) -> dict[str, list[str]]:
        """What of the project still exists: containers, networks, volumes."""
        label = f"com.docker.compose.project={self.name}"
        return {f"{kind}s": compose_objects(kind, label) for kind in ("container", "network", "volume")}
