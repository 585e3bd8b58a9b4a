"""Attention's products and its tiled online softmax: ``dots`` (each element the
canonical 64-lane dot) and ``prods`` (an fma chain in ascending k), whose order does
not depend on the shapes or on the other rows (BLAS's does), and the softmax tile's
max / exp / sum / merge steps.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import torch
from numba import njit, prange
from llvmlite import ir
from numba import get_thread_id, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import vml
from .aten import _LANES8, _rowsum_ok, _torch_row_sum
from .cpu import LANES, _ISA, _V
from .launch import _run, _threads, empty64
from .norms import _array, _as_f32, _flat
from .simd import F32_ONLY, W_DTYPES, _F32, _I16, _I32, _I64, _data_ptr, _fma, _row_ptr, _vfma, _vload, _vstore, c_matrix, counted_loop, for_each_nt, widen_bf16_vec
from .tiles import make_tile
from .vml import vexp
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

# ------------------------------------------------------------------ fixed-order matmuls
# Attention's small matmuls (scores, weighted values, MLA's absorbed projections) in one
# fixed order per output element, whatever the shapes around it. BLAS (MKL) picks its
# blocking from the shapes: on some CPUs (AMD, AVX2) a sum over 256 keys and the same
# sum with 344 masked zeros after it round differently, and a one-query product
# differs from the same row of a 600-query one. Then a prompt read in pieces, or a
# decode step, would not give the bits of one pass. Here each element is computed by
# one thread in an order that depends only on its own operands.

#: register tiles (queries x keys / rows) of the dot form, as the MXFP4 kernel's fp32 tiles
_NTA, _NRA = {"avx512": (4, 4), "avx2": (3, 2), "generic": (2, 2)}[_ISA]
_tile_a = make_tile(_NTA, _NRA, 1, "any", _V)
_tile_a1 = make_tile(_NTA, 1, 1, "any", _V)

# The arguments of the compiled products (``_dots*``, ``_prods*``), grouped by meaning. The
# kernels unpack them by position, so a plain tuple of the same fields serves too (what
# dots / prods pass: a plain tuple is cheaper to build, and for numba to dispatch on).
#: an operand's view: batch g reads rows r0 + g*rg + ..., columns o0 + g*og + ... of array a
Operand = namedtuple("Operand", "a r0 rg o0 og")
#: the flat output: result (g, i, j) goes to out[g*og + i*ostride + j]
Target = namedtuple("Target", "out og ostride")
#: the batch's sizes: G groups of M x N results, each a sum over K
Dims = namedtuple("Dims", "G M N K")
#: the causal cut: when on, row i needs only j (dots) or k (prods) <= lim + i
Limit = namedtuple("Limit", "lim on")


@njit(cache=True, nogil=True, inline="always")
def _dots_block(b, xv, wv, dims, cut, dst, acc):
    # block b (batch g, query tile i0) of _dots, with the thread's scratch acc
    x, xr0, xrg, xo0, xog = xv
    w, wr0, wrg, wo0, wog = wv
    _, M, N, K = dims
    lim, causal = cut
    out, og, ostride = dst
    nj = K // LANES
    km = nj * LANES
    nti = (M + _NTA - 1) // _NTA
    g = b // nti
    i0 = (b - g * nti) * _NTA
    nt = min(_NTA, M - i0)
    xr = xr0 + g * xrg + i0
    xo = xo0 + g * xog
    wr = wr0 + g * wrg
    wo = wo0 + g * wog
    ob = g * og + i0 * ostride
    n_hi = N
    if causal:
        n_hi = max(0, min(N, lim + i0 + nt))      # the tile's last row needs j <= lim + i0 + nt - 1
    j = 0
    while j < n_hi:
        if j + _NRA <= n_hi:
            _tile_a(nt, acc, 0, _NTA, x, x, xr, xo, w, w, wr + j, wo, nj, 3, out, ob + j, ostride)
            j += _NRA
        else:
            _tile_a1(nt, acc, 0, _NTA, x, x, xr, xo, w, w, wr + j, wo, nj, 3, out, ob + j, ostride)
            j += 1
    if km < K:
        for t in range(nt):
            for jj in range(n_hi):
                s = out[ob + t * ostride + jj]
                for k in range(km, K):
                    s = _fma(x[xr + t, xo + k], _as_f32(w[wr + jj, wo + k]), s)
                out[ob + t * ostride + jj] = s


@njit(parallel=True, cache=True, nogil=True)
def _dots(xv, wv, dims, cut, dst, nth):
    # out[g*og + i*ostride + j] = dot(x[xr0 + g*xrg + i, xo0 + g*xog + k], w[wr0 + g*wrg + j, wo0 + g*wog + k])
    # over k < K in the canonical order (64 lanes, tree, then the K % 64 tail in order),
    # with x, xr0, xrg, xo0, xog = xv (an Operand), w... = wv, out, og, ostride = dst;
    # cut = (lim, on): row i only needs j <= lim + i when on (later j are left as they are)
    G, M = dims[0], dims[1]
    acc_all = empty64(nth * _NTA * _NRA * LANES).reshape((nth, _NTA * _NRA, LANES))   # a thread's rows own their lines
    for b in prange(G * ((M + _NTA - 1) // _NTA)):
        _dots_block(b, xv, wv, dims, cut, dst, acc_all[get_thread_id()])


@njit(cache=True, nogil=True)
def _dots_serial(xv, wv, dims, cut, dst, nth):
    G, M = dims[0], dims[1]
    acc = np.empty((_NTA * _NRA, LANES), np.float32)
    for b in range(G * ((M + _NTA - 1) // _NTA)):
        _dots_block(b, xv, wv, dims, cut, dst, acc)


def make_tile_nn(max_nt, nv, v):
    """A numba intrinsic for the product form ``p @ v`` on a register tile of nt rows
    (run-time, 1 .. max_nt) x nv * v columns::

        tile(nt, x, xr, xo, w, wr, wo, K, out, obase, ostride)

    out[obase + t*ostride + c] = the fma chain over k = 0 .. K-1 (from +0) of
    x[xr + t, xo + k] * w[wr + k, wo + c], for t < nt, c < nv * v: x broadcast, w a
    vector load, nt x nv accumulators in registers. x float32 C 2-D, w float32 or bf16
    bits (int16 / uint16, widened in registers: exact) C 2-D, out float32 1-D."""
    def typer(typingctx, nt, x, xr, xo, w, wr, wo, K, out, obase, ostride):
        if not (c_matrix(x, F32_ONLY) and c_matrix(w, W_DTYPES["any"])
                and isinstance(out, types.Array) and out.ndim == 1
                and out.dtype == types.float32):
            return None
        if not all(isinstance(t, types.Integer) for t in (nt, xr, xo, wr, wo, K, obase, ostride)):
            return None
        sig = types.void(nt, x, xr, xo, w, wr, wo, K, out, obase, ostride)

        def codegen(context, builder, sig, args):
            iv = [context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
                  for a, t in zip(args, sig.args)]
            nt_v, x_v, xr, xo, w_v, wr, wo, K, out_v, obase, ostride = iv
            vt = ir.VectorType(_F32, v)
            zv = ir.Constant(vt, [0.0] * v)
            wf32 = sig.args[4].dtype == types.float32
            outp = _data_ptr(context, builder, sig.args[8], out_v)
            wary = context.make_array(sig.args[4])(context, builder, w_v)
            wcols = cgutils.unpack_tuple(builder, wary.shape, 2)[1]
            w0 = _row_ptr(context, builder, sig.args[4], w_v, wr, wo)
            def emit(n_t):
                xp = [_row_ptr(context, builder, sig.args[1], x_v, builder.add(xr, _I64(t)), xo) for t in range(n_t)]

                def body(k, acc, xp=xp, n_t=n_t):
                    row = builder.gep(w0, [builder.mul(k, wcols)], inbounds=True)
                    wv = [_vload(builder, row, _I64(q * v), _F32, v) if wf32 else
                          widen_bf16_vec(builder, _vload(builder, row, _I64(q * v), _I16, v)) for q in range(nv)]
                    new = list(acc)
                    for t in range(n_t):
                        xs = builder.load(builder.gep(xp[t], [k], inbounds=True))
                        xb = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), xs, _I32(0)),
                                                    ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, v), [0] * v))
                        for q in range(nv):
                            new[t * nv + q] = _vfma(builder, xb, wv[q], new[t * nv + q])
                    return new

                fins = counted_loop(builder, K, [zv] * (n_t * nv), body, f"nn{n_t}")
                for t in range(n_t):
                    for q in range(nv):
                        o = builder.add(obase, builder.add(builder.mul(_I64(t), ostride), _I64(q * v)))
                        _vstore(builder, fins[t * nv + q], outp, o)

            for_each_nt(builder, nt_v, max_nt, "nn", emit)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"tile_nn{max_nt}x{nv}_v{_V}"
    return intrinsic(typer)


@intrinsic
def _axpy_row(typingctx, a, xk, w, wr, wo, n):
    """a[c] = fma(xk, fp32(w[wr, wo + c]), a[c]) for c < n (a float32 1-D, w float32 or
    bf16 bits C 2-D): one row of w streamed, four vectors of _V lanes a step, a scalar
    tail. Each element one fma, as the register tiles do it."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32 and xk == types.float32
            and c_matrix(w, W_DTYPES["any"]) and all(isinstance(t, types.Integer) for t in (wr, wo, n))):
        return None
    sig = types.void(a, xk, w, wr, wo, n)

    def codegen(context, builder, sig, args):
        a_v, xk_v, w_v, wr_v, wo_v, n_v = args
        wr_v, wo_v, n_v = (context.cast(builder, v, t, types.int64) for v, t in zip((wr_v, wo_v, n_v), sig.args[3:]))
        v = _V
        vt = ir.VectorType(_F32, v)
        wf32 = sig.args[2].dtype == types.float32
        ap = _data_ptr(context, builder, sig.args[0], a_v)
        wp = _row_ptr(context, builder, sig.args[2], w_v, wr_v, wo_v)
        xb = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), xk_v, _I32(0)),
                                    ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, v), [0] * v))
        step = 4 * v
        nsteps = builder.sdiv(n_v, _I64(step))

        def body(j, vals):
            base = builder.mul(j, _I64(step))
            for q in range(4):
                e = builder.add(base, _I64(q * v))
                wv = _vload(builder, wp, e, _F32, v) if wf32 else widen_bf16_vec(builder, _vload(builder, wp, e, _I16, v))
                _vstore(builder, _vfma(builder, xb, wv, _vload(builder, ap, e, _F32, v)), ap, e)
            return vals

        counted_loop(builder, nsteps, [], body, "axpy")

        def tail(j, vals):
            e = builder.add(builder.mul(nsteps, _I64(step)), j)
            wp_e = builder.gep(wp, [e], inbounds=True)
            wx = builder.load(wp_e)
            wx = wx if wf32 else builder.bitcast(builder.shl(builder.zext(wx, _I32), _I32(16)), _F32)
            ap_e = builder.gep(ap, [e], inbounds=True)
            builder.store(builder.fma(xk_v, wx, builder.load(ap_e)), ap_e)
            return vals

        counted_loop(builder, builder.sub(n_v, builder.mul(nsteps, _I64(step))), [], tail, "axpy_t")
        return context.get_dummy_value()

    return sig, codegen


