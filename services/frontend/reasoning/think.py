"""Reasoning wrapped in ``<think>`` ... ``</think>`` (DeepSeek-R1, Qwen3, SmolLM3).

Splits an answer into ``reasoning_content`` and ``content`` the way vLLM's
DeepSeek-R1 parser does. When the prompt already opened the reasoning (the
chat template ended with ``<think>``: ``started_in_think``), the answer is
reasoning up to ``</think>`` and content after it; a ``<think>`` the model
repeats at the very start is dropped. Otherwise text before ``<think>`` is
content, text between the tags reasoning, text after ``</think>`` content
again. Without a closing tag everything after the opening is reasoning (the
answer was cut off while thinking). Only the first pair of tags counts.
"""

from __future__ import annotations

from enum import Enum

from services.frontend.tool_parsers.base import partial_tag_len


class _Phase(Enum):
    BEFORE = "before"  # content until the start tag
    AT_START = "at_start"  # reasoning opened by the prompt; a repeated start tag may follow
    THINKING = "thinking"  # reasoning until the end tag
    AFTER = "after"  # content to the end


class ReasoningParser:
    """Splits answers of models that think between two tags; stateless."""

    def __init__(self, start_token_text: str = "<think>", end_token_text: str = "</think>",
                 *, started_in_think: bool = False) -> None:
        self.start_token_text = start_token_text
        # The worker ends a reasoning budget or starts guided decoding here.
        self.end_token_text = end_token_text
        self.started_in_think = started_in_think

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves a reasoning block open (its last
        start tag comes after its last end tag): the ``started_in_think`` to use."""
        start = prompt.rfind(self.start_token_text)
        return start != -1 and start > prompt.rfind(self.end_token_text)

    def extract_reasoning(self, text: str, started_in_think: bool | None = None
                          ) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole answer; each None when empty."""
        if started_in_think is None:
            started_in_think = self.started_in_think
        before = ""
        if started_in_think:
            if text.startswith(self.start_token_text):
                text = text[len(self.start_token_text):]
        else:
            before, found, text = text.partition(self.start_token_text)
            if not found:
                return None, before or None
        reasoning, _, after = text.partition(self.end_token_text)
        return reasoning or None, (before + after) or None

    def streamer(self, started_in_think: bool | None = None) -> ReasoningStreamer:
        """A new streaming split for one request (one choice)."""
        if started_in_think is None:
            started_in_think = self.started_in_think
        return ReasoningStreamer(self.start_token_text, self.end_token_text, started_in_think)


class ReasoningStreamer:
    """Streams one answer's split. For any split of the text into ``feed``
    calls followed by ``finish``, the reasoning and content pieces add up to
    ``extract_reasoning``'s (with "" for None). Only text that could begin the
    tag being looked for is held back."""

    def __init__(self, start_token_text: str, end_token_text: str, started_in_think: bool) -> None:
        self._start = start_token_text
        self._end = end_token_text
        self._phase = _Phase.AT_START if started_in_think else _Phase.BEFORE
        self._buffer = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text now arriving is reasoning (the end tag is not yet seen)."""
        return self._phase in (_Phase.AT_START, _Phase.THINKING)

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) now certain."""
        self._buffer += delta_text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flushes what was held back: an unfinished tag is plain text."""
        held, self._buffer = self._buffer, ""
        if self.in_reasoning:
            return held, ""
        return "", held

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        # Returns True after a phase change, False when it needs more text.
        if self._phase is _Phase.AT_START:
            if self._buffer.startswith(self._start):
                self._buffer = self._buffer[len(self._start):]
            elif self._start.startswith(self._buffer):  # empty, or the tag so far
                return False
            self._phase = _Phase.THINKING
            return True
        if self._phase is _Phase.AFTER:
            content.append(self._buffer)
            self._buffer = ""
            return False
        if self._phase is _Phase.BEFORE:
            return self._take_until(self._start, content, _Phase.THINKING)
        return self._take_until(self._end, reasoning, _Phase.AFTER)

    def _take_until(self, tag: str, out: list[str], next_phase: _Phase) -> bool:
        at = self._buffer.find(tag)
        if at == -1:
            keep = partial_tag_len(self._buffer, tag)
            out.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        out.append(self._buffer[:at])
        self._buffer = self._buffer[at + len(tag):]
        self._phase = next_phase
        return True

