"""The small per-token ops, fused: one numba call where torch would dispatch a chain of
elementwise ops (each ~3-10 us of dispatch for a few KB of arithmetic at decode).

Bit-identity with the torch chains they replace (tests/test_fused.py checks it) rests on
three facts: every function here does the same IEEE fp32 / fp64 operations in the same
order per element (a product is rounded before it is added: numba never contracts
``a + b * c`` into an fma without fast-math, which is never set); torch's rsqrt of a
double is 1 / sqrt correctly rounded; and whatever is not plain arithmetic stays
torch's: exp, tanh and log are torch's own vector-math routines, called from the
compiled pass where this process allows it (k3.model.vml), else by torch between two
compiled passes; the reductions that must match torch's order are torch's. Each
element is computed by one thread, so the results do not depend on the thread count.
"""

from __future__ import annotations

import weakref

import numba
import numpy as np
import torch
from numba import njit, prange

from llvmlite import ir
from numba import get_thread_id, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import vml
from .vml import sexp8, sexp16, vexp, vlog, vtanh
from ..quant.bf16 import (J_ADDR, J_N, J_OFF, J_X0, J_X1, LANES, _F32, _I16, _I32, _I64, _ISA, _V,
                          _as_f32_activations, _bf16_matrix, _data_ptr, _fma, _launch_t1, _threads, _row_ptr, _vfma, _vload,
                          _vstore, F32_ONLY, W_DTYPES, c_matrix, counted_loop,
                          described, empty64, for_each_nt, make_tile, run_bf16_jobs, widen_bf16_vec,
                          _i16_ptr, _t1_rows)
from ..quant.mxfp4 import _mxfp4_weight, run_mxfp4_jobs
from ..quant.mxfp4 import (_u8_ptr, perm_steps, split_evens_odds, t1_perm,
                           _t1_rows as _mx_t1_rows)
from ..quant import region
from ..quant.kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.quant.kcache.folder(), until the end

#: below this much work (multiply-adds, state elements) a parallel op runs as its serial
#: twin on the calling thread (``_run``): waking the pool cost more than the second core
#: gave (docs/PERFORMANCE.md, "Per-token overhead"); results do not depend on it
_SERIAL = 1 << 18
#: what one element of a KDA recurrent state weighs against that limit: each step reads
#: and writes the whole state (two passes, from beyond L2), so even a small model's state
#: goes faster split over both cores' caches (docs/PERFORMANCE.md, fourteenth session)
_STATE_COST = 8


@njit(cache=True, nogil=True)
def _weighted_sum(c, w, out):
    T, k, d = c.shape
    for t in range(T):
        w0 = w[t, 0]
        for i in range(d):
            out[t, i] = c[t, 0, i] * w0
        for j in range(1, k):
            wj = w[t, j]
            for i in range(d):
                out[t, i] = out[t, i] + c[t, j, i] * wj


