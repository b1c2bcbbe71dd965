"""What every tool parser returns, the parser interfaces, and the shared JSON call scanner.

A tool call's ``arguments`` is JSON text, as OpenAI sends it. Parsers return
the model's own text of the arguments value verbatim (never re-serialized), so
that the fragments a streamer emits add up to exactly what the non-streaming
path returns. The one exception is documented on ``ToolCallScanner``.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum

# JSON's own whitespace: Python's str.isspace would also accept characters a
# JSON parser rejects, and both paths must agree on where a value ends.
JSON_WHITESPACE = " \t\n\r"
_QUOTE_OR_BACKSLASH = re.compile(r'["\\]')
_VALUE_STARTS = frozenset('{["-0123456789tfn')


@dataclass(slots=True)
class ToolCall:
    """One complete call: ``arguments`` is JSON text (usually an object)."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ExtractedToolCalls:
    """A whole answer split into the text meant for the user and the calls.

    ``content`` is None when the text outside the calls is only whitespace.
    """

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call ``index``: its header (``id`` and ``name`` set, ``arguments``
    "") comes first and once; later pieces carry argument text only."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(slots=True)
class StreamDelta:
    """What one step of a stream adds: user-visible text and call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def make_tool_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCallStreamer(ABC):
    """The per-request state of a streaming parse.

    Contract: for any split of a well-formed answer into ``feed`` calls
    followed by ``finish``, the concatenated ``content`` equals the
    non-streaming ``content`` (or "" where that is None), and the calls'
    headers and argument fragments add up to the non-streaming
    ``tool_calls`` (ids aside: each parse makes its own). Each parser states
    what it streams for malformed answers; no input makes it raise.
    """

    @abstractmethod
    def feed(self, delta_text: str) -> StreamDelta:
        """Takes the next piece of generated text; returns what is now certain."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """Ends the stream: flushes everything still held back."""

    @property
    @abstractmethod
    def tools_called(self) -> bool:
        """Whether a call header has been emitted (finish_reason "tool_calls")."""


class ToolParser(ABC):
    """Finds tool calls in a model's answer; stateless and shared by requests."""

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Parses a whole answer. Never raises: what does not parse stays content."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A new streaming parse for one request (one choice)."""


class ScanState(Enum):
    RUNNING = "running"
    DONE = "done"
    INVALID = "invalid"


class _At(Enum):
    """Where the scanner is in ``{"name": ..., "arguments": ...}`` or a list of them."""

    START = 0
    ITEM_OR_CLOSE = 1  # just after "["
    ITEM = 2  # after "," in the list
    AFTER_ITEM = 3
    KEY_OR_CLOSE = 4  # just after "{"
    KEY_START = 5  # after "," in an object
    KEY = 6
    COLON = 7
    VALUE = 8
    NAME = 9
    ARGS_STRING = 10
    ARGS_RAW = 11
    SKIP = 12
    AFTER_VALUE = 13


