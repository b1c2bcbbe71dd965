"""``max_model_len``: the longest sequence a service accepts, decided by one rule.

The worker (which sizes its batch by it) and the frontend (which rejects
prompts by it) read the same ``config.json`` and must reach the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Longest context served when the model allows more and none was asked for.
DEFAULT_MAX_MODEL_LEN = 2048


def get_sliding_window(hf_config: Mapping[str, Any]) -> int | None:
    """The attention window the architecture actually applies, else None.

    Qwen2 checkpoints carry a ``sliding_window`` that applies only with
    ``use_sliding_window``; Mistral and others apply it whenever it is set.
    """
    architectures = hf_config.get("architectures") or []
    is_qwen2 = ("Qwen2ForCausalLM" in architectures[:1]
                or not architectures and hf_config.get("model_type") == "qwen2")
    if is_qwen2 and not hf_config.get("use_sliding_window", False):
        return None
    return hf_config.get("sliding_window")


def max_model_len_limit(max_position_embeddings: int, sliding_window: int | None) -> int:
    """The model's own limit: its positions, capped at its sliding window.

    Attention here is always full, which equals windowed attention only while
    a sequence fits the window.
    """
    if sliding_window is None:
        return max_position_embeddings
    return min(max_position_embeddings, sliding_window)


def resolve_max_model_len(limit: int, requested: int | None) -> int:
    """``requested`` checked against the model's ``limit``; None is min(limit, 2048).

    Raises ValueError naming the allowed range when ``requested`` is outside [2, limit].
    """
    if requested is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    # One prompt token plus one generated token is the smallest useful request.
    if not 2 <= requested <= limit:
        raise ValueError(f"max_model_len is {requested}; allowed range is [2, {limit}] "
                         "for this model")
    return requested


def max_model_len_from_hf_config(hf_config: Mapping[str, Any], requested: int | None) -> int:
    """``resolve_max_model_len`` for a parsed ``config.json``."""
    limit = max_model_len_limit(hf_config["max_position_embeddings"],
                                get_sliding_window(hf_config))
    return resolve_max_model_len(limit, requested)
