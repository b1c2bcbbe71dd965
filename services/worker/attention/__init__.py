"""Paged attention: per-step metadata and the layer that reads/writes the KV cache."""

from services.worker.attention.layer import Attention
from services.worker.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata"]
