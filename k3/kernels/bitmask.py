"""A grammar's token mask applied to one row of logits (k3.constrain), as one compiled
pass: torch's element ops each pay a dispatch and a thread-pool wake-up right after the
model's parallel regions, which made the mask cost more than the grammar step itself
(docs/PERFORMANCE.md). The bitmask is llguidance's: int32 words, bit j of word w set
when token 32 * w + j is allowed.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end


@njit(cache=True, nogil=True)
def _masked_copy(x, words, out):
    n = x.shape[0]
    out[:] = x   # one straight copy, then the words not all allowed (free text: few)
    out[min(n, words.shape[0] * 32):] = -np.inf   # tokens past the mask's words: not allowed
    for w in range(min(words.shape[0], (n + 31) // 32)):
        bits = words[w]
        if bits == -1:
            continue
        lo = w * 32
        hi = min(lo + 32, n)
        if bits == 0:   # none allowed (inside JSON or a tag: most words)
            out[lo:hi] = -np.inf
        else:
            for i in range(lo, hi):
                if not (bits >> (i - lo)) & 1:
                    out[i] = -np.inf


def masked_copy(logits: torch.Tensor, bitmask: torch.Tensor, out: np.ndarray) -> torch.Tensor:
    """``logits`` (one row of a vocabulary) copied into ``out`` (float32, as long), with
    every token the bitmask ([1, ceil(V / 32)] int32) does not allow at -inf; ``out`` as
    a tensor of the logits' shape. The caller keeps ``out`` between calls: a fresh
    buffer of a large vocabulary's size is fresh pages, whose faults cost more than the
    pass."""
    x = logits.detach().reshape(-1)
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    if out.shape != (x.shape[0],) or out.dtype != np.float32:
        raise ValueError(f"masked_copy: out must be float32 [{x.shape[0]}], got {out.dtype} {list(out.shape)}")
    _masked_copy(x.numpy(), bitmask.reshape(-1).numpy(), out)
    return torch.from_numpy(out).reshape(logits.shape)


_cache_leave(_CACHE_PREV)
