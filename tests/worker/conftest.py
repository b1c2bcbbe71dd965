"""Fixtures shared by the worker's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.worker.grammar import GrammarBackend
from tests.worker.helpers import save_tiny_model

# SmolLM2's vocabulary and end-of-sequence id, for the grammar tests.
SMOLLM2_VOCAB = 49152
SMOLLM2_EOS = 2


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny random Llama (vocabulary of 256); a module may override it."""
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def grammar(default_model_dir) -> GrammarBackend:
    """Structured-output grammars compiled against SmolLM2's tokenizer."""
    backend = GrammarBackend(default_model_dir, SMOLLM2_VOCAB, [SMOLLM2_EOS])
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
