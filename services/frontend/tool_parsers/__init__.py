"""Tool-call parsers: turn a model's answer into OpenAI ``tool_calls``.

``get_tool_parser(name)`` gives the parser a server was configured with;
``tool_choice`` builds the JSON schema that forces calls for
``tool_choice="required"`` or a named function.
"""

from __future__ import annotations

from collections.abc import Callable

from services.frontend.parser_registry import make_parser
from services.frontend.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
)
from services.frontend.tool_parsers.hermes import HermesToolParser

# SmolLM2 writes a list inside one block; the Hermes parser reads both forms.
_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "smollm2": HermesToolParser,
}


TOOL_PARSER_NAMES = tuple(sorted(_PARSERS))


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    return make_parser("tool", _PARSERS, name)


__all__ = [
    "ExtractedToolCalls",
    "HermesToolParser",
    "TOOL_PARSER_NAMES",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
]
