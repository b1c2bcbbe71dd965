"""Reasoning parsers: split a model's thinking from its answer.

``get_reasoning_parser(name)`` gives the parser a server was configured with.
"""

from __future__ import annotations

from collections.abc import Callable

from services.frontend.parser_registry import make_parser
from services.frontend.reasoning.think import ReasoningParser, ReasoningStreamer

# DeepSeek-R1's template opens <think> in the prompt, so its answers start
# inside the reasoning (vLLM's deepseek_r1 assumes the same); "think" is for
# models that write the opening tag themselves.
_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": lambda: ReasoningParser(started_in_think=True),
    "think": ReasoningParser,
}


REASONING_PARSER_NAMES = tuple(sorted(_PARSERS))


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    return make_parser("reasoning", _PARSERS, name)


__all__ = ["REASONING_PARSER_NAMES", "ReasoningParser", "ReasoningStreamer",
           "get_reasoning_parser"]
