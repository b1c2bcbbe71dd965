"""Building blocks shared by the model implementations."""

from services.worker.layers.activation import SiluAndMul
from services.worker.layers.rms_norm import RMSNorm
from services.worker.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb

__all__ = ["RMSNorm", "RotaryEmbedding", "SiluAndMul", "apply_rotary_emb"]
