"""Parsers chosen by name on the command line (tool calls, reasoning)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def make_parser(kind: str, factories: Mapping[str, Callable[[], T]], name: str) -> T:
    """A new ``kind`` parser registered as ``name``; ValueError naming the known ones."""
    factory = factories.get(name)
    if factory is None:
        raise ValueError(
            f"unknown {kind} parser {name!r}; known parsers: {', '.join(sorted(factories))}")
    return factory()
