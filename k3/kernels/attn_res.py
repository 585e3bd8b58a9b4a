"""The Attention Residuals mix (docs/MODEL.md): scores of the pseudo-query against the
normed bank, softmax over the bank, the weighted sum, optionally the next pre-norm,
in one compiled call where a check against torch gives the same bits.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from . import vml
from .aten import _LANES8, _VL, _rowsum_ok, _softmax_row, _torch_row_sum
from .launch import described
from .norms import _array, _gain_array, _norm_rows, _weighted_sum, norm_rows, weighted_sum
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

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


_cache_leave(_CACHE_PREV)
