"""Incremental detokenization with stop strings (vLLM V1's IncrementalDetokenizer).

Text is produced one token at a time and must read exactly like decoding the
whole sequence at once: a character split over several byte-level tokens is
emitted only when complete (never a U+FFFD mid-stream), and the first output
token keeps its leading space because decoding starts from a few prompt
tokens of context.

``IncrementalDetokenizer`` keeps the output ids and text and evaluates stop
strings; subclasses turn one token id into its piece of text:
``FastIncrementalDetokenizer`` through the ``tokenizers`` DecodeStream, and
``SlowIncrementalDetokenizer`` through prefix/read offsets over
``tokenizer.decode`` for tokenizers without a Rust backend.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from services.common.engine import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.frontend.stop_strings import find_stop_string, num_held_back_chars

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - depends on the installed tokenizers
    DecodeStream = None

# How many prompt tokens give the first output token its context (leading
# space, a character that starts in the prompt); vLLM uses a similar window.
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Output token ids and text of one request, plus stop-string checks.

    Used as is when the request asked for no text (``detokenize=False``): it
    then only tracks token ids.
    """

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._sent_text_offset = 0
        self.stop: list[str] = list(params.stop) if params else []
        self.include_stop_str_in_output = bool(params and params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens if params else 0

    @staticmethod
    def from_new_request(
        tokenizer: PreTrainedTokenizerBase | None, request: EngineCoreRequest
    ) -> IncrementalDetokenizer:
        """Picks the implementation for ``tokenizer`` (None or detokenize=False: ids only)."""
        params = request.sampling_params
        if tokenizer is None or not params.detokenize:
            return IncrementalDetokenizer(params)
        if DecodeStream is not None and hasattr(tokenizer, "backend_tokenizer"):
            return FastIncrementalDetokenizer(tokenizer, request)
        return SlowIncrementalDetokenizer(tokenizer, request)

    def decode_next(self, token_id: int) -> str:
        """The text ``token_id`` adds ("" while a character is incomplete)."""
        return ""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Appends ``new_token_ids`` and returns the stop string that ended the text, if any.

        ``stop_terminated``: the engine stopped on the last of these tokens (EOS
        or a stop token id); its text is left out unless
        ``include_stop_str_in_output``. Stop strings are checked after every
        token, so the first one to complete wins; the text is cut there and the
        tokens after it are dropped. No stop string can end within the first
        ``min_tokens`` tokens.
        """
        skip_last = stop_terminated and not self.include_stop_str_in_output
        num_to_decode = len(new_token_ids) - 1 if skip_last else len(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if i >= num_to_decode:
                break
            new_text_start = len(self.output_text)
            self.output_text += self.decode_next(token_id)
            if not self.stop or len(self.output_token_ids) <= self.min_tokens:
                continue
            match = find_stop_string(
                self.output_text, new_text_start, self.stop, self.include_stop_str_in_output
            )
            if match is not None:
                stop_str, cut = match
                self.output_text = self.output_text[:cut]
                return stop_str
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or (``delta``) what was not sent before.

        Until the request finishes, a tail that could still grow into a stop
        string is held back, so text cut by a stop string never reaches the client.
        """
        end = len(self.output_text)
        if not finished and self.stop and not self.include_stop_str_in_output:
            end -= num_held_back_chars(self.output_text, self.stop)
        if not delta:
            return self.output_text[:end]
        start = self._sent_text_offset
        if end <= start:
            return ""
        self._sent_text_offset = end
        return self.output_text[start:end]


class _TokenizerDetokenizer(IncrementalDetokenizer):
    """Shared set-up for the detokenizers that produce text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        super().__init__(params)
        self.skip_special_tokens = params.skip_special_tokens
        # Adjacent added tokens are joined without the separator some decoders
        # (WordPiece, Metaspace) put between them, unless asked to keep it.
        self._added_tokens: dict[int, str] = {}
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added_tokens = {
                token_id: token.content
                for token_id, token in tokenizer.added_tokens_decoder.items()
            }
        self._last_was_added = False

    def decode_next(self, token_id: int) -> str:
        piece = self._decode_piece(token_id)
        if self._added_tokens:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_was_added:
                piece = content
            self._last_was_added = content is not None
        return piece

    def _decode_piece(self, token_id: int) -> str:
        raise NotImplementedError

    @staticmethod
    def _prompt_context(
        tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int]
    ) -> list[int]:
        """The shortest prompt tail (>= 4 tokens) that starts on a character boundary."""
        if len(prompt_token_ids) <= _MIN_PROMPT_CONTEXT:
            return list(prompt_token_ids)
        max_length = min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT)
        for length in range(_MIN_PROMPT_CONTEXT, max_length + 1):
            tail = prompt_token_ids[-length:]
            if not tokenizer.decode(tail).startswith(_REPLACEMENT_CHAR):
                return tail
        return prompt_token_ids[-_MIN_PROMPT_CONTEXT:]


class FastIncrementalDetokenizer(_TokenizerDetokenizer):
    """Decodes through ``tokenizers.decoders.DecodeStream`` (Rust, O(1) per token)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, request: EngineCoreRequest) -> None:
        super().__init__(tokenizer, request)
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=self._prompt_context(tokenizer, request.prompt_token_ids),
            skip_special_tokens=self.skip_special_tokens,
        )

    def _decode_piece(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception as exc:
            # Some tokenizers rewrite already-decoded text, which the stream
            # cannot follow; start a fresh stream at this token.
            if not str(exc).startswith(_INVALID_PREFIX_ERROR):
                raise
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            piece = self._stream.step(self._backend, token_id)
        return piece or ""


class SlowIncrementalDetokenizer(_TokenizerDetokenizer):
    """Prefix/read offsets over ``tokenizer.decode`` (any tokenizer).

    ``decode(ids[prefix:read])`` is the text already emitted for the window;
    ``decode(ids[prefix:])`` with the new token is compared against it, and
    the difference is emitted once it no longer ends in an incomplete
    character.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, request: EngineCoreRequest) -> None:
        super().__init__(tokenizer, request)
        self._tokenizer = tokenizer
        self._ids = self._prompt_context(tokenizer, request.prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode_piece(self, token_id: int) -> str:
        self._ids.append(token_id)
        ids, skip = self._ids, self.skip_special_tokens
        prefix_text = self._tokenizer.decode(
            ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip
        )
        new_text = self._tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
