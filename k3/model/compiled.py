"""The compiled path of a layer: the one place that decides between a layer's parallel
regions and the plain forward.

stack.py, kda.py, mla.py and moe.py state the forward as the spec does. A decode step
(one token of one sequence) can instead run most of a layer in a few parallel regions
(k3/kernels: ``kda_decode_layer`` / ``mla_decode_layer`` for the mixer, continued by a
``LayerEnd`` into the residual step, the router and, where every routed expert of the
layer is resident, the whole MoE block; else ``moe_decode`` for the MoE block once its
experts are fetched), and a sequence's KDA recurrence can run in one call after its
projections (``kda_decode``). Every region does the IEEE operations of the plain forward
in the same order, so both ways give the same bits (tests/test_fused.py, test_golden.py).

The model decides once, when it is built (``why_plain``): the compiled path, or the plain
forward under K3_FUSED=0 or where torch's vector math cannot be called from compiled
code (``k3.kernels.vml``: every region needs it). Within the compiled path a region
still declines a step it does not cover (weights that are not contiguous BF16 matrices,
an MLA cache past one key tile, experts split by a bounded cache); that stage then runs
the plain forward, and ``ran`` counts which way each stage went.
"""

from __future__ import annotations

import weakref
from collections import Counter
from itertools import chain

import torch

from .. import env
from ..config import KDA_L2_EPS
from ..kernels import vml
from ..kernels.kda import KdaConsts, KdaWeights, kda_decode
from ..kernels.kda_region import KdaProj, kda_decode_layer
from ..kernels.launch import described
from ..kernels.layer_end import mix_end, plain_end
from ..kernels.mla_region import MlaShape, MlaWeights, mla_decode_layer
from ..kernels.moe import moe_decode
from ..kernels.norms import add_norm
from .kda import input_projections, kda_mix, kda_projections, uses_chunks
from .kda_state import pool_take
from .mla import K_TILE
from .moe import dense_mlp, group_format, moe_experts, route, router_projections, situ
from .ops import attn_res, linear, linears, mix_query, rms_norm


def why_plain(fused: bool | None = None) -> str | None:
    """Why the plain forward runs (None: it does not, the regions are on). ``fused``: the
    caller's choice (None: K3_FUSED, on unless "0")."""
    if not (env.fused() if fused is None else fused):
        return "K3_FUSED=0" if fused is None else "switched off by the caller"
    if not vml.AVAILABLE:
        return "torch's vector math cannot be called from compiled code here (k3.kernels.vml self-check)"
    return None


def describe(cfg, layers: range, fast: "Compiled | None", why: str | None) -> dict:
    """What runs where, for --verbose, `k3 doctor` and --out: regions on or off (and
    ``why`` not, ``why_plain``'s answer), and which layers have which region."""
    kinds = {"kda": [i for i in layers if not cfg.is_mla(i)], "mla": [i for i in layers if cfg.is_mla(i)],
             "moe": [i for i in layers if cfg.is_moe(i)]}
    out = {"regions": fast is not None, "vml": bool(vml.AVAILABLE), "plain_because": why,
           "layers": {k: _ranges(v) for k, v in kinds.items() if v}}
    if fast is not None:
        out["ran"] = dict(sorted(fast.ran.items()))
    return out


