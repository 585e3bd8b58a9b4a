"""The small per-token ops, fused: one numba call where torch would dispatch a chain of
elementwise ops (each ~3-10 us of dispatch for a few KB of arithmetic at decode).

Bit-identity with the torch chains they replace (tests/test_fused.py checks it) rests on
three facts: every function here does the same IEEE fp32 / fp64 operations in the same
order per element (a product is rounded before it is added: numba never contracts
``a + b * c`` into an fma without fast-math, which is never set); torch's rsqrt of a
double is 1 / sqrt correctly rounded; and whatever is not plain arithmetic (exp, tanh,
the reductions) stays with torch. Each element is computed by one thread, so the
results do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from llvmlite import ir
from numba import get_num_threads, get_thread_id, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant.bf16 import (LANES, _F32, _I16, _I32, _I64, _ISA, _V, _data_ptr, _fma, _row_ptr, _vfma, _vload, _vstore,
                          F32_ONLY, W_DTYPES, c_matrix, counted_loop, described, for_each_nt, make_tile,
                          widen_bf16_vec)

#: below this many elements a fused op runs on one thread (waking the pool costs more)
_SERIAL = 1 << 16


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
def _short_conv(x, w, state, out, new_state):
    T, C = x.shape
    K = w.shape[1]
    H = K - 1
    for t in range(T):
        for c in range(C):
            a = np.float32(0.0)
            for j in range(K):                      # z = cat(state, x); z[t + j] * w[:, j]
                s = t + j
                a = a + (state[s, c] if s < H else x[s - H, c]) * w[c, j]
            out[t, c] = a
    for i in range(H):                              # the last K-1 rows of z
        s = T + i
        for c in range(C):
            new_state[i, c] = state[s, c] if s < H else x[s - H, c]


def short_conv_sum(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None, out: torch.Tensor):
    """The causal depthwise conv of ``k3.model.ops.short_conv`` before its SiLU, written
    into ``out`` [T, C] (a view, e.g. columns of a wider buffer): out[t] = sum over
    j = 0..K-1 of z[t + j] * w[:, j], z = cat(state, x), summed from +0.0 in that
    order. x [T, C]; w fp32 [C, K]; state [K-1, C] or None (zeros). Returns the new
    state [K-1, C] (the last K-1 rows of z)."""
    T, C = x.shape
    K = w.shape[1]
    st = np.zeros((K - 1, C), np.float32) if state is None else state.numpy()
    new_state = np.empty((K - 1, C), np.float32)
    _short_conv(x.numpy(), w.numpy(), st, out.numpy(), new_state)
    return torch.from_numpy(new_state)


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
    shape = x.shape
    d = shape[-1]
    if x.dtype != torch.float32:
        raise ValueError(f"norm_rows takes float32 activations, got {x.dtype}")
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, d).contiguous()  # (each op costs us)
    out = np.empty((x2.shape[0], d), np.float32)
    wn = _NO_GAIN if w is None else described(w, _gain_array)
    _norm_rows(x2.numpy(), float(eps), wn, mean, out)
    y = torch.from_numpy(out)
    return y if x.dim() == 2 else y.view(shape)


@njit(parallel=True, cache=True, nogil=True)
def _kda_recurrent(S0, eg, k, beta, v, q, S, o):
    T, H, dk = k.shape
    dv = v.shape[2]
    for h in prange(H):                 # one head's state (dk x dv) stays in cache for all T
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


def _run(kernel, n, *args):
    """kernel(*args) on the kernels' threads, or on one thread for small n."""
    import numba
    nth = numba.get_num_threads()
    if nth > 1 and n < _SERIAL:
        numba.set_num_threads(1)
        try:
            kernel(*args)
        finally:
            numba.set_num_threads(nth)
    else:
        kernel(*args)


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
    if (into is None or into.shape != (H, dk, dv) or into.dtype != torch.float32 or not into.is_contiguous()
            or into.data_ptr() == S0.data_ptr()):
        into = torch.empty(H, dk, dv)
    S = into.numpy()
    o = np.empty((T, H, dv), np.float32)
    if T == 0:
        S[...] = S0.numpy()
    else:
        _run(_kda_recurrent, T * S.size, S0.numpy(), eg.numpy(), k.numpy(), beta.numpy(), v.numpy(), q.numpy(), S, o)
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


@njit(parallel=True, cache=True, nogil=True)
def _dots(x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, G, M, N, K, lim, causal, out, og, ostride, nth):
    # out[g*og + i*ostride + j] = dot(x[xr0 + g*xrg + i, xo0 + g*xog + k], w[wr0 + g*wrg + j, wo0 + g*wog + k])
    # over k < K in the canonical order (64 lanes, tree, then the K % 64 tail in order);
    # causal: row i only needs j <= lim + i (later j are left as they are)
    nj = K // LANES
    km = nj * LANES
    nti = (M + _NTA - 1) // _NTA
    acc_all = np.empty((nth, _NTA * _NRA, LANES), np.float32)
    for b in prange(G * nti):
        g = b // nti
        i0 = (b - g * nti) * _NTA
        nt = min(_NTA, M - i0)
        acc = acc_all[get_thread_id()]
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


_NTN, _NVN = {"avx512": (4, 4), "avx2": (4, 2), "generic": (4, 2)}[_ISA]
_CWN = _NVN * _V               # columns per product tile
_tile_nn = make_tile_nn(_NTN, _NVN, _V)


@njit(parallel=True, cache=True, nogil=True)
def _prods(x, xr0, xrg, xo0, xog, w, wr0, wrg, wo0, wog, G, M, N, K, lim, lim_on, out, og, ostride):
    # out[g*og + i*ostride + n] = fma chain over k < K (ascending, from +0) of
    # x[xr0 + g*xrg + i, xo0 + g*xog + k] * w[wr0 + g*wrg + k, wo0 + g*wog + n];
    # lim_on: row i only sums k <= lim + i, x being zero beyond (+0 lanes stay as they are)
    nti = (M + _NTN - 1) // _NTN
    for b in prange(G * nti):
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
        _run(_dots, G * M * N * max(K, 1), xn, *x_at, wn, *w_at, G, M, N, K,
             0 if causal is None else causal, causal is not None, out, a, b, get_num_threads())
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
        _run(_prods, G * M * N * max(K, 1), _rows2(x), *x_at, _rows2(w, bf16=True), *w_at, G, M, N, K,
             -1 if causal is None else causal, causal is not None, out, a, b)
    return torch.from_numpy(out)
