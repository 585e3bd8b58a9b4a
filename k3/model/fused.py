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
def _scale_rows(x, s, eps, w, out):
    R, d = x.shape
    gain = w.shape[0] > 0
    for r in range(R):
        inv = np.float32(1.0 / np.sqrt(s[r] + eps))
        for i in range(d):
            y = x[r, i] * inv
            out[r, i] = y * w[i] if gain else y


_NO_GAIN = np.empty(0, np.float32)


def scale_rows(x: torch.Tensor, s: torch.Tensor, eps: float, w: torch.Tensor | None = None) -> torch.Tensor:
    """The tail of an RMS / L2 norm: x * fp32(rsqrt(s + eps)) (* w), per row. x fp32
    [..., d]; s fp64 [...] (or [..., 1]): the row's mean or sum of squares, computed by
    torch; w fp32 [d] or None. Returns a new contiguous tensor shaped like x."""
    shape = x.shape
    d = shape[-1]
    x2 = x.reshape(-1, d)
    out = np.empty((x2.shape[0], d), np.float32)
    _scale_rows(x2.numpy(), s.reshape(-1).numpy(), float(eps), _NO_GAIN if w is None else w.reshape(-1).numpy(), out)
    return torch.from_numpy(out).view(shape)


@njit(parallel=True, cache=True, nogil=True)
def _decay(S, eg, out):
    H, dk, dv = S.shape
    for h in prange(H):
        for a in range(dk):
            e = eg[h, a]
            for b in range(dv):
                out[h, a, b] = S[h, a, b] * e


@njit(parallel=True, cache=True, nogil=True)
def _delta(S, k, beta, v, u):
    H, dk, dv = S.shape
    for h in prange(H):
        d = np.empty(dv, np.float32)
        for b in range(dv):
            d[b] = beta[h] * (v[h, b] - u[h, b])
        for a in range(dk):
            ka = k[h, a]
            for b in range(dv):
                S[h, a, b] = S[h, a, b] + ka * d[b]


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


def kda_decay_state(S: torch.Tensor, eg: torch.Tensor) -> torch.Tensor:
    """S * eg.unsqueeze(-1) as a new tensor: S [H, dk, dv], eg [H, dk] = exp(g_t)."""
    out = np.empty(S.shape, np.float32)
    _run(_decay, S.numel(), S.numpy(), eg.numpy(), out)
    return torch.from_numpy(out)


def kda_delta_update(S: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, u: torch.Tensor) -> None:
    """S += k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - u)).unsqueeze(1), IN PLACE (S is
    the step's own decayed copy): the delta rule's rank-1 update. S [H, dk, dv], k [H, dk],
    beta [H], v and u [H, dv]."""
    _run(_delta, S.numel(), S.numpy(), k.numpy(), beta.numpy(), v.numpy(), u.numpy())
