"""torch's float32 row sum and last-dim softmax re-done as ATen's AVX2 / AVX512 kernels
compute them (SumKernel's interleaved vector accumulators and cascade levels,
SoftMaxKernel's vector max / SLEEF exp / sum / reciprocal), so a torch op between two
compiled passes can go. Each user switches itself on only where a check against torch
gives the same bits (``rowsum_ok``); elsewhere torch's op runs.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .vml import sexp16, sexp8
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

# ------------------------------------------------------------------ torch's row sum and softmax
# Where a result's bits hang on torch's float32 row sum or last-dim softmax (the router's
# renormalisation, the Attention Residuals scores and weights), these re-do them as
# ATen computes them on its AVX2 path (8-lane vectors) or its AVX512 one: the sum's
# four interleaved vector accumulators with their cascade levels (SumKernel's row_sum;
# the bits of 8-lane vectors on both paths of torch 2.13, as measured), the softmax's
# vector max / exp / sum / reciprocal (SoftMaxKernel's _vec_softmax_lastdim, SLEEF's
# exp; 16 lanes on AVX512, the count passed in the scratch's shape, a run-time value,
# so one cached compile serves both paths), so the torch op between two compiled
# passes goes. Each user switches itself on only where a check against torch gives
# the same bits (``_rowsum_ok``, ``_mix_ok``); elsewhere (another ATen path, no SLEEF
# export) torch's op runs as before.
_LANES8 = 8
#: the lanes of ATen's softmax vectors on the path it runs here (AVX512: 16)
_VL = 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8


@njit(cache=True, nogil=True)
def _ceil_log2(x):
    r = 0
    v = x - 1
    while v > 0:
        v >>= 1
        r += 1
    return r


@njit(cache=True, nogil=True, inline="always")
def _add_group(acc, x, i):
    """Vectors 4i .. 4i + 3 of x into the level-0 accumulators 0 .. 3."""
    for k in range(4):
        b = (4 * i + k) * _LANES8
        for l in range(_LANES8):
            acc[0, k, l] += x[b + l]


@njit(cache=True, nogil=True)
def _torch_row_sum(x, acc):
    """sum(x) for a 1-D float32 row, in the order of ATen's inner sum. From 8 elements
    (vectorized): 8-lane vectors; four of them interleaved (vector 4i + k into
    accumulator k) through up to four cascade levels of 2^p vectors each (p = max(4,
    ceil_log2(n / 32) // 4)); leftover vectors into accumulator 0, accumulators 1..3
    added to it; then the scalar tail from 0, then the 8 lanes in order. Below 8
    (scalar): elements 0..3 into four accumulators, the rest into the first, then the
    others added to it. acc: scratch [4, 4, 8] float32."""
    d = x.size
    if d < _LANES8:
        p0 = p1 = p2 = p3 = np.float32(0.0)
        if d >= 4:
            p0, p1, p2, p3 = p0 + x[0], p1 + x[1], p2 + x[2], p3 + x[3]
        for e in range(4 * (d // 4), d):
            p0 += x[e]
        return np.float32(0.0) + (((p0 + p1) + p2) + p3)
    nv = d // _LANES8
    ni = nv // 4
    acc[:] = 0
    lp = max(4, _ceil_log2(ni) // 4) if ni > 1 else 4
    step = 1 << lp
    i = 0
    while i + step <= ni:
        for _ in range(step):
            _add_group(acc, x, i)
            i += 1
        for j in range(1, 4):
            for k in range(4):
                for l in range(_LANES8):
                    acc[j, k, l] += acc[j - 1, k, l]
                    acc[j - 1, k, l] = 0
            if i & ((step - 1) << (j * lp)):
                break
    while i < ni:
        _add_group(acc, x, i)
        i += 1
    for j in range(1, 4):
        for k in range(4):
            for l in range(_LANES8):
                acc[0, k, l] += acc[j, k, l]
    for v in range(4 * ni, nv):
        for l in range(_LANES8):
            acc[0, 0, l] += x[v * _LANES8 + l]
    for k in range(1, 4):
        for l in range(_LANES8):
            acc[0, 0, l] += acc[0, k, l]
    f = np.float32(0.0)
    for e in range(nv * _LANES8, d):
        f += x[e]
    for l in range(_LANES8):
        f += acc[0, 0, l]
    return f


@njit(cache=True, nogil=True)
def _vop(a, b, add):
    """ATen's vector add, or its maximum (NaN if either is; else b unless a > b)."""
    if add:
        return a + b
    if a != a or b != b:
        return np.float32(np.nan)
    return a if a > b else b


@njit(cache=True, nogil=True)
def _reduce_all(x, n, add, v):
    """ATen's vec::reduce_all of x[:n] with add or maximum, L = v.size // 2 lanes (v:
    scratch of 2L): below L elements one after another; else L-lane vectors (the partial
    last one into its first lanes), then the lane tree (i, i ^ L/2), .., (i, i ^ 1)
    (AVX2: a 128-bit swap, then 64- and 32-bit shuffles; AVX512: 256- and 128-bit
    swaps first)."""
    L = v.size // 2
    if n < L:
        a = x[0]
        for i in range(1, n):
            a = _vop(a, x[i], add)
        return a
    for l in range(L):
        v[l] = x[l]
    d = L
    while d < n:
        for l in range(min(L, n - d)):
            v[l] = _vop(v[l], x[d + l], add)
        d += L
    h = L // 2
    while h >= 1:
        for l in range(L):
            v[L + l] = _vop(v[l], v[l ^ h], add)
        for l in range(L):
            v[l] = v[L + l]
        h //= 2
    return v[0]


@njit(cache=True, nogil=True)
def _softmax_row(x, n, buf, v):
    """x[:n] = torch.softmax(x[:n]) as ATen's AVX2 (L = 8) or AVX512 (L = 16) kernel
    computes it: the maximum, then exp(x - max) (SLEEF's L-lane exp), their sum, one
    reciprocal, each times it. buf: scratch of n rounded up to L; v: scratch of 2L."""
    m = _reduce_all(x, n, False, v)
    nb = buf.size
    for i in range(nb):
        buf[i] = x[i] - m if i < n else np.float32(0.0)
    if v.size == 32:
        sexp16(buf, buf)
    else:
        sexp8(buf, buf)
    s = _reduce_all(buf, n, True, v)
    r = np.float32(1.0) / s
    for i in range(n):
        x[i] = buf[i] * r


_ROWSUM_OK: bool | None = None


def _rowsum_ok() -> bool:
    """Whether _torch_row_sum gives torch.sum's bits here (ATen on its AVX2 or AVX512
    path, rows of 1..5,000, the scalar form, every cascade level and tail)."""
    global _ROWSUM_OK
    if _ROWSUM_OK is None:
        _ROWSUM_OK = False
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            g = torch.Generator().manual_seed(20261203)
            acc = np.empty((4, 4, _LANES8), np.float32)
            ok = True
            for d in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 31, 33, 64, 100, 255, 513, 1024, 2049, 5000):
                x = torch.randn(8, d, generator=g) * torch.rand(8, 1, generator=g) * 10
                got = np.array([_torch_row_sum(r, acc) for r in x.numpy()], np.float32)
                ok = ok and np.array_equal(got.view(np.int32), x.sum(-1).numpy().view(np.int32))
            _ROWSUM_OK = ok
    return _ROWSUM_OK


_cache_leave(_CACHE_PREV)
