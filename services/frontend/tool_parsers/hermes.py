"""Tool calls written as ``<tool_call>JSON</tool_call>`` (Hermes, Qwen, SmolLM2).

The JSON is one ``{"name": ..., "arguments": ...}`` object (Hermes/Qwen) or a
list of them (SmolLM2: ``<tool_call>[{...}, {...}]</tool_call>``); an answer
may hold several blocks. Everything outside valid blocks is content; a final
block may lack its closing tag (generation stopped on it).

Validity. ``extract_tool_calls`` keeps a block as calls only when its body is
valid JSON of that shape followed by the closing tag (or the end of the
text); otherwise the block, tags included, stays in the content. The
streamer cannot take back a call it has announced, so it decides at each
call's name: a block found malformed before its first name is complete is
streamed as content exactly as ``extract_tool_calls`` returns it; one found
malformed later keeps the calls already announced and drops the rest of the
block. For well-formed blocks both paths agree exactly, for any split.
"""

from __future__ import annotations

import json
from enum import Enum

from services.frontend.tool_parsers.base import (
    JSON_WHITESPACE,
    ExtractedToolCalls,
    ScanState,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallScanner,
    ToolCallStreamer,
    ToolParser,
    partial_tag_len,
    scan_tool_calls,
)

_DECODER = json.JSONDecoder(strict=False)  # models write raw newlines inside strings


class HermesToolParser(ToolParser):
    """``<tool_call>`` blocks holding one call object or a list of them."""

    def __init__(self, start_tag: str = "<tool_call>", end_tag: str = "</tool_call>") -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(self.start_tag, pos)) != -1:
            content.append(text[pos:start])
            body_start = start + len(self.start_tag)
            parsed = self._parse_block(text, body_start, len(calls))
            if parsed is None:
                pos = self._invalid_block_end(text, body_start)
                content.append(text[start:pos])
            else:
                pos, block_calls = parsed
                calls.extend(block_calls)
        content.append(text[pos:])
        joined = "".join(content)
        return ExtractedToolCalls(joined if joined.strip() else None, calls)

    def streamer(self) -> HermesToolCallStreamer:
        return HermesToolCallStreamer(self.start_tag, self.end_tag)

    def _parse_block(
        self, text: str, body_start: int, first_index: int
    ) -> tuple[int, list[ToolCall]] | None:
        """(end of the block, its calls), or None when the block is malformed."""
        value_start = _skip_whitespace(text, body_start)
        try:
            value, value_end = _DECODER.raw_decode(text, value_start)
        except json.JSONDecodeError:
            return None
        if not _is_call_value(value):
            return None
        tail = _skip_whitespace(text, value_end)
        if text.startswith(self.end_tag, tail):
            end = tail + len(self.end_tag)
        elif tail == len(text):
            end = tail
        else:
            return None
        calls = scan_tool_calls(text[value_start:value_end], first_index)
        return None if calls is None else (end, calls)

    def _invalid_block_end(self, text: str, body_start: int) -> int:
        end = text.find(self.end_tag, body_start)
        return len(text) if end == -1 else end + len(self.end_tag)


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in JSON_WHITESPACE:
        i += 1
    return i


def _is_call_value(value: object) -> bool:
    def is_call(item: object) -> bool:
        return isinstance(item, dict) and isinstance(item.get("name"), str)

    if isinstance(value, list):
        return all(is_call(item) for item in value)
    return is_call(value)


class _Mode(Enum):
    TEXT = "text"  # outside blocks: content
    BODY = "body"  # inside a block's JSON
    TAIL = "tail"  # after the JSON: whitespace, then the closing tag
    AS_CONTENT = "as_content"  # a block malformed before any call: content to its end tag
    DROP = "drop"  # a block malformed after a call: dropped to its end tag