def summary(d: dict) -> str:
    """One line of ``describe``'s report, for the load log."""
    if not d["regions"]:
        return f"layers: the plain forward ({d['plain_because']})"
    names = {"kda": "KDA", "mla": "MLA (while the cache fits one key tile)", "moe": "MoE"}
    return ("layers: compiled regions for one-token steps (K3_FUSED=0 for the plain forward), torch's vector math "
            "called from them: " + "; ".join(f"{names[k]} {v}" for k, v in d["layers"].items()))


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 4] -> "0-2,4"."""
    out, start = [], None
    for a, b in zip(ids, ids[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = None
    return ",".join(out)


class Compiled:
    """A model's compiled layers. ``mixer`` runs one sequence's mixer (any number of
    tokens), ``decode_layer`` a whole layer for one token of one sequence; each stage a
    region does not cover runs the plain forward's code."""

    def __init__(self, cfg, provider, kda_chunked: bool | None):
        self.cfg, self.provider, self.kda_chunked = cfg, provider, kda_chunked
        # optional provider methods (a cache that can hold a whole layer's experts)
        self.resident = getattr(provider, "resident_experts", None)
        self.used = getattr(provider, "used_experts", None)
        self.ran: Counter = Counter()   # stage -> steps it ran as ("kda region", "plain mixer", ...)
        if any(not cfg.is_mla(i) for i in range(cfg.num_hidden_layers)):
            self.kda_consts = KdaConsts(cfg.kda_num_heads, KDA_L2_EPS, cfg.kda_head_dim ** -0.5,
                                        cfg.gate_lower_bound, cfg.rms_norm_eps)

    # ------------------------------------------------------------------ mixers
    def mixer(self, i, w, x, st, end=None):
        """Layer i's mixer on one sequence's rows, in a region where one applies, else
        None (nothing done: the caller runs the plain mixer). ``end``: the LayerEnd the
        one-token region finishes the layer's first half with."""
        y = self._mla(w, x, st, end) if self.cfg.is_mla(i) else self._kda(w, x, st, end)
        if y is None:
            self.ran["plain mixer"] += 1
        return y

    def _kda(self, w, x, st, end):
        cfg = self.cfg
        T = x.shape[0]
        H = cfg.kda_num_heads
        wts = KdaWeights([w[f"self_attn.{n}_conv1d.weight"] for n in "qkv"], w["self_attn.A_log"],
                         w["self_attn.dt_bias"], w["self_attn.o_norm.weight"])
        if T == 1 and not self.kda_chunked and st.record is None:  # the whole step in one parallel region
            ws = input_projections(cfg, w)
            proj = KdaProj(ws, w["self_attn.f_b_proj.weight"],
                           None if cfg.kda_full_rank_gate else w["self_attn.g_b_proj.weight"], w["self_attn.o_proj.weight"])
            step = kda_decode_layer(x, proj, wts, self.kda_consts, [st.conv_q, st.conv_k, st.conv_v], st.S,
                                    pool_take((H, ws[0].shape[0] // H, ws[2].shape[0] // H)), end)
            if step is not None:
                y, S, (st.conv_q, st.conv_k, st.conv_v) = step
                st.advance(S)
                self.ran["kda region"] += 1
                return y
        if st.record is not None or uses_chunks(T, st, self.kda_chunked):
            return None
        # the recurrent form after the projections: inputs, decay, recurrence, gated norm in one call
        proj = kda_projections(cfg, w, x)
        q_in, k_in, v_in, b, u, z = proj
        step = kda_decode([q_in, k_in, v_in], b, u, z, [st.conv_q, st.conv_k, st.conv_v], st.S,
                          pool_take((H, q_in.shape[1] // H, v_in.shape[1] // H)), wts, self.kda_consts)
        if step is None:
            self.ran["plain mixer"] += 1
            return kda_mix(cfg, w, proj, st, False)
        o, S, (st.conv_q, st.conv_k, st.conv_v) = step
        st.advance(S)
        self.ran["kda in one call"] += 1
        return linear(o, w["self_attn.o_proj.weight"])

    def _mla(self, w, x, st, end):
        cfg = self.cfg
        if not (x.shape[0] == 1 and st.latent and st.length < K_TILE):
            return None
        H, nope, rope, vd = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        lora = cfg.q_lora_rank is not None
        kb, vb = st.room(1, (cfg.kv_lora_rank,), (rope,), x)
        mats = MlaWeights(w["self_attn.q_a_proj.weight" if lora else "self_attn.q_proj.weight"],
                          w["self_attn.q_a_layernorm.weight"] if lora else None,
                          w["self_attn.q_b_proj.weight"] if lora else None, w["self_attn.kv_a_proj_with_mqa.weight"],
                          w["self_attn.kv_a_layernorm.weight"], w["self_attn.kv_b_proj.weight"],
                          w["self_attn.g_proj.weight"] if cfg.mla_use_output_gate else None,
                          w["self_attn.o_proj.weight"])
        y = mla_decode_layer(x, mats, MlaShape(H, nope, rope, vd, cfg.mla_norm_eps, (nope + rope) ** -0.5),
                             kb.numpy(), vb.numpy(), st.length, end)
        if y is not None:
            st.extend(1)
            self.ran["mla region"] += 1
        return y

    def _mixer_or_plain(self, model, i, w, xn, st, end):
        y = self.mixer(i, w, xn, st, end)
        return model.plain_mixer(i, w, xn, st) if y is None else y

    # ------------------------------------------------------------------ one layer, one token
    def decode_layer(self, model, i, w, bank, x, st, obs=None) -> torch.Tensor:
        """Layer i for one token of one sequence: x is the hidden state (``bank`` None,
        Kimi-Linear) or K3's partial block sum with its Attention Residuals ``bank``
        (extended in place on block boundaries, as the plain layer does). The region ends
        the mixer with the residual step (and the router, and the MoE block where it can),
        so the layer is one to three launches."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        post = w["post_attention_layernorm.weight"]
        ln = w["input_layernorm.weight"]
        if bank is None:  # Kimi-Linear: pre-norm residual
            h = x
            end = self._route_in(i, w, plain_end(h, post, eps))
            a = self._mixer_or_plain(model, i, w, rms_norm(h, ln, eps), st, end)
            if end is not None and end.done:  # the region did the add and the norm
                if end.has_out:   # and the whole MoE block
                    return self._ffn(i, w, None, None, obs, end)
                h, y = end.h, end.yn
            else:
                h, y = add_norm(h, a, post, eps)
            return self._ffn(i, w, y, h, obs, end)
        P = x
        xn = attn_res(bank + [P], w["self_attention_res_norm.weight"], w["self_attention_res_proj.weight"], eps,
                      post_norm=ln) if bank else rms_norm(P, ln, eps)
        if i % cfg.attn_res_block_size == 0:
            bank.append(P)
            P = None
        mix_w = described(w["mlp_res_norm.weight"], mix_query, w["mlp_res_proj.weight"])
        end = self._route_in(i, w, mix_end(bank, P, mix_w, eps, post, eps))
        a = self._mixer_or_plain(model, i, w, xn, st, end)
        if end is not None and end.done:  # the region made P + a and the mix
            if end.has_out:   # and the whole MoE block
                return self._ffn(i, w, None, None, obs, end)
            P, yn = end.p, end.yn
        else:
            P = a if P is None else P + a
            yn = attn_res(bank + [P], w["mlp_res_norm.weight"], w["mlp_res_proj.weight"], eps, post_norm=post)
        return self._ffn(i, w, yn, P, obs, end)

    def _route_in(self, i, w, end):
        """``end`` (a LayerEnd, or None where the region cannot end the layer), asked for
        the router's projections and top-k too when layer i is an MoE layer, and for the
        whole MoE block where the provider holds every routed expert of the layer."""
        cfg = self.cfg
        if end is None or not cfg.is_moe(i):
            return end
        p, s = "block_sparse_moe.", "block_sparse_moe.shared_experts."
        end.route(cfg.hidden_size, router_projections(cfg, w), w.get(p + "gate.e_score_correction_bias"),
                  cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
        ews = self.resident(i) if end.has_ids and self.resident is not None else None
        descs = None if ews is None else _all_experts(ews)
        if descs is not None:
            latent = cfg.latent_size is not None
            end.experts(descs, 1 if latent else None, (2 if latent else 1) if cfg.num_shared_experts else None,
                        w[p + "routed_expert_norm.weight"] if latent and cfg.latent_moe_use_norm else None,
                        cfg.rms_norm_eps, situ(cfg), w[p + "routed_expert_up_proj.weight"] if latent else None,
                        w[s + "down_proj.weight"] if cfg.num_shared_experts else None)
        return end

    def _ffn(self, i, w, x, base, obs, end):
        """base + layer i's FFN of x, one token; what ``end``'s region already did is taken
        from it (the router's projections and top-k, or the whole MoE block)."""
        cfg = self.cfg
        if not cfg.is_moe(i):
            return dense_mlp(cfg, w, x, base)
        p = "block_sparse_moe."
        s = p + "shared_experts."
        if end is not None and end.done and end.has_out:  # the mixer's region ran the block
            self.ran["moe in the mixer's region"] += 1
            if obs is not None:
                obs.on_route(i, end.ids)
            if self.used is not None:
                self.used(i, end.id_list())
            return end.out
        bias = w.get(p + "gate.e_score_correction_bias")
        if end is not None and end.done and end.has_outs:
            outs = end.outs
            ids, wts = (end.ids, end.wts) if end.has_ids else route(cfg, x, None, bias, logits=outs[0])
        else:
            outs = linears(x, router_projections(cfg, w))   # every projection of x in one call
            ids, wts = route(cfg, x, None, bias, logits=outs[0])
        if obs is not None:
            obs.on_route(i, ids)
        latent = cfg.latent_size is not None
        experts = ids.numpy().reshape(-1).tolist()
        groups = iter(self.provider.expert_groups(i, experts))
        first = next(groups, None)
        if first is not None and list(first) == experts:   # every expert in one group: one region
            fmt, descs = group_format(list(first.values()))
            y = None if fmt is None else moe_decode(
                outs[1] if latent else x, descs, wts,
                w[p + "routed_expert_norm.weight"] if latent and cfg.latent_moe_use_norm else None, cfg.rms_norm_eps,
                outs[-2:] if cfg.num_shared_experts else None, situ(cfg),
                w[p + "routed_expert_up_proj.weight"] if latent else None,
                w[s + "down_proj.weight"] if cfg.num_shared_experts else None, base)
            if y is not None:
                self.ran["moe region"] += 1
                return y
        self.ran["plain moe"] += 1
        groups = groups if first is None else chain([first], groups)
        return moe_experts(cfg, w, x, outs, ids, wts, i, self.provider, base, groups)


#: a layer's resident ExpertSet -> its experts' descriptors (or None); an entry goes with its set
_ALL_EXPERTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_FORMAT = object()


def _all_experts(ews):
    """The kernel descriptors [E, 3, ...] of every routed expert of a layer (``ews``, the
    ExpertSet a provider hands out unchanged while those experts stay where they are:
    kept per set, for as long as it lives), or None where they do not share one kernel
    format."""
    try:
        descs = _ALL_EXPERTS.get(ews)
    except TypeError:   # a sequence without weak references: made each time
        return group_format(list(ews))[1]
    if descs is None:
        descs = group_format(list(ews))[1]
        _ALL_EXPERTS[ews] = _NO_FORMAT if descs is None else descs
    return None if descs is _NO_FORMAT else descs
