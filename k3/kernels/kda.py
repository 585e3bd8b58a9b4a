"""KDA's per-token steps, compiled: the short convs with SiLU, q/k L2 norms and beta,
the decay (K3's lower-bounded sigmoid, Kimi-Linear's softplus form), the recurrent
delta-rule steps (fixed summation order, one thread per head), the gated output norm,
and ``kda_decode`` (all of them after the projections, in one call).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import torch
from numba import njit, prange

from . import vml
from .launch import _run, described
from .norms import _NO_GAIN, _array, _f32_vector, _flat, _gain_array, _gate1, _norm_rows, _sigmoid1, _silu_post, gate, norm_rows, sigmoid
from .vml import vexp, vlog
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

#: what one element of a KDA recurrent state weighs against that limit: each step reads
#: and writes the whole state (two passes, from beyond L2), so even a small model's state
#: goes faster split over both cores' caches (docs/PERFORMANCE.md, "Per-token overhead")
_STATE_COST = 8


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


#: KDA's three short convs (``_conv_args``): inputs, taps [K, C], states, the output
#: [T, sum C] with the streams side by side and its SiLU's scratch, the new states
Convs = namedtuple("Convs", "x0 x1 x2 w0 w1 w2 s0 s1 s2 acc neg n0 n1 n2")
#: KDA's inputs step after them: the L2 norms' eps, q's gain (its scale), q, k, v, b and beta
KdaIn = namedtuple("KdaIn", "l2eps qgain q k v b beta")
#: the decay step (``_decay_args``, then exp(g)'s buffer)
Decay = namedtuple("Decay", "u dtb A H lb lb_mode buf x v lv g eg")
#: the recurrence: the state it starts from (never written), the new one, the output
Recurrence = namedtuple("Recurrence", "S0 S o")
#: the gated output norm: its gain and eps, the gate z, the norm's output, the gated output
GateNorm = namedtuple("GateNorm", "w eps z y out")
#: a KDA layer's constants (Python side): heads, the L2 norms' eps, q's scale, the decay's
#: lower bound (K3; None: Kimi-Linear's softplus form), the output norm's eps
KdaConsts = namedtuple("KdaConsts", "n_heads l2_eps q_scale lower_bound eps")
#: its small weights (Python side): conv taps [C, 1, K] of q, k, v, A_log, dt_bias, the output norm's gain
KdaWeights = namedtuple("KdaWeights", "conv_ws a_log dt_bias o_norm_w")


@njit(cache=True, nogil=True)
def _short_convs3(cv):
    x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2 = cv
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
def _short_convs3_silu(cv):
    _short_convs3(cv)
    _conv_silu(cv.acc, cv.neg)


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
    if vml.AVAILABLE:
        if len(xs) == 3:
            _short_convs3_silu(Convs(*xn, *wn, *sn, acc, e, *news))
        else:
            _short_convs1_silu(xn[0], wn[0], sn[0], acc, e, news[0])
    else:
        if len(xs) == 3:
            _short_convs3(Convs(*xn, *wn, *sn, acc, e, *news))
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
def _kda_inputs1(cv, inp):
    eps, qgain, q, k, v, b, beta = inp
    acc, x0, x1 = cv.acc, cv.x0, cv.x1
    _short_convs3_silu(cv)
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
    (vml.AVAILABLE): the causal convs + SiLU of q, k, v (short_convs_silu), q and k L2-normed
    per head (norm_rows without the mean, q times q_scale in the norm's last multiply),
    beta = sigmoid(b). The same operations, in the same order, as those calls one by one.
    Returns (q [T, H, dk], k [T, H, dk], v [T, H, dv], [new conv states], beta [T, H])."""
    T = xs[0].shape[0]
    cs = [x.shape[1] for x in xs]
    if not vml.AVAILABLE or len(xs) != 3 or cs[0] % n_heads or cs[1] != cs[0] or cs[2] % n_heads:
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
    _kda_inputs1(Convs(*xn, *wn, *sn, acc, np.empty_like(acc), *news),
                 KdaIn(float(eps), described(scale_gain(D, q_scale), _gain_array), q, k, v, bn, beta))
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
    if not vml.AVAILABLE:
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
def _kda_decode_in(cv, inp, dec):
    """kda_decode's steps before the recurrence (the inputs, the decay and its exp);
    returns q, k, v and exp(g) as [T, H, d]."""
    _kda_inputs1(cv, inp)
    _decay1(dec.u, dec.dtb, dec.A, dec.H, dec.lb, dec.lb_mode, dec.buf, dec.x, dec.v, dec.lv, dec.g, dec.eg)
    q, k, v, beta, eg = inp.q, inp.k, inp.v, inp.beta, dec.eg
    T, Hk = beta.shape
    return q.reshape(T, Hk, -1), k.reshape(T, Hk, -1), v.reshape(T, Hk, -1), eg.reshape(T, Hk, -1)


