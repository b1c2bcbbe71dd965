"""The embedded Redis: a real valkey-server that, with a password, lets no one else in;
and the free ports servers are started on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from services.common.redis_server import EmbeddedRedis, free_port

PASSWORD = "s3cret-for-this-run_only"


def test_with_a_password_only_its_holders_read_or_write() -> None:
    server = EmbeddedRedis(password=PASSWORD)
    try:
        assert PASSWORD in server.url
        with redis.Redis.from_url(server.url) as insider:
            assert insider.set("k", "v")
        with redis.Redis(host="127.0.0.1", port=server.port) as outsider:
            with pytest.raises(redis.exceptions.AuthenticationError):
                outsider.set("k", "w")
        with redis.Redis(host="127.0.0.1", port=server.port, password="wrong-password") as liar:
            with pytest.raises(redis.exceptions.AuthenticationError):
                liar.get("k")
        # Not on its command line, which every local user can read.
        cmdline = open(f"/proc/{server.pid}/cmdline", "rb").read()
        assert PASSWORD.encode() not in cmdline
    finally:
        server.stop()


def test_restarted_on_its_port_it_keeps_the_password() -> None:
    first = EmbeddedRedis(password=PASSWORD)
    port = first.port
    first.stop()
    second = EmbeddedRedis(port=port, password=PASSWORD)
    try:
        with redis.Redis.from_url(second.url) as client:
            assert client.ping()
        with redis.Redis(host="127.0.0.1", port=port) as outsider:
            with pytest.raises(redis.exceptions.AuthenticationError):
                outsider.set("k", "v")
    finally:
        second.stop()


@pytest.mark.parametrize("password", ["short", 'has "quotes" in it', "x" * 200])
def test_a_password_it_cannot_write_safely_is_refused(password: str) -> None:
    with pytest.raises(ValueError, match="password"):
        EmbeddedRedis(password=password)


def test_free_ports_are_distinct_and_below_the_ephemeral_range() -> None:
    """A port handed out can be bound, is never handed out twice, and lies where no
    outgoing connection's local end can take it before its server binds it."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= port < first_ephemeral for port in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
