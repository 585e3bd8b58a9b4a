"""Per-token elementwise ops as single compiled calls: the fixed-order norm statistic
(``norm_rows``, ``add_norm``), finite checks, weighted sums, sigmoid / SiLU / gate and
the SiLU- and SiTU-GLUs. Each does the IEEE operations of the torch chain it replaces
in the same order; exp, tanh and log are torch's own (``k3.kernels.vml``) or torch
calls between two compiled passes.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit
from numba import types
from numba.extending import intrinsic

from . import vml
from .launch import described
from .simd import _F32, _I32
from .vml import vexp, vtanh
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

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


# ------------------------------------------------------------------ gates, GLUs, router
# exp and tanh must be torch's (its vectorised exp / tanh give bits numba's libm does
# not, and a position-independent result, k3.model.ops). Where k3.kernels.vml can call
# torch's own routines from compiled code (vml.AVAILABLE), each chain below is ONE compiled
# call; otherwise one compiled pass writes their arguments side by side in one buffer,
# one torch call per function runs over its part of that buffer, and one compiled pass
# combines the results. Either way: the same IEEE operations in the same order per
# element as the torch chain (numba rounds every float32 operation; the scalars are
# passed as float32, as torch casts a Python number to the tensor's dtype).

#: call torch's exp / tanh / log from the compiled passes (tests switch it off to check
#: that both forms give the same bits)


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
    (the form without vml.AVAILABLE)."""
    e = np.empty_like(xn)
    _neg(xn, e)
    torch.from_numpy(e).exp_()
    return e


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) per element: -x, torch's exp, + 1, 1 / that (in that order)."""
    xn = _flat(x)
    out = np.empty_like(xn)
    if vml.AVAILABLE:
        _sigmoid1(xn, out)
    else:
        _sigmoid_post(_exp_neg(xn), out)
    return torch.from_numpy(out.reshape(x.shape))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) per element."""
    xn = _flat(x)
    out = np.empty_like(xn)
    if vml.AVAILABLE:
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
    if vml.AVAILABLE:
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
    compiled call with vml.AVAILABLE, else torch's tanh / exp between two compiled passes."""
    if vml.AVAILABLE:
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


def _f32_vector(b: torch.Tensor) -> np.ndarray:
    return b.reshape(-1).to(torch.float32).numpy()


_cache_leave(_CACHE_PREV)
