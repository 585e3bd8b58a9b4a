"""Kimi Delta Attention (KDA): gated delta rule with per-channel decay.

Recurrence per head (state S [dk, dv], fp32, S0 = 0), read after the update:
    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T q_t
Two forms that agree to fp32 rounding: `kda_recurrent` (token by token, used for
decode) and `kda_chunked` (the same recurrence rewritten per chunk with a unit-lower-
triangular solve, used for prefill).
"""

from __future__ import annotations

import torch

from ..config import KDA_L2_EPS
from ..kernels.kda import kda_decay as fused_kda_decay
from ..kernels.kda import kda_inputs, kda_recurrent_steps, norm_gate
from .kda_state import KDAState, pool_take
from .ops import grouped_linear, linear, linears

CHUNK = 16
# Below this many tokens the recurrent form is used even for prefill.
CHUNK_MIN_T = 32


def kda_decay(u: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, n_heads: int,
              lower_bound: float | None, with_exp: bool = False):
    """Log-space decay g [T, H, dk] from the raw gate u [T, H*dk].
    K3 (lower_bound set): g = lb * sigmoid(exp(A_log[h]) * (u + dt_bias)).
    Kimi-Linear:          g = -exp(A_log[h]) * softplus(u + dt_bias).
    ``with_exp``: (g, exp(g)), both from one call."""
    return fused_kda_decay(u, a_log, dt_bias, n_heads, lower_bound, with_exp)


