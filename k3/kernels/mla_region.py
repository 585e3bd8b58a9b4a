"""Latent MLA's whole one-token step as one parallel region (``mla_decode_layer``):
projections, q and latent norms, the new cache row, absorbed query, one-tile softmax,
W_v, gate and output projection, then what its ``LayerEnd`` asks for.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
import torch
from numba import njit, prange

from . import vml
from . import region
from .aten import _LANES8, _rowsum_ok
from .attention import _NRA, _NTA, Dims, Limit, Operand, Target, _dots_block, _prods_block, _scores_softmax1
from .cpu import LANES
from .launch import described
from .layer_end import END_NONE_ARGS, LayerEnd, _end_part, _end_setup
from .norms import _NO_GAIN, _f32_gain, _flat, _gate1, _norm_rows
from .plans import RegionSteps, _Plan, _bf16_2d, _f32p, _layer_plan
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

# ------------------------------------------------------------------ MLA's one-token step
# MLA work-array slots (``ints``): heads, nope, rope, v dims, latent rank, q_a rows (0:
# no q LoRA), gated, then the offsets of q_a's output, ckv, the gate's input, the
# normed q_a, q, o and the gated o.
_M_H, _M_NOPE, _M_ROPE, _M_VD, _M_L, _M_QR, _M_GATED, _M_QA, _M_CKV, _M_G, _M_QN, _M_Q, _M_O, _M_OG, _M_NW = range(15)


#: the heads and widths: heads, nope and rope widths of a query head, value width, latent rank
MlaDims = namedtuple("MlaDims", "H nope rope vd L")
#: the region's views into its workspace: q_a's output and its norm, kv_a's (latent | rope
#: key), q, the heads' output, the gate's input and the gated output (empty: no gate)
MlaBufs = namedtuple("MlaBufs", "qa qn ckv q o gz og")
#: kv_b_proj as stored (its key and value halves) and the cache: latents kb and rope keys vb,
#: the new row written at ``past``
MlaKV = namedtuple("MlaKV", "wkv kb vb past")
#: q_a's and the latent's norm gains, their eps, the scores' scale
MlaNorms = namedtuple("MlaNorms", "qgain cgain neps scale")
#: the attention's scratch: absorbed queries, latent and rope scores, probabilities and
#: their sums, weighted latents, a thread's dot accumulators, the softmax's lanes
MlaScratch = namedtuple("MlaScratch", "ql a b p s v acc acc8")
#: the weights the region reads (Python side): q_a (q_proj without q LoRA), q_a's norm and
#: q_b (None without), kv_a, the latent's norm, kv_b_proj, the gate's g_proj (None: no
#: gate), o_proj
MlaWeights = namedtuple("MlaWeights", "q_a q_norm q_b kv_a kv_norm wkv g_w o_w")
#: its shape (Python side): heads, nope, rope, value width, the q_a / latent norms' eps, the scale
MlaShape = namedtuple("MlaShape", "H nope rope vd eps scale")


@njit(cache=True, nogil=True)
def _mla_layer1_part(c, st, dims, bufs, kv, nm, sc, res, rt, moe, ew):
    """Thread c's part of ``_mla_layer1`` (its loop body, compiled once)."""
    x, y, tab, p0, p1, work, fl = st
    H, nope, rope, vd, L = dims
    qa, qn, ckv, q, o, gz, og = bufs
    wkv, kb, vb, past = kv
    qgain, cgain, neps, scale = nm
    ql, a, b, p, s, v, acc, acc8 = sc
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
                _prods_block(g, Operand(q, 0, 0, 0, dq), Operand(wkv, 0, nope + vd, 0, 0), Dims(H, 1, L, nope),
                             Limit(-1, False), Target(ql, L, H * L))
                _dots_block(g, Operand(ql.reshape((1, H * L)), 0, 0, 0, L), Operand(kb, 0, 0, 0, 0), Dims(H, 1, n, L),
                            Limit(past, True), Target(a, n, n), acc)
                _dots_block(g, Operand(q, 0, 0, nope, dq), Operand(vb, 0, 0, 0, 0), Dims(H, 1, n, rope), Limit(past, True),
                            Target(b, n, n), acc)
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
                _prods_block(g, Operand(p, 0, 1, 0, 0), Operand(kb, 0, 0, 0, 0), Dims(H, 1, L, n), Limit(past, True),
                             Target(vf, L, L))
                for i in range(g * L, g * L + L):
                    vf[i] = vf[i] / s[g]
                _dots_block(g, Operand(v.reshape((1, H * L)), 0, 0, 0, L), Operand(wkv, nope, nope + vd, 0, 0),
                            Dims(H, 1, vd, L), Limit(0, False), Target(o, vd, H * vd), acc)
            region.finish(fl, 8 + h)
    region.wait(fl, 8)
    region.wait(fl, 9)
    if gz.size and region.claim(fl, 10):
        _gate1(o, gz, og)
        region.finish(fl, 10)
    region.wait(fl, 10)
    region.bf16_step(tab, p1, tab.shape[0], x, work, y, fl, 11, c)   # o_proj
    _end_part(c, fl, np.int64(13), y, res, rt, moe, ew)


