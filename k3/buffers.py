"""Buffers the I/O and the kernels share: uninitialised arrays aligned for O_DIRECT
reads and, for weights a kernel streams, on transparent huge pages. (The ground floor:
the checkpoint's readers, the memory system and the kernels all take them from here.)"""

from __future__ import annotations

import mmap

import numpy as np

from . import env
from .units import ALIGN


#: a transparent huge page (x86-64)
HUGE = 2 << 20


def aligned_empty(nbytes: int, align: int = ALIGN, huge: bool = False) -> np.ndarray:
    """Uninitialised 1-D uint8 array of ``nbytes`` whose data pointer is ``align``-aligned.

    ``huge``: a buffer of at least 2 MiB that a kernel will stream (weights) is also
    2 MiB-aligned and its whole 2 MiB pages advised as transparent huge pages (one TLB
    entry per 2 MiB instead of 512; unless K3_NOHUGE is set or the system has them
    off). The tail after the last whole 2 MiB stays in small pages, so the buffer never
    makes more than its own bytes resident."""
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment must be a power of two, got {align}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if huge and nbytes >= HUGE and align <= HUGE and env.hugepages():
        buf = _huge_empty(nbytes)
        if buf is not None:
            return buf
    raw = np.empty(nbytes + align, dtype=np.uint8)
    lead = (-raw.ctypes.data) % align
    # (slice one byte first: numpy would not move the pointer of an empty slice)
    return raw[lead : lead + max(nbytes, 1)][:nbytes]  # keeps `raw` alive through .base


def _huge_empty(nbytes: int) -> np.ndarray | None:
    """``nbytes`` of anonymous memory at a 2 MiB boundary, its whole 2 MiB pages advised
    MADV_HUGEPAGE; None when the mapping fails (the caller falls back to np.empty). The
    array keeps the mapping alive; pages become resident when first written."""
    try:
        mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return None
    buf = np.frombuffer(mm, dtype=np.uint8)
    lead = (-buf.ctypes.data) % HUGE
    whole = nbytes // HUGE * HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, lead, whole)
        except (OSError, ValueError):
            pass
    return buf[lead:lead + nbytes]
