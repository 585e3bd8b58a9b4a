"""Gated Multi-head Latent Attention without positional encoding (NoPE).

The 64 "rope" dims of the key are one vector shared by all heads and never rotated;
position enters the network only through KDA (docs/MODEL.md §3.4).

Two forms of the KV cache, chosen per state (``MLAState.latent``):

* expanded: per position and head the key [nope | rope] and value, fp32, as the C
  engine holds them (K3: 96 x 320 floats per MLA layer);
* latent (the default): per position the normalised latent ``c`` (kv_lora_rank) and the
  shared rope key (qk_rope_head_dim) only, 576 floats per MLA layer for K3, 53x less.
  Attention runs in the latent space: kv_b_proj's key half is absorbed into the query
  (q_lat = W_k^T q_nope per head) and its value half applied after the weighted sum
  (o = W_v (sum_s p_s c_s)), the same attention in exact arithmetic.

A run uses one form for prefill, decode and full recompute alike.
"""

from __future__ import annotations

import torch

from ..config import MLA_NORM_EPS
from ..kernels.attention import dots, prods, scores_softmax, softmax_merge, softmax_tile
from .ops import gate as output_gate, linear, linears, rms_norm

#: keys per tile (fixed absolute positions 0, K_TILE, 2*K_TILE, ...)
K_TILE = 2048
#: the score tile's size target: query rows per tile = SCORE_TILE_BYTES / (heads x K_TILE x 4)
SCORE_TILE_BYTES = 16 << 20


