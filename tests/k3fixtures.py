"""Readers for the kimi-k3-in-c reference fixtures copied into tests/fixtures/k3-in-c-v1.

The fixtures name tensors with `_` instead of `.` and their own short names for the
MoE block; `checkpoint_name` maps them to the released checkpoint names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "k3-in-c-v1"

_MOE = {
    "mlp_down_weight": "block_sparse_moe.routed_expert_down_proj.weight",
    "mlp_up_weight": "block_sparse_moe.routed_expert_up_proj.weight",
    "mlp_norm_weight": "block_sparse_moe.routed_expert_norm.weight",
    "mlp_gate_weight": "block_sparse_moe.gate.weight",
    "mlp_e_score_correction_bias": "block_sparse_moe.gate.e_score_correction_bias",
    "mlp_shared_w1_weight": "block_sparse_moe.shared_experts.gate_proj.weight",
    "mlp_shared_w3_weight": "block_sparse_moe.shared_experts.up_proj.weight",
    "mlp_shared_w2_weight": "block_sparse_moe.shared_experts.down_proj.weight",
    "mlp_down_proj_weight": "mlp.down_proj.weight",
    "mlp_gate_proj_weight": "mlp.gate_proj.weight",
    "mlp_up_proj_weight": "mlp.up_proj.weight",
    "mlp_res_norm_weight": "mlp_res_norm.weight",
    "mlp_res_proj_weight": "mlp_res_proj.weight",
    "input_layernorm_weight": "input_layernorm.weight",
    "post_attention_layernorm_weight": "post_attention_layernorm.weight",
    "self_attention_res_norm_weight": "self_attention_res_norm.weight",
    "self_attention_res_proj_weight": "self_attention_res_proj.weight",
}


def layer_name(rest: str) -> str:
    """Fixture name inside a layer (no `layers_N_` prefix) -> checkpoint name."""
    if rest in _MOE:
        return _MOE[rest]
    m = re.fullmatch(r"mlp_experts_(\d+)_(w[123])_weight", rest)
    if m:
        return f"block_sparse_moe.experts.{m[1]}.{m[2]}.weight"
    if rest.startswith("self_attn_"):
        r = rest[len("self_attn_"):]
        if r.endswith("_weight"):
            return "self_attn." + r[: -len("_weight")] + ".weight"
        return "self_attn." + r
    raise KeyError(rest)


def checkpoint_name(name: str) -> str:
    m = re.fullmatch(r"layers_(\d+)_(.+)", name)
    if m:
        return f"layers.{m[1]}.{layer_name(m[2])}"
    return name[: -len("_weight")] + ".weight"


def tiny_model():
    """(config dict, {checkpoint name: fp32 tensor}) of the 13-layer tiny K3."""
    meta = json.loads((FIXTURES / "tiny_k3.json").read_text())
    raw = np.fromfile(FIXTURES / "tiny_k3.bin", dtype="<f4")
    t = {}
    for name, info in meta["tensors"].items():
        a = raw[info["offset"]: info["offset"] + info["numel"]].reshape(info["shape"])
        t[checkpoint_name(name)] = torch.from_numpy(a.copy())
    return meta["config"], t


def ref():
    return json.loads((FIXTURES / "ref_k3.json").read_text())


def op(name: str) -> dict:
    return json.loads((FIXTURES / "ops" / f"{name}.json").read_text())


def arr(entry) -> torch.Tensor:
    """A fixture {shape, data} entry as an fp32 tensor."""
    return torch.tensor(entry["data"], dtype=torch.float32).reshape(entry["shape"])


def manifest() -> dict:
    return json.loads((FIXTURES / "ops" / "MANIFEST.json").read_text())
