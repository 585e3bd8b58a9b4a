"""Gated Multi-head Latent Attention without positional encoding (NoPE).

The 64 "rope" dims of the key are one vector shared by all heads and never rotated;
position enters the network only through KDA. The KV cache holds the expanded
per-head keys and values in fp32 (like the C engine), so a cached position gives
exactly the numbers a full recompute would produce for it.
"""

from __future__ import annotations

import torch

from ..config import MLA_NORM_EPS
from .ops import linear, rms_norm


def attend(q, k, v, past: int, scale: float) -> torch.Tensor:
    """Causal softmax attention, fp32. q [T, H, dk] for absolute positions past..past+T-1;
    k [S, H, dk], v [S, H, dv] for positions 0..S-1. Returns [T, H, dv]."""
    T, S = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,shd->hts", q, k) * scale  # [H, T, S]
    mask = torch.arange(S).unsqueeze(0) > (torch.arange(T) + past).unsqueeze(1)
    p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", p, v)


class MLAState:
    """KV cache of one MLA layer: k [S, H, nope+rope], v [S, H, v_dim], fp32."""

    __slots__ = ("k", "v")

    def __init__(self):
        self.k = None
        self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[0]


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
        if past:
            k = torch.cat([st.k, k], 0)
            v = torch.cat([st.v, v], 0)
        st.k, st.v = k, v
    o = attend(q, k, v, past, (nope + rope) ** -0.5).reshape(T, H * vd)
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(linear(x, w["self_attn.g_proj.weight"]))
    return linear(o, w["self_attn.o_proj.weight"])


__all__ = ["MLAState", "mla_layer", "MLA_NORM_EPS"]
