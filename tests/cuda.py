"""Marks for the tests that need a CUDA device.

Each such test carries the ``cuda`` mark, so ``pytest -m cuda`` on a GPU
machine runs every CUDA path and nothing else; without a GPU they skip,
saying why.
"""

from __future__ import annotations

import pytest
import torch

skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# For ``pytestmark`` and ``pytest.param(..., marks=CUDA_MARKS)``.
CUDA_MARKS = (pytest.mark.cuda, skip_without_cuda)


def needs_cuda(test):
    """Decorates a test (or a test class) with both marks."""
    return pytest.mark.cuda(skip_without_cuda(test))
