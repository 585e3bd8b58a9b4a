"""Sigmoid router (noaux_tc) and the (latent) mixture of experts.

Router: scores = sigmoid(x W_gate^T) in fp32; the top-k is chosen on scores +
e_score_correction_bias (ties to the lowest expert id, descending order); the weights
are the UNBIASED scores of the chosen experts, renormalised, times
routed_scaling_factor. Expert outputs are summed in fp32 in that top-k order, so a
token's result does not depend on which other tokens share the batch.

Routed experts run grouped (:func:`routed_experts`): per group of experts the provider
hands out, ONE kernel call multiplies every (token, expert) pair by its expert's gate
and up matrices and one more by the down matrices, with one compiled GLU between them
(k3.kernels.moe.expert_ffn). Each product has the bits of its own call, so this equals
a per-expert loop of linear calls bit for bit (tests/test_fused.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.launch import described
from ..kernels.moe import expert_descriptors, expert_ffn, moe_mix, route_topk
from .ops import glu_act, kernel_format, linear, linears, mlp


def route(cfg, x: torch.Tensor, gate_w, bias, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, d] -> (ids [T, k] long, weights [T, k] fp32). ``logits``: x W_gate^T when
    the caller computed it (with x's other projections, in one call)."""
    if logits is None:
        logits = linear(x, gate_w)
    # one compiled selection around torch's exp and the weights' sum (k3.kernels.moe.route_topk)
    return route_topk(logits, bias, cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)


def situ(cfg) -> tuple | None:
    """(beta, linear_beta) of a SiTU-GLU model, None for SiLU-GLU (the fused GLUs' form)."""
    return (cfg.situ_beta, cfg.situ_linear_beta) if cfg.hidden_act == "situ" else None


def _expert_kind(ew) -> tuple:
    """(kernel format of its three matrices or None, gate rows, and with a format their
    kernel descriptors [3, ...] as ``expert_ffn`` takes them) of one routed expert."""
    fmt = kernel_format([ew.w1, ew.w3, ew.w2])
    return fmt, ew.w1.shape[0], None if fmt is None else expert_descriptors(fmt, [ew.w1, ew.w3, ew.w2])


def group_format(ews) -> tuple[str | None, np.ndarray | None]:
    """(the kernel format every expert of a group shares (with one gate size), else None;
    then the group's descriptors [G, 3, ...] for expert_ffn). Kept per live expert
    object (``described``): a cache slot's expert is checked once."""
    kinds = [described(ew, _expert_kind) for ew in ews]
    fmt, rows = kinds[0][:2]
    if fmt is None or any(k[0] != fmt or k[1] != rows for k in kinds):
        return None, None
    return fmt, np.array([k[2] for k in kinds])


#: (token, expert) pairs one grouped call multiplies at most: a long prefill pass then
#: holds one contribution per pair, and the phases' buffers of one tile only
PAIR_TILE = 2048


