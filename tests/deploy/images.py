"""Docker images for the compose test, built on this machine: no image registry is
reachable here, so the base that stands in for ``python:3.11-slim`` is made with
debootstrap from Debian's own mirror and imported, and a Redis image is built on it
with Debian's ``redis-server``. Each is cached by its tag.

``docker_unavailable_reason()`` says why the images cannot be had (not root, no
Docker engine, no debootstrap); ``docker_command()`` is a Docker client that can
build with BuildKit (the project's Dockerfile mounts a secret and a cache).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# Bump the suffix when what goes into an image changes.
BASE_IMAGE = "kvmesh-test/bookworm-python3.11:1"
REDIS_IMAGE = "kvmesh-test/redis:1"
# python3-dev: the headers python:3.11-slim has and inductor's C++ builds include.
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python3-dev", "ca-certificates")
DEBIAN_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
REDIS_DOCKERFILE = """\
FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \\
 && rm -rf /var/lib/apt/lists/*
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
"""


@functools.cache
def docker_command() -> tuple[str, ...] | None:
    """A Docker client that builds with BuildKit, as argv; None if there is none.

    A client with the buildx plugin builds with it; one older than 23.0 (Debian's
    ``docker.io``) has BuildKit inside, enabled by DOCKER_BUILDKIT=1. A newer
    client without buildx only has the legacy builder, which lacks ``RUN --mount``.
    """
    for path in _all_on_path("docker"):
        if _ok([path, "buildx", "version"]):
            return (path,)
        version = _output([path, "version", "--format", "{{.Client.Version}}"])
        if version and version.split(".")[0].isdigit() and int(version.split(".")[0]) < 23:
            return ("env", "DOCKER_BUILDKIT=1", path)
    return None


@functools.cache
def docker_unavailable_reason() -> str | None:
    """Why the compose test cannot run here, or None."""
    if os.geteuid() != 0:
        return "building images and running a Docker engine here needs root"
    if docker_command() is None:
        return "no Docker client that builds with BuildKit (Debian: apt-get install docker.io)"
    if not _ok([*docker_command(), "info"]):
        return "no Docker engine answers (start dockerd as root)"
    if shutil.which("docker-compose") is None and not _ok([*docker_command(), "compose", "version"]):
        return "no compose client (Debian: apt-get install docker-compose)"
    if shutil.which("debootstrap") is None:
        return "no debootstrap to make the base image (Debian: apt-get install debootstrap)"
    return None


@functools.cache
def compose_command() -> tuple[str, ...]:
    """``docker compose`` (v2) where the plugin is there, else Debian's docker-compose."""
    if _ok([*docker_command(), "compose", "version"]):
        return (*docker_command(), "compose")
    return ("docker-compose",)


def image_exists(tag: str) -> bool:
    return _ok([*docker_command(), "image", "inspect", tag])


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (the one that is reachable)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    return DEFAULT_MIRROR


def ensure_base_image() -> str:
    """The Debian bookworm base with Python 3.11 (pip, venv, headers); made once."""
    if not image_exists(BASE_IMAGE):
        with tempfile.TemporaryDirectory(prefix="kvmesh-rootfs-") as root:
            subprocess.run(["debootstrap", "--variant=minbase",
                            f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE, root,
                            debian_mirror()], check=True, capture_output=True, text=True)
            # Nothing of the build's apt lists or caches goes into the image.
            for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
                shutil.rmtree(Path(root) / leftover, ignore_errors=True)
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run([*docker_command(), "import", "-", BASE_IMAGE], stdin=tar.stdout,
                           check=True, capture_output=True)
            if tar.wait() != 0:
                raise RuntimeError(f"tar of {root} failed")
    return BASE_IMAGE


def ensure_redis_image() -> str:
    """A Redis image with Debian's redis-server on the base; stands in for redis:7."""
    if not image_exists(REDIS_IMAGE):
        with tempfile.TemporaryDirectory(prefix="kvmesh-redis-") as context:
            Path(context, "Dockerfile").write_text(REDIS_DOCKERFILE.format(base=ensure_base_image()))
            subprocess.run([*docker_command(), "build", "-t", REDIS_IMAGE, context],
                           check=True, capture_output=True, text=True)
    return REDIS_IMAGE


def _all_on_path(name: str) -> list[str]:
    found = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK) and path.resolve() not in found:
            found.append(path.resolve())
    return [str(p) for p in found]


def _ok(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _output(command: list[str]) -> str | None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None
