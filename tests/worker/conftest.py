"""Fixtures shared by the worker's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.helpers import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny random Llama (vocabulary of 256); a module may override it."""
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