_NTN, _NVN = {"avx512": (4, 4), "avx2": (4, 2), "generic": (4, 2)}[_ISA]
_CWN = _NVN * _V               # columns per product tile
_tile_nn = make_tile_nn(_NTN, _NVN, _V)


@njit(cache=True, nogil=True, inline="always")
def _prods_block(b, xv, wv, dims, cut, dst):
    # block b (batch g, row tile i0) of _prods
    x, xr0, xrg, xo0, xog = xv
    w, wr0, wrg, wo0, wog = wv
    _, M, N, K = dims
    lim, lim_on = cut
    out, og, ostride = dst
    nti = (M + _NTN - 1) // _NTN
    g = b // nti
    i0 = (b - g * nti) * _NTN
    nt = min(_NTN, M - i0)
    kk = K
    if lim_on:
        kk = max(0, min(K, lim + i0 + nt))
    xr = xr0 + g * xrg + i0
    xo = xo0 + g * xog
    wr = wr0 + g * wrg
    wo = wo0 + g * wog
    ob = g * og + i0 * ostride
    if nt == 1 and N >= _CWN:      # one row (decode): w's rows streamed whole, the chains in L1
        a = np.zeros(N, np.float32)
        for k in range(kk):         # (the register tiles walk w a tile of columns at a time,
            _axpy_row(a, x[xr, xo + k], w, wr + k, wo, N)  # row after strided row)
        for c in range(N):
            out[ob + c] = a[c]
        return
    n = 0
    while n + _CWN <= N:
        _tile_nn(nt, x, xr, xo, w, wr, wo + n, kk, out, ob + n, ostride)
        n += _CWN
    for t in range(nt):
        for c in range(n, N):
            s = np.float32(0.0)
            for k in range(kk):
                s = _fma(x[xr + t, xo + k], _as_f32(w[wr + k, wo + c]), s)
            out[ob + t * ostride + c] = s


