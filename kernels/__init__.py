"""Attention-path kernels: each op has a Triton kernel and a batched PyTorch reference.

`<op>` dispatches to `<op>_triton` for CUDA tensors (or with KVMESH_FORCE_TRITON=1)
and to `<op>_ref`, the CPU path, otherwise. Triton is imported only when a Triton
kernel is first launched.
"""

from kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton
from kernels.reshape_and_cache import (
    reshape_and_cache,
    reshape_and_cache_ref,
    reshape_and_cache_triton,
)
from kernels.slot_mapping import (
    PAD_SLOT_ID,
    compute_slot_mapping,
    compute_slot_mapping_cpu,
    compute_slot_mapping_ref,
    compute_slot_mapping_triton,
)

__all__ = [
    "PAD_SLOT_ID",
    "compute_slot_mapping",
    "compute_slot_mapping_cpu",
    "compute_slot_mapping_ref",
    "compute_slot_mapping_triton",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_triton",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "reshape_and_cache_triton",
]
