"""OpenAI ``tools`` / ``tool_choice``: checking them and forcing calls.

``tool_choice="required"`` or a named function is honoured by guided
decoding: the answer is generated under ``tool_call_schema`` as a bare JSON
array ``[{"name": ..., "arguments": {...}}, ...]`` (no tags), which
``forced_tool_calls`` (whole answer) or ``ForcedToolCallStreamer`` (stream)
turn into calls. "auto" leaves the model free and a tool parser reads its
answer; "none" offers no calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.common.validation import ValidationError
from services.frontend.tool_parsers.base import (
    ScanState,
    StreamDelta,
    ToolCall,
    ToolCallScanner,
    ToolCallStreamer,
    scan_tool_calls,
)

TOOL_CHOICE_MODES = ("none", "auto", "required")
# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Where JSON Schema keeps reusable definitions; "#/$defs/..." references
# resolve against the root, so they move to the root of the combined schema.
_DEFINITION_KEYS = ("$defs", "definitions")


def validate_tools(tools: object, tool_choice: object) -> None:
    """Checks a request's ``tools`` and ``tool_choice`` (either may be None).

    Raises ValidationError naming the field (``tools[2].function.name``,
    ``tool_choice``) for: tools not a non-empty list of
    ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``,
    a repeated name, tool_choice given without tools, tool_choice not one of
    "none" / "auto" / "required" / ``{"type": "function", "function": {"name"}}``,
    or a named tool_choice naming no tool.
    """
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise ValidationError("tools",
                                  f"tools must be a non-empty list of tools, got {tools!r}")
        names: set[str] = set()
        for index, tool in enumerate(tools):
            name = _validate_tool(index, tool)
            if name in names:
                raise ValidationError(f"tools[{index}].function.name",
                                      f"tools[{index}].function.name {name!r} is used twice")
            names.add(name)
    if tool_choice is None:
        return
    if tools is None:
        raise ValidationError("tool_choice", "tool_choice is only allowed when tools are given")
    _validate_tool_choice(tool_choice, {tool["function"]["name"] for tool in tools})


def _validate_tool(index: int, tool: object) -> str:
    field = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ValidationError(field, f"{field} must be an object, got {tool!r}")
    if tool.get("type") != "function":
        raise ValidationError(f"{field}.type",
                              f"{field}.type must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValidationError(f"{field}.function",
                              f"{field}.function must be an object, got {function!r}")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise ValidationError(f"{field}.function.name",
                              f"{field}.function.name must be 1 to 64 letters, digits, '_' "
                              f"or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValidationError(f"{field}.function.description",
                              f"{field}.function.description must be a string, "
                              f"got {description!r}")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValidationError(f"{field}.function.parameters",
                              f"{field}.function.parameters must be a JSON Schema object, "
                              f"got {parameters!r}")
    return name


def _validate_tool_choice(tool_choice: object, names: set[str]) -> None:
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise ValidationError("tool_choice", f"tool_choice must be one of "
                                  f"{', '.join(TOOL_CHOICE_MODES)} or a named function, "
                                  f"got {tool_choice!r}")
        return
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise ValidationError("tool_choice", "tool_choice must be one of none, auto, required "
                              "or {'type': 'function', 'function': {'name': ...}}, "
                              f"got {tool_choice!r}")
    if function["name"] not in names:
        raise ValidationError("tool_choice.function.name",
                              f"tool_choice names {function['name']!r}, which is not among "
                              f"the tools: {', '.join(sorted(names))}")


def forces_tool_calls(tool_choice: object) -> bool:
    """Whether ``tool_choice`` makes the answer a forced list of calls."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def tool_call_schema(tools: list[dict[str, Any]],
                     tool_choice: str | dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of a forced answer, for validated ``tools`` and ``tool_choice``.

    "required": an array of at least one call, each item one of the tools
    (``anyOf``: ``{"name": <const>, "arguments": <its parameters>}``). A named
    function: an array of exactly one call of that tool. Definitions inside
    parameters move to the root so their references still resolve;
    ValidationError if two tools define one name differently. ValueError for a
    tool_choice that forces nothing ("auto", "none").
    """
    if tool_choice == "required":
        chosen = tools
    elif isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [tool for tool in tools if tool["function"]["name"] == name]
    else:
        raise ValueError(f"tool_choice {tool_choice!r} does not force a tool call")
    definitions: dict[str, dict[str, Any]] = {}
    items = [_call_schema(tools.index(tool), tool, definitions) for tool in chosen]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if isinstance(tool_choice, dict):
        schema["maxItems"] = 1
    for key, defs in definitions.items():
        if defs:
            schema[key] = defs
    return schema


def _call_schema(index: int, tool: dict[str, Any],
                 definitions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    function = tool["function"]
    parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
    for key in _DEFINITION_KEYS:
        for def_name, definition in (parameters.pop(key, None) or {}).items():
            known = definitions.setdefault(key, {}).setdefault(def_name, definition)
            if known != definition:
                raise ValidationError(f"tools[{index}].function.parameters.{key}.{def_name}",
                                      f"two tools define {key}.{def_name} differently")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a forced answer (a JSON array of ``{"name", "arguments"}``).

    ``arguments`` is the model's text of each value, as streaming emits it.
    ValueError when ``text`` is not such an array (e.g. cut off by max_tokens).
    """
    try:
        value = json.loads(text, strict=False)
    except json.JSONDecodeError as error:
        raise ValueError(f"the forced tool-call answer is not valid JSON: {error}") from None
    calls = scan_tool_calls(text) if isinstance(value, list) else None
    if calls is None or len(calls) != len(value):
        raise ValueError(f"the forced tool-call answer is not a list of calls: {text[:200]!r}")
    return calls


class ForcedToolCallStreamer(ToolCallStreamer):
    """Streams a forced answer: every piece of it is a call, nothing is content.

    Text after the array (there should be none under the schema) is dropped.
    """

    def __init__(self) -> None:
        self._scanner = ToolCallScanner()

    @property
    def tools_called(self) -> bool:
        return self._scanner.num_calls > 0

    def feed(self, delta_text: str) -> StreamDelta:
        if self._scanner.state is ScanState.RUNNING:
            self._scanner.feed(delta_text)
        return StreamDelta("", self._scanner.take_deltas())

    def finish(self) -> StreamDelta:
        self._scanner.finish()
        return StreamDelta("", self._scanner.take_deltas())
