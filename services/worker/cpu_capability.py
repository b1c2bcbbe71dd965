"""What the CPU offers for half-precision math, asked of torch once per process.

The worker's ``dtype="auto"`` on the CPU is bfloat16 only where bfloat16
matmuls run natively (AVX512-BF16 or AMX); elsewhere torch emulates them and
float32 is faster. Callers take a ``CpuCapability`` argument so tests can
inject either answer instead of depending on the machine they run on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CpuCapability:
    """The instruction sets that decide the CPU's default dtype."""

    isa: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    avx512_bf16: bool
    amx: bool

    @property
    def native_bfloat16(self) -> bool:
        """Whether bfloat16 matmuls run in hardware (AVX512-BF16 dot products or AMX tiles)."""
        return self.avx512_bf16 or self.amx


@functools.cache
def detect_cpu_capability() -> CpuCapability:
    """The running CPU's capability, as torch reports it (cached: it cannot change)."""
    cpu = torch.cpu
    # Private helpers, present since torch 2.1; a torch without them reports no support.
    avx512_bf16 = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
    amx = getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    return CpuCapability(torch.backends.cpu.get_cpu_capability(), bool(avx512_bf16), bool(amx))
