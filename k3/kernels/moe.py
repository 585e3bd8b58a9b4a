"""The mixture of experts, compiled: the router's top-k (``route_topk``), the routed
experts' FFN over a group in two grouped kernel calls with the GLU between
(``expert_ffn``), the weighted mix with the latent norm and the shared expert's GLU
(``moe_mix``), and the whole one-token MoE block as one parallel region
(``moe_decode``).
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
import torch
from numba import njit, prange

from . import vml
from . import region
from .aten import _LANES8, _rowsum_ok, _torch_row_sum
from .bf16 import _bf16_matrix, _t1_rows, run_bf16_jobs
from .launch import J_ADDR, J_N, J_OFF, J_X0, J_X1, _as_f32_activations, described, empty64
from .mxfp4 import _mxfp4_weight, _t1_rows as _mx_t1_rows, perm_steps, run_mxfp4_jobs, split_evens_odds, t1_perm
from .mxfp4_tiles import _u8_ptr
from .norms import _NO_GAIN, _array, _exp_neg, _f32_gain, _f32_vector, _flat, _gain_array, _gate_up, _glu, _glu_into, _glu_of, _glu_params, _neg_exp, _norm_rows, _weighted_sum, norm_rows, weighted_sum
from .plans import _Plan, _bf16_2d, _f32p, _layer_plan
from .simd import _i16_ptr
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

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
    if not vml.AVAILABLE:
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


#: the one-token MoE block's mix step (``_moe_mix1``): the routing weights, whether there is
#: a latent norm, its eps and gain, the shared expert's gate | up, the GLU's parameters
MoeMix = namedtuple("MoeMix", "wts norm eps nw gu_s situ beta lb has_lb")
#: its output: the BF16 rows after the mix (latent up, shared down), how they sum
#: (``moe_decode``'s modes), the output y and the residual base (empty: none)
MoeOut = namedtuple("MoeOut", "tab mode y base")


@njit(cache=True, nogil=True)
def _moe_decode1_part(c, z, d, mix, out, mx, sc, fl):
    """Thread c's part of ``_moe_decode1`` (a plain function: the region's loop body,
    compiled once, not into the parallel loop's lowering)."""
    wts, norm, eps, nw, gu_s, situ, beta, lb, has_lb = mix
    tab, mode, y, base = out
    gu, hx, contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop = sc
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
    # a plain tuple: numba's parfor lowering rebuilds a namedtuple only from its class's own call
    return gu, hx, contrib, work, r, hs, down, P1, P3, ze, zo, zep, zop, he, ho, hep, hop


@njit(cache=True, nogil=True)
def _end_moe(c, fl, dall, ids, z, mix, out, dsh, sc):
    """Thread c's part of an MoE block run at the end of a mixer's region (``_end_part``),
    every routed expert of the layer at hand (descriptors dall [E, 3, ...]): the chosen
    experts' descriptors and z's split (one thread), then ``_moe_decode1``'s steps (its
    flags ``fl``, its workspace ``sc`` from ``_moe_scratch``)."""
    mx = dall.shape[2] == 4
    if region.claim(fl, 9):
        for j in range(dsh.shape[0]):
            dsh[j] = dall[ids[0, j]]
        P1, ze, zo, zep, zop = sc[7], sc[9], sc[10], sc[11], sc[12]
        _mx_input(z, mx, P1, ze, zo, zep, zop)
        region.finish(fl, 9)
    region.wait(fl, 9)
    _moe_decode1_part(c, z, dsh, mix, out, mx, sc, fl)


@njit(parallel=True, cache=True, nogil=True)
def _moe_decode1(z, d, inter_s, mix, out):
    """moe_decode's region: the experts' gate and up products (gates on one half, ups on
    the other), their GLU (one thread), the down products (the experts in two halves),
    ``_moe_mix1`` (one thread), the table's BF16 rows (latent up-projection, shared
    expert's down projection: each in halves), the sum (one thread). ``mode``: y is the
    up-projection (0), plus the shared expert's down (1), the mix plus it (2), the mix (3);
    then plus ``base`` where it is not empty. Returns False, having done nothing, where
    the descriptors do not chain on z (``_chains``)."""
    G, inter, dz, n_out = d.shape[0], d[0, 0, 0], z.shape[1], out.y.size
    if not _chains(d, dz) or d.shape[2] == 4 and (dz % 2 or inter % 2):
        return False
    mx = d.shape[2] == 4
    sc = _moe_scratch(G, inter, dz, inter_s, n_out, mx)
    _mx_input(z, mx, sc[7], sc[9], sc[10], sc[11], sc[12])
    fl = region.flags(9)
    for i in prange(2):
        _moe_decode1_part(np.int64(i), z, d, mix, out, mx, sc, fl)
    return True


def moe_decode(z, descs: np.ndarray, wts, norm_w, eps: float, shared_gu, situ: tuple | None, up_w, down_w,
               base: torch.Tensor | None = None):
    """An MoE block's one-token step after the router and the expert fetch, in ONE
    parallel region (k3.kernels.region): the routed experts (descriptors ``descs`` [k, 3,
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
    if not vml.AVAILABLE or z.dim() != 2 or z.shape[0] != 1 or descs.ndim != 3 or descs.shape[0] == 0:
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
    mix = MoeMix(_array(wts), norm_w is not None, float(eps),
                 _NO_GAIN if norm_w is None else described(norm_w, _f32_gain), gu, *_glu_params(situ))
    if not _moe_decode1(zn, descs, inter_s, mix, MoeOut(p.tab, p.mode, y, bn)):
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
    if vml.AVAILABLE and renorm and k >= _LANES8 and _rowsum_ok():  # the renormalising sum re-done: one call
        xn = _flat(logits)
        _route_topk_sum(xn, bn, k, ids, wts, np.empty_like(xn), np.float32(scale),
                        np.empty((4, 4, _LANES8), np.float32))
        return torch.from_numpy(ids), torch.from_numpy(wts)
    if vml.AVAILABLE:
        xn = _flat(logits)
        _route_topk1(xn, bn, k, ids, wts, np.empty_like(xn))
    else:
        _route_topk(_exp_neg(_flat(logits)).reshape(T, E), bn, k, ids, wts)
    w = torch.from_numpy(wts)
    total = w.sum(-1, keepdim=True).numpy() if renorm else wts[:, :1]
    _route_scale(wts, total, renorm, np.float32(scale))
    return torch.from_numpy(ids), w


_cache_leave(_CACHE_PREV)
