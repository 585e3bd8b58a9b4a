"""Sigmoid router (noaux_tc) and the (latent) mixture of experts.

Router: scores = sigmoid(x W_gate^T) in fp32; the top-k is chosen on scores +
e_score_correction_bias (ties to the lowest expert id, descending order); the weights
are the UNBIASED scores of the chosen experts, renormalised, times
routed_scaling_factor. Expert outputs are summed in fp32 in that top-k order, so a
token's result does not depend on which other tokens share the batch.
"""

from __future__ import annotations

import torch

from .ops import glu_act, linear, mlp, rms_norm, sigmoid, vec


def route(cfg, x: torch.Tensor, gate_w, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, d] -> (ids [T, k] long, weights [T, k] fp32)."""
    logits = linear(x, gate_w)
    scores = sigmoid(logits)
    biased = scores + vec(bias).reshape(1, -1) if bias is not None else scores
    # stable descending sort = ties resolved to the lowest expert index
    order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
    ids = order[:, : cfg.num_experts_per_token]
    wts = torch.gather(scores, 1, ids)
    if cfg.moe_renormalize:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return ids, wts * cfg.routed_scaling_factor


def moe_block(cfg, w, x: torch.Tensor, layer: int, provider, observer=None) -> torch.Tensor:
    """FFN of an MoE layer on the normed input x [T, d]."""
    T = x.shape[0]
    p = "block_sparse_moe."
    ids, wts = route(cfg, x, w[p + "gate.weight"], w.get(p + "gate.e_score_correction_bias"))
    latent = cfg.latent_size is not None
    z = linear(x, w[p + "routed_expert_down_proj.weight"]) if latent else x
    uniq = sorted(set(ids.flatten().tolist()))
    if observer is not None:
        observer.on_route(layer, ids)
    # Each expert runs once over the tokens that chose it; contributions are then summed
    # per token in top-k order, whatever groups the provider hands the experts out in.
    contrib = z.new_zeros(T, cfg.num_experts_per_token, z.shape[1])
    for group in provider.expert_groups(layer, uniq):
        for e, ew in group.items():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = linear(glu_act(cfg, linear(z[tok], ew.w1), linear(z[tok], ew.w3)), ew.w2)
            contrib[tok, slot] = y
    r = contrib[:, 0] * wts[:, :1]
    for j in range(1, cfg.num_experts_per_token):
        r = r + contrib[:, j] * wts[:, j:j + 1]
    if latent:
        if cfg.latent_moe_use_norm:
            r = rms_norm(r, w[p + "routed_expert_norm.weight"], cfg.rms_norm_eps)
        r = linear(r, w[p + "routed_expert_up_proj.weight"])
    if cfg.num_shared_experts:
        s = p + "shared_experts."
        r = r + mlp(cfg, x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
    return r


def dense_mlp(cfg, w, x):
    return mlp(cfg, x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
