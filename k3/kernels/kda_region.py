"""KDA's whole one-token step as one parallel region (``kda_decode_layer``): the
projections, convs, norms, decay, recurrence, gated norm and output projection, and
then what its ``LayerEnd`` asks for.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
import torch
from numba import njit, prange

from . import vml
from . import region
from .kda import (Convs, Decay, GateNorm, KdaConsts, KdaIn, KdaWeights, Recurrence, _conv_taps, _exp_vector,
                  _kda_decode_in, _kda_head, _norm_gate1, _state_into, scale_gain)
from .launch import described
from .layer_end import END_NONE_ARGS, LayerEnd, _end_part, _end_setup
from .norms import _array, _f32_gain, _f32_vector, _flat, _gain_array
from .plans import RegionSteps, _Plan, _bf16_2d, _f32p, _layer_plan
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

#: the region's per-layer constants: the L2 norms' eps, q's gain, dt_bias and A (fp32), the
#: decay's lower bound and whether there is one, the output norm's gain and eps
KdaLayerConsts = namedtuple("KdaLayerConsts", "l2eps qgain dtb A lb lb_mode ow eps")
#: the weights the region reads (Python side): the six projections of x, the decay's and the
#: low-rank gate's second projections (g_b None for a full-rank gate), the output projection
KdaProj = namedtuple("KdaProj", "ws f_b g_b o_w")


@njit(cache=True, nogil=True)
def _kda_layer1_part(c, st, cv, inp, dec, rec, gn, views, res, rt, moe, ew):
    """Thread c's part of ``_kda_layer1`` (a plain function: the region's loop body,
    compiled once, not into the parallel loop's lowering)."""
    x, y, tab, p0, p1, work, fl = st
    H, beta = dec.H, inp.beta
    S0, S, o = rec
    q3, k3, v3, e3 = views
    region.bf16_step(tab, 0, p0, x, work, y, fl, 0, c)
    region.bf16_step(tab, p0, p1, x, work, y, fl, 2, c)
    if region.claim(fl, 4):
        _kda_decode_in(cv, inp, dec)
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
        _norm_gate1(o.reshape(H, o.shape[2]), gn.eps, gn.w, gn.z, gn.y, gn.out)
        region.finish(fl, 7)
    region.wait(fl, 7)
    region.bf16_step(tab, p1, tab.shape[0], x, work, y, fl, 8, c)
    _end_part(c, fl, np.int64(10), y, res, rt, moe, ew)


@njit(parallel=True, cache=True, nogil=True)
def _kda_layer1(x, y, tab, ints, taps, states, kc, S0, S, res, rt, moe):
    """kda_decode_layer's region (its ``_Plan`` has the table and the workspace layout):
    table rows 0 .. p0-1 (the projections of x), p0 .. p1-1 (the gate's second
    projections), then the steps of ``_kda_decode1`` (inputs and decay on one thread,
    the recurrence's heads in two halves, the gated norm on one thread), then the rows
    from p1 (the output projection, into y); pieces of k3.kernels.region, claimed by
    whichever thread comes first. ``taps`` and ``states``: the q, k, v convs'; ``kc``: a
    KdaLayerConsts; ``res``, ``rt``, ``moe``: the LayerEnd's. Returns the new conv states."""
    w0, w1, w2 = taps
    s0, s1, s2 = states
    l2eps, qgain, dtb, A, lb, lb_mode, ow, eps = kc
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
    views = (q.reshape(1, H, dk), k.reshape(1, H, dk), v.reshape(1, H, dv), eg.reshape(1, H, dk))
    fl = region.flags(14)
    ew = _end_setup(rt, moe)
    st = RegionSteps(x, y, tab, p0, p1, work, fl)
    cvs = Convs(x0, x1, x2, w0, w1, w2, s0, s1, s2, acc, neg, n0, n1, n2)
    inp = KdaIn(l2eps, qgain, q, k, v, b, beta)
    dec = Decay(un, dtb, A, H, lb, lb_mode, buf, xd, v1, lv, g, eg)
    rec = Recurrence(S0, S, o)
    gn = GateNorm(ow, eps, z, yn, out)
    for i in prange(2):
        _kda_layer1_part(np.int64(i), st, cvs, inp, dec, rec, gn, views, res, rt, moe, ew)
    return n0, n1, n2


#: id(o_proj weight) -> its layer's KDA plan; the entry goes with that weight object
_KDA_PLANS: dict = {}


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


def kda_decode_layer(x, proj: KdaProj, wts: KdaWeights, k: KdaConsts, conv_states, S0, into,
                     end: LayerEnd | None = None):
    """KDA's whole one-token step after its input norm, in ONE parallel region (see
    k3.kernels.region): the projections of x [1, d] by ``proj.ws`` (q, k, v, f_a, b and
    the gate: g_proj, or g_a_proj when ``g_b`` is its second projection), the decay's
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
    ws = proj.ws
    if not vml.AVAILABLE or x.dim() != 2 or x.shape[0] != 1 or len(ws) != 6:
        return None
    H = k.n_heads
    p = _layer_plan(_KDA_PLANS, list(ws) + [proj.f_b, proj.g_b] + list(wts.conv_ws)
                    + [wts.a_log, wts.dt_bias, wts.o_norm_w, proj.o_w], (H, k.q_scale, x.shape[1]), _kda_plan_fill)
    if p is None:
        return None
    dk, dv = int(p.ints[3]), int(p.ints[4])
    xn = _flat(x)
    sn = tuple(np.zeros((t.shape[0] - 1, t.shape[1]), np.float32) if st is None else _array(st)
               for t, st in zip(p.taps, conv_states))
    S0n = np.zeros((H, dk, dv), np.float32) if S0 is None else _array(S0)
    into = _state_into(into, S0, (H, dk, dv))
    y = np.empty(p.d_out, np.float32)
    lb_mode = k.lower_bound is not None
    kc = KdaLayerConsts(float(k.l2_eps), p.qgain, p.dtb, p.A, np.float32(k.lower_bound if lb_mode else 0.0), lb_mode,
                        p.ow, float(k.eps))
    ea = END_NONE_ARGS if end is None else end.region_args(p.d_out)
    news = _kda_layer1(xn, y, p.tab, p.ints, p.taps, sn, kc, S0n, into.numpy(), *ea)
    if ea is not END_NONE_ARGS:
        end.done = True
    return torch.from_numpy(y).view(1, -1), into, [torch.from_numpy(n) for n in news]


_cache_leave(_CACHE_PREV)
