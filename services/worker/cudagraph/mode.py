"""`CUDAGraphMode`: which CUDA graphs a worker captures, and its downgrade rules.

Single modes (NONE, PIECEWISE, FULL) are also the runtime modes a batch is
dispatched to. FULL_DECODE_ONLY and FULL_AND_PIECEWISE are dual modes: uniform
decode batches use one member mode (FULL), the other batches the other (nothing
or PIECEWISE). The default is FULL_AND_PIECEWISE on CUDA and NONE on the CPU.
"""

from __future__ import annotations

import enum
import logging

from services.worker.attention.backend import AttentionCGSupport

logger = logging.getLogger(__name__)


class CUDAGraphMode(enum.Enum):
    """What is captured: nothing, the pieces between attention calls, or the whole model."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @classmethod
    def parse(cls, name: str) -> CUDAGraphMode:
        """The mode named ``name`` (case-insensitive); ValueError naming the allowed ones."""
        try:
            return cls[name.upper()]
        except KeyError:
            allowed = ", ".join(m.name for m in cls)
            raise ValueError(f"cudagraph_mode {name!r} is not one of {allowed}") from None

    def decode_mode(self) -> CUDAGraphMode:
        """Runtime mode wanted for uniform decode batches."""
        return {
            CUDAGraphMode.NONE: CUDAGraphMode.NONE,
            CUDAGraphMode.PIECEWISE: CUDAGraphMode.PIECEWISE,
        }.get(self, CUDAGraphMode.FULL)

    def mixed_mode(self) -> CUDAGraphMode:
        """Runtime mode wanted for every other batch (prefill, chunked prefill, mixed)."""
        return {
            CUDAGraphMode.FULL: CUDAGraphMode.FULL,
            CUDAGraphMode.PIECEWISE: CUDAGraphMode.PIECEWISE,
            CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.PIECEWISE,
        }.get(self, CUDAGraphMode.NONE)

    def has_full_cudagraphs(self) -> bool:
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise_cudagraphs(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())

    def separate_routine(self) -> bool:
        """True for the dual modes, whose decode graphs are keyed apart from mixed ones."""
        return self in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    support: AttentionCGSupport,
    *,
    piecewise_available: bool = True,
    uniform_decode_query_len: int = 1,
) -> CUDAGraphMode:
    """The closest mode to ``requested`` that the attention backend can run.

    ``support`` is the attention backend's (the lowest one, if a model mixes
    backends). PIECEWISE graphs never contain attention, so they need no
    support; they need a model split at attention (``piecewise_available``).
    Full graphs of mixed batches need ALWAYS; full graphs of decode batches
    need UNIFORM_BATCH, or UNIFORM_SINGLE_TOKEN_DECODE when decode batches have
    one query token (``uniform_decode_query_len == 1``, no speculative tokens).
    A downgrade is logged once, here.
    """
    resolved = _downgrade(requested, support, piecewise_available, uniform_decode_query_len)
    if resolved is not requested:
        logger.warning(
            "cudagraph_mode %s is not supported by this attention backend (support %s%s); "
            "using %s", requested.name, support.name,
            "" if piecewise_available else ", no piecewise split", resolved.name,
        )
    return resolved


def _downgrade(mode: CUDAGraphMode, support: AttentionCGSupport, piecewise_available: bool,
               uniform_decode_query_len: int) -> CUDAGraphMode:
    if mode.has_piecewise_cudagraphs() and not piecewise_available:
        # FULL_AND_PIECEWISE keeps its full decode graphs; PIECEWISE has nothing left.
        mode = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full_cudagraphs() else CUDAGraphMode.NONE
    full_decode_ok = support.value >= AttentionCGSupport.UNIFORM_BATCH.value or (
        support is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE and uniform_decode_query_len == 1
    )
    fallback = CUDAGraphMode.PIECEWISE if piecewise_available else CUDAGraphMode.NONE
    if mode is CUDAGraphMode.FULL and support is not AttentionCGSupport.ALWAYS:
        # Mixed batches cannot be captured whole: keep full graphs for decode only.
        if full_decode_ok:
            return CUDAGraphMode.FULL_AND_PIECEWISE if piecewise_available else CUDAGraphMode.FULL_DECODE_ONLY
        return fallback
    if mode.separate_routine() and not full_decode_ok:
        return fallback if mode is CUDAGraphMode.FULL_AND_PIECEWISE else CUDAGraphMode.NONE
    return mode