def _online_softmax(T: int, H: int, past: int, scores, values, dv: int, like: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention for queries at absolute positions past..past+T-1 over keys
    0..past+T-1, tiled over queries and keys with a running (online) softmax, so the
    working set is a few [H, q_tile, K_TILE] tiles whatever the length. ``scores(t0, t1,
    s0, s1)`` gives the scaled scores [H, t1-t0, s1-s0]; ``values(p, t0, t1, s0, s1)``
    the weighted values [H, t1-t0, dv] of probabilities p (zero past each query's own
    position). Key tiles start at fixed
    positions. Returns [T, H, dv]."""
    out = like.new_empty(T, H, dv)
    q_tile = max(1, SCORE_TILE_BYTES // (H * K_TILE * 4))
    for t0 in range(0, T, q_tile):
        t1 = min(T, t0 + q_tile)
        m = like.new_full((H, t1 - t0, 1), float("-inf"))
        den = like.new_zeros(H, t1 - t0, 1)
        acc = like.new_zeros(H, t1 - t0, dv)
        for s0 in range(0, past + t1, K_TILE):  # keys past the last query's position are never seen
            s1 = min(past + t1, s0 + K_TILE)
            sc = scores(t0, t1, s0, s1)
            if s1 - 1 > past + t0:  # some key lies past the first query's position (never at decode)
                pos = torch.arange(t0, t1) + past  # absolute positions of these queries
                sc = sc.masked_fill(torch.arange(s0, s1).unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
            # m_new = max(m, amax(sc)) (finite: key 0 is in every query's first tile),
            # p = exp(sc - m_new), corr = exp(m - m_new); den, acc rescaled and summed
            p, m, corr = softmax_tile(sc, m)
            softmax_merge(den, acc, corr, p.sum(-1, keepdim=True), values(p, t0, t1, s0, s1))
        out[t0:t1] = (acc / den).transpose(0, 1)
    return out


def attend(q, k, v, past: int, scale: float) -> torch.Tensor:
    """Causal softmax attention, fp32. q [T, H, dk] for absolute positions past..past+T-1;
    k [S, H, dk], v [S, H, dv] for positions 0..S-1. Returns [T, H, dv]."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    q2, k2, v2 = (a.contiguous().view(a.shape[0], -1) for a in (q, k, v))
    return _online_softmax(
        T, H, past,
        lambda t0, t1, s0, s1: dots(q2, k2, H, t1 - t0, s1 - s0, dk, x_at=(t0, 0, 0, dk), w_at=(s0, 0, 0, dk),
                                    causal=past + t0 - s0).view(H, t1 - t0, s1 - s0) * scale,
        lambda p, t0, t1, s0, s1: prods(p.view(-1, s1 - s0), v2, H, t1 - t0, dv, s1 - s0, x_at=(0, t1 - t0, 0, 0),
                                        w_at=(s0, 0, 0, dv), causal=past + t0 - s0).view(H, t1 - t0, dv), dv, q)


def attend_latent(q_lat, q_pe, c, kpe, past: int, scale: float) -> torch.Tensor:
    """Attention with the keys and values in latent form: q_lat [T, H, L] (the absorbed
    queries), q_pe [T, H, R]; c [S, L], kpe [S, R] shared by all heads. Returns the
    weighted latents [T, H, L] (kv_b_proj's value half is applied by the caller)."""
    T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    ql2, qp2 = (a.contiguous().view(T, -1) for a in (q_lat, q_pe))
    c, kpe = c.contiguous(), kpe.contiguous()
    if T == 1 and past < K_TILE:  # decode, one key tile: no running maximum to carry
        n = past + 1
        one = scores_softmax(dots(ql2, c, H, 1, n, L, x_at=(0, 0, 0, L), causal=past),
                             dots(qp2, kpe, H, 1, n, R, x_at=(0, 0, 0, R), causal=past), scale, H, n)
        if one is not None:
            p, s = one
            v = prods(p, c, H, 1, L, n, x_at=(0, 1, 0, 0), causal=past).view(H, L)
            return (v / s.view(H, 1)).view(1, H, L)

    def scores(t0, t1, s0, s1):
        m, n, lim = t1 - t0, s1 - s0, past + t0 - s0
        return (dots(ql2, c, H, m, n, L, x_at=(t0, 0, 0, L), w_at=(s0, 0, 0, 0), causal=lim)
                + dots(qp2, kpe, H, m, n, R, x_at=(t0, 0, 0, R), w_at=(s0, 0, 0, 0), causal=lim)).view(H, m, n) * scale

    return _online_softmax(
        T, H, past, scores,
        lambda p, t0, t1, s0, s1: prods(p.view(-1, s1 - s0), c, H, t1 - t0, L, s1 - s0, x_at=(0, t1 - t0, 0, 0),
                                        w_at=(s0, 0, 0, 0), causal=past + t0 - s0).view(H, t1 - t0, L), L, q_lat)


class MLAState:
    """KV cache of one MLA layer: ``k``, ``v`` views of buffers with room for ``capacity``
    positions, so appending a token writes in place (a concatenation would hold two
    copies of the cache for a moment). Expanded form: k [S, H, nope+rope], v [S, H, v_dim];
    latent form: k = the normalised latents c [S, kv_lora_rank], v = the rope keys [S, rope]."""

    __slots__ = ("k", "v", "_kb", "_vb", "capacity", "latent")

    def __init__(self, capacity: int = 0, latent: bool = False):
        self.k = self.v = None
        self._kb = self._vb = None
        self.capacity = capacity
        self.latent = latent

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def room(self, n: int, k_shape: tuple, v_shape: tuple, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, grown where they had no room for n more positions (one position's
        key and value shapes; ``like``'s dtype); the cache's length is unchanged until
        ``extend``."""
        n1 = self.length + n
        if self._kb is None or n1 > self._kb.shape[0]:  # first use, or past the capacity: grow
            n0 = self.length
            cap = max(n1, self.capacity, 2 * (0 if self._kb is None else self._kb.shape[0]))
            kb, vb = like.new_empty(cap, *k_shape), like.new_empty(cap, *v_shape)
            if n0:
                kb[:n0], vb[:n0] = self.k, self.v
            self._kb, self._vb = kb, vb
        return self._kb, self._vb

    def extend(self, n: int) -> None:
        """The next n buffer rows (written by the caller) join the cache."""
        n1 = self.length + n
        self.k, self.v = self._kb[:n1], self._vb[:n1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n0 = self.length
        kb, vb = self.room(k.shape[0], k.shape[1:], v.shape[1:], k)
        kb[n0:n0 + k.shape[0]], vb[n0:n0 + k.shape[0]] = k, v
        self.extend(k.shape[0])

    def truncate(self, n: int) -> None:
        """Back to the first n positions (the buffer keeps its room)."""
        if n == 0:
            self.k = self.v = None
        elif n < self.length:
            self.k, self.v = self.k[:n], self.v[:n]


def mla_layer(cfg, w, x: torch.Tensor, st: MLAState | None) -> torch.Tensor:
    """x [T, d] normed input; attends causally over cached positions + these T, in the
    state's KV form (expanded when there is no state)."""
    T = x.shape[0]
    H, nope, rope, vd = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    lora = cfg.q_lora_rank is not None
    q_w = w["self_attn.q_a_proj.weight" if lora else "self_attn.q_proj.weight"]
    kv_a = w["self_attn.kv_a_proj_with_mqa.weight"]
    gate_w = w["self_attn.g_proj.weight"] if cfg.mla_use_output_gate else None
    scale = (nope + rope) ** -0.5
    st = st if st is not None else MLAState()
    past = st.length
    # every projection of x in one kernel call
    ws = [q_w, kv_a]
    if gate_w is not None:
        ws.append(gate_w)
    q, ckv, *gate = linears(x, ws)  # ckv [T, kv_lora + rope]
    if lora:
        q = linear(rms_norm(q, w["self_attn.q_a_layernorm.weight"], cfg.mla_norm_eps), w["self_attn.q_b_proj.weight"])
    q = q.reshape(T, H, nope + rope)
    c, k_pe = ckv[:, : cfg.kv_lora_rank], ckv[:, cfg.kv_lora_rank:]
    c = rms_norm(c, w["self_attn.kv_a_layernorm.weight"], cfg.mla_norm_eps)
    if st.latent:
        L = cfg.kv_lora_rank
        wkv = w["self_attn.kv_b_proj.weight"]  # [H * (nope + vd), L], read as stored (bf16 widened in registers)
        if wkv.dtype not in (torch.bfloat16, torch.float32):
            wkv = wkv.float()
        wkv = wkv.contiguous()
        st.append(c, k_pe)
        q2 = q.reshape(T, -1)
        # W_k^T q_nope per head: q_lat[t, h] = sum_j q[t, h, j] * wkv[h, j]
        q_lat = prods(q2, wkv, H, T, L, nope, x_at=(0, 0, 0, nope + rope), w_at=(0, nope + vd, 0, 0),
                      out_at=(L, H * L)).view(T, H, L)
        o_lat = attend_latent(q_lat, q[..., nope:], st.k, st.v, past, scale)
        # W_v o_lat per head: o[t, h, i] = o_lat[t, h] . wkv[h, nope + i]
        o = dots(o_lat.view(T, -1), wkv, H, T, vd, L, x_at=(0, 0, 0, L), w_at=(nope, nope + vd, 0, 0),
                 out_at=(vd, H * vd)).view(T, H * vd)
    else:
        kv = linear(c, w["self_attn.kv_b_proj.weight"]).reshape(T, H, nope + vd)
        st.append(torch.cat([kv[..., :nope], k_pe.unsqueeze(1).expand(T, H, rope)], -1), kv[..., nope:])
        o = attend(q, st.k, st.v, past, scale).reshape(T, H * vd)
    if cfg.mla_use_output_gate:
        o = output_gate(o, gate[0])
    return linear(o, w["self_attn.o_proj.weight"])


__all__ = ["MLAState", "mla_layer", "attend", "attend_latent", "MLA_NORM_EPS"]