@njit(cache=True, nogil=True)
def _kda_decode1(cv, inp, dec, rec, gn):
    q3, k3, v3, e3 = _kda_decode_in(cv, inp, dec)
    S0, S, o = rec
    _kda_recurrent(S0, e3, k3, inp.beta, v3, q3, S, o)
    _norm_gate1(o.reshape(-1, o.shape[2]), gn.eps, gn.w, gn.z, gn.y, gn.out)


@njit(cache=True, nogil=True)
def _kda_decode1_serial(cv, inp, dec, rec, gn):
    q3, k3, v3, e3 = _kda_decode_in(cv, inp, dec)
    S0, S, o = rec
    _kda_recurrent_serial(S0, e3, k3, inp.beta, v3, q3, S, o)
    _norm_gate1(o.reshape(-1, o.shape[2]), gn.eps, gn.w, gn.z, gn.y, gn.out)


def kda_decode(xs, b, u, z, conv_states, S0, into, wts: KdaWeights, k: KdaConsts):
    """KDA after its projections (xs = [q_in, k_in, v_in], b, the decay's gate u, the
    output gate z), for a pass that is not chunked (decode), in ONE compiled call:
    ``kda_inputs`` (the convs + SiLU of q, k, v with their states, q and k L2-normed per
    head with q's scale, beta = sigmoid(b)), then the decay and its exp (kda_decay
    with_exp), the recurrence (kda_recurrent_steps: S0 [H, dk, dv] is never written)
    and the per-head RMS norm and output gate (norm_gate), each the same compiled code
    in the same order; q, k, v and beta never leave the call. Returns (the gated output
    [T, H * dv], the new state: ``into`` when that is a contiguous fp32 buffer of its
    shape other than S0, [the new conv states]), or None where that call is not the path
    (no fused math, no tokens, a head split that does not divide): the caller then runs
    those steps one by one. Small passes run serially (``_run``)."""
    T = xs[0].shape[0]
    cs = [x.shape[1] for x in xs]
    H = k.n_heads
    if (not vml.AVAILABLE or T == 0 or len(xs) != 3 or cs[0] % H or cs[1] != cs[0] or cs[2] % H
            or u.shape[1] != cs[0] or b.shape[-1] != H):
        return None
    dk, dv = cs[0] // H, cs[2] // H
    zn = _flat(z)
    if zn.size != T * H * dv:
        raise ValueError(f"kda_decode: gate {tuple(z.shape)} for an output of {T} x {H} x {dv}")
    xn, wn, sn, news, acc = _conv_args(xs, wts.conv_ws, conv_states)
    cv = Convs(*xn, *wn, *sn, acc, np.empty_like(acc), *news)
    inp = KdaIn(float(k.l2_eps), described(scale_gain(dk, k.q_scale), _gain_array), np.empty((T * H, dk), np.float32),
                np.empty((T * H, dk), np.float32), np.empty((T, cs[2]), np.float32), _array(b).reshape(T, H),
                np.empty((T, H), np.float32))
    dec = Decay(*_decay_args(u, wts.a_log, wts.dt_bias, H, k.lower_bound), np.empty(T * H * dk, np.float32))
    S0n = np.zeros((H, dk, dv), np.float32) if S0 is None else _array(S0)
    into = _state_into(into, S0, (H, dk, dv))
    out = np.empty(zn.size, np.float32)
    gn = GateNorm(described(wts.o_norm_w, _gain_array), float(k.eps), zn, np.empty((T * H, dv), np.float32), out)
    _run(_kda_decode1, _kda_decode1_serial, _STATE_COST * T * H * dk * dv, cv, inp, dec,
         Recurrence(S0n, into.numpy(), np.empty((T, H, dv), np.float32)), gn)
    return torch.from_numpy(out.reshape(z.shape)), into, [torch.from_numpy(n) for n in news]


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
    if vml.AVAILABLE:
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
