"""Sigmoid router (noaux_tc) and the (latent) mixture of experts.

Router: scores = sigmoid(x W_gate^T) in fp32; the top-k is chosen on scores +
e_score_correction_bias (ties to the lowest expert id, descending order); the weights
are the UNBIASED scores of the chosen experts, renormalised, times
routed_scaling_factor. Expert outputs are summed in fp32 in that top-k order, so a
token's result does not depend on which other tokens share the batch.

Routed experts run grouped (:func:`routed_experts`): per group of experts the provider
hands out, ONE kernel call multiplies every (token, expert) pair by its expert's gate
and up matrices and one more by the down matrices, with one compiled GLU between them
(k3.model.fused.expert_ffn). Each product has the bits of its own call, so this equals
a per-expert loop of linear calls bit for bit (tests/test_fused.py).
"""

from __future__ import annotations

import weakref
from itertools import chain

import numpy as np
import torch

from ..quant.bf16 import described
from .fused import expert_descriptors, expert_ffn, moe_decode, moe_mix, route_topk
from .ops import glu_act, kernel_format, linear, linears, mlp


def route(cfg, x: torch.Tensor, gate_w, bias, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, d] -> (ids [T, k] long, weights [T, k] fp32). ``logits``: x W_gate^T when
    the caller computed it (with x's other projections, in one call)."""
    if logits is None:
        logits = linear(x, gate_w)
    # one compiled selection around torch's exp and the weights' sum (k3.model.fused)
    return route_topk(logits, bias, cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)


def _situ(cfg) -> tuple | None:
    """(beta, linear_beta) of a SiTU-GLU model, None for SiLU-GLU (the fused GLUs' form)."""
    return (cfg.situ_beta, cfg.situ_linear_beta) if cfg.hidden_act == "situ" else None


def _expert_kind(ew) -> tuple:
    """(kernel format of its three matrices or None, gate rows, and with a format their
    kernel descriptors [3, ...] as ``expert_ffn`` takes them) of one routed expert."""
    fmt = kernel_format([ew.w1, ew.w3, ew.w2])
    return fmt, ew.w1.shape[0], None if fmt is None else expert_descriptors(fmt, [ew.w1, ew.w3, ew.w2])


def _group_format(ews) -> tuple[str | None, np.ndarray | None]:
    """(the kernel format every expert of a group shares (with one gate size), else None;
    then the group's descriptors [G, 3, ...] for expert_ffn). Kept per live expert
    object (``described``): a cache slot's expert is checked once."""
    kinds = [described(ew, _expert_kind) for ew in ews]
    fmt, rows = kinds[0][:2]
    if fmt is None or any(k[0] != fmt or k[1] != rows for k in kinds):
        return None, None
    return fmt, np.array([k[2] for k in kinds])


def routed_experts(cfg, z: torch.Tensor, ids: torch.Tensor, layer: int, provider, groups=None) -> torch.Tensor:
    """contrib [T, k, d]: contrib[t, j] = expert ids[t, j] on z[t], two kernel calls per group
    of experts: the (token, expert) pairs are sorted by expert, so each expert's tokens
    are one run of rows; gate and up of every expert in one call, the GLU over all
    pairs at once, down in one call (expert_ffn). One token (decode) needs no sort:
    its k experts are distinct, each reads row 0 of z, and its pairs are already in
    top-k order. ``groups``: the provider's expert groups for these ids when the caller
    has started reading them."""
    T, k = ids.shape
    d = z.shape[1]
    flat = ids.numpy().reshape(-1)
    situ = _situ(cfg)
    if T == 1:
        experts = flat.tolist()
        x, span, dest = z, None, None
    else:
        order = np.argsort(flat, kind="stable")     # pair a -> its position t * k + j
        uniq, first, count = np.unique(flat[order], return_index=True, return_counts=True)
        experts = uniq.tolist()
        span = {e: (int(a), int(a + n)) for e, a, n in zip(experts, first, count)}
        x = z[torch.from_numpy(order // k)]     # the pairs' inputs, grouped by expert
        dest = {e: order[a:b].tolist() for e, (a, b) in span.items()}
    contrib, every = None, list(range(T * k))
    for group in provider.expert_groups(layer, experts) if groups is None else groups:
        if not group:
            continue
        es, ews = list(group), list(group.values())
        if T == 1:  # every expert reads row 0; its pair is its place in the top-k
            rows = [(0, 1)] * len(es)
            pos = every if es == experts else [experts.index(e) for e in es]
        else:
            rows, pos = [span[e] for e in es], [p for e in es for p in dest[e]]
        fmt, descs = _group_format(ews)
        if fmt is not None:
            y = torch.from_numpy(expert_ffn(fmt, x, [ew.w1 for ew in ews], [ew.w3 for ew in ews],
                                            [ew.w2 for ew in ews], rows, situ, descs)).view(-1, d)
            if contrib is None and pos == every:  # one group, in pair order: y is the result
                return y.view(T, k, d)
        if contrib is None:
            contrib = z.new_empty(T * k, d)
        if fmt is not None:
            contrib[pos] = y
            continue
        for i, (e, ew, (a, b)) in enumerate(zip(es, ews, rows)):  # no shared kernel format (F32 fixtures)
            contrib[[pos[i]] if T == 1 else dest[e]] = linear(
                glu_act(cfg, linear(x[a:b], ew.w1), linear(x[a:b], ew.w3)), ew.w2)
    return contrib.view(T, k, d)


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


def route_in(end, cfg, w, layer: int, provider) -> None:
    """Ask the layer's mixer region (``end``, a k3.model.fused.LayerEnd) for the router's
    projections and top-k too, and for the whole MoE block where the provider holds every
    routed expert of the layer (``resident_experts``)."""
    p, s = "block_sparse_moe.", "block_sparse_moe.shared_experts."
    end.route(cfg.hidden_size, router_projections(cfg, w), w.get(p + "gate.e_score_correction_bias"),
              cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
    resident = getattr(provider, "resident_experts", None)
    ews = resident(layer) if end.has_ids and resident is not None else None
    if ews is None:
        return
    descs = _all_experts(ews)
    if descs is not None:
        latent = cfg.latent_size is not None
        end.experts(descs, 1 if latent else None, (2 if latent else 1) if cfg.num_shared_experts else None,
                    w[p + "routed_expert_norm.weight"] if latent and cfg.latent_moe_use_norm else None,
                    cfg.rms_norm_eps, _situ(cfg), w[p + "routed_expert_up_proj.weight"] if latent else None,
                    w[s + "down_proj.weight"] if cfg.num_shared_experts else None)


#: a layer's resident ExpertSet -> its experts' descriptors (or None); an entry goes with its set
_ALL_EXPERTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_FORMAT = object()


def _all_experts(ews) -> np.ndarray | None:
    """The kernel descriptors [E, 3, ...] of every routed expert of a layer (``ews``, the
    ExpertSet a provider hands out unchanged while those experts stay where they are:
    kept per set, for as long as it lives), or None where they do not share one kernel
    format."""
    try:
        descs = _ALL_EXPERTS.get(ews)
    except TypeError:   # a sequence without weak references: made each time
        return _group_format(list(ews))[1]
    if descs is None:
        descs = _group_format(list(ews))[1]
        _ALL_EXPERTS[ews] = _NO_FORMAT if descs is None else descs
    return None if descs is _NO_FORMAT else descs


def moe_block(cfg, w, x: torch.Tensor, layer: int, provider, observer=None, end=None,
              base: torch.Tensor | None = None) -> torch.Tensor:
    """FFN of an MoE layer on the normed input x [T, d], plus ``base`` [T, d] where given (the
    residual stream, added last). ``end``: the LayerEnd whose region made x, with the
    router's projections (and top-k) of x when it did them, or the block's output when
    it ran the whole block (x and base are then not read)."""
    p = "block_sparse_moe."
    s = p + "shared_experts."
    latent = cfg.latent_size is not None
    if end is not None and end.done and end.has_out:  # the region ran the block too
        if observer is not None:
            observer.on_route(layer, end.ids)
        used = getattr(provider, "used_experts", None)   # (optional, as resident_experts is)
        if used is not None:
            used(layer, end.id_list())
        return end.out
    if end is not None and end.done and end.has_outs:
        outs = end.outs
        ids, wts = (end.ids, end.wts) if end.has_ids else route(
            cfg, x, None, w.get(p + "gate.e_score_correction_bias"), logits=outs[0])
    else:
        outs = linears(x, router_projections(cfg, w))   # every projection of x in one call
        ids, wts = route(cfg, x, None, w.get(p + "gate.e_score_correction_bias"), logits=outs[0])
    z = outs[1] if latent else x
    if observer is not None:
        observer.on_route(layer, ids)
    # Each expert runs once over the tokens that chose it; contributions are then summed
    # per token in top-k order, whatever groups the provider hands the experts out in.
    # the weighted sum of the contributions, the latent norm and the shared expert's GLU: one call
    situ = _situ(cfg)
    norm_w = w[p + "routed_expert_norm.weight"] if latent and cfg.latent_moe_use_norm else None
    shared_gu = outs[-2:] if cfg.num_shared_experts else None
    groups = None
    if x.shape[0] == 1:  # decode: experts, mix and projections in one parallel region when they allow it
        experts = ids.numpy().reshape(-1).tolist()
        groups = iter(provider.expert_groups(layer, experts))
        first = next(groups, None)
        if first is not None and list(first) == experts:
            fmt, descs = _group_format(list(first.values()))
            y = None if fmt is None else moe_decode(
                z, descs, wts, norm_w, cfg.rms_norm_eps, shared_gu, situ,
                w[p + "routed_expert_up_proj.weight"] if latent else None,
                w[s + "down_proj.weight"] if cfg.num_shared_experts else None, base)
            if y is not None:
                return y
        groups = groups if first is None else chain([first], groups)
    r, h = moe_mix(routed_experts(cfg, z, ids, layer, provider, groups), wts, norm_w, cfg.rms_norm_eps,
                   shared_gu, situ)
    if latent:
        r = linear(r, w[p + "routed_expert_up_proj.weight"])
    if cfg.num_shared_experts:
        r = r + linear(h, w[s + "down_proj.weight"])
    return r if base is None else base + r


def dense_mlp(cfg, w, x, base: torch.Tensor | None = None):
    y = mlp(cfg, x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
    return y if base is None else base + y
