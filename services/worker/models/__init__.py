"""Model implementations and the architecture registry."""

from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.registry import MODEL_REGISTRY, get_model, get_model_class

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model", "get_model_class"]