@njit(parallel=True, cache=True, nogil=True)
def _prods(xv, wv, dims, cut, dst):
    # out[g*og + i*ostride + n] = fma chain over k < K (ascending, from +0) of
    # x[xr0 + g*xrg + i, xo0 + g*xog + k] * w[wr0 + g*wrg + k, wo0 + g*wog + n], named as
    # in _dots; cut = (lim, on): row i only sums k <= lim + i when on, x being zero
    # beyond (+0 lanes stay as they are)
    G, M = dims[0], dims[1]
    for b in prange(G * ((M + _NTN - 1) // _NTN)):
        _prods_block(b, xv, wv, dims, cut, dst)


@njit(cache=True, nogil=True)
def _prods_serial(xv, wv, dims, cut, dst):
    G, M = dims[0], dims[1]
    for b in range(G * ((M + _NTN - 1) // _NTN)):
        _prods_block(b, xv, wv, dims, cut, dst)


def _rows2(t: torch.Tensor, bf16: bool = False) -> np.ndarray:
    """A C-contiguous 2-D numpy view of t: float32, or (bf16) a bfloat16 tensor's bits as
    int16. Anything else is refused (the callers own these operands)."""
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError("the fixed-order matmuls take C-contiguous 2-D operands")
    if bf16 and t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype != torch.float32:
        raise ValueError(f"the fixed-order matmuls take float32{' or bfloat16' if bf16 else ''} operands, got {t.dtype}")
    return t.numpy()


def _out(G: int, M: int, N: int, out_at, alloc) -> tuple[np.ndarray, int, int]:
    """The flat float32 output of G x M x N results at out[g*a + i*b + j] (out_at = (a, b),
    row-major [G, M, N] when None), its last element the last one written; (out, a, b)."""
    a, b = out_at if out_at is not None else (M * N, N)
    return alloc(max(0, (G - 1) * a + (M - 1) * b + N) if G and M and N else 0, np.float32), a, b


def dots(x: torch.Tensor, w: torch.Tensor, G: int, M: int, N: int, K: int, *, x_at=(0, 0, 0, 0),
         w_at=(0, 0, 0, 0), out_at=None, causal: int | None = None) -> torch.Tensor:
    """Batched dot products in the canonical order of the BF16/MXFP4 kernels, on
    register tiles. x: C-contiguous 2-D float32; w likewise, or bfloat16 (read as stored,
    widened exactly in registers); for g < G, i < M, j < N:

        out[g, i, j] = sum over k < K of x[r0 + g*rg + i, o0 + g*og + k] * w[...same for j...]

    with x_at = (r0, rg, o0, og) and w_at likewise. Returns out flat: [G, M, N] row-major,
    or laid out as out[g*a + i*b + j] with out_at = (a, b) (the caller's shape). causal
    (int): only j <= causal + i is computed (the others are left zero)."""
    out, a, b = _out(G, M, N, out_at, np.zeros)
    if G and M and N:
        xn, wn = _rows2(x), _rows2(w, bf16=True)
        # (Operand, Operand, Dims, Limit, Target) as plain tuples
        _run(_dots, _dots_serial, G * M * N * max(K, 1), (xn, *x_at), (wn, *w_at), (G, M, N, K),
             (0 if causal is None else causal, causal is not None), (out, a, b), _threads()[0]())
    return torch.from_numpy(out)


def prods(x: torch.Tensor, w: torch.Tensor, G: int, M: int, N: int, K: int, *, x_at=(0, 0, 0, 0),
          w_at=(0, 0, 0, 0), out_at=None, causal: int | None = None) -> torch.Tensor:
    """Batched products ``x @ w`` with one order per element: an fma chain over k in
    ascending order, from +0. x: C-contiguous 2-D float32; w likewise, or bfloat16 (read
    as stored, widened exactly in registers); for g < G, i < M, n < N:

        out[g, i, n] = sum over k < K of x[r0 + g*rg + i, o0 + g*og + k] * w[r0' + g*rg' + k, o0' + g*og' + n]

    with x_at = (r0, rg, o0, og), w_at = (r0', rg', o0', og'). Returns out flat, [G, M, N]
    row-major or out[g*a + i*b + n] with out_at = (a, b). causal (int): row i sums only
    k <= causal + i, x being zero beyond (adding a zero product never changes a sum
    that starts at +0), so a row gives the same bits whatever follows its keys."""
    out, a, b = _out(G, M, N, out_at, np.empty)
    if G and M and N:
        # (Operand, Operand, Dims, Limit, Target) as plain tuples
        _run(_prods, _prods_serial, G * M * N * max(K, 1), (_rows2(x), *x_at), (_rows2(w, bf16=True), *w_at),
             (G, M, N, K), (-1 if causal is None else causal, causal is not None), (out, a, b))
    return torch.from_numpy(out)


# ------------------------------------------------------------------ online softmax
@njit(cache=True, nogil=True)
def _softmax_pre(sc, m, m_new, corr):
    R, n = sc.shape
    nan = np.float32(np.nan)
    for r in range(R):
        mx = -np.inf
        seen_nan = False
        for j in range(n):                                 # amax: NaN if any element is NaN
            v = sc[r, j]
            if v != v:
                seen_nan = True
            elif v > mx:
                mx = v
        a = m[r]
        mn = nan if (seen_nan or a != a) else np.float32(max(a, mx))   # torch.maximum
        m_new[r] = mn
        for j in range(n):
            sc[r, j] = sc[r, j] - mn
        corr[r] = a - mn


@njit(cache=True, nogil=True)
def _softmax_pre1(sc, m, m_new, corr):
    _softmax_pre(sc, m, m_new, corr)
    e = sc.reshape(-1)
    vexp(e, e)
    vexp(corr, corr)


def softmax_tile(sc: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key tile of an online softmax: scores sc [..., n] (a fresh float32 tensor,
    overwritten), running maxima m [..., 1]. Returns (p = exp(sc - m_new), m_new =
    torch.maximum(m, sc.amax(-1)), corr = exp(m - m_new)): torch's chain, each
    subtraction rounded, exp torch's, in one compiled call (NaN as torch propagates it;
    a signed zero in m_new cannot change a result: exp(+-0) = 1)."""
    shape = sc.shape
    scn = _array(sc).reshape(-1, shape[-1])
    mn = _flat(m)
    m_new = np.empty_like(mn)
    corr = np.empty_like(mn)
    if vml.AVAILABLE:
        _softmax_pre1(scn, mn, m_new, corr)
    else:
        _softmax_pre(scn, mn, m_new, corr)
        torch.from_numpy(scn).exp_()
        torch.from_numpy(corr).exp_()
    mshape = m.shape
    return torch.from_numpy(scn.reshape(shape)), torch.from_numpy(m_new.reshape(mshape)), \
        torch.from_numpy(corr.reshape(mshape))


@njit(cache=True, nogil=True)
def _scores_softmax1(a, b, scale, p, s, acc):
    R, n = p.shape
    for r in range(R):
        mx = -np.inf
        seen_nan = False
        for j in range(n):
            v = (a[r * n + j] + b[r * n + j]) * scale
            p[r, j] = v
            if v != v:
                seen_nan = True
            elif v > mx:
                mx = v
        mn = np.float32(np.nan) if seen_nan else np.float32(mx)
        for j in range(n):
            p[r, j] = p[r, j] - mn
    e = p.reshape(-1)
    vexp(e, e)
    for r in range(R):
        s[r] = _torch_row_sum(p[r], acc)


def scores_softmax(a: torch.Tensor, b: torch.Tensor, scale: float, rows: int, n: int):
    """The first (and only) key tile of an online softmax, whole: scores sc = (a + b) *
    scale ([rows, n], a and b flat, fp32 with the scale rounded to fp32, as torch's ops),
    p = exp(sc - max(sc)) per row (torch's exp), and each row's sum as torch's row sum.
    The running maximum starts at -inf, so the correction factor is 0 and the tile's
    merge leaves den = sum, acc = the weighted values: the caller divides. Returns (p
    [rows, n], sums [rows]), or None where the fused math or the row sum is not torch's
    here (the caller then runs the general tiles)."""
    if not (vml.AVAILABLE and _rowsum_ok()):
        return None
    p = np.empty((rows, n), np.float32)
    sums = np.empty(rows, np.float32)
    _scores_softmax1(_flat(a), _flat(b), np.float32(scale), p, sums, np.empty((4, 4, _LANES8), np.float32))
    return torch.from_numpy(p), torch.from_numpy(sums)


@njit(cache=True, nogil=True)
def _softmax_merge(den, acc, corr, s, v):
    R, dv = acc.shape
    for r in range(R):
        c = corr[r]
        den[r] = den[r] * c + s[r]
        for i in range(dv):
            acc[r, i] = acc[r, i] * c + v[r, i]


def softmax_merge(den: torch.Tensor, acc: torch.Tensor, corr: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> None:
    """In place: den = den * corr + s and acc = acc * corr + v (den, corr, s [..., 1];
    acc, v [..., dv]; each product rounded before the sum), an online softmax's update."""
    dv = acc.shape[-1]
    _softmax_merge(_flat(den), acc.numpy().reshape(-1, dv), _flat(corr), _flat(s), _array(v).reshape(-1, dv))


_cache_leave(_CACHE_PREV)
