"""Loading custom processors and building the worker's LogitsProcessors.

Custom processors come from two places, in this order:
1. installed plugins: the entry-point group ``kvmesh.logits_processors``, e.g.
   ``[project.entry-points."kvmesh.logits_processors"] my_proc = "my_pkg.procs:MyProc"``;
2. the worker's ``logits_processors`` setting: classes, or ``"module.path:QualName"`` strings.
A class named twice is built once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.plugins import LOGITS_PROCESSORS_GROUP, load_entry_points, load_qualname

from services.worker.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from services.worker.sample.logits_processor.interface import (
    LogitsProcessor,
    LogitsProcessorConfig,
)
from services.worker.sample.logits_processor.state import LogitsProcessors
from services.worker.sample.logits_processor.structured_output import (
    StructuredOutputLogitsProcessor,
)
from services.worker.sample.logits_processor.thinking import ThinkingBudgetLogitsProcessor

LOGITSPROCS_GROUP = LOGITS_PROCESSORS_GROUP

BUILTIN_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)


def _check_processor_class(obj: object, origin: str) -> type[LogitsProcessor]:
    if not isinstance(obj, type) or not issubclass(obj, LogitsProcessor):
        raise ValueError(f"logits processor {origin} is {obj!r}, not a LogitsProcessor subclass")
    return obj


def load_plugin_logitsprocs() -> list[type[LogitsProcessor]]:
    """Every class registered under the ``kvmesh.logits_processors`` entry-point group."""
    return [_check_processor_class(obj, f"plugin {name!r}")
            for name, obj in load_entry_points(LOGITSPROCS_GROUP)]


def load_logitsproc_by_qualname(spec: str) -> type[LogitsProcessor]:
    """Import ``"module.path:QualName"`` (QualName may be dotted, for nested classes)."""
    return _check_processor_class(load_qualname(spec), repr(spec))


def load_custom_logitsprocs(
    specs: Sequence[str | type[LogitsProcessor]] = (),
) -> list[type[LogitsProcessor]]:
    """Plugins first, then ``specs``; duplicates dropped, first occurrence kept."""
    classes = load_plugin_logitsprocs()
    for spec in specs:
        if isinstance(spec, str):
            classes.append(load_logitsproc_by_qualname(spec))
        else:
            classes.append(_check_processor_class(spec, repr(spec)))
    return list(dict.fromkeys(classes))


def build_logitsprocs(
    config: LogitsProcessorConfig,
    device: torch.device,
    is_pin_memory: bool,
    custom: Sequence[str | type[LogitsProcessor]] = (),
) -> LogitsProcessors:
    """Instantiate the built-ins, the thinking budget and structured outputs (each if
    configured) and the custom processors.

    Order within each argmax group: min tokens, logit bias, thinking budget (so
    nothing but a grammar undoes its forcing), structured outputs (last of the
    built-ins: it sees every mask before it and fails a row left with no
    token), then custom processors.
    """
    classes: list[type[LogitsProcessor]] = list(BUILTIN_LOGITS_PROCESSORS)
    if config.thinking is not None:
        classes.append(ThinkingBudgetLogitsProcessor)
    if config.grammar is not None:
        classes.append(StructuredOutputLogitsProcessor)
    classes.extend(c for c in load_custom_logitsprocs(custom) if c not in classes)
    return LogitsProcessors(cls(config, device, is_pin_memory) for cls in classes)
