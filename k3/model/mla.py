"""Gated Multi-head Latent Attention without positional encoding (NoPE).

The 64 "rope" dims of the key are one vector shared by all heads and never rotated;
position enters the network only through KDA. The KV cache holds the expanded
per-head keys and values in fp32 (like the C engine), so a cached position gives
exactly the numbers a full recompute would produce for it.
"""

from __future__ import annotations

import torch

from ..config import MLA_NORM_EPS
from .ops import linear, rms_norm, sigmoid


#: keys per tile (fixed absolute positions 0, K_TILE, 2*K_TILE, ...)
K_TILE = 2048
#: the score tile's size target: query rows per tile = SCORE_TILE_BYTES / (heads x K_TILE x 4)
SCORE_TILE_BYTES = 16 << 20


def attend(q, k, v, past: int, scale: float) -> torch.Tensor:
    """Causal softmax attention, fp32. q [T, H, dk] for absolute positions past..past+T-1;
    k [S, H, dk], v [S, H, dv] for positions 0..S-1. Returns [T, H, dv].

    Tiled over queries and keys with a running (online) softmax, so the working set is a
    few [H, q_tile, K_TILE] tiles whatever the length (a 14,000-token prompt would need
    several [H, T, T] score matrices otherwise). Key tiles start at fixed positions, so a
    query's numbers do not depend on how many queries share the call."""
    T, H, dk = q.shape
    out = q.new_empty(T, H, v.shape[-1])
    q_tile = max(1, SCORE_TILE_BYTES // (H * K_TILE * 4))
    for t0 in range(0, T, q_tile):
        t1 = min(T, t0 + q_tile)
        qb = q[t0:t1]
        pos = torch.arange(t0, t1) + past  # absolute positions of these queries
        m = q.new_full((H, t1 - t0, 1), float("-inf"))
        den = q.new_zeros(H, t1 - t0, 1)
        acc = q.new_zeros(H, t1 - t0, v.shape[-1])
        for s0 in range(0, past + t1, K_TILE):  # keys past the last query's position are never seen
            s1 = min(past + t1, s0 + K_TILE)
            sc = torch.einsum("thd,shd->hts", qb, k[s0:s1]) * scale
            sc = sc.masked_fill(torch.arange(s0, s1).unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))  # finite: key 0 is in every query's first tile
            p = torch.exp(sc - m_new)
            corr = torch.exp(m - m_new)
            den = den * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + torch.einsum("hts,shd->htd", p, v[s0:s1])
            m = m_new
        out[t0:t1] = (acc / den).transpose(0, 1)
    return out


class MLAState:
    """KV cache of one MLA layer: k [S, H, nope+rope], v [S, H, v_dim], fp32 - views of
    buffers with room for ``capacity`` positions, so appending a token writes in place
    (a concatenation would hold two copies of the cache for a moment)."""

    __slots__ = ("k", "v", "_kb", "_vb", "capacity")

    def __init__(self, capacity: int = 0):
        self.k = self.v = None
        self._kb = self._vb = None
        self.capacity = capacity

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n0 = self.length
        n1 = n0 + k.shape[0]
        if self._kb is None or n1 > self._kb.shape[0]:  # first use, or past the capacity: grow
            cap = max(n1, self.capacity, 2 * (0 if self._kb is None else self._kb.shape[0]))
            kb, vb = k.new_empty(cap, *k.shape[1:]), v.new_empty(cap, *v.shape[1:])
            if n0:
                kb[:n0], vb[:n0] = self.k, self.v
            self._kb, self._vb = kb, vb
        self._kb[n0:n1], self._vb[n0:n1] = k, v
        self.k, self.v = self._kb[:n1], self._vb[:n1]

    def truncate(self, n: int) -> None:
        """Back to the first n positions (the buffer keeps its room)."""
        if n == 0:
            self.k = self.v = None
        elif n < self.length:
            self.k, self.v = self.k[:n], self.v[:n]


def mla_layer(cfg, w, x: torch.Tensor, st: MLAState | None) -> torch.Tensor:
    """x [T, d] normed input; attends causally over cached positions + these T."""
    T = x.shape[0]
    H, nope, rope, vd = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is not None:
        cq = rms_norm(linear(x, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_layernorm.weight"], cfg.mla_norm_eps)
        q = linear(cq, w["self_attn.q_b_proj.weight"])
    else:
        q = linear(x, w["self_attn.q_proj.weight"])
    q = q.reshape(T, H, nope + rope)
    ckv = linear(x, w["self_attn.kv_a_proj_with_mqa.weight"])  # [T, kv_lora + rope]
    c, k_pe = ckv[:, : cfg.kv_lora_rank], ckv[:, cfg.kv_lora_rank:]
    c = rms_norm(c, w["self_attn.kv_a_layernorm.weight"], cfg.mla_norm_eps)
    kv = linear(c, w["self_attn.kv_b_proj.weight"]).reshape(T, H, nope + vd)
    k = torch.cat([kv[..., :nope], k_pe.unsqueeze(1).expand(T, H, rope)], -1)
    v = kv[..., nope:]
    past = 0
    if st is not None:
        past = st.length
        st.append(k, v)
        k, v = st.k, st.v
    o = attend(q, k, v, past, (nope + rope) ** -0.5).reshape(T, H * vd)
    if cfg.mla_use_output_gate:
        o = o * sigmoid(linear(x, w["self_attn.g_proj.weight"]))
    return linear(o, w["self_attn.o_proj.weight"])


__all__ = ["MLAState", "mla_layer", "MLA_NORM_EPS"]
