"""Chat answers as OpenAI tool calls: parsed from free text ("auto") or forced by a schema.

``tool_choice`` "auto" lets the model answer freely; the server's tool parser
finds the calls in its text. "required" and a named function generate under
a JSON schema (``tool_call_schema``) whose answer is the list of calls
itself. Either way, a choice that made calls finishes with "tool_calls".
"""

from __future__ import annotations

from typing import Any

from services.frontend.tool_parsers import ToolCall, ToolCallDelta, ToolCallStreamer, ToolParser
from services.frontend.tool_parsers.tool_choice import ForcedToolCallStreamer, forced_tool_calls


class ChatToolCalls:
    """Turns one request's choices into messages and deltas with ``tool_calls``.

    ``parser`` reads free answers (tool_choice "auto"); None means the answer
    was forced into a list of calls (tool_choice "required" or named).
    """

    def __init__(self, parser: ToolParser | None) -> None:
        self._parser = parser
        self._streamers: dict[int, ToolCallStreamer] = {}

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole answer, and its finish_reason."""
        if self._parser is None:
            try:
                content, calls = None, forced_tool_calls(text)
            except ValueError:  # cut off by max_tokens: the text is all there is
                content, calls = text, []
        else:
            extracted = self._parser.extract_tool_calls(text)
            content, calls = extracted.content, extracted.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [_call(c) for c in calls]
        return message, _finish_reason(finish_reason, bool(calls))

    def delta(self, index: int, text: str, finish_reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        """Choice ``index``'s delta for the next piece of text, and its finish_reason."""
        streamer = self._streamers.get(index)
        if streamer is None:
            streamer = self._parser.streamer() if self._parser else ForcedToolCallStreamer()
            self._streamers[index] = streamer
        piece = streamer.feed(text)
        content, calls = piece.content, list(piece.tool_calls)
        if finish_reason is not None:
            tail = streamer.finish()
            content += tail.content
            calls += tail.tool_calls
        delta: dict[str, Any] = {"content": content}
        if calls:
            delta["tool_calls"] = [_call_delta(c) for c in calls]
        return delta, _finish_reason(finish_reason, streamer.tools_called)


def _finish_reason(finish_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is not None:  # the header: id, type and name, once per call
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}
