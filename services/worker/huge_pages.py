"""Weights moved onto transparent huge pages (2 MiB) for the CPU decode step.

A one-stream decode step streams every weight from memory once, ~200 MB for
SmolLM2-135M in bfloat16. On 4 KiB pages that is ~50,000 pages a step, each a
TLB miss and a page walk, and the hardware prefetchers stop at every page's
end. Torch allocates tensors on 4 KiB pages unless told otherwise
(``THP_MEM_ALLOC_ENABLE``, and then only tensors of 2 MiB and more: most of a
small model's weights are less). Here the weights are copied, in the order
the step reads them, into one buffer the kernel is asked to back with huge
pages (``madvise(MADV_HUGEPAGE)``, honoured where
/sys/kernel/mm/transparent_hugepage/enabled is ``always`` or ``madvise``),
and each tensor is pointed at its copy in place, so every module holding it
reads it there. The values are unchanged; only where they live changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_SLICE_ALIGNMENT = 64  # a cache line, as torch aligns its allocations
_THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``);
    None where it has none (not Linux, or built without)."""
    try:
        text = _THP_MODE_FILE.read_text()
    except OSError:
        return None
    # The mode in force is the bracketed one: "always [madvise] never".
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    return madvise


def move_to_huge_pages_(tensors: Iterable[torch.Tensor]) -> int:
    """Copies ``tensors`` into one new buffer backed by transparent huge pages, in the
    order given, and points each at its copy (``Tensor.set_``: the same tensor
    object, so whatever holds it reads the copy), each copy a storage of its own.
    Returns the bytes moved: 0, with nothing changed, where the kernel offers no
    huge pages on request.

    Only contiguous CPU tensors move. Tensors that view the same bytes (a tied LM
    head and embedding) go on sharing one copy. A tensor that viewed part of a
    larger storage (a GGUF file's mapping) no longer shares it with the rest."""
    if thp_mode() not in ("always", "madvise") or _madvise() is None:
        return 0
    by_bytes: dict[tuple[int, int], list[torch.Tensor]] = {}  # insertion order: the order given
    for t in tensors:
        if (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
                and t.numel() > 0):
            by_bytes.setdefault((t.data_ptr(), t.numel() * t.element_size()), []).append(t)
    slots = [_aligned(nbytes, _SLICE_ALIGNMENT) for _, nbytes in by_bytes]
    total = _aligned(sum(slots), HUGE_PAGE_BYTES)
    if total == 0:
        return 0
    # A fresh private anonymous mapping, untouched until the copies below fault its pages
    # in (torch's allocator may hand back pages already faulted in, on 4 KiB). One
    # more huge page of room lets the slices start on a huge page boundary.
    mapping = mmap.mmap(-1, total + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = _aligned(buffer.data_ptr(), HUGE_PAGE_BYTES) - buffer.data_ptr()
    if _madvise()(buffer.data_ptr() + offset, total, _MADV_HUGEPAGE) != 0:
        logger.warning("event=huge_pages_refused errno=%d", ctypes.get_errno())
        return 0
    with torch.inference_mode():  # which updates weights made in it (or out of it) in place
        for ((_, nbytes), group), slot in zip(by_bytes.items(), slots):
            # A storage of its own for each copy, over the mapping: tensors of one
            # storage count as aliases, and torch.compile refuses a nested compile
            # region (the decode step's layer) whose inputs alias each other.
            copy = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
            copy.copy_(group[0].reshape(-1).view(torch.uint8))
            for t in group:
                t.set_(copy.untyped_storage(), 0, t.shape, t.stride())
            offset += slot
    return sum(nbytes for _, nbytes in by_bytes)


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment
