"""Every written tensor's data, deterministic in (seed, name).

Scales are chosen so a forward pass stays finite and routing is non-degenerate:
matrices ~ N(0, 1/fan_in), norm gains 1 + N(0, 0.02), AttnRes pseudo-queries
N(0, 1/d), A_log = linspace(-0.4, 1.2) per head, small dt_bias, router rows
N(0, 1/d) (so gate logits ~ N(0, 1) for a normalised input) and a small linspace
correction bias, lm_head N(0, 1/d).
"""

from __future__ import annotations

import math

import torch

from .draw import _gauss, _sample_mxfp4, _stream
from .plan import SynthPlan, _Expert, _T
from .presets import NUM_SPECIAL

def _value(plan: SynthPlan, t: _T) -> torch.Tensor:
    """The tensor's data (deterministic in (seed, name))."""
    cfg, rel = plan.cfg, t.rel
    bg = _stream(plan.seed, t.name)
    if rel is None:  # vision stubs
        if t.name.endswith("norm.weight"):
            return _gauss(bg, t.shape, 1.0, 0.02, t.dtype)
        return _gauss(bg, t.shape, 0.0, 0.02, t.dtype)
    if rel.endswith("A_log"):
        H = cfg.kda_num_heads
        v = torch.zeros(math.prod(t.shape), dtype=torch.float64)
        v[:H] = torch.linspace(-0.4, 1.2, H, dtype=torch.float64)
        return v.reshape(t.shape).to(_TORCH[t.dtype])
    if rel.endswith("e_score_correction_bias"):
        return torch.linspace(-0.05, 0.05, t.shape[0], dtype=torch.float64).to(_TORCH[t.dtype])
    if rel.endswith("dt_bias"):
        return _gauss(bg, t.shape, 0.0, 0.1, t.dtype)
    if rel.endswith("_conv1d.weight"):
        return _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[-1]), t.dtype)
    if rel.endswith("norm.weight"):  # every RMSNorm gain (layernorms, o_norm, AttnRes, latent)
        return _gauss(bg, t.shape, 1.0, 0.02, t.dtype)
    if rel == "embed_tokens.weight":
        return _gauss(bg, t.shape, 0.0, 1.0, t.dtype)
    if rel == "lm_head.weight":
        # Rows of the 256 special ids get 1/10 of the scale, so (as in a trained model)
        # greedy decoding emits ordinary text tokens rather than reserved specials.
        w = _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[-1]), t.dtype)
        n = t.shape[0] - NUM_SPECIAL
        w[n:] = (w[n:].to(torch.float32) * 0.1).to(w.dtype)
        return w
    # matrices, AttnRes pseudo-queries [1, d], router, lm_head: N(0, 1/fan_in)
    return _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[-1]), t.dtype)


_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}


def _expert_values(plan: SynthPlan, ex: _Expert) -> list[tuple[str, torch.Tensor]]:
    cfg = plan.cfg
    bg = _stream(plan.seed, f"{plan.prefix}layers.{ex.layer}.block_sparse_moe.experts.{ex.expert}")
    out = []
    if plan.expert_mode == "bf16":
        for t in ex.tensors:
            out.append((t.name, _gauss(bg, t.shape, 0.0, 1.0 / math.sqrt(t.shape[1]), "BF16")))
        return out
    g = cfg.expert_group_size
    for tp, ts in zip(ex.tensors[0::2], ex.tensors[1::2]):  # (packed, scale) pairs
        rows, cols = tp.shape[0], tp.shape[1] * 2
        if plan.expert_mode == "packed":
            packed, scale = _sample_mxfp4(bg, rows, cols, g)
        else:
            from ..kernels.mxfp4 import encode_mxfp4

            packed, scale = encode_mxfp4(_gauss(bg, (rows, cols), 0.0, 1.0 / math.sqrt(cols), "F32"), g)
        out += [(tp.name, packed), (ts.name, scale)]
    return out


def tensor_value(plan: SynthPlan, name: str) -> torch.Tensor:
    """Regenerate one written tensor by its full name (tests, debugging)."""
    for sh in plan.shards:
        for it in sh:
            if isinstance(it, _Expert):
                if any(t.name == name for t in it.tensors):
                    return dict(_expert_values(plan, it))[name]
            elif it.name == name:
                return _value(plan, it)
    raise KeyError(name)