@njit(parallel=True, cache=True, nogil=True)
def _mla_layer1(x, y, tab, ints, kv, nm, res, rt, moe):
    """mla_decode_layer's region (its ``_Plan``, from ``_mla_plan_fill``, has the table and
    the workspace layout, ``ints``: the _M_* slots): table rows 0 .. p0-1 (the projections of x), the norms
    and the cache's new row (one thread), rows p0 .. p1-1 (q_b), the heads' absorbed
    queries and scores in two halves, the softmax (one thread), the heads' weighted
    latents and values in two halves, the output gate (one thread), then the rows from
    p1 (o_proj, into y). ``kv``: an MlaKV, ``nm``: MlaNorms; ``res``, ``rt``, ``moe``: the
    LayerEnd's."""
    past = kv.past
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
    ew = _end_setup(rt, moe)
    st = RegionSteps(x, y, tab, p0, p1, work, fl)
    dims = MlaDims(H, nope, rope, vd, L)
    bufs = MlaBufs(qa, qn, ckv, q, o, gz, og)
    for i in prange(2):
        _mla_layer1_part(np.int64(i), st, dims, bufs, kv, nm, MlaScratch(ql, a, b, p, s, v, acc[i], acc8), res, rt,
                         moe, ew)


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


def mla_decode_layer(x, w: MlaWeights, shape: MlaShape, kb, vb, past: int, end: LayerEnd | None = None):
    """Latent MLA's whole one-token step after its input norm, in ONE parallel region
    (k3.kernels.region), for a query at position ``past`` whose keys all lie in one
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
    if not (vml.AVAILABLE and x.dim() == 2 and x.shape[0] == 1 and _rowsum_ok()):
        return None
    H, nope, rope, vd, eps, scale = shape
    L = w.kv_norm.numel()
    p = _layer_plan(_MLA_PLANS, list(w), (H, nope, rope, vd, L, x.shape[1]), _mla_plan_fill)
    if p is None or kb.shape[1] != L or vb.shape[1] != rope or min(kb.shape[0], vb.shape[0]) <= past:
        return None
    y = np.empty(p.d_out, np.float32)
    ea = END_NONE_ARGS if end is None else end.region_args(p.d_out)
    _mla_layer1(_flat(x), y, p.tab, p.ints, MlaKV(p.wkv, kb, vb, past),
                MlaNorms(p.qgain, p.cgain, float(eps), np.float32(scale)), *ea)
    if ea is not END_NONE_ARGS:
        end.done = True
    return torch.from_numpy(y).view(1, -1)


_cache_leave(_CACHE_PREV)
