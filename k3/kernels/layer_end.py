"""What a one-token mixer region goes on with after the mixer (``LayerEnd``): the
residual step (Kimi-Linear's add and post-norm; K3's partial sum and the FFN's
Attention Residuals mix), the router's projections and top-k, and, when every routed
expert of the layer is resident, the whole MoE block with the residual add.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
import torch
from numba import njit

from . import vml
from . import region
from .aten import _LANES8, _VL, _rowsum_ok
from .attn_res import _attn_mix_norm, _mix_ok
from .launch import described
from .moe import MoeMix, MoeOut, _chains, _end_moe, _moe_plan_fill, _moe_scratch, _route_topk_sum
from .norms import _NO_GAIN, _array, _f32_gain, _f32_vector, _gain_array, _glu_params, _norm_rows
from .plans import _Plan, _bf16_2d, _f32p, _layer_plan
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

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

#: the residual step: its mode, whether P exists, V (Kimi-Linear: h [1, 1, d]; K3: the bank
#: and P, P' written into its last row), the mix's query and eps, ATen's softmax lanes,
#: the post-norm's gain and eps, the new h (or the mix's scratch) and yn
Residual = namedtuple("Residual", "mode has_p V mw meps vl nw neps hs yn")
#: the router after it: its one-token rows (region.T_* columns), their output, the top-k
#: (0: not in the region), the score bias and scale, the chosen ids and weights, scratch
Router = namedtuple("Router", "tab out k bias scale ids wts e")
#: the MoE block after the router: every routed expert's descriptors, moe_decode's
#: layout (``mi``), the latent norm's gain and eps, the GLU's parameters, the latent-up and
#: shared-down rows, the layer's output
MoeEnd = namedtuple("MoeEnd", "descs mi nw eps situ beta lb has_lb tab out")


@njit(cache=True, nogil=True)
def _end_part(c, fl, s, y, res, rt, moe, ew):
    """The layer's next steps after the region's output y (thread c; pieces s .. s+3 of
    fl, then the MoE block's own flags in ``ew``): ``res`` a Residual, ``rt`` a Router,
    ``moe`` a MoeEnd, ``ew`` their workspace (``_end_setup``); see LayerEnd."""
    emode, has_p, V, mw, meps, vl, nw, neps, hs, yn = res
    rtab, rout, rk, rbias, rscale, ids, wts, e = rt
    dall, mi, mnw, meps2, situ, beta, lb, has_lb, mtab, out = moe
    dsh, mfl, sc = ew[0], ew[1], ew[2:]
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
            _end_moe(c, mfl, dall, ids, z, MoeMix(wts, mi[4] != 0, meps2, mnw, gu_s, situ, beta, lb, has_lb),
                     MoeOut(mtab, mi[3], out, base), dsh, sc)


@njit(cache=True, nogil=True)
def _end_setup(rt, moe):
    """_end_part's MoE workspace (empty without experts): the chosen experts'
    descriptors, the MoE steps' flags, then ``_moe_scratch``'s arrays, as one flat plain
    tuple: numba's parfor lowering rebuilds a namedtuple passed into a prange body only
    from its class's own call, and a tuple nested in a tuple not at all."""
    dall, mi = moe.descs, moe.mi
    G = rt.k if dall.shape[0] else 0
    dsh = np.empty((G, 3, dall.shape[2]), np.int64)
    return (dsh, region.flags(10)) + _moe_scratch(G, dall[0, 0, 0] if G else 0, mi[5], mi[2], mi[6],
                                                  dall.shape[2] == 4)


_NO_ROWS = np.empty((0, 7), np.int64)
_NO_V = np.empty((1, 1, 0), np.float32)
_NO_IDS = np.empty((1, 0), np.int64)
_NO_WTS = np.empty((1, 0), np.float32)
_NO_EXPERTS = np.empty((0, 3, 3), np.int64)
_NO_MI = np.zeros(8, np.int64)
_NO_ROUTER = Router(_NO_ROWS, _NO_GAIN, 0, _NO_GAIN, np.float32(0.0), _NO_IDS, _NO_WTS, _NO_GAIN)
_NO_MOE = MoeEnd(_NO_EXPERTS, _NO_MI, _NO_GAIN, 0.0, False, np.float32(1.0), np.float32(1.0), False, _NO_ROWS, _NO_GAIN)
#: a region that ends with its output: (Residual, Router, MoeEnd) that do nothing
END_NONE_ARGS = (Residual(END_NONE, False, _NO_V, _NO_GAIN, 0.0, _VL, _NO_GAIN, 0.0, _NO_GAIN, _NO_GAIN),
                 _NO_ROUTER, _NO_MOE)


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
        """The region's (Residual, Router, MoeEnd) for an output of d floats (END_NONE_ARGS
        where they do not fit)."""
        return self.args if self.d == d else END_NONE_ARGS

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
        self.args = (self.args[0], Router(p.tab, rout, rk, p.bn, p.scale, ids, wts,
                                          np.empty(p.tab[0, region.T_N], np.float32) if rk else _NO_GAIN), _NO_MOE)
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
        self.args = self.args[:2] + (MoeEnd(descs, *p.tail, out),)
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
    if not (vml.AVAILABLE and h.dim() == 2 and h.shape[0] == 1 and h.dtype == torch.float32):
        return None
    e = LayerEnd()
    d = h.shape[1]
    hs, yn = np.empty(d, np.float32), np.empty(d, np.float32)
    e.d, e._h, e._yn = d, hs, yn
    e.args = (Residual(END_PLAIN, False, _array(h).reshape(1, 1, d), _NO_GAIN, 0.0, _VL, described(post_w, _f32_gain),
                       float(eps), hs, yn), _NO_ROUTER, _NO_MOE)
    return e


def mix_end(bank: list, P: torch.Tensor | None, mix_w: torch.Tensor, eps: float, post_w: torch.Tensor,
            post_eps: float) -> LayerEnd | None:
    """K3's residual step for a region to finish with: P' = P + y (y when P is None), then
    attn_mix of bank + [P'] with the pseudo-query mix_w (fp32, the norm gain folded in)
    and the post-norm (post_w, post_eps) into yn; None where attn_mix would not run its
    compiled form (or not one token)."""
    if not (vml.AVAILABLE and bank and bank[0].dim() == 2 and bank[0].shape[0] == 1 and bank[0].shape[1] >= _LANES8
            and _mix_ok()):
        return None
    e = LayerEnd()
    V = torch.stack(bank + [bank[-1] if P is None else P], 0)  # the last row: P, then P' in place
    d = V.shape[2]
    yn = np.empty(d, np.float32)
    e.d, e._P, e._yn = d, V, yn
    e.args = (Residual(END_MIX, P is not None, V.numpy(), described(mix_w, _gain_array), float(eps), _VL,
                       described(post_w, _f32_gain), float(post_eps), np.empty(d, np.float32), yn), _NO_ROUTER, _NO_MOE)
    return e


_cache_leave(_CACHE_PREV)
