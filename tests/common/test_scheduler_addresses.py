"""Scheduler addresses: parsing, and a name resolved to one target per scheduler."""

from __future__ import annotations

import socket

import pytest

from services.common import scheduler_addresses
from services.common.scheduler_addresses import (
    SchedulerTarget,
    parse_scheduler_addresses,
    resolve_scheduler_targets,
)


def _resolver(answers: dict[str, list[str]]):
    """A stand-in for the system resolver (the OS's, not one of ours) answering ``answers``."""
    def getaddrinfo(host: str, port: int, type: int = 0):  # noqa: A002 (socket's name)
        if host not in answers:
            raise socket.gaierror(f"{host} does not resolve")
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in answers[host]]
    return getaddrinfo


def test_addresses_are_checked_and_deduplicated() -> None:
    assert parse_scheduler_addresses("a:1, b:2,a:1") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="'a' is not HOST:PORT"):
        parse_scheduler_addresses("a")


def test_a_name_is_one_target_per_address_even_with_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scaled name answering one address while a replica restarts must not be
    dialed by name beside its address (the same scheduler, counted twice)."""
    monkeypatch.setattr(scheduler_addresses.socket, "getaddrinfo", _resolver(
        {"cells": ["10.0.0.2", "10.0.0.1"], "one": ["10.0.0.3"]}))
    assert resolve_scheduler_targets(["cells:50052"]) == [
        SchedulerTarget("10.0.0.1:50052", "cells"), SchedulerTarget("10.0.0.2:50052", "cells")]
    (target,) = resolve_scheduler_targets(["one:50052"])
    assert target == SchedulerTarget("10.0.0.3:50052", "one")
    assert dict(target.channel_options())["grpc.ssl_target_name_override"] == "one"


def test_literals_stay_and_an_unresolved_name_is_dialed_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_addresses.socket, "getaddrinfo", _resolver({}))
    assert resolve_scheduler_targets(["127.0.0.1:1", "localhost:2", "later:3"]) == [
        SchedulerTarget("127.0.0.1:1"), SchedulerTarget("localhost:2"), SchedulerTarget("later:3")]
