"""Which tensors a model needs, with their shapes: one home for the checkpoint's tensor
graph. The loader checks a checkpoint against it before running; the synthetic
generator writes exactly it.

Names are relative: globals without prefix (`embed_tokens.weight`, `lm_head.weight`),
layer tensors relative to `layers.{i}.`. On disk K3 prefixes `language_model.model.`
(and `language_model.lm_head.weight`), Kimi-Linear `model.` (and `lm_head.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    kind: str  # "matrix" (BF16/F32 as stored) | "vector" (small, widened to fp32) | "alog"


def _pad128(n: int) -> int:
    return (n + 127) // 128 * 128


def global_specs(cfg) -> dict[str, Spec]:
    d, V = cfg.hidden_size, cfg.vocab_size
    s = {
        "embed_tokens.weight": Spec((V, d), "matrix"),
        "norm.weight": Spec((d,), "vector"),
    }
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = Spec((V, d), "matrix")
    if cfg.attn_res_block_size is not None:
        s["output_attn_res_norm.weight"] = Spec((d,), "vector")
        s["output_attn_res_proj.weight"] = Spec((1, d), "vector")
    return s


def layer_specs(cfg, i: int) -> dict[str, Spec]:
    """Non-expert tensors of layer i."""
    d = cfg.hidden_size
    M, V = "matrix", "vector"
    s = {
        "input_layernorm.weight": Spec((d,), V),
        "post_attention_layernorm.weight": Spec((d,), V),
    }
    if cfg.attn_res_block_size is not None:
        for n in ("self_attention_res", "mlp_res"):
            s[f"{n}_norm.weight"] = Spec((d,), V)
            s[f"{n}_proj.weight"] = Spec((1, d), V)
    a = "self_attn."
    if cfg.is_mla(i):
        H, qk, vd = cfg.mla_num_heads, cfg.qk_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is not None:
            s[a + "q_a_proj.weight"] = Spec((cfg.q_lora_rank, d), M)
            s[a + "q_a_layernorm.weight"] = Spec((cfg.q_lora_rank,), V)
            s[a + "q_b_proj.weight"] = Spec((H * qk, cfg.q_lora_rank), M)
        else:
            s[a + "q_proj.weight"] = Spec((H * qk, d), M)
        s[a + "kv_a_proj_with_mqa.weight"] = Spec((cfg.kv_lora_rank + cfg.qk_rope_head_dim, d), M)
        s[a + "kv_a_layernorm.weight"] = Spec((cfg.kv_lora_rank,), V)
        s[a + "kv_b_proj.weight"] = Spec((H * (cfg.qk_nope_head_dim + vd), cfg.kv_lora_rank), M)
        if cfg.mla_use_output_gate:
            s[a + "g_proj.weight"] = Spec((H * vd, d), M)
        s[a + "o_proj.weight"] = Spec((d, H * vd), M)
    else:
        H, D, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
        HD = H * D
        for p in "qkv":
            s[a + f"{p}_proj.weight"] = Spec((HD, d), M)
            s[a + f"{p}_conv1d.weight"] = Spec((HD, 1, K), V)
        s[a + "A_log"] = Spec((H,), "alog")
        s[a + "dt_bias"] = Spec((HD,), V)
        s[a + "f_a_proj.weight"] = Spec((D, d), M)
        s[a + "f_b_proj.weight"] = Spec((HD, D), M)
        s[a + "b_proj.weight"] = Spec((H, d), M)
        if cfg.kda_full_rank_gate:
            s[a + "g_proj.weight"] = Spec((HD, d), M)
        else:
            s[a + "g_a_proj.weight"] = Spec((D, d), M)
            s[a + "g_b_proj.weight"] = Spec((HD, D), M)
        s[a + "o_norm.weight"] = Spec((D,), V)
        s[a + "o_proj.weight"] = Spec((d, HD), M)
    if cfg.is_moe(i):
        p = "block_sparse_moe."
        s[p + "gate.weight"] = Spec((cfg.num_experts, d), M)
        s[p + "gate.e_score_correction_bias"] = Spec((cfg.num_experts,), V)
        if cfg.latent_size is not None:
            L = cfg.latent_size
            s[p + "routed_expert_down_proj.weight"] = Spec((L, d), M)
            if cfg.latent_moe_use_norm:
                s[p + "routed_expert_norm.weight"] = Spec((L,), V)
            s[p + "routed_expert_up_proj.weight"] = Spec((d, L), M)
        if cfg.num_shared_experts:
            w = cfg.shared_width
            s[p + "shared_experts.gate_proj.weight"] = Spec((w, d), M)
            s[p + "shared_experts.up_proj.weight"] = Spec((w, d), M)
            s[p + "shared_experts.down_proj.weight"] = Spec((d, w), M)
    else:
        I = cfg.intermediate_size
        s["mlp.gate_proj.weight"] = Spec((I, d), M)
        s["mlp.up_proj.weight"] = Spec((I, d), M)
        s["mlp.down_proj.weight"] = Spec((d, I), M)
    return s


def alog_ok(shape: tuple[int, ...], n_heads: int) -> bool:
    """A_log is [H] (fixtures), [pad128(H)] zero-padded (K3) or [1, 1, H, 1] (Kimi-Linear)."""
    n = 1
    for x in shape:
        n *= x
    return shape in ((n_heads,), (_pad128(n_heads),), (1, 1, n_heads, 1)) or (len(shape) == 1 and n >= n_heads)


def expert_logical_shapes(cfg) -> dict[str, tuple[int, int]]:
    mi, inp = cfg.moe_intermediate_size, cfg.expert_in
    return {"w1": (mi, inp), "w3": (mi, inp), "w2": (inp, mi)}


def expert_specs(cfg, quantized) -> dict[str, tuple[tuple[int, ...], str]]:
    """Relative names (`w1.weight_packed`, ...) -> (shape, dtype kind), in the release's
    on-disk order w1, w2, w3 with packed before scale. `quantized` is a bool for all
    three matrices or a {"w1": bool, ...} dict (a matrix whose input width is not a
    multiple of the group size can only be stored unpacked)."""
    out = {}
    sh = expert_logical_shapes(cfg)
    g = cfg.expert_group_size
    for w in ("w1", "w2", "w3"):
        r, c = sh[w]
        q = quantized[w] if isinstance(quantized, dict) else quantized
        if q:
            out[f"{w}.weight_packed"] = ((r, c // 2), "U8")
            out[f"{w}.weight_scale"] = ((r, c // g), "U8")
        else:
            out[f"{w}.weight"] = ((r, c), "float")
    return out


def expert_nbytes(cfg) -> int:
    sh = expert_logical_shapes(cfg)
    return sum(r * c // 2 + r * c // cfg.expert_group_size for r, c in sh.values())