def kda_recurrent(q, k, v, g, beta, state, into: torch.Tensor | None = None, eg: torch.Tensor | None = None):
    """q, k [T, H, dk] (q already scaled), v [T, H, dv], g [T, H, dk] log-decay,
    beta [T, H], state [H, dk, dv] or None (never written). Returns (o [T, H, dv], the
    new state), the new state written into ``into`` when given (a buffer nobody else
    holds, of the state's shape). ``eg``: torch.exp(g) when the caller has it."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    S = q.new_zeros(H, dk, dv) if state is None else state.contiguous()
    c = torch.Tensor.contiguous
    return kda_recurrent_steps(S, c(torch.exp(g) if eg is None else eg), c(k), c(beta), c(v), c(q), into)


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunked form of `kda_recurrent` (same arguments and results).

    Within a chunk with cumulative log-decay G_t (inclusive) and start state S0:
      A[t,i] = sum_d k_t,d k_i,d exp(G_t,d - G_i,d)   (i < t)
      (I + diag(beta) A) U = diag(beta) (V - (exp(G) * K) S0)
      o_t = S0^T (exp(G_t) * q_t) + sum_{i<=t} u_i sum_d q_t,d k_i,d exp(G_t,d - G_i,d)
      S_L = exp(G_L) * S0 + sum_i (k_i * exp(G_L - G_i)) u_i^T
    Pairwise differences G_t - G_i <= 0 are exponentiated directly, so no term can
    overflow whatever the decay."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    S = q.new_zeros(H, dk, dv) if state is None else state.clone()
    out = q.new_empty(T, H, dv)
    for s0 in range(0, T, chunk):
        e = min(T, s0 + chunk)
        L = e - s0
        qc = q[s0:e].transpose(0, 1)  # [H, L, dk]
        kc = k[s0:e].transpose(0, 1)
        vc = v[s0:e].transpose(0, 1)  # [H, L, dv]
        bc = beta[s0:e].transpose(0, 1)  # [H, L]
        G = torch.cumsum(g[s0:e].transpose(0, 1), dim=1)  # [H, L, dk]
        diff = G.unsqueeze(2) - G.unsqueeze(1)  # [H, t, i, dk] = G_t - G_i
        incl = torch.tril(torch.ones(L, L, dtype=torch.bool))
        decay = torch.exp(diff.masked_fill(~incl.unsqueeze(-1), float("-inf")))
        A = torch.einsum("htd,hid,htid->hti", kc, kc, decay)
        A = A.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool), -1), 0.0)
        Bm = torch.einsum("htd,hid,htid->hti", qc, kc, decay)  # inclusive of i == t
        eG = torch.exp(G)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("hld,hdv->hlv", eG * kc, S))
        M = torch.eye(L).unsqueeze(0) + bc.unsqueeze(-1) * A
        U = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        o = torch.einsum("hld,hdv->hlv", eG * qc, S) + Bm @ U
        out[s0:e] = o.transpose(0, 1)
        tail = torch.exp(G[:, -1:, :] - G)  # [H, L, dk]
        S = eG[:, -1, :].unsqueeze(-1) * S + torch.einsum("hld,hlv->hdv", kc * tail, U)
    return out, S


def rollback(st: KDAState, conv: tuple, S0, keep: int) -> None:
    """Set st to what it was after the first ``keep`` tokens of the recorded pass, which
    started from conv histories ``conv`` and recurrent state ``S0``: the same operations
    on the same inputs as the pass (recurrent form), so the same bits."""
    r = st.record
    hist = []
    for c0, x in zip(conv, (r["q_in"], r["k_in"], r["v_in"])):
        z = torch.cat([c0 if c0 is not None else x.new_zeros(r["conv_len"], x.shape[1]), x[:keep]], 0)
        hist.append(z[keep:].clone())
    st.conv_q, st.conv_k, st.conv_v = hist
    if keep == 0:
        st.S = S0
    else:
        _, st.S = kda_recurrent(r["q"][:keep], r["k"][:keep], r["v"][:keep], r["g"][:keep], r["beta"][:keep], S0)


def input_projections(cfg, w) -> list:
    """The six matrices that read the mixer's input: q, k, v, the decay's first (f_a), b,
    and the output gate (g_proj, or its low-rank first half g_a_proj)."""
    gate = "self_attn.g_proj.weight" if cfg.kda_full_rank_gate else "self_attn.g_a_proj.weight"
    return [w[f"self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj")] + [w[gate]]


def kda_projections(cfg, w, x: torch.Tensor) -> tuple:
    """The projections of the normed input x [T, d]: (q_in, k_in, v_in, b, u, z), u the
    decay's raw gate and z the output gate, each [T, ...]; one kernel call for the six
    that read x, one more for the two second projections of the low-rank gates."""
    T = x.shape[0]
    q_in, k_in, v_in, f_a, b, z = linears(x, input_projections(cfg, w))
    f_b = w["self_attn.f_b_proj.weight"]
    if cfg.kda_full_rank_gate:
        u = linear(f_a, f_b)
    else:  # the decay's and the low-rank gate's second projections, in one call where they can share it
        g_b = w["self_attn.g_b_proj.weight"]
        flat = grouped_linear(torch.cat([f_a, z]), [f_b, g_b], [(0, T), (T, 2 * T)]) \
            if f_a.shape[1] == z.shape[1] else None
        if flat is None:
            u, z = linear(f_a, f_b), linear(z, g_b)
        else:
            u, z = flat[:T * f_b.shape[0]].view(T, -1), flat[T * f_b.shape[0]:].view(T, -1)
    return q_in, k_in, v_in, b, u, z


def uses_chunks(T: int, st: KDAState, chunked: bool | None) -> bool:
    """Whether a pass of T tokens on ``st`` takes the chunked form: prompts from
    CHUNK_MIN_T tokens unless the caller chose, never a pass that may be rolled back
    (speculative verification records the recurrent form's inputs)."""
    if st.record is not None:
        return False
    return T >= CHUNK_MIN_T if chunked is None else chunked


def kda_layer(cfg, w, x: torch.Tensor, st: KDAState | None, chunked: bool | None = None) -> torch.Tensor:
    """Full KDA mixer on the normed input x [T, d]; updates ``st`` in place if given."""
    st = st if st is not None else KDAState()
    return kda_mix(cfg, w, kda_projections(cfg, w, x), st, uses_chunks(x.shape[0], st, chunked))


def kda_mix(cfg, w, proj: tuple, st: KDAState, chunked: bool) -> torch.Tensor:
    """The mixer after its projections (``kda_projections``): convs, norms, decay, the
    delta rule in the chosen form, the gated output norm and the output projection."""
    q_in, k_in, v_in, b, u, z = proj
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    # convs + SiLU, q and k L2-normed per head (q scaled), beta = sigmoid(b): one call
    q, k, v, (st.conv_q, st.conv_k, st.conv_v), beta = kda_inputs(
        [q_in, k_in, v_in], [w[f"self_attn.{n}_conv1d.weight"] for n in "qkv"], [st.conv_q, st.conv_k, st.conv_v],
        b, H, KDA_L2_EPS, D ** -0.5)
    a_log, dt_bias = w["self_attn.A_log"], w["self_attn.dt_bias"]
    if chunked:
        g, eg = kda_decay(u, a_log, dt_bias, H, cfg.gate_lower_bound), None
    else:  # the recurrent form also takes exp(g), made in the decay's own call
        g, eg = kda_decay(u, a_log, dt_bias, H, cfg.gate_lower_bound, with_exp=True)
    if st.record is not None:
        st.record.update(q_in=q_in, k_in=k_in, v_in=v_in, q=q, k=k, v=v, g=g, beta=beta,
                         conv_len=w["self_attn.q_conv1d.weight"].shape[-1] - 1)
    if chunked:
        o, S = kda_chunked(q, k, v, g, beta, st.S)
    else:
        o, S = kda_recurrent(q, k, v, g, beta, st.S, into=pool_take((H, k.shape[-1], v.shape[-1])), eg=eg)
    st.advance(S)
    # fla FusedRMSNormGated(activation='sigmoid'): per-head RMSNorm, gain, then gate; all fp32.
    o = norm_gate(o, w["self_attn.o_norm.weight"], cfg.rms_norm_eps, z)
    return linear(o, w["self_attn.o_proj.weight"])