class _ContentGate:
    """Holds whitespace-only content until real text follows it.

    The non-streaming content is None when it is only whitespace, so the
    whitespace around calls is sent only once the answer has text to show.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._opened = False

    def pass_through(self, text: str) -> str:
        if self._opened or not text:
            return text
        if text.isspace():
            self._pending += text
            return ""
        self._opened = True
        text, self._pending = self._pending + text, ""
        return text


class HermesToolCallStreamer(ToolCallStreamer):
    """Streams one answer: content as soon as it cannot begin a start tag,
    then each call's header and its argument text as it is generated."""

    def __init__(self, start_tag: str, end_tag: str) -> None:
        self._start_tag = start_tag
        self._end_tag = end_tag
        self._buffer = ""  # text received and not yet decided on
        self._mode = _Mode.TEXT
        self._scanner: ToolCallScanner | None = None
        self._block_raw = ""  # the current block's text so far, while it may become content
        self._num_calls = 0
        self._gate = _ContentGate()
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    @property
    def tools_called(self) -> bool:
        return self._num_calls > 0

    def feed(self, delta_text: str) -> StreamDelta:
        self._buffer += delta_text
        while self._step():
            pass
        return self._take()

    def finish(self) -> StreamDelta:
        if self._mode in (_Mode.BODY, _Mode.TAIL):
            self._finish_block()
        elif self._mode in (_Mode.TEXT, _Mode.AS_CONTENT):
            self._emit_content(self._buffer)
        self._buffer = ""
        self._mode = _Mode.TEXT
        return self._take()

    def _step(self) -> bool:
        """Advances one state; False when it needs more text."""
        if self._mode is _Mode.TEXT:
            return self._step_text()
        if self._mode is _Mode.BODY:
            return self._step_body()
        if self._mode is _Mode.TAIL:
            return self._step_tail()
        return self._step_to_end_tag()

    def _step_text(self) -> bool:
        start = self._buffer.find(self._start_tag)
        if start == -1:
            keep = partial_tag_len(self._buffer, self._start_tag)
            self._emit_content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._emit_content(self._buffer[:start])
        self._buffer = self._buffer[start + len(self._start_tag) :]
        self._block_raw = self._start_tag
        self._scanner = ToolCallScanner(first_index=self._num_calls)
        self._mode = _Mode.BODY
        return True

    def _step_body(self) -> bool:
        assert self._scanner is not None
        consumed = self._scanner.feed(self._buffer)
        self._block_raw += self._buffer[:consumed]
        self._buffer = self._buffer[consumed:]
        self._collect_calls()
        if self._scanner.state is ScanState.INVALID:
            self._abandon_block()
            return True
        if self._scanner.state is ScanState.DONE:
            self._mode = _Mode.TAIL
            return True
        return False

    def _step_tail(self) -> bool:
        rest = self._buffer.lstrip(JSON_WHITESPACE)
        self._block_raw += self._buffer[: len(self._buffer) - len(rest)]
        self._buffer = rest
        if rest.startswith(self._end_tag):
            self._buffer = rest[len(self._end_tag) :]
            self._mode = _Mode.TEXT
            return True
        if self._end_tag.startswith(rest):  # empty, or the tag so far
            return False
        self._abandon_block()
        return True

    def _step_to_end_tag(self) -> bool:
        end = self._buffer.find(self._end_tag)
        if end == -1:
            keep = partial_tag_len(self._buffer, self._end_tag)
            taken = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
        else:
            taken = self._buffer[: end + len(self._end_tag)]
            self._buffer = self._buffer[end + len(self._end_tag) :]
        if self._mode is _Mode.AS_CONTENT:
            self._emit_content(taken)
        if end == -1:
            return False
        self._mode = _Mode.TEXT
        return True

    def _abandon_block(self) -> None:
        # Before the block's first call its text is still ours to show.
        assert self._scanner is not None
        if self._scanner.num_calls == 0:
            self._emit_content(self._block_raw)
            self._mode = _Mode.AS_CONTENT
        else:
            self._mode = _Mode.DROP
        self._block_raw = ""

    def _finish_block(self) -> None:
        # The text ended inside a block: a complete list with no calls, or a
        # block with calls, is kept (as extract_tool_calls keeps an unclosed
        # final block); anything else without a call is content.
        assert self._scanner is not None
        self._scanner.finish()
        self._collect_calls()
        if self._scanner.num_calls == 0 and (self._mode is _Mode.BODY or self._buffer):
            self._emit_content(self._block_raw + self._buffer)

    def _collect_calls(self) -> None:
        assert self._scanner is not None
        self._deltas.extend(self._scanner.take_deltas())
        self._num_calls = self._scanner.next_index

    def _emit_content(self, text: str) -> None:
        text = self._gate.pass_through(text)
        if text:
            self._content.append(text)

    def _take(self) -> StreamDelta:
        delta = StreamDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return delta
