"""Elementwise and small ops of the K3 / Kimi-Linear forward pass.

Numeric contract: weights arrive as stored (BF16, F32, MXFP4); every activation,
accumulation, norm and softmax here is fp32 (norm statistics in fp64, like the C
engine). Each op is per token, so a token's result does not depend on how many
tokens share the call: prefill, decode, full recompute, a speculative verification and
a batch of sequences see the same numbers.

Position independence: torch computes some elementwise functions (sigmoid, silu,
softplus, log1p) with a vectorised formula in the body of a tensor and a scalar one in
its tail and at the seams between threads, so an element's bits depend on where it sits
and on the thread count. exp, tanh and log do not, nor does IEEE arithmetic: the
functions below are built from those alone.
"""

from __future__ import annotations

import torch

from ..kernels import attn_res as k_attn_res, kda as k_kda, norms as k_norms
from ..kernels import bf16_grouped, bf16_linear, mxfp4_grouped, mxfp4_linear
from ..kernels.launch import described
from ..kernels.norms import norm_rows
from .weights import Mxfp4Weight


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """y = x @ W.T for x fp32 [T, in]; W BF16 / F32 tensor [out, in] or Mxfp4Weight."""
    if isinstance(w, Mxfp4Weight):
        return mxfp4_linear(x.contiguous(), w.packed, w.scale)
    if not isinstance(w, torch.Tensor):  # RowChunks: a matrix streamed in row blocks
        return torch.cat([linear(x, c) for c in w.chunks()], dim=1)
    if w.dtype == torch.bfloat16:
        return bf16_linear(x.contiguous(), w)
    # F32 (fixtures, small F32 checkpoints) or F16: accumulate in fp64 like the C engine's
    # double accumulators, so cancelling sums stay within the fixtures' 1e-5.
    return (x.double() @ w.double().T).to(torch.float32)


def _weight_format(w) -> str | None:
    if isinstance(w, Mxfp4Weight):
        return "mxfp4"
    if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous():
        return "bf16"
    return None


def kernel_format(ws) -> str | None:
    """"bf16" / "mxfp4" when every weight can go to that grouped kernel, else None (each
    weight object's format found once while it lives, ``described``)."""
    fmts = {described(w, _weight_format) for w in ws}
    return fmts.pop() if len(fmts) == 1 else None


def grouped_linear(x: torch.Tensor, ws, rows=None):
    """Several linears in ONE kernel call: weight g multiplies rows rows[g] = (x0, x1)
    of x (all of x when ``rows`` is None). Returns the flat fp32 result (each product
    row-major [x1 - x0, out_g], one after another), or None when the weights do not
    share a kernel format (F32 fixtures, streamed row chunks): then the caller runs
    ``linear`` per weight. Each element has the same bits as ``linear`` gives it."""
    fmt = kernel_format(ws)
    if fmt is None or not ws:
        return None
    return (bf16_grouped if fmt == "bf16" else mxfp4_grouped)(x.contiguous(), ws, rows)


def linears(x: torch.Tensor, ws) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """[linear(x, w) for w in ws] - the projections that read the same input - in one
    kernel call when the weights share a format (same bits either way)."""
    flat = grouped_linear(x, ws)
    if flat is None:
        return [linear(x, w) for w in ws]
    T, outs, off = x.shape[0], [], 0
    if T == 1:  # the [1, n] products lie side by side: one split, not a slice and a view each
        return flat.view(1, -1).split_with_sizes([w.shape[0] for w in ws], 1)
    for w in ws:
        n = w.shape[0]
        outs.append(flat[off:off + T * n].view(T, n))
        off += T * n
    return outs


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), position-independent (see the module docstring); fused."""
    return k_norms.sigmoid(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return k_norms.silu(x)


def gate(o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(z), elementwise (an output gate; o and z of one shape)."""
    return k_norms.gate(o, z)


def vec(w: torch.Tensor) -> torch.Tensor:
    """A small parameter vector as fp32 (norm gains, biases, conv taps)."""
    return w.to(torch.float32)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps); the mean of squares in fp64 in a fixed order, all
    in one fused call (k3.kernels.norms.norm_rows)."""
    return norm_rows(x, eps, w)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta).
    The sigmoid takes the uncapped gate; |out| <= beta*linear_beta. Fused: torch's tanh
    and exp, the arithmetic around them compiled (k3.kernels)."""
    return k_norms.situ_glu(g, u, beta, linear_beta)


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return k_norms.silu_glu(g, u)


def glu_act(cfg, g, u):
    if cfg.hidden_act == "situ":
        return situ_glu(g, u, cfg.situ_beta, cfg.situ_linear_beta)
    return silu_glu(g, u)


def mlp(cfg, x, gate_w, up_w, down_w, gu=None) -> torch.Tensor:
    """GLU MLP; ``gu``: the gate and up projections of x when the caller computed them
    (with other projections of x, in one call)."""
    g, u = linears(x, [gate_w, up_w]) if gu is None else gu
    return linear(glu_act(cfg, g, u), down_w)


def short_convs(xs, ws, states):
    """Causal depthwise conv + SiLU of several streams (KDA's q, k, v), one SiLU over all
    of them. Per stream: x [T, C]; w [C, 1, K] (w[:, 0, K-1] multiplies the current
    token); state [K-1, C] = the previous K-1 inputs (None: zeros, sequence start).
    Returns ([out [T, C]], [new_state [K-1, C]]). Fused (k3.kernels)."""
    return k_kda.short_convs_silu(xs, ws, states)


def short_conv(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None):
    """Causal depthwise conv + SiLU of one stream (see short_convs).
    Returns (out [T, C], new_state [K-1, C])."""
    (y,), (st,) = short_convs([x], [w], [state])
    return y, st


def l2_norm(x: torch.Tensor, eps: float, scale: float | None = None) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (sum, not mean); the sum in fp64.
    ``scale``: the result times scale, in the same call (the scale rounded to fp32
    first, as torch's tensor * number rounds it)."""
    if scale is None:
        return norm_rows(x, eps, mean=False)
    return norm_rows(x, eps, k_kda.scale_gain(x.shape[-1], scale), mean=False)


def attn_res(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
             post_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Attention Residuals mix. sources: list of fp32 [T, d]. The norm gain is folded into
    the pseudo-query (w = norm * proj); normalised sources are used only for scoring, the
    raw ones are mixed. Scores are an elementwise product summed over the contiguous last
    dim and the softmax runs along a contiguous last dim (one row per token): a batched
    matrix-vector product (`normed @ w`) and a softmax over a leading dim depend on the
    thread count. ``post_norm``: the mix's rms_norm with that gain (and eps) instead, the
    next sublayer's pre-norm, in the same call. One fused call (k3.kernels.attn_res.attn_mix)."""
    return k_attn_res.attn_mix(torch.stack(sources, 0), described(norm_w, mix_query, proj_w), eps,
                          None if post_norm is None else (post_norm, eps))


def mix_query(norm_w: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """w = fp32(norm) * fp32(proj) of an Attention Residuals mix (kept per live pair of
    weight objects by ``described``: it depends on nothing else)."""
    return vec(norm_w).reshape(-1) * vec(proj_w).reshape(-1)