class ToolCallScanner:
    """Incremental scanner of one JSON tool-call value: an object
    ``{"name": ..., "arguments": ...}`` or a list of them (possibly empty).

    ``feed`` consumes text up to the end of the value (or up to the first
    character that cannot continue it, leaving ``state`` INVALID) and returns
    how many characters it consumed. A call's header is emitted as soon as its
    name string is complete; argument text is emitted as it is consumed, found
    by a bracket- and string-aware scan so nothing is re-serialized. Arguments
    that come before the name are held until the name arrives; a call without
    "arguments" gets "{}"; keys other than the first "name" and "arguments"
    are skipped.

    Arguments given as a JSON string (``"arguments": "{\\"x\\": 1}"``) are
    emitted decoded: the string's value is the JSON text the model meant, and
    passing on the quoted form would make clients decode twice. Decoding is
    incremental; an escape split across feeds (or a surrogate pair) is held
    until complete. Any other value (object, array, number, null) is emitted
    verbatim.

    Values of skipped keys and arguments are delimited, not validated: callers
    that need valid JSON check it themselves (``scan_tool_calls`` callers do).
    """

    def __init__(self, first_index: int = 0) -> None:
        self.first_index = first_index
        self.state = ScanState.RUNNING
        self.num_calls = 0
        self._at = _At.START
        self._in_list = False
        self._deltas: list[ToolCallDelta] = []
        self._escape = False  # inside a string, just after a backslash
        self._raw = ""  # undecoded text of the key, name or string arguments being read
        self._depth = 0  # open brackets of a skipped or verbatim value
        self._in_string = False  # inside a string of such a value
        self._key = ""
        self._index = -1  # index of the call being read, once its name is known
        self._name: str | None = None
        self._has_arguments = False
        self._held_arguments = ""

    @property
    def next_index(self) -> int:
        """The index the next call found will get."""
        return self.first_index + self.num_calls

    def feed(self, text: str) -> int:
        """Scans ``text``; returns how many characters belong to the value."""
        i = 0
        while i < len(text) and self.state is ScanState.RUNNING:
            i = self._step(text, i)
        if self._at is _At.ARGS_STRING:
            self._flush_string_arguments(final=False)
        return i

    def finish(self) -> None:
        """Emits what is held of unfinished string arguments (the text ended)."""
        if self._at is _At.ARGS_STRING:
            self._flush_string_arguments(final=True)

    def take_deltas(self) -> list[ToolCallDelta]:
        """The call pieces found since the last call, in order."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def _step(self, text: str, i: int) -> int:
        if self._at in (_At.KEY, _At.NAME, _At.ARGS_STRING):
            return self._step_string(text, i)
        if self._at in (_At.ARGS_RAW, _At.SKIP):
            return self._step_value(text, i)
        while i < len(text) and text[i] in JSON_WHITESPACE:
            i += 1
        if i == len(text):
            return i
        if self._at is _At.VALUE:
            return i + self._begin_value(text[i])
        return i + self._step_punctuation(text[i])

    def _step_punctuation(self, c: str) -> int:
        # Returns 1 when ``c`` was consumed, 0 when it ended the scan as INVALID.
        at = self._at
        if c == "{" and at in (_At.START, _At.ITEM_OR_CLOSE, _At.ITEM):
            self._begin_object()
        elif c == "[" and at is _At.START:
            self._in_list = True
            self._at = _At.ITEM_OR_CLOSE
        elif c == "]" and at in (_At.ITEM_OR_CLOSE, _At.AFTER_ITEM):
            self.state = ScanState.DONE
        elif c == "," and at is _At.AFTER_ITEM:
            self._at = _At.ITEM
        elif c == '"' and at in (_At.KEY_OR_CLOSE, _At.KEY_START):
            self._at = _At.KEY
        elif c == ":" and at is _At.COLON:
            self._at = _At.VALUE
        elif c == "," and at is _At.AFTER_VALUE:
            self._at = _At.KEY_START
        elif c == "}" and at in (_At.KEY_OR_CLOSE, _At.AFTER_VALUE) and self._name is not None:
            self._end_object()
        else:
            self.state = ScanState.INVALID
            return 0
        return 1

    def _begin_object(self) -> None:
        self._at = _At.KEY_OR_CLOSE
        self._name = None
        self._has_arguments = False
        self._held_arguments = ""

    def _end_object(self) -> None:
        if not self._has_arguments:
            self._emit_arguments("{}")
        if self._in_list:
            self._at = _At.AFTER_ITEM
        else:
            self.state = ScanState.DONE

    def _begin_value(self, c: str) -> int:
        # Returns how many characters it consumed: the quote of a string read
        # here, nothing for a value the value scanner reads from its start.
        if self._key == "name" and self._name is None:
            if c != '"':
                self.state = ScanState.INVALID
                return 0
            self._at = _At.NAME
            return 1
        if self._key == "arguments" and not self._has_arguments:
            self._has_arguments = True
            if c == '"':
                self._at = _At.ARGS_STRING
                return 1
            self._at = _At.ARGS_RAW
        else:
            self._at = _At.SKIP
        if c not in _VALUE_STARTS:
            self.state = ScanState.INVALID
        self._depth = 0
        self._in_string = False
        return 0

    def _step_string(self, text: str, i: int) -> int:
        end, closed = self._scan_string(text, i)
        self._raw += text[i:end]
        if not closed:
            return end
        raw, self._raw = self._raw, ""
        value = decode_json_string(raw)
        if self._at is _At.KEY:
            self._key = value
            self._at = _At.COLON
            return end + 1
        if self._at is _At.NAME:
            self._name = value
            self._commit()
        else:
            self._emit_arguments(value)
        self._at = _At.AFTER_VALUE
        return end + 1

    def _step_value(self, text: str, i: int) -> int:
        end, done = self._scan_value(text, i)
        if self._at is _At.ARGS_RAW:
            self._emit_arguments(text[i:end])
        if done:
            self._at = _At.AFTER_VALUE
        return end

    def _scan_string(self, text: str, i: int) -> tuple[int, bool]:
        """(end, closed): text[i:end] is string content; closed when text[end]
        is the closing quote. Backslash state carries across feeds."""
        while i < len(text):
            if self._escape:
                self._escape = False
                i += 1
                continue
            match = _QUOTE_OR_BACKSLASH.search(text, i)
            if match is None:
                return len(text), False
            i = match.start()
            if text[i] == '"':
                return i, True
            self._escape = True
            i += 1
        return len(text), False

    def _scan_value(self, text: str, i: int) -> tuple[int, bool]:
        """(end, done): text[i:end] belongs to the value; done when it ended there.

        A container ends at its closing bracket, a string at its closing quote,
        a number or literal before the ",", "}", "]" or whitespace after it.
        """
        while i < len(text):
            if self._in_string:
                end, closed = self._scan_string(text, i)
                if not closed:
                    return len(text), False
                i = end + 1
                self._in_string = False
                if self._depth == 0:
                    return i, True
                continue
            c = text[i]
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                if self._depth == 0:
                    return i, True
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, True
            elif self._depth == 0 and (c == "," or c in JSON_WHITESPACE):
                return i, True
            i += 1
        return len(text), False

    def _commit(self) -> None:
        self._index = self.next_index
        self.num_calls += 1
        self._deltas.append(ToolCallDelta(self._index, make_tool_call_id(), self._name, ""))
        held, self._held_arguments = self._held_arguments, ""
        self._emit_arguments(held)

    def _emit_arguments(self, text: str) -> None:
        if not text:
            return
        if self._name is None:
            self._held_arguments += text
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.id is None and last.index == self._index:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(self._index, None, None, text))

    def _flush_string_arguments(self, *, final: bool) -> None:
        cut = len(self._raw) if final else _decodable_len(self._raw)
        if cut:
            self._emit_arguments(decode_json_string(self._raw[:cut]))
            self._raw = self._raw[cut:]


def decode_json_string(raw: str) -> str:
    """The value of JSON string content (without quotes); ``raw`` itself if it
    holds an invalid escape, so a malformed answer never raises."""
    try:
        return json.loads(f'"{raw}"', strict=False)
    except json.JSONDecodeError:
        return raw


def _decodable_len(raw: str) -> int:
    """The longest prefix of JSON string content that ends on a whole escape.

    A high-surrogate escape waits for the low half after it, so a character
    outside the BMP is never emitted as two halves.
    """
    i = raw.find("\\")
    while i != -1:
        if i + 1 == len(raw) or (raw[i + 1] == "u" and i + 6 > len(raw)):
            return i
        if raw[i + 1] != "u":
            i = raw.find("\\", i + 2)
            continue
        if _is_high_surrogate(raw[i + 2 : i + 6]) and i + 12 > len(raw):
            return i
        i = raw.find("\\", i + 6)
    return len(raw)


def _is_high_surrogate(hex_digits: str) -> bool:
    try:
        return 0xD800 <= int(hex_digits, 16) <= 0xDBFF
    except ValueError:
        return False


def scan_tool_calls(text: str, first_index: int = 0) -> list[ToolCall] | None:
    """The calls of a complete JSON call value (object or list), with the same
    arguments a streamed scan emits; None unless ``text`` is exactly one such
    value (surrounding whitespace aside)."""
    scanner = ToolCallScanner(first_index)
    consumed = scanner.feed(text)
    scanner.finish()
    if scanner.state is not ScanState.DONE or text[consumed:].strip(JSON_WHITESPACE):
        return None
    return calls_from_deltas(scanner.take_deltas())


def calls_from_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Assembles streamed pieces into whole calls, in index order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = ToolCall(delta.id, delta.name or "", "")
        calls[delta.index].arguments += delta.arguments
    return [calls[index] for index in sorted(calls)]
