"""Structured-output grammars compiled against the model's tokenizer, off the step's path.

The worker compiles each request's constraint once, on a background thread
started when the request arrives (so it overlaps the prefill), with
xgrammar's compiled-grammar cache behind it; the structured-output logits
processor waits for the result only when it first masks the request's row.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from services.common.grammar import build_grammar
from services.common.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# Futures of recent grammars, so a request's prefetch and its processor share
# one compilation; xgrammar's own cache keeps compiled grammars beyond this.
_MAX_PENDING = 256


class GrammarBackend:
    """Compiles ``StructuredOutputsParams`` into xgrammar ``CompiledGrammar``s.

    The tokenizer (from ``model_dir``) is read on the backend's thread at
    construction, so a worker registers without waiting for it. ``vocab_size``
    is the model's (the logits' width), which may exceed the tokenizer's.
    ``stop_token_ids`` end a grammar (the model's end-of-sequence ids).
    Thread-safe for ``compile``; matchers are used by one thread at a time.
    """

    def __init__(self, model_dir: str | os.PathLike, vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        # One thread: compilations queue behind the tokenizer and each other;
        # xgrammar parallelises inside one compilation.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: Future[xgrammar.GrammarCompiler] = self._executor.submit(
            self._make_compiler, str(model_dir))
        self._pending: OrderedDict[tuple[str, str, bool], Future[xgrammar.CompiledGrammar]] = (
            OrderedDict())

    def _make_compiler(self, model_dir: str) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self._tokenizer = tokenizer
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile(self, so: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``so``, as a future; its error is a ValueError.

        Calls with the same constraint share one future while it is recent.
        """
        key = so.key
        future = self._pending.get(key)
        if future is None:
            future = self._executor.submit(self._compile, so)
            self._pending[key] = future
            if len(self._pending) > _MAX_PENDING:
                self._pending.popitem(last=False)
        else:
            self._pending.move_to_end(key)
        return future

    def _compile(self, so: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self._compiler.result()
        grammar = build_grammar(so)  # ValueError for an invalid constraint
        return compiler.compile_grammar(grammar)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids (no special tokens): a string the grammar forces, as drafts."""
        self._compiler.result()  # the tokenizer is read with it
        return self._tokenizer.encode(text, add_special_tokens=False)

    def new_matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
