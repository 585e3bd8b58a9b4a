"""One parallel region for several dependent steps: claimable halves and spin waits.

Every kernel launch of a decode step pays a fixed cost beside its work: numba's
dispatch, waking the pool's worker, the join at the end (docs/PERFORMANCE.md,
"Per-token overhead"). A fused op
that runs several dependent steps (a matmul, then math on its result, then another
matmul) can run them all in ONE ``prange(2)`` region instead: each step is cut into
two halves (or is one piece), and between steps the threads wait for the pieces the
next step reads.

Nothing here may assume that the region's two iterations run at the same time: a
pool of one thread, or a worker busy elsewhere, runs iteration 1 after iteration 0.
So a piece is CLAIMED (an atomic compare-and-swap) by whichever thread comes to it
first, and a thread waits only for pieces that were claimed (and so are being done);
a thread that finds the other's half unclaimed does it itself. Iteration 0 alone can
thus do everything, and a late worker costs nothing but its own delay. Which thread
computes a piece never changes the piece's numbers: the results are the same bits
whoever runs what.

Flags: an int64 array of ``flags(n)`` for n pieces, zeroed per region (a piece's
claim word and done word on separate cache lines).

    claim(flags, s) -> bool     # piece s is mine (first caller only)
    finish(flags, s)            # piece s done: its writes visible to a waiter
    wait(flags, s)              # until piece s, if claimed, is done
    bf16_step(tab, r0, r1, ...)  # table rows r0..r1-1 of one-token BF16 products, in halves
"""

from __future__ import annotations

import platform
import numba
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir

from .bf16 import _t1_rows
from .simd import _i16_ptr, address_intrinsic
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
_WORDS = 16   # int64 words per piece: the claim word, and the done word a cache line on


@njit(cache=True, nogil=True, inline="always")
def flags(n):
    """Zeroed flags for n pieces."""
    return np.zeros(n * _WORDS, np.int64)


def _item_ptr(context, builder, aryty, ary, idx):
    a = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, a, [idx])


@intrinsic
def _cas01(typingctx, arr, idx):
    """arr[idx]: 0 -> 1 atomically (sequentially consistent); True when this call did it."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig.args[0], args[0], args[1])
        i64 = context.get_value_type(types.int64)
        res = builder.cmpxchg(ptr, i64(0), i64(1), "seq_cst", "seq_cst")
        return builder.extract_value(res, 1)

    return types.boolean(arr, idx), codegen


@intrinsic
def _load_acquire(typingctx, arr, idx):
    """arr[idx] read with acquire ordering (a spin loop sees the other thread's store)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_item_ptr(context, builder, sig.args[0], args[0], args[1]), "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def _store_release(typingctx, arr, idx, val):
    """arr[idx] = val with release ordering (writes before it are seen before it)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)
            and isinstance(val, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, _item_ptr(context, builder, sig.args[0], args[0], args[1]), "release", 8)
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


@intrinsic
def _pause(typingctx):
    """The spin-wait hint (x86 ``pause``; nothing elsewhere)."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True, nogil=True, inline="always")
def claim(fl, s):
    return _cas01(fl, s * _WORDS)


@njit(cache=True, nogil=True, inline="always")
def finish(fl, s):
    _store_release(fl, s * _WORDS + 8, 1)


@njit(cache=True, nogil=True, inline="always")
def wait(fl, s):
    # a piece nobody claimed has nobody to wait for (the caller claims it or it is empty)
    if _load_acquire(fl, s * _WORDS) != 0:
        while _load_acquire(fl, s * _WORDS + 8) == 0:
            _pause()


_f32_ptr = address_intrinsic(types.float32)

# Columns of a one-token BF16 step table (int64 [n, 6]): row r multiplies a [1, K] input
# by W [N, K] (bf16 bits at address T_W) into N floats. The input is K floats at
# offset T_XO of array T_XS (0: the op's input x, 1: its workspace), the output goes to
# offset T_OO of array T_OS (1: the workspace, 2: the op's result y).
T_K, T_N, T_W, T_XS, T_XO, T_OS, T_OO = range(7)


@njit(cache=True, nogil=True, inline="always")
def _pick(k, x, work, y):
    return x if k == 0 else (work if k == 1 else y)


@njit(cache=True, nogil=True, inline="always")
def _split(N):
    return min(N, (N // 2 + 7) // 8 * 8)   # a multiple of 8 rows (the eight-row dots)


@njit(cache=True, nogil=True)
def bf16_half(tab, r, h, x, work, y):
    """Half h (0: the first rows, 1: the rest) of row r's product (x, work, y float32
    1-D arrays, see the T_* columns), by the one-token kernels' own row code
    (``k3.kernels.bf16._t1_rows``): each output has the bits ``bf16_linear`` gives it."""
    K, N = tab[r, T_K], tab[r, T_N]
    src, dst = _pick(tab[r, T_XS], x, work, y), _pick(tab[r, T_OS], x, work, y)
    xv = numba.carray(_f32_ptr(src.ctypes.data + 4 * tab[r, T_XO]), (1, K))
    w = numba.carray(_i16_ptr(tab[r, T_W]), (N, K))
    out = numba.carray(_f32_ptr(dst.ctypes.data + 4 * tab[r, T_OO]), (N,))
    m = _split(N)
    if h == 0:
        _t1_rows(xv, 0, w, out, 0, 0, m)
    else:
        _t1_rows(xv, 0, w, out, 0, m, N)


@njit(cache=True, nogil=True, inline="always")
def bf16_step(tab, r0, r1, x, work, y, fl, s, c):
    """Table rows r0 .. r1-1 as one step of a region, pieces s (first halves) and s + 1
    (second halves), called by thread c of the region's two: its own half first, the
    other if still unclaimed; returns when both are done. (Inlined: a separate function
    would be compiled once per constant s its callers pass.)"""
    for k in range(2):
        h = c if k == 0 else 1 - c
        if claim(fl, s + h):
            for r in range(r0, r1):
                bf16_half(tab, r, h, x, work, y)
            finish(fl, s + h)
    wait(fl, s)
    wait(fl, s + 1)


_cache_leave(_CACHE_PREV)
