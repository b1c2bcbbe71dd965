"""Reasoning models' answers on /v1/chat/completions: ``reasoning_content`` apart.

With a reasoning parser configured (``--reasoning-parser``), the text between
the model's think tags goes to ``message.reasoning_content`` (and to
``delta.reasoning_content`` when streaming), the rest to ``content``, where
tool calls are looked for. A structured-output constraint applies after the
reasoning: where the parser says answers start inside it (the template opened
it), the worker is told the tokens that end it.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from services.common.sampling_params import SamplingParams
from services.frontend.reasoning import ReasoningParser, ReasoningStreamer


class ChatReasoning:
    """Splits one request's choices into reasoning and content, whole or streamed."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._streamers: dict[int, ReasoningStreamer] = {}

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content or None, content) of a whole answer."""
        reasoning, content = self._parser.extract_reasoning(text)
        return reasoning, content or ""

    def split_delta(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """Choice ``index``'s (reasoning, content) pieces for the next text."""
        streamer = self._streamers.setdefault(index, self._parser.streamer())
        reasoning, content = streamer.feed(text)
        if finished:
            tail_reasoning, tail_content = streamer.finish()
            reasoning, content = reasoning + tail_reasoning, content + tail_content
        return reasoning, content


def constrain_after_reasoning(params: SamplingParams, parser: ReasoningParser,
                              tokenizer: PreTrainedTokenizerBase) -> None:
    """Leaves the reasoning free: the constraint starts after the parser's end tag.

    Only for parsers whose answers start inside the reasoning; otherwise the
    model opens it itself, if at all, and the constraint holds from the start.
    """
    so = params.structured_outputs
    if so is not None and parser.started_in_think:
        so.reasoning_end_token_ids = tokenizer.encode(parser.end_token_text,
                                                      add_special_tokens=False)
