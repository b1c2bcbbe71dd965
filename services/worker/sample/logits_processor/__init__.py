"""Logits processors: the batch-level framework, the built-ins and plugin loading."""

from services.worker.sample.logits_processor.adapter import (
    AdapterLogitsProcessor,
    RequestLogitsProcessor,
)
from services.worker.sample.logits_processor.builder import BatchUpdateBuilder
from services.worker.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from services.worker.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    MovedRequest,
    MoveDirectionality,
    RemovedRequest,
    ThinkingConfig,
    process_dict_updates,
)
from services.worker.sample.logits_processor.loader import (
    BUILTIN_LOGITS_PROCESSORS,
    LOGITSPROCS_GROUP,
    build_logitsprocs,
    load_custom_logitsprocs,
)
from services.worker.sample.logits_processor.state import LogitsProcessors
from services.worker.sample.logits_processor.thinking import ThinkingBudgetLogitsProcessor

__all__ = [
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BUILTIN_LOGITS_PROCESSORS",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LOGITSPROCS_GROUP",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessorConfig",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "ThinkingBudgetLogitsProcessor",
    "ThinkingConfig",
    "build_logitsprocs",
    "load_custom_logitsprocs",
    "process_dict_updates",
]
