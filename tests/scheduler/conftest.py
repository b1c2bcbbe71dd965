"""Fixtures shared by the scheduler's service tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.grpc_utils import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny random Llama the workers of a test module load."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
