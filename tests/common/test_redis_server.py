"""The embedded Redis: a real valkey-server that, with a password, lets no one else in."""

from __future__ import annotations

import pytest
import redis

from services.common.redis_server import EmbeddedRedis

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