def weighted_sum(c: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """sum_j c[:, j] * wts[:, j] for c [T, k, d] (any strides), wts [T, k]: each product
    rounded, then added left to right (j = 0, 1, ...): the top-k order of the MoE, the
    source order of the Attention Residuals mix."""
    out = np.empty((c.shape[0], c.shape[2]), np.float32)
    _weighted_sum(c.numpy(), wts.numpy(), out)
    return torch.from_numpy(out)


@njit(cache=True, nogil=True)
def _all_finite(x):
    for i in range(x.size):
        v = x[i]
        if v - v != 0.0:                            # NaN for inf and NaN alike
            return False
    return True


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of the float32 tensor x is finite: one pass, no temporaries
    (torch's isfinite + all + bool is three dispatched ops and a mask)."""
    if x.dtype != torch.float32:
        return bool(torch.isfinite(x).all())
    return _all_finite(x.contiguous().view(-1).numpy())


@intrinsic
def _as_f32(typingctx, v):
    """A float32 as it is, or bf16 bits (int16 / uint16) widened to float32 (exact)."""
    if v == types.float32:
        return types.float32(v), lambda context, builder, sig, args: args[0]
    if v in (types.int16, types.uint16):
        def codegen(context, builder, sig, args):
            u = builder.shl(builder.zext(args[0], _I32), _I32(16))
            return builder.bitcast(u, _F32)
        return types.float32(v), codegen
    return None


@njit(cache=True, nogil=True)
def _norm_rows(x, eps, w, mean, out):
    R, d = x.shape
    gain = w.shape[0] > 0
    d8 = d - d % 8
    for r in range(R):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
        for i in range(0, d8, 8):                   # lane l: the squares of x[i], i = l mod 8
            v0 = np.float64(x[r, i])
            v1 = np.float64(x[r, i + 1])
            v2 = np.float64(x[r, i + 2])
            v3 = np.float64(x[r, i + 3])
            v4 = np.float64(x[r, i + 4])
            v5 = np.float64(x[r, i + 5])
            v6 = np.float64(x[r, i + 6])
            v7 = np.float64(x[r, i + 7])
            a0 += v0 * v0
            a1 += v1 * v1
            a2 += v2 * v2
            a3 += v3 * v3
            a4 += v4 * v4
            a5 += v5 * v5
            a6 += v6 * v6
            a7 += v7 * v7
        for i in range(d8, d):
            v = np.float64(x[r, i])
            m = i - d8
            if m == 0:
                a0 += v * v
            elif m == 1:
                a1 += v * v
            elif m == 2:
                a2 += v * v
            elif m == 3:
                a3 += v * v
            elif m == 4:
                a4 += v * v
            elif m == 5:
                a5 += v * v
            else:
                a6 += v * v
        s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
        if mean:
            s = s / d
        inv = np.float32(1.0 / np.sqrt(s + eps))
        for i in range(d):
            y = x[r, i] * inv
            out[r, i] = y * _as_f32(w[i]) if gain else y


_NO_GAIN = np.empty(0, np.float32)


@njit(cache=True, nogil=True)
def _add_norm(h, a, eps, w, s, out):
    hf, af, sf = h.reshape(-1), a.reshape(-1), s.reshape(-1)
    for i in range(sf.size):
        sf[i] = hf[i] + af[i]
    _norm_rows(s, eps, w, True, out)


def add_norm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor | None, eps: float):
    """(h + a, rms_norm(h + a) times the gain w): a residual add and the pre-norm of the
    next sublayer in one compiled call (each sum rounded, then norm_rows' arithmetic).
    h, a float32 [T, d] of one shape."""
    if h.shape != a.shape:
        raise ValueError(f"add_norm: {tuple(h.shape)} and {tuple(a.shape)} differ")
    hn, an = _array(h), _array(a)
    hn2 = hn.reshape(-1, hn.shape[-1])
    s = np.empty(hn2.shape, np.float32)
    out = np.empty(hn2.shape, np.float32)
    _add_norm(hn2, an.reshape(hn2.shape), float(eps), _NO_GAIN if w is None else described(w, _gain_array), s, out)
    return torch.from_numpy(s.reshape(hn.shape)), torch.from_numpy(out.reshape(hn.shape))


def _f32_gain(w: torch.Tensor) -> np.ndarray:
    """A norm gain widened to fp32 (exact): what the regions take whatever the stored
    dtype, so that each is compiled once (norm_rows widens a bf16 gain the same way)."""
    return w.reshape(-1).to(torch.float32).numpy()


def _gain_array(w: torch.Tensor) -> np.ndarray:
    """A norm gain as the kernel reads it: bf16 bits as stored (int16), else fp32."""
    w = w.reshape(-1)
    return (w.view(torch.int16) if w.dtype == torch.bfloat16 else w.to(torch.float32)).numpy()


def norm_rows(x: torch.Tensor, eps: float, w: torch.Tensor | None = None, mean: bool = True) -> torch.Tensor:
    """An RMS norm (``mean``: x * fp32(rsqrt(mean(x^2) + eps))) or an L2 norm (the sum
    instead of the mean) per row of x fp32 [..., d], times the gain w [d] (fp32 or bf16,
    read as stored) if given. Returns a new contiguous tensor shaped like x.

    The statistic is fp64 (each square exact) in one fixed order: eight lanes, lane l
    the squares of the elements i = l mod 8 added in ascending i from +0.0, then
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); the mean divides by d; the
    inverse root is 1 / sqrt in fp64, rounded once to fp32. (torch's fp64 reduction, used
    before, has a CPU-dependent order; the fp32 factor came out the same on every row
    tried, docs/ARCHITECTURE.md.)"""
    if x.dtype != torch.float32:
        raise ValueError(f"norm_rows takes float32 activations, got {x.dtype}")
    xn = (x if x.is_contiguous() else x.contiguous()).numpy()  # numpy's reshapes cost less than torch's
    x2 = xn.reshape(-1, xn.shape[-1])
    out = np.empty(x2.shape, np.float32)
    wn = _NO_GAIN if w is None else described(w, _gain_array)
    _norm_rows(x2, float(eps), wn, mean, out)
    return torch.from_numpy(out.reshape(xn.shape))


@njit(cache=True, nogil=True, inline="always")
def _kda_head(S0, eg, k, beta, v, q, S, o, h):
    """Head h of the recurrence (kda_recurrent_steps): its state (dk x dv) stays in
    cache for all T."""
    T, H, dk = k.shape
    dv = v.shape[2]
    u = np.empty(dv, np.float32)
    d = np.empty(dv, np.float32)
    src = S0
    for t in range(T):
        for b in range(dv):
            u[b] = np.float32(0.0)
            o[t, h, b] = np.float32(0.0)
        for a in range(dk):         # decay, and u = S'^T k
            e = eg[t, h, a]
            ka = k[t, h, a]
            for b in range(dv):
                x = src[h, a, b] * e
                S[h, a, b] = x
                u[b] = u[b] + x * ka
        bt = beta[t, h]
        for b in range(dv):
            d[b] = bt * (v[t, h, b] - u[b])
        for a in range(dk):         # the rank-1 update, and o = S^T q
            ka = k[t, h, a]
            qa = q[t, h, a]
            for b in range(dv):
                x = S[h, a, b] + ka * d[b]
                S[h, a, b] = x
                o[t, h, b] = o[t, h, b] + x * qa
        src = S


@njit(parallel=True, cache=True, nogil=True)
def _kda_recurrent(S0, eg, k, beta, v, q, S, o):
    for h in prange(k.shape[1]):
        _kda_head(S0, eg, k, beta, v, q, S, o, h)


@njit(cache=True, nogil=True)
def _kda_recurrent_serial(S0, eg, k, beta, v, q, S, o):
    for h in range(k.shape[1]):
        _kda_head(S0, eg, k, beta, v, q, S, o, h)


def _run(kernel, serial, n, *args):
    """kernel(*args) on the kernels' threads, or its serial twin (the same compiled
    block code) for work below _SERIAL: k3.quant.bf16._launch_t1's choice."""
    _launch_t1(kernel, serial, n, _SERIAL, *args)


def _state_into(into, S0, shape) -> torch.Tensor:
    """``into`` when it can take a new recurrent state of ``shape`` (a contiguous fp32
    buffer of that shape, not S0 itself), else a new tensor."""
    if (into is None or tuple(into.shape) != tuple(shape) or into.dtype != torch.float32
            or not into.is_contiguous() or (S0 is not None and into.data_ptr() == S0.data_ptr())):
        return torch.empty(*shape)
    return into


def kda_recurrent_steps(S0: torch.Tensor, eg: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, v: torch.Tensor,
                        q: torch.Tensor, into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA recurrence token by token, in one call: for t < T, per head,
    S' = S * eg[t] (per row), u = S'^T k[t], S = S' + k[t] (beta[t] (v[t] - u))^T,
    o[t] = S^T q[t]. S0 [H, dk, dv] is never written (snapshots hold references to it);
    eg = exp(g) [T, H, dk], k and q [T, H, dk], beta [T, H], v [T, H, dv]. Returns
    (o [T, H, dv], the new state: ``into`` when that is a contiguous fp32 buffer of the
    state's shape other than S0, else a new tensor).

    The two contractions are each product rounded, then added in ascending row order
    from +0.0 (u[b] = (((0 + S'[0,b] k[0]) + S'[1,b] k[1]) + ...)); the update rounds
    beta (v - u), then k times it, then the sum. One fixed order per element, whatever
    the CPU, the thread count or how many tokens share the call (BLAS's order depends on
    all three)."""
    T, H, dk = k.shape
    dv = v.shape[2]
    into = _state_into(into, S0, (H, dk, dv))
    S = into.numpy()
    o = np.empty((T, H, dv), np.float32)
    if T == 0:
        S[...] = S0.numpy()
    else:
        _run(_kda_recurrent, _kda_recurrent_serial, _STATE_COST * T * S.size, S0.numpy(), eg.numpy(), k.numpy(),
             beta.numpy(), v.numpy(), q.numpy(), S, o)
    return torch.from_numpy(o), into


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


@njit(cache=True, nogil=True, inline="always")
def _dots_block(b, x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, M, N, K, lim, causal, out, og, ostride, acc):
    # block b (batch g, query tile i0) of _dots, with the thread's scratch acc
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
def _dots(x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, G, M, N, K, lim, causal, out, og, ostride, nth):
    # out[g*og + i*ostride + j] = dot(x[xr0 + g*xrg + i, xo0 + g*xog + k], w[wr0 + g*wrg + j, wo0 + g*wog + k])
    # over k < K in the canonical order (64 lanes, tree, then the K % 64 tail in order);
    # causal: row i only needs j <= lim + i (later j are left as they are)
    acc_all = empty64(nth * _NTA * _NRA * LANES).reshape((nth, _NTA * _NRA, LANES))   # a thread's rows own their lines
    for b in prange(G * ((M + _NTA - 1) // _NTA)):
        _dots_block(b, x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, M, N, K, lim, causal, out, og, ostride,
                    acc_all[get_thread_id()])


@njit(cache=True, nogil=True)
def _dots_serial(x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, G, M, N, K, lim, causal, out, og, ostride, nth):
    acc = np.empty((_NTA * _NRA, LANES), np.float32)
    for b in range(G * ((M + _NTA - 1) // _NTA)):
        _dots_block(b, x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, M, N, K, lim, causal, out, og, ostride, acc)


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
def _prods_block(b, x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, M, N, K, lim, lim_on, out, og, ostride):
    # block b (batch g, row tile i0) of _prods
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
def _prods(x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, G, M, N, K, lim, lim_on, out, og, ostride):
    # out[g*og + i*ostride + n] = fma chain over k < K (ascending, from +0) of
    # x[xr0 + g*xrg + i, xo0 + g*xog + k] * w[wr0 + g*wrg + k, wo0 + g*wog + n];
    # lim_on: row i only sums k <= lim + i, x being zero beyond (+0 lanes stay as they are)
    for b in prange(G * ((M + _NTN - 1) // _NTN)):
        _prods_block(b, x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, M, N, K, lim, lim_on, out, og, ostride)


@njit(cache=True, nogil=True)
def _prods_serial(x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, G, M, N, K, lim, lim_on, out, og, ostride):
    for b in range(G * ((M + _NTN - 1) // _NTN)):
        _prods_block(b, x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, M, N, K, lim, lim_on, out, og, ostride)


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
        _run(_dots, _dots_serial, G * M * N * max(K, 1), xn, *x_at, wn, *w_at, G, M, N, K,
             0 if causal is None else causal, causal is not None, out, a, b, _threads()[0]())
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
        _run(_prods, _prods_serial, G * M * N * max(K, 1), _rows2(x), *x_at, _rows2(w, bf16=True), *w_at, G, M, N, K,
             -1 if causal is None else causal, causal is not None, out, a, b)
    return torch.from_numpy(out)


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


# ------------------------------------------------------------------ gates, GLUs, router
# exp and tanh must be torch's (its vectorised exp / tanh give bits numba's libm does
# not, and a position-independent result, k3.model.ops). Where k3.model.vml can call
# torch's own routines from compiled code (USE_VML), each chain below is ONE compiled
# call; otherwise one compiled pass writes their arguments side by side in one buffer,
# one torch call per function runs over its part of that buffer, and one compiled pass
# combines the results. Either way: the same IEEE operations in the same order per
# element as the torch chain (numba rounds every float32 operation; the scalars are
# passed as float32, as torch casts a Python number to the tensor's dtype).

#: call torch's exp / tanh / log from the compiled passes (tests switch it off to check
#: that both forms give the same bits)
USE_VML = vml.AVAILABLE


@njit(cache=True, nogil=True)
def _neg(x, out):
    for i in range(x.size):
        out[i] = -x[i]


@njit(cache=True, nogil=True)
def _sigmoid_post(e, out):
    one = np.float32(1.0)
    for i in range(e.size):
        out[i] = one / (e[i] + one)


@njit(cache=True, nogil=True)
def _silu_post(x, e, out):
    one = np.float32(1.0)
    for i in range(x.size):
        out[i] = x[i] / (e[i] + one)


@njit(cache=True, nogil=True)
def _gate_post(o, e, out):
    one = np.float32(1.0)
    for i in range(o.size):
        out[i] = o[i] * (one / (e[i] + one))


@njit(cache=True, nogil=True)
def _sigmoid1(x, out):
    _neg(x, out)
    vexp(out, out)
    _sigmoid_post(out, out)                             # each element reads itself first


@njit(cache=True, nogil=True)
def _silu1(x, out):
    _neg(x, out)
    vexp(out, out)
    _silu_post(x, out, out)


@njit(cache=True, nogil=True)
def _gate1(o, z, out):
    _neg(z, out)
    vexp(out, out)
    _gate_post(o, out, out)


def _array(x) -> np.ndarray:
    """x (a float32 tensor or array) as a C-contiguous float32 numpy array of its shape
    (a view when x is contiguous)."""
    if type(x) is np.ndarray:
        if x.dtype != np.float32:
            raise ValueError(f"the fused ops take float32 activations, got numpy {x.dtype}")
        return np.ascontiguousarray(x)
    if x.dtype != torch.float32:
        raise ValueError(f"the fused ops take float32 activations, got {x.dtype}")
    return (x if x.is_contiguous() else x.contiguous()).numpy()


def _flat(x) -> np.ndarray:
    """_array(x) as 1-D."""
    return _array(x).reshape(-1)


@njit(cache=True, nogil=True)
def _neg_exp(x, out):
    _neg(x, out)
    vexp(out, out)


def _exp_neg(xn: np.ndarray) -> np.ndarray:
    """exp(-x) for a flat float32 array: the negation compiled, torch's exp in place
    (the form without USE_VML)."""
    e = np.empty_like(xn)
    _neg(xn, e)
    torch.from_numpy(e).exp_()
    return e


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) per element: -x, torch's exp, + 1, 1 / that (in that order)."""
    xn = _flat(x)
    out = np.empty_like(xn)
    if USE_VML:
        _sigmoid1(xn, out)
    else:
        _sigmoid_post(_exp_neg(xn), out)
    return torch.from_numpy(out.reshape(x.shape))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) per element."""
    xn = _flat(x)
    out = np.empty_like(xn)
    if USE_VML:
        _silu1(xn, out)
    else:
        _silu_post(xn, _exp_neg(xn), out)
    return torch.from_numpy(out.reshape(x.shape))


def gate(o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(z) per element (o and z of one shape): an output gate."""
    on, zn = _flat(o), _flat(z)
    if on.size != zn.size:
        raise ValueError(f"gate: {tuple(o.shape)} and {tuple(z.shape)} differ")
    out = np.empty_like(on)
    if USE_VML:
        _gate1(on, zn, out)
    else:
        _gate_post(on, _exp_neg(zn), out)
    return torch.from_numpy(out.reshape(o.shape))


# ------------------------------------------------------------------ an expert group's FFN
# The GLU of a group's gate | up output gu = [gate (m) | up (m)] into h (m), its scratch
# in gu and h themselves: the operations of situ_glu / silu_glu in the same order per
# element (tanh(g / beta) and tanh(u / lb) in place in gu, exp(-g) in h).
@njit(cache=True, nogil=True)
def _glu_pre(gu, h, situ, beta, lb, has_lb):
    m = h.size
    g, u, hf = gu[:m], gu[m:2 * m], h.reshape(-1)
    for i in range(m):
        hf[i] = -g[i]
    if situ:
        for i in range(m):
            g[i] = g[i] / beta
        if has_lb:
            for i in range(m):
                u[i] = u[i] / lb


@njit(cache=True, nogil=True)
def _glu_post(gu, h, situ, beta, lb, has_lb):
    m = h.size
    g, u, hf = gu[:m], gu[m:2 * m], h.reshape(-1)
    one = np.float32(1.0)
    if not situ:
        for i in range(m):
            hf[i] = (g[i] / (hf[i] + one)) * u[i]
        return
    for i in range(m):
        a = (g[i] * beta) * (one / (hf[i] + one))
        hf[i] = a * (u[i] * lb if has_lb else u[i])


@njit(cache=True, nogil=True)
def _glu_into(gu, h, situ, beta, lb, has_lb):
    _glu_pre(gu, h, situ, beta, lb, has_lb)
    if situ:
        m = h.size
        t = gu[:2 * m] if has_lb else gu[:m]
        vtanh(t, t)
    hf = h.reshape(-1)
    vexp(hf, hf)
    _glu_post(gu, h, situ, beta, lb, has_lb)


def _glu(gu: np.ndarray, h: np.ndarray, situ: bool, beta, lb, has_lb: bool) -> None:
    """h = GLU(gate | up = gu) (float32, gu flat of 2 * h.size; gu is overwritten): one
    compiled call with USE_VML, else torch's tanh / exp between two compiled passes."""
    if USE_VML:
        _glu_into(gu, h, situ, beta, lb, has_lb)
        return
    _glu_pre(gu, h, situ, beta, lb, has_lb)
    if situ:
        torch.from_numpy(gu[:2 * h.size if has_lb else h.size]).tanh_()
    torch.from_numpy(h.reshape(-1)).exp_()
    _glu_post(gu, h, situ, beta, lb, has_lb)


def _glu_params(situ: tuple | None) -> tuple:
    """(SiTU?, beta, linear_beta, has linear_beta) as the GLU kernels take them, from
    situ = (beta, linear_beta or None), or None for SiLU-GLU."""
    has_lb = situ is not None and situ[1] is not None
    return (situ is not None, np.float32(situ[0] if situ is not None else 1.0),
            np.float32(situ[1] if has_lb else 1.0), has_lb)


def _gate_up(g, u) -> np.ndarray:
    """gate | up, flat, as the GLU kernels read them (g and u of one size)."""
    gn, un = _flat(g), _flat(u)
    if gn.size != un.size:
        raise ValueError(f"GLU: gate {tuple(g.shape)} and up {tuple(u.shape)} differ")
    return np.concatenate((gn, un))


def _glu_of(g, u, situ: tuple | None) -> torch.Tensor:
    gu = _gate_up(g, u)
    out = np.empty(gu.size // 2, np.float32)
    _glu(gu, out, *_glu_params(situ))
    return torch.from_numpy(out.reshape(g.shape))


@njit(cache=True, nogil=True)
def _moe_mix1(c, wts, r, norm, eps, nw, gu, h, situ, beta, lb, has_lb):
    _weighted_sum(c, wts, r)
    if norm:
        _norm_rows(r, eps, nw, True, r)               # in place: a row's statistic comes first
    if gu.size:
        _glu_into(gu, h, situ, beta, lb, has_lb)


def moe_mix(contrib: torch.Tensor, wts: torch.Tensor, norm_w: torch.Tensor | None, eps: float,
            shared_gu, situ: tuple | None):
    """The MoE block's compiled steps between its kernel calls, in one call where the
    fused math runs: the routed contributions [T, k, d] summed with the router weights
    (weighted_sum), RMS-normed with norm_w when given (norm_rows), and the shared expert's
    GLU of its gate and up projections shared_gu = (g, u) when given (SiTU-GLU with situ =
    (beta, linear_beta), else SiLU-GLU). Returns (r [T, d], the GLU [T, inter] or None),
    the bits of those calls one by one."""
    if not USE_VML:
        r = weighted_sum(contrib, wts)
        if norm_w is not None:
            r = norm_rows(r, eps, norm_w)
        if shared_gu is None:
            return r, None
        return r, _glu_of(*shared_gu, situ)
    T, _, d = contrib.shape
    r = np.empty((T, d), np.float32)
    if shared_gu is None:
        gu, h = _NO_GAIN, np.empty((0, 0), np.float32)
    else:
        gu, h = _gate_up(*shared_gu), np.empty(shared_gu[0].shape, np.float32)
    _moe_mix1(contrib.numpy(), wts.numpy(), r, norm_w is not None, float(eps),
              _NO_GAIN if norm_w is None else described(norm_w, _gain_array), gu, h, *_glu_params(situ))
    return torch.from_numpy(r), (None if shared_gu is None else torch.from_numpy(h))


def silu_glu(g, u) -> torch.Tensor:
    """silu(g) * u per element (g and u float32 tensors or arrays of one shape):
    (g / (exp(-g) + 1)) * u, each operation rounded in that order, exp torch's."""
    return _glu_of(g, u, None)


def situ_glu(g, u, beta: float, linear_beta: float | None) -> torch.Tensor:
    """((beta * tanh(g / beta)) * sigmoid(g)) * (linear_beta * tanh(u / linear_beta))
    per element (the last factor u itself when linear_beta is None), each operation
    rounded in that order, tanh and exp torch's (sigmoid(g) = 1 / (exp(-g) + 1)). g, u:
    float32 tensors or arrays of one shape."""
    return _glu_of(g, u, (beta, linear_beta))


def expert_descriptors(fmt: str, ws) -> np.ndarray:
    """The checked kernel descriptors of matrices ``ws`` (each kept per live weight
    object, ``described``) of format ``fmt`` as one int64 array [len(ws), ...]."""
    describe = _bf16_matrix if fmt == "bf16" else _mxfp4_weight
    return np.array([described(w, describe) for w in ws], np.int64)


_ONE_ROWS: dict[int, np.ndarray] = {}


def _one_row(G: int) -> np.ndarray:
    """The rows table [G, 2] of G experts that all read the one token's row (0, 1): the
    decode step's, made once per G (``_ffn_jobs`` only reads it; left writeable, since a
    read-only array is another numba type: a compile in the first decode step)."""
    r = _ONE_ROWS.get(G)
    if r is None:
        r = _ONE_ROWS[G] = np.tile(np.array([0, 1], np.int64), (G, 1))
    return r


def expert_ffn(fmt: str, x, w1s, w3s, w2s, rows, situ: tuple | None, descs: np.ndarray | None = None) -> np.ndarray:
    """A group of routed experts: expert g multiplies rows rows[g] = (x0, x1) of x
    [M, d] (float32) by its gate and up matrices (w1s[g], w3s[g], of one out-size
    ``inter``), the GLU (SiTU-GLU with situ = (beta, linear_beta), else SiLU-GLU), then
    its down matrix w2s[g]. Returns the down outputs flat, row-major [pairs, d] in the
    order of the rows (expert 0's rows first). ``fmt``: "bf16" or "mxfp4", every weight
    in it. ``descs``: the matrices' descriptors [G, 3, ...] (per expert,
    ``expert_descriptors`` of its w1, w3 and w2) where the caller keeps them per expert.

    Two kernel calls and the GLU between them (``_glu``, as silu_glu / situ_glu). It works
    in place in gate | up and its output (no scratch beside them), gate | up is dropped
    before the down call, and every element has the bits of one linear / GLU call per
    expert (tests/test_fused.py). (The kernels stay calls from Python here: a compiled
    caller gets each kernel's machine code generated again into it. One token's
    experts take ``moe_decode`` instead, whose region does compile the row code into
    it, once, at load.)"""
    xn, _ = _as_f32_activations(x)
    M, K = xn.shape
    G = len(w1s)
    if G == 0:
        return np.empty(0, np.float32)
    if descs is None:
        descs = expert_descriptors(fmt, [w for e in zip(w1s, w3s, w2s) for w in e]).reshape(G, 3, -1)
    d = descs
    r = _one_row(G) if M == 1 and rows == [(0, 1)] * G else np.array(rows, np.int64).reshape(G, 2)
    jobs13 = np.empty((2 * G, J_ADDR + d.shape[2] - 2), np.int64)
    jobs2 = np.empty((G, jobs13.shape[1]), np.int64)
    n13, n2, n, tmax, bad, why = _ffn_jobs(d, r, M, K, jobs13, jobs2)
    if why == 2:
        raise ValueError(f"expert_ffn: expert {bad}'s rows {tuple(rows[bad])} lie outside the activation's {M} rows")
    if why == 1:
        w = (w1s, w3s, w2s)[bad // G][bad % G]
        raise ValueError(f"expert_ffn: the {('gate', 'up', 'down')[bad // G]} matrix of expert {bad % G} "
                         f"({_shape_of(w)}) does not chain: gate and up must be [n, {K}], down [{K}, n], one n")
    inter = int(d[0, 0, 0])
    jobs13, jobs2 = jobs13[:n13], jobs2[:n2]
    run = run_bf16_jobs if fmt == "bf16" else run_mxfp4_jobs
    gu = np.empty(2 * n * inter, np.float32)
    run(xn, jobs13, gu, 2 * n * inter * K, tmax)
    h = np.empty((n, inter), np.float32)
    _glu(gu, h, *_glu_params(situ))
    del gu
    y = np.empty(n * K, np.float32)
    run(h, jobs2, y, n * K * inter, tmax)
    return y


@njit(cache=True, nogil=True, inline="always")
def _mx_input(x, mx, P, xe, xo, xep, xop):
    """Where the experts are MXFP4 (``mx``): x's evens and odds, in the one-token
    decode's lane order too where rows of P bytes read that."""
    if mx:
        split_evens_odds(x, xe, xo)
        if t1_perm(P):
            perm_steps(xe, xo, xep, xop)


@njit(cache=True, nogil=True)
def _chains(d, K):
    """Whether expert descriptors d [G, 3, ncols] chain on K input features: gate and up
    [n, K], down [K, n], one n for every expert (``_ffn_jobs``' check)."""
    na = d.shape[2] - 1
    inter = d[0, 0, 0]
    for g in range(d.shape[0]):
        for h in range(3):
            if d[g, h, 0] != (K if h == 2 else inter) or d[g, h, na] != (inter if h == 2 else K):
                return False
    return inter > 0


@njit(cache=True, nogil=True)
def _expert_matrix(dd, x2, xe, xo, xep, xop, row, out, off):
    """Every row of one expert matrix (descriptor dd: bf16 (n, address, K) or mxfp4 (n,
    packed, scale, 2P)) times row ``row`` of x2 [M, K] (split into xe, xo, xep, xop for
    mxfp4) into out[off:], by the one-token kernels' own row code. (Callers pass row
    as a variable, never a constant: numba compiles a function again for each constant
    argument it is called with.)"""
    na = dd.shape[0] - 1
    N, K = dd[0], dd[na]
    if na == 2:
        _t1_rows(x2, row, numba.carray(_i16_ptr(dd[1]), (N, K)), out, off, 0, N)
    else:
        P = K // 2
        _mx_t1_rows(xe, xo, xep, xop, row, numba.carray(_u8_ptr(dd[1]), (N, P)),
                    numba.carray(_u8_ptr(dd[2]), (N, P // 16)), out, off, 0, N)


@njit(cache=True, nogil=True)
def _moe_decode1_part(c, z, d, wts, norm, eps, nw, gu_s, situ, beta, lb, has_lb, tab, mode, y, base, mx, gu, hx,
                      contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop, fl):
    """Thread c's part of ``_moe_decode1`` (a plain function: the region's loop body,
    compiled once, not into the parallel loop's lowering)."""
    G, inter, dz, n_out = d.shape[0], d[0, 0, 0], z.shape[1], y.size
    for j in range(2):
        h = c if j == 0 else 1 - c
        if region.claim(fl, h):          # gates (h = 0) or ups (h = 1), gate | up as expert_ffn lays them
            for g in range(G):
                _expert_matrix(d[g, h], z, ze, zo, zep, zop, np.int64(0), gu, (h * G + g) * inter)
            region.finish(fl, h)
    region.wait(fl, 0)
    region.wait(fl, 1)
    if region.claim(fl, 2):
        _glu_into(gu, hx, situ, beta, lb, has_lb)
        _mx_input(hx, mx, P3, he, ho, hep, hop)
        region.finish(fl, 2)
    region.wait(fl, 2)
    gm = G // 2
    cf = contrib.reshape(-1)
    for j in range(2):
        h = c if j == 0 else 1 - c
        if region.claim(fl, 3 + h):
            for g in range(0 if h == 0 else gm, gm if h == 0 else G):
                _expert_matrix(d[g, 2], hx, he, ho, hep, hop, g, cf, g * dz)
            region.finish(fl, 3 + h)
    region.wait(fl, 3)
    region.wait(fl, 4)
    if region.claim(fl, 5):
        _moe_mix1(contrib, wts, r, norm, eps, nw, gu_s, hs, situ, beta, lb, has_lb)
        region.finish(fl, 5)
    region.wait(fl, 5)
    region.bf16_step(tab, 0, tab.shape[0], z.reshape(-1), work, y, fl, 6, c)
    if region.claim(fl, 8):
        if mode == 1:
            for t in range(n_out):
                y[t] = y[t] + down[t]
        elif mode == 2:
            for t in range(n_out):
                y[t] = r[0, t] + down[t]
        elif mode == 3:
            for t in range(n_out):
                y[t] = r[0, t]
        if base.size:    # the residual stream's add (h + ffn, or K3's P + ffn)
            for t in range(n_out):
                y[t] = base[t] + y[t]
        region.finish(fl, 8)
    region.wait(fl, 8)


@njit(cache=True, nogil=True)
def _moe_scratch(G, inter, dz, inter_s, n_out, mx):
    """The workspace of ``_moe_decode1_part`` for G experts of ``inter`` rows on dz inputs
    (the latent), a shared expert of inter_s rows and n_out outputs (mx: MXFP4 experts,
    whose inputs are split into even and odd elements)."""
    gu = np.empty(2 * G * inter, np.float32)
    hx = np.empty((G, inter), np.float32)
    contrib = np.empty((1, G, dz), np.float32)
    work = np.empty(dz + inter_s + n_out, np.float32)
    wp = work.ctypes.data
    r = numba.carray(_f32p(wp), (1, dz))
    hs = numba.carray(_f32p(wp + 4 * dz), (1 if inter_s else 0, inter_s))
    down = numba.carray(_f32p(wp + 4 * (dz + inter_s)), (n_out,))
    P1, P3 = (dz // 2, inter // 2) if mx else (0, 0)
    ze, zo = empty64(P1).reshape((1, P1)), empty64(P1).reshape((1, P1))
    he, ho = empty64(G * P3).reshape((G, P3)), empty64(G * P3).reshape((G, P3))
    zep, zop = (empty64(P1).reshape((1, P1)), empty64(P1).reshape((1, P1))) if mx and t1_perm(P1) else (ze, zo)
    hep, hop = (empty64(G * P3).reshape((G, P3)), empty64(G * P3).reshape((G, P3))) if mx and t1_perm(P3) \
        else (he, ho)
    return gu, hx, contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop


@njit(cache=True, nogil=True)
def _end_moe(c, fl, dall, ids, wts, z, gu_s, norm, eps, nw, situ, beta, lb, has_lb, tab, mode, y, base, dsh, sc):
    """Thread c's part of an MoE block run at the end of a mixer's region (``_end_part``),
    every routed expert of the layer at hand (descriptors dall [E, 3, ...]): the chosen
    experts' descriptors and z's split (one thread), then ``_moe_decode1``'s steps (its
    flags ``fl``, its workspace ``sc`` from ``_moe_scratch``)."""
    gu, hx, contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop = sc
    mx = dall.shape[2] == 4
    if region.claim(fl, 9):
        for j in range(dsh.shape[0]):
            dsh[j] = dall[ids[0, j]]
        _mx_input(z, mx, P1, ze, zo, zep, zop)
        region.finish(fl, 9)
    region.wait(fl, 9)
    _moe_decode1_part(c, z, dsh, wts, norm, eps, nw, gu_s, situ, beta, lb, has_lb, tab, mode, y, base, mx, gu, hx,
                      contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop, fl)


@njit(parallel=True, cache=True, nogil=True)
def _moe_decode1(z, d, wts, norm, eps, nw, gu_s, inter_s, situ, beta, lb, has_lb, tab, mode, y, base):
    """moe_decode's region: the experts' gate and up products (gates on one half, ups on
    the other), their GLU (one thread), the down products (the experts in two halves),
    ``_moe_mix1`` (one thread), the table's BF16 rows (latent up-projection, shared
    expert's down projection: each in halves), the sum (one thread). ``mode``: y is the
    up-projection (0), plus the shared expert's down (1), the mix plus it (2), the mix (3);
    then plus ``base`` where it is not empty. Returns False, having done nothing, where
    the descriptors do not chain on z (``_chains``)."""
    G, inter, dz, n_out = d.shape[0], d[0, 0, 0], z.shape[1], y.size
    if not _chains(d, dz) or d.shape[2] == 4 and (dz % 2 or inter % 2):
        return False
    mx = d.shape[2] == 4
    gu, hx, contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop = _moe_scratch(
        G, inter, dz, inter_s, n_out, mx)
    _mx_input(z, mx, P1, ze, zo, zep, zop)
    fl = region.flags(9)
    for i in prange(2):
        _moe_decode1_part(np.int64(i), z, d, wts, norm, eps, nw, gu_s, situ, beta, lb, has_lb, tab, mode, y, base, mx,
                          gu, hx, contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop, fl)
    return True


def moe_decode(z, descs: np.ndarray, wts, norm_w, eps: float, shared_gu, situ: tuple | None, up_w, down_w,
               base: torch.Tensor | None = None):
    """An MoE block's one-token step after the router and the expert fetch, in ONE
    parallel region (k3.quant.region): the routed experts (descriptors ``descs`` [k, 3,
    ...] in top-k order, every expert of one kernel format: ``expert_ffn``'s products
    and GLU), ``moe_mix`` (their weighted sum wts [1, k], the latent norm with norm_w,
    the shared expert's GLU of shared_gu = (gate, up) [1, inter], or gate | up as one
    flat array), the latent up-projection ``up_w`` (bf16 [d, latent]) and the shared
    expert's down projection ``down_w`` (bf16 [d, inter]) where the model has them, and
    their sum, plus ``base`` [1, d] where given (the residual stream: h + the FFN): the
    bits of those calls one by one (each product by the one-token kernels' row code).
    z: the experts' input [1, latent] (fp32). Returns y [1, d], or None where this is
    not the path (no fused math, not one token, projections not contiguous bf16
    matrices, descriptors that do not chain on z)."""
    if not USE_VML or z.dim() != 2 or z.shape[0] != 1 or descs.ndim != 3 or descs.shape[0] == 0:
        return None
    zn = _array(z)
    dz = zn.shape[1]
    gu = _NO_GAIN if shared_gu is None else shared_gu if type(shared_gu) is np.ndarray else _gate_up(*shared_gu)
    inter_s = gu.size // 2
    if down_w is None:   # no shared expert: nothing to keep the table under, made each call
        p = _moe_plan_fill(_Plan(), [up_w, down_w], dz, inter_s)
    else:
        p = _layer_plan(_MOE_PLANS, [up_w, down_w], (dz, inter_s), _moe_plan_fill)
    if p is None or p.tab is None or (down_w is None) != (shared_gu is None):
        return None
    y = np.empty(p.n_out, np.float32)
    bn = _NO_GAIN if base is None else _flat(base)
    if bn.size not in (0, p.n_out):
        return None
    if not _moe_decode1(zn, descs, _array(wts), norm_w is not None, float(eps),
                        _NO_GAIN if norm_w is None else described(norm_w, _f32_gain), gu, inter_s,
                        *_glu_params(situ), p.tab, p.mode, y, bn):
        return None
    return torch.from_numpy(y).view(1, p.n_out)


#: id(the shared expert's down projection) -> moe_decode's table of the layer
_MOE_PLANS: dict = {}


def _moe_plan_fill(p: _Plan, mats, dz: int, inter_s: int) -> _Plan:
    """moe_decode's table of BF16 rows (latent up-projection, shared expert's down) and
    its mode, or tab None where the projections do not fit."""
    up_w, down_w = mats
    p.tab = None
    if any(w is not None and not _bf16_2d(w) for w in (up_w, down_w)):
        return p
    n_out = up_w.shape[0] if up_w is not None else dz
    if (up_w is not None and up_w.shape[1] != dz) or (down_w is not None and down_w.shape != (n_out, inter_s)):
        return p
    rows = []
    if up_w is not None:
        rows.append((dz, n_out, up_w.data_ptr(), 1, 0, 2, 0))
    if down_w is not None:
        rows.append((inter_s, n_out, down_w.data_ptr(), 1, dz, 1, dz + inter_s))
    p.mode = (1 if down_w is not None else 0) if up_w is not None else (2 if down_w is not None else 3)
    p.tab = np.array(rows, np.int64).reshape(len(rows), 7)
    p.n_out = n_out
    return p


def _shape_of(w) -> str:
    s = getattr(w, "shape", None)
    return f"shape {tuple(s)}" if s is not None else type(w).__name__


@njit(cache=True, nogil=True)
def _ffn_jobs(d, r, M, K, jobs13, jobs2):
    """expert_ffn's two job tables (J_* columns), as grouped_jobs would make them. d
    [G, 3, ncols]: per expert the descriptors (n, addresses..., in-features) of its gate,
    up and down matrices; r [G, 2]: each expert's rows of x [M, K]. Gate | up: every gate
    product, then every up product; down: the GLU's rows, expert by expert. Returns
    (gate | up jobs, down jobs, pairs, most rows of one expert, the first bad weight
    (3 * G numbering) or -1, why: 0 fine, 1 its shape does not chain, 2 rows outside x)."""
    G = r.shape[0]
    na = d.shape[2] - 1
    inter = d[0, 0, 0] if G > 0 else 0
    n = tmax = 0
    for g in range(G):
        if not 0 <= r[g, 0] <= r[g, 1] <= M:
            return 0, 0, 0, 0, g, 2
        n += r[g, 1] - r[g, 0]
        tmax = max(tmax, r[g, 1] - r[g, 0])
    for h in range(3):
        for g in range(G):
            if d[g, h, 0] != (K if h == 2 else inter) or d[g, h, na] != (inter if h == 2 else K):
                return 0, 0, 0, 0, h * G + g, 1
    j13 = j2 = 0
    for h in range(2):
        at = 0                                          # the pairs before expert g
        for g in range(G):
            x0, x1 = r[g, 0], r[g, 1]
            if x1 > x0 and inter > 0:
                jobs13[j13, J_N] = inter
                jobs13[j13, J_X0] = x0
                jobs13[j13, J_X1] = x1
                jobs13[j13, J_OFF] = (h * n + at) * inter
                for a in range(1, na):
                    jobs13[j13, J_ADDR + a - 1] = d[g, h, a]
                j13 += 1
            at += x1 - x0
    at = 0
    for g in range(G):
        c = r[g, 1] - r[g, 0]
        if c > 0 and K > 0:
            jobs2[j2, J_N] = K
            jobs2[j2, J_X0] = at
            jobs2[j2, J_X1] = at + c
            jobs2[j2, J_OFF] = at * K
            for a in range(1, na):
                jobs2[j2, J_ADDR + a - 1] = d[g, 2, a]
            j2 += 1
        at += c
    return j13, j2, n, tmax, -1, 0


@njit(cache=True, nogil=True)
def _greater(a, b):
    """The order of torch's descending sort: NaN above every number, -0.0 equal to +0.0."""
    return a > b or (a != a and b == b)


@njit(cache=True, nogil=True)
def _route_topk(e, bias, k, ids, wts):
    T, E = e.shape
    one = np.float32(1.0)
    has_bias = bias.shape[0] > 0
    s = np.empty(E, np.float32)
    key = np.empty(E, np.float32)
    for t in range(T):
        for i in range(E):
            s[i] = one / (e[t, i] + one)                   # the sigmoid
            key[i] = s[i] + bias[i] if has_bias else s[i]
        n = 0                                             # ids[t, :n] sorted, stable
        for i in range(E):
            if n == k and not _greater(key[i], key[ids[t, k - 1]]):
                continue
            p = min(n, k - 1)                             # insert after every key >= this one
            while p > 0 and _greater(key[i], key[ids[t, p - 1]]):
                ids[t, p] = ids[t, p - 1]
                p -= 1
            ids[t, p] = i
            n = min(n + 1, k)
        for j in range(k):
            wts[t, j] = s[ids[t, j]]


@njit(cache=True, nogil=True)
def _route_topk1(x, bias, k, ids, wts, e):
    _neg_exp(x, e)                                        # flat [T * E]
    _route_topk(e.reshape(ids.shape[0], -1), bias, k, ids, wts)


@njit(cache=True, nogil=True)
def _route_scale(wts, total, renorm, scale):
    T, k = wts.shape
    tiny = np.float32(1e-20)
    for t in range(T):
        d = total[t, 0] + tiny
        for j in range(k):
            wts[t, j] = (wts[t, j] / d if renorm else wts[t, j]) * scale


@njit(cache=True, nogil=True)
def _route_topk_sum(x, bias, k, ids, wts, e, scale, acc):
    """_route_topk1, then the weights divided by (their sum + 1e-20) (the sum as torch's
    row sum, _torch_row_sum), times scale: route_topk's renormalising form in one call."""
    _route_topk1(x, bias, k, ids, wts, e)
    T = ids.shape[0]
    total = np.empty((T, 1), np.float32)
    for t in range(T):
        total[t, 0] = _torch_row_sum(wts[t], acc)
    _route_scale(wts, total, True, scale)


def _f32_vector(b: torch.Tensor) -> np.ndarray:
    return b.reshape(-1).to(torch.float32).numpy()


def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, k: int, renorm: bool, scale: float):
    """The sigmoid router's choice (k3.model.moe.route) from the router logits [T, E]:
    scores = sigmoid(logits); the k largest of scores + bias (fp32, as stored widened)
    in descending order, equal keys in ascending expert id (a stable descending sort;
    NaN above every number, as torch sorts); their unbiased scores, divided by (their
    sum + 1e-20) when ``renorm`` (the sum torch's, over the k in that order), times
    ``scale``. Returns (ids [T, k] int64, weights [T, k] float32)."""
    T, E = logits.shape
    if not 0 < k <= E:
        raise ValueError(f"route_topk: k = {k} experts of {E}")
    bn = _NO_GAIN if bias is None else described(bias, _f32_vector)
    if bn.shape[0] not in (0, E):
        raise ValueError(f"route_topk: bias of {bn.shape[0]} experts, logits of {E}")
    ids = np.empty((T, k), np.int64)
    wts = np.empty((T, k), np.float32)
    if USE_VML and renorm and k >= _LANES8 and _rowsum_ok():  # the renormalising sum re-done: one call
        xn = _flat(logits)
        _route_topk_sum(xn, bn, k, ids, wts, np.empty_like(xn), np.float32(scale),
                        np.empty((4, 4, _LANES8), np.float32))
        return torch.from_numpy(ids), torch.from_numpy(wts)
    if USE_VML:
        xn = _flat(logits)
        _route_topk1(xn, bn, k, ids, wts, np.empty_like(xn))
    else:
        _route_topk(_exp_neg(_flat(logits)).reshape(T, E), bn, k, ids, wts)
    w = torch.from_numpy(wts)
    total = w.sum(-1, keepdim=True).numpy() if renorm else wts[:, :1]
    _route_scale(wts, total, renorm, np.float32(scale))
    return torch.from_numpy(ids), w


# ------------------------------------------------------------------ Attention Residuals mix
# K3's mix scores each source by the sum of its normed, weighted row and takes a softmax
# over the sources (torch's row sum and softmax, re-done above): ONE compiled call
# instead of seven torch ops and two compiled ones, where ``_mix_ok``.
@njit(cache=True, nogil=True)
def _attn_mix(V, w, eps, out, vl):
    S, T, d = V.shape
    scaled = np.empty((S * T, d), np.float32)             # scratch made here: a numpy
    scores = np.empty((T, S), np.float32)                 # allocation from Python costs
    acc = np.empty((4, 4, _LANES8), np.float32)           # ten times one made in here
    buf = np.empty(-(-S // vl) * vl, np.float32)
    v = np.empty(2 * vl, np.float32)
    _norm_rows(V.reshape(S * T, d), eps, w, True, scaled)
    for t in range(T):
        for s in range(S):
            scores[t, s] = _torch_row_sum(scaled[s * T + t], acc)
        _softmax_row(scores[t], S, buf, v)
    _weighted_sum(V.transpose(1, 0, 2), scores, out)


@njit(cache=True, nogil=True)
def _attn_mix_norm(V, w, eps, out, vl, nw, neps, normed):
    _attn_mix(V, w, eps, out, vl)
    _norm_rows(out, neps, nw, True, normed)


def _attn_mix_torch(V: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The mix as torch's chain (the reference and the fallback)."""
    scaled = norm_rows(V, eps, w)
    S, T = V.shape[0], V.shape[1]
    scores = scaled.sum(-1)
    scores = scores.view(1, S) if T == 1 else scores.T.contiguous()  # [T, S]
    a = torch.softmax(scores, dim=-1)
    return weighted_sum(V.permute(1, 0, 2), a)  # fixed summation order: source 0, 1, ...


def _attn_mix_compiled(V: torch.Tensor, w: torch.Tensor, eps: float, post=None) -> torch.Tensor:
    S, T, d = V.shape
    Vn = _array(V)
    out = np.empty((T, d), np.float32)
    args = (Vn, described(w, _gain_array), float(eps), out, _VL)
    if post is None:
        _attn_mix(*args)
        return torch.from_numpy(out)
    normed = np.empty((T, d), np.float32)
    _attn_mix_norm(*args, described(post[0], _gain_array), float(post[1]), normed)
    return torch.from_numpy(normed)


_MIX_OK: bool | None = None


def _mix_ok() -> bool:
    """Whether the compiled mix gives the chain's bits here: ATen on its AVX2 or AVX512
    path, SLEEF's exp of its width exported, and a check on random and special cases
    (1..40 sources, one and several tokens, rows of 8..7,200 with a scalar tail, a
    masked-like very negative score) equal bit for bit."""
    global _MIX_OK
    if _MIX_OK is None:
        _MIX_OK = False
        if (vml.HAS_SLEEF16 if _VL == 16 else vml.HAS_SLEEF8) and _rowsum_ok():
            g = torch.Generator().manual_seed(20261202)
            ok = True
            for S, T, d in ((1, 1, 8), (2, 1, 64), (3, 2, 9), (5, 1, 1024), (8, 1, 100), (9, 3, 257),
                            (17, 1, 2304), (40, 2, 33), (4, 1, 7200)):
                V = torch.randn(S, T, d, generator=g) * torch.rand(S, T, 1, generator=g) * 30
                V[0, 0, :] *= 1e3
                w = torch.randn(d, generator=g) * 3
                if not torch.equal(_attn_mix_compiled(V, w, 1e-6).view(torch.int32),
                                   _attn_mix_torch(V, w, 1e-6).view(torch.int32)):
                    ok = False
                    break
            _MIX_OK = ok
    return _MIX_OK


def attn_mix(V: torch.Tensor, w: torch.Tensor, eps: float, post: tuple | None = None) -> torch.Tensor:
    """K3's Attention Residuals mix of the sources V [S, T, d] (float32) with the
    pseudo-query w [d] (fp32, the norm gain already folded in): per token t, the score of
    source s is sum(rms_norm(V[s, t]) * w) (torch's float32 sum), the weights the softmax
    over s (torch's), the result sum_s V[s, t] * a[t, s] in source order (each product
    rounded, added left to right). ``post`` = (gain, eps): the mix's RMS norm instead
    (norm_rows; the next sublayer's pre-norm), in the same call. One compiled call where
    ``_mix_ok``; torch's chain elsewhere: the same bits either way. Returns [T, d]."""
    if V.dtype != torch.float32:
        raise ValueError(f"attn_mix takes float32 sources, got {V.dtype}")
    if V.shape[-1] >= _LANES8 and _mix_ok():
        return _attn_mix_compiled(V, w, eps, post)
    out = _attn_mix_torch(V, w, eps)
    return out if post is None else norm_rows(out, post[1], post[0])


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
    if USE_VML:
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
    if not (USE_VML and _rowsum_ok()):
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


# ------------------------------------------------------------------ KDA's conv and decay
@njit(cache=True, nogil=True, inline="always")
def _conv_stream(x, wt, state, acc, neg, new_state, off):
    T, C = x.shape
    K = wt.shape[0]
    H = K - 1
    for t in range(T):
        for c in range(C):
            acc[t, off + c] = np.float32(0.0)
        for j in range(K):                          # z = cat(state, x); + z[t + j] * w[:, j], j in order
            p = t + j
            src = state[p] if p < H else x[p - H]
            wj = wt[j]
            for c in range(C):
                acc[t, off + c] = acc[t, off + c] + src[c] * wj[c]
        for c in range(C):
            neg[t, off + c] = -acc[t, off + c]
    for i in range(H):                              # the last K-1 rows of z
        p = T + i
        for c in range(C):
            new_state[i, c] = state[p, c] if p < H else x[p - H, c]


# One entry per stream count with the arrays as plain arguments: numba types a tuple
# argument in Python on every call (~30 us), an array in its C dispatcher.
@njit(cache=True, nogil=True)
def _short_convs3(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2):
    _conv_stream(x0, w0, s0, acc, neg, n0, 0)
    _conv_stream(x1, w1, s1, acc, neg, n1, x0.shape[1])
    _conv_stream(x2, w2, s2, acc, neg, n2, x0.shape[1] + x1.shape[1])


@njit(cache=True, nogil=True)
def _short_convs1(x0, w0, s0, acc, neg, n0):
    _conv_stream(x0, w0, s0, acc, neg, n0, 0)


@njit(cache=True, nogil=True)
def _conv_silu(acc, neg):
    flat, e = acc.reshape(-1), neg.reshape(-1)
    vexp(e, e)
    _silu_post(flat, e, flat)                           # in place: each element reads itself first


@njit(cache=True, nogil=True)
def _short_convs3_silu(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2):
    _short_convs3(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2)
    _conv_silu(acc, neg)


@njit(cache=True, nogil=True)
def _short_convs1_silu(x0, w0, s0, acc, neg, n0):
    _conv_stream(x0, w0, s0, acc, neg, n0, 0)
    _conv_silu(acc, neg)


def _conv_taps(w: torch.Tensor) -> np.ndarray:
    """Conv taps [C, 1, K] as fp32 [K, C] (one row per tap: the inner loop runs along C)."""
    return np.ascontiguousarray(w.to(torch.float32).reshape(w.shape[0], -1).numpy().T)


def _conv_args(xs, ws, states) -> tuple:
    """The short convs' arrays: (inputs, taps [K, C] fp32, states (zeros at a sequence's
    start), new-state buffers, the output [T, sum C] with the streams side by side)."""
    wn = tuple(described(w, _conv_taps) for w in ws)
    sn = tuple(np.zeros((wk.shape[0] - 1, x.shape[1]), np.float32) if st is None else _array(st)
               for wk, st, x in zip(wn, states, xs))
    news = tuple(np.empty((wk.shape[0] - 1, x.shape[1]), np.float32) for wk, x in zip(wn, xs))
    acc = np.empty((xs[0].shape[0], sum(x.shape[1] for x in xs)), np.float32)
    return [_array(x) for x in xs], wn, sn, news, acc


def short_convs_silu(xs, ws, states):
    """Causal depthwise conv + SiLU of streams xs (k3.model.ops.short_convs): per stream
    x [T, C], taps w [C, 1, K] (fp32 as stored or widened), state [K-1, C] or None
    (zeros). out[t] = silu(sum over j < K of z[t + j] * w[:, j]), z = cat(state, x),
    the sum from +0.0 in that order, each product rounded; silu(a) = a / (exp(-a) + 1)
    with torch's exp, one call for every stream. Returns ([out [T, C]], [new_state
    [K-1, C] = the last K-1 rows of z])."""
    cs = [x.shape[1] for x in xs]
    xn, wn, sn, news, acc = _conv_args(xs, ws, states)
    e = np.empty_like(acc)
    if len(xs) not in (1, 3):
        raise ValueError(f"short_convs_silu: {len(xs)} streams (KDA has 3; 1 for a single conv)")
    if USE_VML:
        if len(xs) == 3:
            _short_convs3_silu(*xn, *wn, *sn, acc, e, *news)
        else:
            _short_convs1_silu(xn[0], wn[0], sn[0], acc, e, news[0])
    else:
        if len(xs) == 3:
            _short_convs3(*xn, *wn, *sn, acc, e, *news)
        else:
            _short_convs1(xn[0], wn[0], sn[0], acc, e, news[0])
        torch.from_numpy(e).exp_()
        flat = acc.reshape(-1)
        _silu_post(flat, e.reshape(-1), flat)           # in place: each element reads itself first
    outs, off = [], 0
    for c in cs:                                        # numpy's column slices cost less than torch's
        outs.append(torch.from_numpy(acc[:, off:off + c]))
        off += c
    return outs, [torch.from_numpy(n) for n in news]


@njit(cache=True, nogil=True)
def _kda_inputs1(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, eps, qgain, q, k, v, b, beta):
    _short_convs3_silu(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2)
    T = acc.shape[0]
    c0, c1 = x0.shape[1], x1.shape[1]
    qf, kf, vf = q.reshape(-1), k.reshape(-1), v.reshape(-1)
    for t in range(T):                                  # each stream's rows, contiguous
        for c in range(c0):
            qf[t * c0 + c] = acc[t, c]
        for c in range(c1):
            kf[t * c1 + c] = acc[t, c0 + c]
        for c in range(v.shape[1]):
            vf[t * v.shape[1] + c] = acc[t, c0 + c1 + c]
    _norm_rows(q, eps, qgain, False, q)                 # in place: a row's statistic comes first
    _norm_rows(k, eps, _NO_GAIN, False, k)
    _sigmoid1(b.reshape(-1), beta.reshape(-1))


_QGAINS: dict = {}


def scale_gain(d: int, scale: float) -> torch.Tensor:
    """A norm gain of d copies of fp32(scale): norm_rows' last multiply then applies a
    scale as torch's tensor * number would after the norm."""
    key = (d, float(scale))
    g = _QGAINS.get(key)
    if g is None:
        g = _QGAINS[key] = torch.full((d,), float(scale), dtype=torch.float32)
    return g


def kda_inputs(xs, ws, states, b: torch.Tensor, n_heads: int, eps: float, q_scale: float):
    """KDA's inputs from its projections, in one compiled call where the fused math runs
    (USE_VML): the causal convs + SiLU of q, k, v (short_convs_silu), q and k L2-normed
    per head (norm_rows without the mean, q times q_scale in the norm's last multiply),
    beta = sigmoid(b). The same operations, in the same order, as those calls one by one.
    Returns (q [T, H, dk], k [T, H, dk], v [T, H, dv], [new conv states], beta [T, H])."""
    T = xs[0].shape[0]
    cs = [x.shape[1] for x in xs]
    if not USE_VML or len(xs) != 3 or cs[0] % n_heads or cs[1] != cs[0] or cs[2] % n_heads:
        (q, k, v), news = short_convs_silu(xs, ws, states)
        q = norm_rows(q.reshape(T, n_heads, -1), eps, scale_gain(cs[0] // n_heads, q_scale), mean=False)
        k = norm_rows(k.reshape(T, n_heads, -1), eps, mean=False)
        return q, k, v.reshape(T, n_heads, -1), news, sigmoid(b)
    D = cs[0] // n_heads
    xn, wn, sn, news, acc = _conv_args(xs, ws, states)
    q = np.empty((T * n_heads, D), np.float32)
    k = np.empty((T * n_heads, D), np.float32)
    v = np.empty((T, cs[2]), np.float32)
    bn = _array(b)
    beta = np.empty(bn.shape, np.float32)
    _kda_inputs1(*xn, *wn, *sn, acc, np.empty_like(acc), *news, float(eps),
                 described(scale_gain(D, q_scale), _gain_array), q, k, v, bn, beta)
    return (torch.from_numpy(q.reshape(T, n_heads, D)), torch.from_numpy(k.reshape(T, n_heads, D)),
            torch.from_numpy(v.reshape(T, n_heads, -1)), [torch.from_numpy(n) for n in news],
            torch.from_numpy(beta))


@njit(cache=True, nogil=True)
def _norm_gate1(o, eps, w, z, y, out):
    _norm_rows(o, eps, w, True, y)
    _gate1(y.reshape(-1), z, out)


def norm_gate(o: torch.Tensor, w: torch.Tensor, eps: float, z: torch.Tensor) -> torch.Tensor:
    """RMS norm of o's rows [..., d] times the gain w, then times sigmoid(z) (z of o's
    size, flat): fla's FusedRMSNormGated (sigmoid), as norm_rows then gate, in one
    compiled call where the fused math runs. Returns [numel / z's last dim..., ] shaped
    like z."""
    if not USE_VML:
        return gate(norm_rows(o, eps, w).reshape(z.shape), z)
    on = _array(o)
    on = on.reshape(-1, on.shape[-1])
    zn = _flat(z)
    if zn.size != on.size:
        raise ValueError(f"norm_gate: o {tuple(o.shape)} and z {tuple(z.shape)} differ in size")
    out = np.empty(zn.size, np.float32)
    _norm_gate1(on, float(eps), described(w, _gain_array), zn, np.empty_like(on), out)
    return torch.from_numpy(out.reshape(z.shape))


@njit(cache=True, nogil=True)
def _decay_pre(u, dtb, A, H, lb_mode, x, buf):
    T, HD = u.shape
    dk = HD // H
    cap = np.float32(20.0)
    for t in range(T):
        for j in range(HD):
            v = u[t, j] + dtb[j]
            if lb_mode:
                buf[t, j] = -(A[j // dk] * v)
            else:
                x[t, j] = v
                buf[t, j] = cap if v > cap else v        # clamp(max=20): NaN stays NaN


@njit(cache=True, nogil=True)
def _decay_lb_post(e, lb, g):
    one = np.float32(1.0)
    for i in range(e.size):
        g[i] = lb * (one / (e[i] + one))


@njit(cache=True, nogil=True)
def _one_plus(y, out):
    one = np.float32(1.0)
    for i in range(y.size):
        out[i] = one + y[i]


@njit(cache=True, nogil=True)
def _decay_softplus_post(x, y, u, lu, A, H, g):
    T, HD = x.shape
    dk = HD // H
    one = np.float32(1.0)
    cap = np.float32(20.0)
    for t in range(T):
        for j in range(HD):
            i = t * HD + j
            lp = y[i] if u[i] == one else (lu[i] * y[i]) / (u[i] - one)
            sp = x[t, j] if x[t, j] > cap else lp
            g[i] = (-A[j // dk]) * sp


@njit(cache=True, nogil=True)
def _decay_lb1(un, dtb, A, H, lb, buf, g, eg):
    _decay_pre(un, dtb, A, H, True, buf, buf)
    e = buf.reshape(-1)
    vexp(e, e)
    _decay_lb_post(e, lb, g.reshape(-1))
    if eg.size:                                           # exp(g) too, for the recurrence
        vexp(g.reshape(-1), eg)


@njit(cache=True, nogil=True)
def _decay_softplus1(un, dtb, A, H, x, buf, v, lv, g, eg):
    _decay_pre(un, dtb, A, H, False, x, buf)
    y, v1, lv1 = buf.reshape(-1), v.reshape(-1), lv.reshape(-1)
    vexp(y, y)
    _one_plus(y, v1)
    vlog(v1, lv1)
    _decay_softplus_post(x, y, v1, lv1, A, H, g.reshape(-1))
    if eg.size:
        vexp(g.reshape(-1), eg)


@njit(cache=True, nogil=True)
def _decay1(un, dtb, A, H, lb, lb_mode, buf, x, v1, lv, g, eg):
    if lb_mode:
        _decay_lb1(un, dtb, A, H, lb, buf, g, eg)
    else:
        _decay_softplus1(un, dtb, A, H, x, buf, v1, lv, g, eg)


def _decay_args(u, a_log, dt_bias, n_heads: int, lower_bound: float | None) -> tuple:
    """kda_decay's arrays: (u, dt_bias fp32, A = torch's exp of A_log, n_heads, fp32
    lower bound, lb_mode, buf, x, v, lv, g), as _decay1 takes them (x is buf and v, lv
    are empty in the lower-bound form). ValueError for A_log or a gate that do not fit
    n_heads."""
    T, HD = u.shape
    A = described(a_log, _exp_vector)
    if A.shape[0] < n_heads or HD % n_heads:
        raise ValueError(f"kda_decay: A_log of {A.shape[0]} heads, gate of {HD} for {n_heads} heads")
    lb_mode = lower_bound is not None
    buf = np.empty((T, HD), np.float32)
    v = np.empty((0, 0) if lb_mode else (T, HD), np.float32)
    return (_array(u), described(dt_bias, _f32_vector), A, n_heads, np.float32(lower_bound if lb_mode else 0.0),
            lb_mode, buf, buf if lb_mode else np.empty((T, HD), np.float32), v, np.empty_like(v),
            np.empty((T, HD), np.float32))


@njit(cache=True, nogil=True)
def _kda_decode_in(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps, qgain, q, k, v, b, beta,
                   un, dtb, A, H, lb, lb_mode, buf, x, v1, lv, g, eg):
    """kda_decode's steps before the recurrence (the inputs, the decay and its exp);
    returns q, k, v and exp(g) as [T, H, d]."""
    _kda_inputs1(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps, qgain, q, k, v, b, beta)
    _decay1(un, dtb, A, H, lb, lb_mode, buf, x, v1, lv, g, eg)
    T, Hk = beta.shape
    return q.reshape(T, Hk, -1), k.reshape(T, Hk, -1), v.reshape(T, Hk, -1), eg.reshape(T, Hk, -1)


@njit(cache=True, nogil=True)
def _kda_decode1(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps, qgain, q, k, v, b, beta,
                 un, dtb, A, H, lb, lb_mode, buf, x, v1, lv, g, eg, S0, S, o, ow, eps, z, y, out):
    q3, k3, v3, e3 = _kda_decode_in(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps, qgain, q, k, v,
                                    b, beta, un, dtb, A, H, lb, lb_mode, buf, x, v1, lv, g, eg)
    _kda_recurrent(S0, e3, k3, beta, v3, q3, S, o)
    _norm_gate1(o.reshape(-1, o.shape[2]), eps, ow, z, y, out)


@njit(cache=True, nogil=True)
def _kda_decode1_serial(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps, qgain, q, k, v, b, beta,
                        un, dtb, A, H, lb, lb_mode, buf, x, v1, lv, g, eg, S0, S, o, ow, eps, z, y, out):
    q3, k3, v3, e3 = _kda_decode_in(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps, qgain, q, k, v,
                                    b, beta, un, dtb, A, H, lb, lb_mode, buf, x, v1, lv, g, eg)
    _kda_recurrent_serial(S0, e3, k3, beta, v3, q3, S, o)
    _norm_gate1(o.reshape(-1, o.shape[2]), eps, ow, z, y, out)


def kda_decode(xs, conv_ws, conv_states, b, l2_eps: float, q_scale: float, u, a_log, dt_bias, n_heads: int,
               lower_bound: float | None, S0, into, o_norm_w, eps: float, z):
    """KDA after its projections, for a pass that is not chunked (decode), in ONE compiled
    call: ``kda_inputs`` (the convs + SiLU of q, k, v from xs with their states, q and k
    L2-normed per head with q's scale, beta = sigmoid(b)), then the decay and its exp
    (kda_decay with_exp, from the gate u), the recurrence (kda_recurrent_steps: S0
    [H, dk, dv] is never written) and the per-head RMS norm and output gate
    (norm_gate), each the same compiled code in the same order; q, k, v and beta never
    leave the call. Returns (the gated output [T, H * dv], the new state: ``into`` when
    that is a contiguous fp32 buffer of its shape other than S0, [the new conv states]),
    or None where that call is not the path (no fused math, no tokens, a head split
    that does not divide): the caller then runs those steps one by one. Small passes
    run serially (``_run``)."""
    T = xs[0].shape[0]
    cs = [x.shape[1] for x in xs]
    H = n_heads
    if (not USE_VML or T == 0 or len(xs) != 3 or cs[0] % H or cs[1] != cs[0] or cs[2] % H
            or u.shape[1] != cs[0] or b.shape[-1] != H):
        return None
    dk, dv = cs[0] // H, cs[2] // H
    zn = _flat(z)
    if zn.size != T * H * dv:
        raise ValueError(f"kda_decode: gate {tuple(z.shape)} for an output of {T} x {H} x {dv}")
    xn, wn, sn, news, acc = _conv_args(xs, conv_ws, conv_states)
    q = np.empty((T * H, dk), np.float32)
    k = np.empty((T * H, dk), np.float32)
    v = np.empty((T, cs[2]), np.float32)
    beta = np.empty((T, H), np.float32)
    args = _decay_args(u, a_log, dt_bias, H, lower_bound)
    S0n = np.zeros((H, dk, dv), np.float32) if S0 is None else _array(S0)
    into = _state_into(into, S0, (H, dk, dv))
    out = np.empty(zn.size, np.float32)
    _run(_kda_decode1, _kda_decode1_serial, _STATE_COST * T * H * dk * dv, *xn, *wn, *sn, acc, np.empty_like(acc),
         *news, float(l2_eps), described(scale_gain(dk, q_scale), _gain_array), q, k, v, _array(b).reshape(T, H), beta,
         *args, np.empty(T * H * dk, np.float32), S0n, into.numpy(), np.empty((T, H, dv), np.float32),
         described(o_norm_w, _gain_array), float(eps), zn, np.empty((T * H, dv), np.float32), out)
    return torch.from_numpy(out.reshape(z.shape)), into, [torch.from_numpy(n) for n in news]


@njit(cache=True, nogil=True)
def _kda_layer1_part(c, x, y, tab, p0, p1, work, x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps,
                     qgain, q, k, v, b, beta, un, dtb, A, H, lb, lb_mode, buf, xd, v1, lv, g, eg, S0, S, o, ow, eps,
                     z, yn, out, q3, k3, v3, e3, fl, emode, has_p, V, mw, meps, vl, nw, neps, hs, yn2, rtab, rout, rk,
                     rbias, rscale, ids, wts, e, dall, mi, mnw, meps2, situ, beta2, lb2, has_lb, mtab, mout, dsh, sc,
                     mfl):
    """Thread c's part of ``_kda_layer1`` (a plain function: the region's loop body,
    compiled once, not into the parallel loop's lowering)."""
    region.bf16_step(tab, 0, p0, x, work, y, fl, 0, c)
    region.bf16_step(tab, p0, p1, x, work, y, fl, 2, c)
    if region.claim(fl, 4):
        _kda_decode_in(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2, l2eps, qgain, q, k, v, b, beta,
                       un, dtb, A, H, lb, lb_mode, buf, xd, v1, lv, g, eg)
        region.finish(fl, 4)
    region.wait(fl, 4)
    hm = H // 2
    for j in range(2):
        h = c if j == 0 else 1 - c
        if region.claim(fl, 5 + h):
            for hh in range(0 if h == 0 else hm, hm if h == 0 else H):
                _kda_head(S0, e3, k3, beta, v3, q3, S, o, hh)
            region.finish(fl, 5 + h)
    region.wait(fl, 5)
    region.wait(fl, 6)
    if region.claim(fl, 7):
        _norm_gate1(o.reshape(H, o.shape[2]), eps, ow, z, yn, out)
        region.finish(fl, 7)
    region.wait(fl, 7)
    region.bf16_step(tab, p1, tab.shape[0], x, work, y, fl, 8, c)
    _end_part(c, fl, np.int64(10), emode, has_p, V, y, mw, meps, vl, nw, neps, hs, yn2, rtab, rout, rk, rbias, rscale,
              ids, wts, e, dall, mi, mnw, meps2, situ, beta2, lb2, has_lb, mtab, mout, dsh, sc, mfl)


@njit(parallel=True, cache=True, nogil=True)
def _kda_layer1(x, y, tab, ints, w0, w1, w2, s0, s1, s2, l2eps, qgain, dtb, A, lb, lb_mode, S0, S, ow, eps,
               emode, has_p, V, mw, meps, vl, nw, neps, hs, yn2, rtab, rout, rk, rbias, rscale, ids, wts, e, dall, mi,
               mnw, meps2, situ, beta2, lb2, has_lb, mtab, mout):
    """kda_decode_layer's region (its ``_Plan`` has the table and the workspace layout):
    table rows 0 .. p0-1 (the projections of x), p0 .. p1-1 (the gate's second
    projections), then the steps of ``_kda_decode1`` (inputs and decay on one thread,
    the recurrence's heads in two halves, the gated norm on one thread), then the rows
    from p1 (the output projection, into y); pieces of k3.quant.region, claimed by
    whichever thread comes first. Returns the new conv states."""
    p0, p1, H, dk, dv, nwork = ints[0], ints[1], ints[2], ints[3], ints[4], ints[5]
    cq, cv = H * dk, H * dv
    work = np.empty(nwork, np.float32)
    wp = work.ctypes.data
    x0 = numba.carray(_f32p(wp + 4 * ints[6]), (1, cq))
    x1 = numba.carray(_f32p(wp + 4 * ints[7]), (1, cq))
    x2 = numba.carray(_f32p(wp + 4 * ints[8]), (1, cv))
    b = numba.carray(_f32p(wp + 4 * ints[9]), (1, H))
    un = numba.carray(_f32p(wp + 4 * ints[10]), (1, cq))
    z = numba.carray(_f32p(wp + 4 * ints[11]), (cv,))
    out = numba.carray(_f32p(wp + 4 * ints[12]), (cv,))
    acc = np.empty((1, 2 * cq + cv), np.float32)
    neg = np.empty_like(acc)
    n0 = np.empty((w0.shape[0] - 1, cq), np.float32)
    n1 = np.empty((w1.shape[0] - 1, cq), np.float32)
    n2 = np.empty((w2.shape[0] - 1, cv), np.float32)
    q = np.empty((H, dk), np.float32)
    k = np.empty((H, dk), np.float32)
    v = np.empty((1, cv), np.float32)
    beta = np.empty((1, H), np.float32)
    buf = np.empty((1, cq), np.float32)
    xd = buf if lb_mode else np.empty((1, cq), np.float32)
    v1 = np.empty((0, 0) if lb_mode else (1, cq), np.float32)
    lv = np.empty_like(v1)
    g = np.empty((1, cq), np.float32)
    eg = np.empty(cq, np.float32)
    o = np.empty((1, H, dv), np.float32)
    yn = np.empty((H, dv), np.float32)
    q3, k3, v3, e3 = q.reshape(1, H, dk), k.reshape(1, H, dk), v.reshape(1, H, dv), eg.reshape(1, H, dk)
    fl = region.flags(14)
    dsh, sc, mfl = _end_setup(dall, mi, rk)
    for i in prange(2):
        _kda_layer1_part(np.int64(i), x, y, tab, p0, p1, work, x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1,
                         n2, l2eps, qgain, q, k, v, b, beta, un, dtb, A, H, lb, lb_mode, buf, xd, v1, lv, g, eg, S0,
                         S, o, ow, eps, z, yn, out, q3, k3, v3, e3, fl, emode, has_p, V, mw, meps, vl, nw,
                         neps, hs, yn2, rtab, rout, rk, rbias, rscale, ids, wts, e, dall, mi, mnw, meps2, situ, beta2,
                         lb2, has_lb, mtab, mout, dsh, sc, mfl)
    return n0, n1, n2


_f32p = region.address_intrinsic(types.float32)


def _bf16_2d(w) -> bool:
    return isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous()


# --------------------------------------------------------- a layer's first half, finished in its mixer's region
# A decode step's mixer region (KDA's, MLA's) may go on past its output y with what the
# layer does next, so that no call of its own pays a launch for it: the residual step
# (Kimi-Linear: h' = h + y and the post-attention norm; K3: the partial sum P' = P + y
# and the FFN's Attention Residuals mix with its post-norm) into yn, then the MoE
# router's projections of yn (gate, latent down, shared gate and up: one-token rows)
# and its top-k, and, with every routed expert of the layer held, the MoE block with
# the residual add. Each is the compiled code of the separate calls (add_norm,
# attn_mix, linears, route_topk, moe_decode), in their order, so the same bits.
#: residual modes: none, Kimi-Linear's add and norm, K3's partial sum and mix
END_NONE, END_PLAIN, END_MIX = 0, 1, 2


@njit(cache=True, nogil=True)
def _end_part(c, fl, s, emode, has_p, V, y, mw, meps, vl, nw, neps, hs, yn, rtab, rout, rk, rbias, rscale, ids, wts,
              e, dall, mi, mnw, meps2, situ, beta, lb, has_lb, mtab, out, dsh, sc, mfl):
    """The layer's next steps after the region's output y (thread c; pieces s .. s+3 of
    fl, then the MoE block's own flags mfl); see LayerEnd."""
    if emode == END_NONE:
        return
    d = y.size
    if region.claim(fl, s):
        if emode == END_PLAIN:
            h = V.reshape(-1)
            for t in range(d):
                hs[t] = h[t] + y[t]
            _norm_rows(hs.reshape((1, d)), neps, nw, True, yn.reshape((1, d)))
        else:
            p = V[V.shape[0] - 1, 0]
            for t in range(d):
                p[t] = p[t] + y[t] if has_p else y[t]
            _attn_mix_norm(V, mw, meps, hs.reshape((1, d)), vl, nw, neps, yn.reshape((1, d)))
        region.finish(fl, s)
    region.wait(fl, s)
    if rtab.shape[0]:
        region.bf16_step(rtab, 0, rtab.shape[0], yn, rout, rout, fl, s + 1, c)
        if rk and region.claim(fl, s + 3):
            E = rtab[0, region.T_N]
            _route_topk_sum(rout[:E], rbias, rk, ids, wts, e, rscale, np.empty((4, 4, _LANES8), np.float32))
            region.finish(fl, s + 3)
        region.wait(fl, s + 3)
        if dall.shape[0]:   # the MoE block too, every expert of the layer at hand
            ro = rout.ctypes.data
            z = yn.reshape((1, d)) if mi[0] < 0 else numba.carray(_f32p(ro + 4 * mi[0]), (1, mi[5]))
            gu_s = numba.carray(_f32p(ro + 4 * max(mi[1], 0)), (2 * mi[2] if mi[1] >= 0 else 0,))
            base = hs if emode == END_PLAIN else V[V.shape[0] - 1, 0]
            _end_moe(c, mfl, dall, ids, wts, z, gu_s, mi[4] != 0, meps2, mnw, situ, beta, lb, has_lb, mtab, mi[3],
                     out, base, dsh, sc)


@njit(cache=True, nogil=True)
def _end_setup(dall, mi, k):
    """_end_part's MoE workspace (empty without ``dall``): the chosen experts'
    descriptors, ``_moe_scratch``, the MoE steps' flags."""
    G = k if dall.shape[0] else 0
    dsh = np.empty((G, 3, dall.shape[2]), np.int64)
    sc = _moe_scratch(G, dall[0, 0, 0] if G else 0, mi[5], mi[2], mi[6], dall.shape[2] == 4)
    return dsh, sc, region.flags(10)


_NO_ROWS = np.empty((0, 7), np.int64)
_NO_V = np.empty((1, 1, 0), np.float32)
_NO_IDS = np.empty((1, 0), np.int64)
_NO_WTS = np.empty((1, 0), np.float32)
_NO_EXPERTS = np.empty((0, 3, 3), np.int64)
_NO_MI = np.zeros(8, np.int64)
#: the arguments of a region that ends with its output: residual step, router, MoE block
_END_NONE_ARGS = (END_NONE, False, _NO_V, _NO_GAIN, 0.0, _VL, _NO_GAIN, 0.0, _NO_GAIN, _NO_GAIN,
                  _NO_ROWS, _NO_GAIN, 0, _NO_GAIN, np.float32(0.0), _NO_IDS, _NO_WTS, _NO_GAIN,
                  _NO_EXPERTS, _NO_MI, _NO_GAIN, 0.0, False, np.float32(1.0), np.float32(1.0), False, _NO_ROWS,
                  _NO_GAIN)


class LayerEnd:
    """What a one-token mixer region is asked to finish its layer's first half with
    (``plain_end`` / ``mix_end``, then ``route``), and after the region (``done``) its
    results: ``h`` (Kimi-Linear's new hidden state) or ``p`` (K3's new partial sum),
    ``yn`` (the FFN's input), and with a router ``outs`` (its projections of yn, as
    ``linears`` splits them) and, where the top-k was done too, ``ids`` and ``wts``;
    with the MoE block ``out``, the layer's output. (Each a view of the region's numpy
    output made when asked: the whole-layer path asks for ``out`` alone.)"""

    __slots__ = ("args", "d", "done", "_h", "_P", "_yn", "_rout", "_ids", "_wts", "rows", "_out")

    def __init__(self):
        self.done = False
        self._h = self._P = self._rout = self._ids = self._wts = self._out = None

    @property
    def h(self) -> torch.Tensor | None:
        return None if self._h is None else torch.from_numpy(self._h).view(1, self.d)

    @property
    def p(self) -> torch.Tensor | None:
        return None if self._P is None else self._P[-1]

    @property
    def yn(self) -> torch.Tensor:
        return torch.from_numpy(self._yn).view(1, self.d)

    @property
    def outs(self) -> tuple | None:
        return None if self._rout is None else torch.from_numpy(self._rout).view(1, -1).split_with_sizes(self.rows, 1)

    @property
    def ids(self) -> torch.Tensor | None:
        return None if self._ids is None else torch.from_numpy(self._ids)

    @property
    def wts(self) -> torch.Tensor | None:
        return None if self._wts is None else torch.from_numpy(self._wts)

    @property
    def out(self) -> torch.Tensor | None:
        return None if self._out is None else torch.from_numpy(self._out).view(1, self.d)

    @property
    def has_outs(self) -> bool:
        return self._rout is not None

    @property
    def has_ids(self) -> bool:
        return self._ids is not None

    @property
    def has_out(self) -> bool:
        return self._out is not None

    def id_list(self) -> list[int]:
        """The chosen experts' ids, as a list."""
        return self._ids.reshape(-1).tolist()

    def region_args(self, d: int) -> tuple:
        """The region's end arguments for an output of d floats (none where they do not fit)."""
        return self.args if self.d == d else _END_NONE_ARGS

    def route(self, x_dim: int, ws, bias, k: int, renorm: bool, scale: float) -> None:
        """Also the router's projections of yn by ``ws`` (router gate first, then the
        others ``linears`` would be given, all contiguous bf16 [n, x_dim]) and, where
        route_topk would take its one-call form, its top-k; nothing where ws do not fit."""
        if x_dim != self.d:
            return
        p = _layer_plan(_ROUTER_PLANS, list(ws) + ([] if bias is None else [bias]),
                        (x_dim, k, renorm, scale, bias is not None), _router_plan_fill)
        if p is None:
            return
        rout = np.empty(p.n, np.float32)
        rk = p.rk
        ids, wts = (np.empty((1, k), np.int64), np.empty((1, k), np.float32)) if rk else (_NO_IDS, _NO_WTS)
        self.args = self.args[:10] + (p.tab, rout, rk, p.bn, p.scale, ids, wts,
                                      np.empty(p.tab[0, region.T_N], np.float32) if rk else _NO_GAIN) \
            + _END_NONE_ARGS[18:]
        self.rows, self._rout = p.sizes, rout
        if rk:
            self._ids, self._wts = ids, wts

    def experts(self, descs: np.ndarray, z_row: int | None, gu_row: int | None, norm_w, eps: float,
                situ: tuple | None, up_w, down_w) -> None:
        """Also the MoE block, after ``route`` did the top-k: ``descs`` [E, 3, ...] the
        kernel descriptors (``expert_descriptors``, one format) of every routed expert of
        the layer, by id, valid through the region; ``z_row`` / ``gu_row`` which of the
        router's projections are the latent z and the shared expert's gate (its up the
        next), None for none (z is then yn); moe_decode's other arguments. The region's
        result ``out`` is then the layer's output, the residual added. Nothing where the
        experts or projections do not fit."""
        if self._ids is None or descs.ndim != 3 or descs.shape[0] == 0:
            return
        mats = [m for m in (norm_w, up_w, down_w) if m is not None]
        if not mats:   # nothing to keep the plan under (a model without these is not one of ours)
            return
        p = _layer_plan(_MOE_END_PLANS, mats, (z_row, gu_row, tuple(self.rows), self.d, float(eps), situ,
                                               norm_w is not None, up_w is not None), _moe_end_fill)
        if p is None:
            return
        if p.checked is not descs:   # (the same descriptors while the layer's experts stay put)
            if not _chains(descs, p.dz) or descs.shape[2] == 4 and (p.dz % 2 or descs[0, 0, 0] % 2):
                return
            p.checked = descs
        out = np.empty(self.d, np.float32)
        self.args = self.args[:18] + (descs,) + p.tail + (out,)
        self._out = out


#: id(the MoE block's last weight of norm, up, down) -> what LayerEnd.experts passes the region
_MOE_END_PLANS: dict = {}


def _moe_end_fill(p: _Plan, mats, z_row, gu_row, rows: tuple, d: int, eps: float, situ, has_norm: bool,
                  has_up: bool) -> None:
    it = iter(mats)
    norm_w, up_w = (next(it) if has_norm else None), (next(it) if has_up else None)
    down_w = next(it, None)
    p.tab = p.checked = None
    offs = np.cumsum((0,) + rows)
    p.dz = rows[z_row] if z_row is not None else d
    inter_s = rows[gu_row] if gu_row is not None else 0
    if (gu_row is not None and rows[gu_row + 1] != inter_s) or (down_w is None) != (gu_row is None):
        return
    m = _moe_plan_fill(_Plan(), [up_w, down_w], p.dz, inter_s)
    if m.tab is None or m.n_out != d:
        return
    mi = np.array([-1 if z_row is None else offs[z_row], -1 if gu_row is None else offs[gu_row], inter_s, m.mode,
                   norm_w is not None, p.dz, d, 0], np.int64)
    p.tail = (mi, _NO_GAIN if norm_w is None else _f32_gain(norm_w), float(eps), *_glu_params(situ), m.tab)
    p.tab = m.tab


#: id(a router's bias, else its last projection) -> its one-token rows and top-k numbers
_ROUTER_PLANS: dict = {}


def _router_plan_fill(p: _Plan, mats, d: int, k: int, renorm: bool, scale: float, has_bias: bool) -> None:
    ws, bias = (mats[:-1], mats[-1]) if has_bias else (mats, None)
    p.tab = None
    if not all(_bf16_2d(w) and w.shape[1] == d for w in ws):
        return
    rows, off = [], 0
    for w in ws:
        rows.append((d, w.shape[0], w.data_ptr(), 0, 0, 1, off))
        off += w.shape[0]
    E = ws[0].shape[0]
    p.bn = _NO_GAIN if bias is None else _f32_vector(bias)
    p.rk = k if (renorm and k >= _LANES8 and 0 < k <= E and p.bn.shape[0] in (0, E) and _rowsum_ok()) else 0
    p.n, p.sizes, p.scale = off, [w.shape[0] for w in ws], np.float32(scale)
    p.tab = np.array(rows, np.int64)


def plain_end(h: torch.Tensor, post_w: torch.Tensor, eps: float) -> LayerEnd | None:
    """Kimi-Linear's residual step for a region to finish with: h' = h + y and yn =
    rms_norm(h') with the gain post_w (add_norm's math); None where it is not for one."""
    if not (USE_VML and h.dim() == 2 and h.shape[0] == 1 and h.dtype == torch.float32):
        return None
    e = LayerEnd()
    d = h.shape[1]
    hs, yn = np.empty(d, np.float32), np.empty(d, np.float32)
    e.d, e._h, e._yn = d, hs, yn
    e.args = (END_PLAIN, False, _array(h).reshape(1, 1, d), _NO_GAIN, 0.0, _VL, described(post_w, _f32_gain),
              float(eps), hs, yn) + _END_NONE_ARGS[10:]
    return e


def mix_end(bank: list, P: torch.Tensor | None, mix_w: torch.Tensor, eps: float, post_w: torch.Tensor,
            post_eps: float) -> LayerEnd | None:
    """K3's residual step for a region to finish with: P' = P + y (y when P is None), then
    attn_mix of bank + [P'] with the pseudo-query mix_w (fp32, the norm gain folded in)
    and the post-norm (post_w, post_eps) into yn; None where attn_mix would not run its
    compiled form (or not one token)."""
    if not (USE_VML and bank and bank[0].dim() == 2 and bank[0].shape[0] == 1 and bank[0].shape[1] >= _LANES8
            and _mix_ok()):
        return None
    e = LayerEnd()
    V = torch.stack(bank + [bank[-1] if P is None else P], 0)  # the last row: P, then P' in place
    d = V.shape[2]
    yn = np.empty(d, np.float32)
    e.d, e._P, e._yn = d, V, yn
    e.args = (END_MIX, P is not None, V.numpy(), described(mix_w, _gain_array), float(eps), _VL,
              described(post_w, _f32_gain), float(post_eps), np.empty(d, np.float32), yn) + _END_NONE_ARGS[10:]
    return e


class _Plan:
    """What a region keeps per layer (``_layer_plan``): its step table (``tab`` None:
    these weights are not for the region) and what its fill adds (layout numbers, the
    weights' kernel forms), with weak references to the weight objects it was made for
    (it holds none of them)."""


#: id(o_proj weight) -> its layer's KDA plan; the entry goes with that weight object
_KDA_PLANS: dict = {}


def _layer_plan(plans: dict, mats, params: tuple, fill) -> _Plan | None:
    """The plan of a layer's weights ``mats`` (None for an absent one) and ``params``:
    ``fill(plan, mats, *params)`` once per live set of weight objects, kept in ``plans``
    under the last one (whose end drops the entry); None where the region does not take
    them."""
    last = mats[-1]
    key = id(last)
    p = plans.get(key)
    if not (p is not None and p.params == params and len(p.refs) == len(mats)
            and all(r() is m for r, m in zip(p.refs, mats))):
        p = _Plan()
        try:
            p.refs = tuple(weakref.ref(m, (lambda _r, k=key, plans=plans: plans.pop(k, None)) if m is last
                                       else None) if m is not None else _NONE_REF for m in mats)
        except TypeError:   # objects without weak references: nothing kept
            return None
        p.params = params
        fill(p, mats, *params)
        plans[key] = p
    return p if p.tab is not None else None


def _none() -> None:
    return None


_NONE_REF = _none   # stands for an absent weight (g_b of a full-rank gate): calling it gives None


def _kda_plan_fill(p: _Plan, mats, H: int, q_scale: float, d: int) -> None:
    ws, (f_b, g_b), conv_ws, (a_log, dt_bias, o_norm_w, o_w) = mats[:6], mats[6:8], mats[8:11], mats[11:]
    p.tab = None
    if len(ws) != 6 or not all(_bf16_2d(w) for w in ws + [f_b, o_w] + ([g_b] if g_b is not None else [])):
        return
    if any(w.shape[1] != d for w in ws):
        return
    cq, ck, cv, fa, nb, ng = (w.shape[0] for w in ws)
    if (cq % H or ck != cq or cv % H or nb != H or f_b.shape != (cq, fa)
            or (g_b is not None and g_b.shape != (cv, ng)) or (g_b is None and ng != cv) or o_w.shape[1] != cv):
        return
    taps = tuple(described(w, _conv_taps) for w in conv_ws)
    if [t.shape[1] for t in taps] != [cq, cq, cv] or len({t.shape[0] for t in taps}) != 1:
        return
    A = described(a_log, _exp_vector)
    if A.shape[0] < H or dt_bias.numel() != cq or o_norm_w.numel() != cv // H:
        return
    offs, off = [], 0
    for w in ws:
        offs.append(off)
        off += w.shape[0]
    o_q, o_k, o_v, o_fa, o_b, o_za = offs
    o_u = off
    o_z = o_u + cq if g_b is not None else o_za
    o_g = o_u + cq + (cv if g_b is not None else 0)
    rows = [(d, w.shape[0], w.data_ptr(), 0, 0, 1, o) for w, o in zip(ws, offs)]
    rows.append((fa, cq, f_b.data_ptr(), 1, o_fa, 1, o_u))
    if g_b is not None:
        rows.append((ng, cv, g_b.data_ptr(), 1, o_za, 1, o_z))
    rows.append((cv, o_w.shape[0], o_w.data_ptr(), 1, o_g, 2, 0))
    p.tab = np.array(rows, np.int64)
    p.ints = np.array([6, len(rows) - 1, H, cq // H, cv // H, o_g + cv, o_q, o_k, o_v, o_b, o_u, o_z, o_g], np.int64)
    p.taps, p.A, p.d_out = taps, A, o_w.shape[0]
    p.qgain = described(scale_gain(cq // H, q_scale), _gain_array)
    p.dtb = described(dt_bias, _f32_vector)
    p.ow = described(o_norm_w, _f32_gain)


def kda_decode_layer(x, ws, f_b, g_b, conv_ws, conv_states, l2_eps: float, q_scale: float, a_log, dt_bias,
                     n_heads: int, lower_bound: float | None, S0, into, o_norm_w, eps: float, o_w,
                     end: LayerEnd | None = None):
    """KDA's whole one-token step after its input norm, in ONE parallel region (see
    k3.quant.region): the projections of x [1, d] by ``ws`` (q, k, v, f_a, b and the
    gate: g_proj, or g_a_proj when ``g_b`` is its second projection), the decay's
    second projection ``f_b`` of f_a (and ``g_b`` of the gate's first), then
    ``kda_decode``'s steps (the same compiled code in the same order), then the output
    projection ``o_w``. Every number is the one the separate calls give (each product
    by the one-token kernels' row code). What depends on the weights alone (the step
    table with their addresses, their kernel forms) is made once per layer
    (``_layer_plan``). Returns (y [1, d_out], the new state as kda_decode gives it, [the
    new conv states]), or None where this is not the path (not one token, a weight not
    a contiguous bf16 matrix, no fused math, shapes kda_decode does not take): the
    caller then runs the steps as separate calls. ``end``: a LayerEnd the region goes
    on with after y (its results in it, ``done`` set, when it did)."""
    if not USE_VML or x.dim() != 2 or x.shape[0] != 1 or len(ws) != 6:
        return None
    H = n_heads
    p = _layer_plan(_KDA_PLANS, list(ws) + [f_b, g_b] + list(conv_ws) + [a_log, dt_bias, o_norm_w, o_w],
                    (H, q_scale, x.shape[1]), _kda_plan_fill)
    if p is None:
        return None
    dk, dv = int(p.ints[3]), int(p.ints[4])
    xn = _flat(x)
    sn = [np.zeros((t.shape[0] - 1, t.shape[1]), np.float32) if st is None else _array(st)
          for t, st in zip(p.taps, conv_states)]
    S0n = np.zeros((H, dk, dv), np.float32) if S0 is None else _array(S0)
    into = _state_into(into, S0, (H, dk, dv))
    y = np.empty(p.d_out, np.float32)
    lb_mode = lower_bound is not None
    ea = _END_NONE_ARGS if end is None else end.region_args(p.d_out)
    news = _kda_layer1(xn, y, p.tab, p.ints, *p.taps, *sn, float(l2_eps), p.qgain, p.dtb, p.A,
                       np.float32(lower_bound if lb_mode else 0.0), lb_mode, S0n, into.numpy(), p.ow, float(eps), *ea)
    if ea is not _END_NONE_ARGS:
        end.done = True
    return torch.from_numpy(y).view(1, -1), into, [torch.from_numpy(n) for n in news]


# ------------------------------------------------------------------ MLA's one-token step
# MLA work-array slots (``ints``): heads, nope, rope, v dims, latent rank, q_a rows (0:
# no q LoRA), gated, then the offsets of q_a's output, ckv, the gate's input, the
# normed q_a, q, o and the gated o.
_M_H, _M_NOPE, _M_ROPE, _M_VD, _M_L, _M_QR, _M_GATED, _M_QA, _M_CKV, _M_G, _M_QN, _M_Q, _M_O, _M_OG, _M_NW = range(15)


@njit(cache=True, nogil=True)
def _mla_layer1_part(c, x, y, tab, p0, p1, work, H, nope, rope, vd, L, qa, qn, ckv, q, o, gz, og, wkv, kb, vb, past,
                     qgain, cgain, neps, scale, ql, a, b, p, s, v, acc, acc8, fl, emode, has_p, V, mw, meps, vl, nw,
                     eneps, hs, yn, rtab, rout, rk, rbias, rscale, ids, wts, e, dall, mi, mnw, meps2, situ, beta,
                     lb, has_lb, mtab, mout, dsh, sc, mfl):
    """Thread c's part of ``_mla_layer1`` (its loop body, compiled once)."""
    n = past + 1
    dq = nope + rope
    region.bf16_step(tab, 0, p0, x, work, y, fl, 0, c)       # q_a (or q), kv_a, the gate's input
    if region.claim(fl, 2):
        if qa.shape[1]:
            _norm_rows(qa, neps, qgain, True, qn)
        _norm_rows(ckv[:, :L], neps, cgain, True, kb[past:n])   # the cache's new row, in place
        for i in range(rope):
            vb[past, i] = ckv[0, L + i]
        region.finish(fl, 2)
    region.wait(fl, 2)
    region.bf16_step(tab, p0, p1, x, work, y, fl, 3, c)      # q_b (q LoRA)
    hm = H // 2
    for j in range(2):     # per head: the absorbed query W_k^T q_nope, its latent and rope scores
        h = c if j == 0 else 1 - c
        if region.claim(fl, 5 + h):
            for g in range(0 if h == 0 else hm, hm if h == 0 else H):
                _prods_block(g, q, 0, 0, 0, dq, wkv, 0, nope + vd, 0, 0, 1, L, nope, -1, False, ql, L, H * L)
                _dots_block(g, ql.reshape((1, H * L)), 0, 0, 0, L, kb, 0, 0, 0, 0, 1, n, L, past, True, a, n, n, acc)
                _dots_block(g, q, 0, 0, nope, dq, vb, 0, 0, 0, 0, 1, n, rope, past, True, b, n, n, acc)
            region.finish(fl, 5 + h)
    region.wait(fl, 5)
    region.wait(fl, 6)
    if region.claim(fl, 7):
        _scores_softmax1(a, b, scale, p, s, acc8)
        region.finish(fl, 7)
    region.wait(fl, 7)
    vf = v.reshape(-1)
    for j in range(2):     # per head: the weighted latents over their sum, then W_v of them
        h = c if j == 0 else 1 - c
        if region.claim(fl, 8 + h):
            for g in range(0 if h == 0 else hm, hm if h == 0 else H):
                _prods_block(g, p, 0, 1, 0, 0, kb, 0, 0, 0, 0, 1, L, n, past, True, vf, L, L)
                for i in range(g * L, g * L + L):
                    vf[i] = vf[i] / s[g]
                _dots_block(g, v.reshape((1, H * L)), 0, 0, 0, L, wkv, nope, nope + vd, 0, 0, 1, vd, L, 0, False,
                            o, vd, H * vd, acc)
            region.finish(fl, 8 + h)
    region.wait(fl, 8)
    region.wait(fl, 9)
    if gz.size and region.claim(fl, 10):
        _gate1(o, gz, og)
        region.finish(fl, 10)
    region.wait(fl, 10)
    region.bf16_step(tab, p1, tab.shape[0], x, work, y, fl, 11, c)   # o_proj
    _end_part(c, fl, np.int64(13), emode, has_p, V, y, mw, meps, vl, nw, eneps, hs, yn, rtab, rout, rk, rbias, rscale,
              ids, wts, e, dall, mi, mnw, meps2, situ, beta, lb, has_lb, mtab, mout, dsh, sc, mfl)


@njit(parallel=True, cache=True, nogil=True)
def _mla_layer1(x, y, tab, ints, wkv, kb, vb, past, qgain, cgain, neps, scale, emode, has_p, V, mw, meps, vl, nw, eneps,
               hs, yn, rtab, rout, rk, rbias, rscale, ids, wts, e, dall, mi, mnw, meps2, situ, beta, lb, has_lb, mtab,
               mout):
    """mla_decode_layer's region (its ``_Plan``, from ``_mla_plan_fill``, has the table and
    the workspace layout, ``ints``: the _M_* slots): table rows 0 .. p0-1 (the projections of x), the norms
    and the cache's new row (one thread), rows p0 .. p1-1 (q_b), the heads' absorbed
    queries and scores in two halves, the softmax (one thread), the heads' weighted
    latents and values in two halves, the output gate (one thread), then the rows from
    p1 (o_proj, into y)."""
    H, nope, rope, vd, L, qr, gated = (ints[_M_H], ints[_M_NOPE], ints[_M_ROPE], ints[_M_VD], ints[_M_L],
                                       ints[_M_QR], ints[_M_GATED])
    n = past + 1
    p0 = 2 + gated
    p1 = p0 + (1 if qr else 0)
    work = np.empty(ints[_M_NW], np.float32)
    wp = work.ctypes.data
    qa = numba.carray(_f32p(wp + 4 * ints[_M_QA]), (1, qr))
    qn = numba.carray(_f32p(wp + 4 * ints[_M_QN]), (1, qr))
    ckv = numba.carray(_f32p(wp + 4 * ints[_M_CKV]), (1, L + rope))
    q = numba.carray(_f32p(wp + 4 * ints[_M_Q]), (1, H * (nope + rope)))
    o = numba.carray(_f32p(wp + 4 * ints[_M_O]), (H * vd,))
    gz = numba.carray(_f32p(wp + 4 * ints[_M_G]), (H * vd * gated,))
    og = numba.carray(_f32p(wp + 4 * ints[_M_OG]), (H * vd * gated,))
    ql = np.empty(H * L, np.float32)
    a = np.zeros(H * n, np.float32)
    b = np.zeros(H * n, np.float32)
    p = np.empty((H, n), np.float32)
    s = np.empty(H, np.float32)
    v = np.empty((H, L), np.float32)
    acc = np.empty((2, _NTA * _NRA, LANES), np.float32)
    acc8 = np.empty((4, 4, _LANES8), np.float32)
    fl = region.flags(17)
    dsh, sc, mfl = _end_setup(dall, mi, rk)
    for i in prange(2):
        _mla_layer1_part(np.int64(i), x, y, tab, p0, p1, work, H, nope, rope, vd, L, qa, qn, ckv, q, o, gz, og, wkv,
                         kb, vb, past, qgain, cgain, neps, scale, ql, a, b, p, s, v, acc[i], acc8, fl, emode, has_p, V,
                         mw, meps, vl, nw, eneps, hs, yn, rtab, rout, rk, rbias, rscale, ids, wts, e, dall, mi, mnw,
                         meps2, situ, beta, lb, has_lb, mtab, mout, dsh, sc, mfl)


#: id(o_proj weight) -> its layer's MLA plan; the entry goes with that weight object
_MLA_PLANS: dict = {}


def _mla_plan_fill(p: _Plan, mats, H: int, nope: int, rope: int, vd: int, L: int, d: int) -> None:
    q_a, q_norm, q_b, kv_a, kv_norm, wkv, g_w, o_w = mats
    p.tab = None
    lora = q_b is not None
    of_x = [q_a, kv_a] + ([g_w] if g_w is not None else [])
    if not all(_bf16_2d(w) for w in of_x + [wkv, o_w] + ([q_b] if lora else [])) or any(w.shape[1] != d for w in of_x):
        return
    dq, qr = nope + rope, q_a.shape[0] if lora else 0
    if ((q_b if lora else q_a).shape[0] != H * dq or (lora and (q_b.shape[1] != qr or q_norm.numel() != qr))
            or kv_a.shape[0] != L + rope or kv_norm.numel() != L or wkv.shape != (H * (nope + vd), L)
            or (g_w is not None and g_w.shape[0] != H * vd) or o_w.shape[1] != H * vd):
        return
    o_qa, o_ckv = 0, qr
    o_g = o_ckv + L + rope
    o_qn = o_g + (H * vd if g_w is not None else 0)
    o_q = o_qn + qr
    o_o = o_q + H * dq
    o_og = o_o + H * vd
    nw = o_og + (H * vd if g_w is not None else 0)
    rows = [(d, q_a.shape[0], q_a.data_ptr(), 0, 0, 1, o_qa if lora else o_q),
            (d, L + rope, kv_a.data_ptr(), 0, 0, 1, o_ckv)]
    if g_w is not None:
        rows.append((d, H * vd, g_w.data_ptr(), 0, 0, 1, o_g))
    if lora:
        rows.append((qr, H * dq, q_b.data_ptr(), 1, o_qn, 1, o_q))
    rows.append((H * vd, o_w.shape[0], o_w.data_ptr(), 1, o_og if g_w is not None else o_o, 2, 0))
    p.tab = np.array(rows, np.int64)
    p.ints = np.array([H, nope, rope, vd, L, qr, int(g_w is not None), o_qa, o_ckv, o_g, o_qn, o_q, o_o, o_og, nw],
                      np.int64)
    p.wkv = wkv.view(torch.int16).numpy()
    p.qgain = described(q_norm, _f32_gain) if lora else _NO_GAIN
    p.cgain = described(kv_norm, _f32_gain)
    p.d_out = o_w.shape[0]


def mla_decode_layer(x, q_a, q_norm, q_b, kv_a, kv_norm, wkv, g_w, o_w, kb, vb, past: int, H: int, nope: int,
                     rope: int, vd: int, eps: float, scale: float, end: LayerEnd | None = None):
    """Latent MLA's whole one-token step after its input norm, in ONE parallel region
    (k3.quant.region), for a query at position ``past`` whose keys all lie in one
    softmax tile: the projections of x [1, d] by q_a (q_proj when ``q_b`` is None: no q
    LoRA), kv_a and the output gate's g_w (None: no gate); q_a's norm (q_norm, ``eps``)
    and q_b; the latent's norm (kv_norm) and the new cache row, written into kb [>past,
    L] and vb [>past, rope] (the state's buffers) at row ``past``; per head the absorbed
    query, the scores, ``scores_softmax``, the weighted latents over their sum and W_v of
    them (kv_b_proj ``wkv``: its key and value halves), the gate, o_proj ``o_w``: the
    calls ``mla_layer`` makes one by one (``dots``, ``prods`` and the one-token kernels'
    row code, the same blocks), so the same bits. Returns y [1, d_out], or None where
    this is not the path (not one token, no fused math or torch's row sum not re-done
    here, a weight not a contiguous bf16 matrix, shapes that do not fit): nothing
    written then. ``end``: a LayerEnd the region goes on with after y (its results in
    it, ``done`` set, when it did)."""
    if not (USE_VML and x.dim() == 2 and x.shape[0] == 1 and _rowsum_ok()):
        return None
    L = kv_norm.numel()
    p = _layer_plan(_MLA_PLANS, [q_a, q_norm, q_b, kv_a, kv_norm, wkv, g_w, o_w], (H, nope, rope, vd, L, x.shape[1]),
                    _mla_plan_fill)
    if p is None or kb.shape[1] != L or vb.shape[1] != rope or min(kb.shape[0], vb.shape[0]) <= past:
        return None
    y = np.empty(p.d_out, np.float32)
    ea = _END_NONE_ARGS if end is None else end.region_args(p.d_out)
    _mla_layer1(_flat(x), y, p.tab, p.ints, p.wkv, kb, vb, past, p.qgain, p.cgain, float(eps), np.float32(scale), *ea)
    if ea is not _END_NONE_ARGS:
        end.done = True
    return torch.from_numpy(y).view(1, -1)


def _exp_vector(a: torch.Tensor) -> np.ndarray:
    return torch.exp(a.reshape(-1).to(torch.float32)).numpy()


def kda_decay(u: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, n_heads: int,
              lower_bound: float | None, with_exp: bool = False):
    """KDA's log-space decay g [T, H, dk] from the raw gate u [T, H * dk] (formulas in
    k3.model.kda.kda_decay), with A = torch's exp of A_log (kept per weight), x = u +
    dt_bias. K3: lower_bound * (1 / (exp(-(A x)) + 1)). Kimi-Linear: (-A) * softplus(x),
    softplus(x) = x above 20, else with y = exp(min(x, 20)), v = 1 + y:
    y where v == 1, else (log(v) * y) / (v - 1). exp and log are torch's, one call each
    over all the elements; every other operation compiled, in that order. ``with_exp``:
    returns (g, exp(g)), torch's exp of g made in the same call (the recurrence's
    per-step decay factors)."""
    T, HD = u.shape
    args = _decay_args(u, a_log, dt_bias, n_heads, lower_bound)
    un, dtb, A, _, lb, lb_mode, buf, x, v, _, g = args
    shape = (T, n_heads, HD // n_heads)
    if USE_VML:
        eg = np.empty(T * HD if with_exp else 0, np.float32)
        _decay1(*args, eg)
        gt = torch.from_numpy(g.reshape(shape))
        return (gt, torch.from_numpy(eg.reshape(shape))) if with_exp else gt
    _decay_pre(un, dtb, A, n_heads, lb_mode, x, buf)
    torch.from_numpy(buf).exp_()
    if lb_mode:
        _decay_lb_post(buf.reshape(-1), lb, g.reshape(-1))
    else:
        _one_plus(buf.reshape(-1), v.reshape(-1))
        lv = torch.log(torch.from_numpy(v)).numpy()
        _decay_softplus_post(x, buf.reshape(-1), v.reshape(-1), lv.reshape(-1), A, n_heads, g.reshape(-1))
    gt = torch.from_numpy(g.reshape(shape))
    return (gt, torch.exp(gt)) if with_exp else gt


_cache_leave(_CACHE_PREV)