def routed_experts(cfg, z: torch.Tensor, ids: torch.Tensor, layer: int, provider, groups=None) -> torch.Tensor:
    """contrib [T, k, d]: contrib[t, j] = expert ids[t, j] on z[t]. The (token, expert)
    pairs are sorted by expert, so each expert's tokens are one run of rows; per group of
    experts the provider hands out, and per tile of at most PAIR_TILE of its pairs, one
    grouped call (expert_ffn: gate and up, the GLU, down). One token (decode) needs no
    sort: its k experts are distinct, each reads row 0 of z, and its pairs are already
    in top-k order. ``groups``: the provider's expert groups for these ids when the
    caller has started reading them."""
    T, k = ids.shape
    flat = ids.numpy().reshape(-1)
    if T == 1:
        return _one_token(cfg, z, flat.tolist(), layer, provider, groups)
    order = np.argsort(flat, kind="stable")     # pair a -> its position t * k + j
    uniq, first, count = np.unique(flat[order], return_index=True, return_counts=True)
    experts = uniq.tolist()
    span = {e: (int(a), int(a + n)) for e, a, n in zip(experts, first, count)}
    contrib = z.new_empty(T * k, z.shape[1])
    for group in provider.expert_groups(layer, experts) if groups is None else groups:
        for tile in _tiles(list(group.items()), span, PAIR_TILE):
            where = np.concatenate([order[a:b] for _, _, (a, b) in tile])
            at = np.cumsum([0] + [b - a for _, _, (a, b) in tile]).tolist()
            x = z[torch.from_numpy(where // k)]     # the tile's inputs, grouped by expert
            rows = list(zip(at, at[1:]))
            contrib[torch.from_numpy(where)] = _experts_on(cfg, x, [ew for _, ew, _ in tile], rows)
    return contrib.view(T, k, -1)


def _tiles(items: list, span: dict, limit: int):
    """The (expert, weights, (a, b)) runs of a group's experts, in tiles of at most
    ``limit`` pairs (a longer run is cut into row ranges: each row is its own product)."""
    tile, n = [], 0
    for e, ew in items:
        a, b = span[e]
        while a < b:
            if n == limit:
                yield tile
                tile, n = [], 0
            take = min(b - a, limit - n)
            tile.append((e, ew, (a, a + take)))
            n, a = n + take, a + take
    if tile:
        yield tile


def _experts_on(cfg, x: torch.Tensor, ews: list, rows: list) -> torch.Tensor:
    """[pairs, d]: expert i of ``ews`` on the rows rows[i] = (a, b) of x, in that order:
    one grouped kernel call where the experts share a kernel format, else a linear
    call per expert (F32 fixtures)."""
    fmt, descs = group_format(ews)
    if fmt is not None:
        return torch.from_numpy(expert_ffn(fmt, x, [ew.w1 for ew in ews], [ew.w3 for ew in ews],
                                           [ew.w2 for ew in ews], rows, situ(cfg), descs)).view(-1, x.shape[1])
    return torch.cat([linear(glu_act(cfg, linear(x[a:b], ew.w1), linear(x[a:b], ew.w3)), ew.w2)
                      for ew, (a, b) in zip(ews, rows)])


def _one_token(cfg, z: torch.Tensor, experts: list, layer: int, provider, groups) -> torch.Tensor:
    """contrib [1, k, d] of one token: every expert reads row 0; its pair is its place
    in the top-k."""
    contrib = None
    for group in provider.expert_groups(layer, experts) if groups is None else groups:
        if not group:
            continue
        es, ews = list(group), list(group.values())
        y = _experts_on(cfg, z, ews, [(0, 1)] * len(es))
        if contrib is None and es == experts:  # one group, in top-k order: y is the result
            return y.view(1, len(experts), -1)
        pos = [experts.index(e) for e in es]
        if contrib is None:
            contrib = z.new_empty(len(experts), z.shape[1])
        contrib[pos] = y
    return contrib.view(1, len(experts), -1)


def router_projections(cfg, w) -> list:
    """The projections of an MoE layer's input that need no expert: the router gate, then
    the latent down-projection and the shared expert's gate and up where the model has
    them (one call reads them all)."""
    p, s = "block_sparse_moe.", "block_sparse_moe.shared_experts."
    ws = [w[p + "gate.weight"]]
    if cfg.latent_size is not None:
        ws.append(w[p + "routed_expert_down_proj.weight"])
    if cfg.num_shared_experts:
        ws += [w[s + "gate_proj.weight"], w[s + "up_proj.weight"]]
    return ws


def moe_block(cfg, w, x: torch.Tensor, layer: int, provider, observer=None,
              base: torch.Tensor | None = None) -> torch.Tensor:
    """FFN of an MoE layer on the normed input x [T, d], plus ``base`` [T, d] where given
    (the residual stream, added last)."""
    outs = linears(x, router_projections(cfg, w))   # every projection of x in one call
    ids, wts = route(cfg, x, None, w.get("block_sparse_moe.gate.e_score_correction_bias"), logits=outs[0])
    if observer is not None:
        observer.on_route(layer, ids)
    return moe_experts(cfg, w, x, outs, ids, wts, layer, provider, base)


def moe_experts(cfg, w, x: torch.Tensor, outs: list, ids: torch.Tensor, wts: torch.Tensor, layer: int, provider,
                base: torch.Tensor | None = None, groups=None) -> torch.Tensor:
    """The block after its router: the routed experts on z (x, or the latent down-
    projection outs[1]), their weighted sum with the latent norm, the latent up-projection,
    the shared expert (its gate and up are outs[-2:]), then ``base``. ``groups``: the
    provider's expert groups for ``ids`` when the caller has started reading them."""
    p = "block_sparse_moe."
    s = p + "shared_experts."
    latent = cfg.latent_size is not None
    z = outs[1] if latent else x
    # Each expert runs once over the tokens that chose it; contributions are then summed
    # per token in top-k order, whatever groups the provider hands the experts out in.
    # the weighted sum of the contributions, the latent norm and the shared expert's GLU: one call
    norm_w = w[p + "routed_expert_norm.weight"] if latent and cfg.latent_moe_use_norm else None
    shared_gu = outs[-2:] if cfg.num_shared_experts else None
    r, h = moe_mix(routed_experts(cfg, z, ids, layer, provider, groups), wts, norm_w, cfg.rms_norm_eps,
                   shared_gu, situ(cfg))
    if latent:
        r = linear(r, w[p + "routed_expert_up_proj.weight"])
    if cfg.num_shared_experts:
        r = r + linear(h, w[s + "down_proj.weight"])
    return r if base is None else base + r


def dense_mlp(cfg, w, x, base: torch.Tensor | None = None):
    y = mlp(cfg, x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
    return y if base is None else base + y
