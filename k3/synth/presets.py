"""Presets and config.json for `k3 synth`: the per-preset shapes, the special tokens at
their offsets, the overrides (`--layers/--experts/--vocab`) and the config dict that is
written (K3's nested form or Kimi-Linear's flat form)."""

from __future__ import annotations

import json

from ..errors import UsageError

ARCHS = ("k3", "kimi_linear")
NUM_SPECIAL = 256
K3_BASE = 163584  # first special id of the release (its 163,584 BPE ranks)

# ------------------------------------------------------------------------ presets
# Per-preset shapes. K3 keeps the release's structure (KDA x3 + MLA, last layer MLA,
# dense layer 0, latent MoE, 2 shared experts, SiTU); realdims uses K3's real
# per-tensor shapes with few layers/experts and a small vocabulary.
def _kimi_linear(k3: dict, **over) -> dict:
    """The Kimi-Linear preset beside a K3 one: the same trunk shapes without K3's latent
    MoE, Attention Residuals and MXFP4 experts, a plain q_proj, one shared expert."""
    d = {k: v for k, v in k3.items() if k not in ("latent", "attn_res", "expert_mode")}
    return {**d, "q_lora": None, "shared": 1, **over}


_TINY = dict(hidden=128, layers=8, vocab=1280, kda_heads=4, kda_head_dim=32, mla_heads=4, q_lora=64, kv_lora=32,
             nope=16, rope=8, v=16, inter=256, experts=16, topk=4, moe_inter=64, shared=2, latent=64, attn_res=3,
             expert_mode="encode")
_SMALL = dict(hidden=768, layers=14, vocab=2304, kda_heads=6, kda_head_dim=128, mla_heads=6, q_lora=256,
              kv_lora=128, nope=64, rope=32, v=64, inter=2048, experts=32, topk=8, moe_inter=256, shared=2,
              latent=384, attn_res=4, expert_mode="packed")
# K3's real per-tensor shapes (docs/MODEL.md §1-2); 4 layers: KDA, KDA, KDA, MLA.
_REALDIMS = dict(hidden=7168, layers=4, vocab=2304, kda_heads=96, kda_head_dim=128, mla_heads=96, q_lora=1536,
                 kv_lora=512, nope=128, rope=64, v=128, inter=33792, experts=32, topk=16, moe_inter=3072, shared=2,
                 latent=3584, attn_res=12, expert_mode="packed")
# K3's expert ratio at tiny dims: 896 routed experts per MoE layer, top-16 (the pool a
# batch or a draft shares so little of), so tests see K3's cache and routing regime in
# seconds (three MoE layers, ~17 MB).
_POOL = dict(_TINY, layers=4, experts=896, topk=16, expert_mode="packed")
PRESETS: dict[str, dict[str, dict]] = {
    "tiny": {"k3": _TINY, "kimi_linear": _kimi_linear(_TINY)},
    "pool": {"k3": _POOL, "kimi_linear": _kimi_linear(_POOL)},
    "small": {"k3": _SMALL, "kimi_linear": _kimi_linear(_SMALL)},
    # Kimi-Linear-48B's real per-tensor shapes (docs/MODEL.md §6).
    "realdims": {"k3": _REALDIMS, "kimi_linear": _kimi_linear(_REALDIMS, hidden=2304, kda_heads=32, mla_heads=32,
                                                               inter=9216, topk=8, moe_inter=1024)},
}

# Special tokens at their offsets from the first special id. K3's are those of docs/MODEL.md §5;
# Kimi-Linear's are K2-style (only BOS/EOS/<|im_end|>/PAD are confirmed).
_K3_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|end_of_msg|>", True),
    3: ("<|open|>", False), 4: ("<|close|>", False), 5: ("<|sep|>", False),
    6: ("[start_header_id]", True), 7: ("[end_header_id]", True), 9: ("[EOT]", True),
    18: ("<|media_begin|>", True), 19: ("<|media_content|>", True), 20: ("<|media_end|>", True),
    21: ("<|media_pad|>", True), 65: ("<osagent_mode>", True),
    254: ("[UNK]", True), 255: ("[PAD]", True),
}
_KL_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("[start_header_id]", True), 7: ("[end_header_id]", True),
    9: ("[EOT]", True), 10: ("<|im_system|>", True), 17: ("<|im_middle|>", True),
    254: ("[UNK]", True), 255: ("[PAD]", True),
}
_BOS, _EOS, _PAD, _MEDIA_PAD = 0, 2, 255, 21


def special_tokens(arch: str, n_ranks: int) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) of the named special tokens for a vocabulary of
    `n_ranks` BPE ranks (specials occupy ids n_ranks .. n_ranks + 255)."""
    table = _K3_SPECIALS if arch == "k3" else _KL_SPECIALS
    return {n_ranks + off: v for off, v in table.items()}


def _mla_layers(n_layers: int) -> list[int]:
    """0-based MLA layers: every 4th ((i + 1) % 4 == 0) plus the last, as in K3."""
    return sorted({i for i in range(n_layers) if (i + 1) % 4 == 0} | {n_layers - 1})


MAX_VOCAB = 1 << 20


def _resolve(preset: str, arch: str, layers: int | None, experts: int | None, vocab: int | None = None) -> dict:
    if arch not in ARCHS:
        raise UsageError(f"synth: unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}.")
    if preset not in PRESETS:
        raise UsageError(f"synth: unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    p = dict(PRESETS[preset][arch])
    if layers is not None:
        if not isinstance(layers, int) or layers < 2:
            raise UsageError(
                f"synth: --layers must be >= 2 (layer 0 is the dense layer and the last layer is MLA, "
                f"so a model with MoE needs at least 2), got {layers}.")
        p["layers"] = layers
    if experts is not None:
        if not isinstance(experts, int) or experts < p["topk"]:
            raise UsageError(
                f"synth: --experts must be >= the preset's top-k ({p['topk']} experts per token for "
                f"{preset}/{arch}), got {experts}.")
        p["experts"] = experts
    if vocab is not None:
        if not isinstance(vocab, int) or isinstance(vocab, bool) or not 2 * NUM_SPECIAL <= vocab <= MAX_VOCAB:
            raise UsageError(
                f"synth: --vocab must be between {2 * NUM_SPECIAL} (256 byte ranks and {NUM_SPECIAL} specials) and "
                f"{MAX_VOCAB}, got {vocab!r}; K3's release has {K3_BASE + NUM_SPECIAL}.")
        p["vocab"] = vocab
    return p


# ------------------------------------------------------------------------ config
def _text_config(p: dict) -> dict:
    """The text model's config keys that K3 and Kimi-Linear share, for resolved preset `p`."""
    L = p["layers"]
    n_ranks = p["vocab"] - NUM_SPECIAL
    bos, eos, pad = n_ranks + _BOS, n_ranks + _EOS, n_ranks + _PAD
    mla = _mla_layers(L)
    full_attn = [i + 1 for i in mla]
    kda = [i + 1 for i in range(L) if i not in mla]
    lac = {"full_attn_layers": full_attn, "kda_layers": kda, "num_heads": p["kda_heads"],
           "head_dim": p["kda_head_dim"], "short_conv_kernel_size": 4}
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": p["vocab"],
        "hidden_size": p["hidden"],
        "num_hidden_layers": L,
        "num_attention_heads": p["mla_heads"],
        "num_key_value_heads": p["mla_heads"],
        "q_lora_rank": p["q_lora"],
        "kv_lora_rank": p["kv_lora"],
        "qk_nope_head_dim": p["nope"],
        "qk_rope_head_dim": p["rope"],
        "v_head_dim": p["v"],
        "mla_use_nope": True,
        "linear_attn_config": lac,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "intermediate_size": p["inter"],
        "num_experts": p["experts"],
        "num_experts_per_token": p["topk"],
        "num_shared_experts": p["shared"],
        "moe_intermediate_size": p["moe_inter"],
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "bfloat16",
        "use_cache": True,
    }
    return text


def build_config(preset: str = "tiny", arch: str = "k3", layers: int | None = None,
                 experts: int | None = None, vocab: int | None = None) -> dict:
    """The config.json dict for a preset (K3 nested or Kimi-Linear flat)."""
    p = _resolve(preset, arch, layers, experts, vocab)
    text = _text_config(p)
    if arch == "kimi_linear":
        text.update({
            "auto_map": {
                "AutoConfig": "configuration_kimi.KimiLinearConfig",
                "AutoModel": "modeling_kimi.KimiLinearModel",
                "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
            },
            "head_dim": p["hidden"] // p["mla_heads"],  # present in the release, unused
            "hidden_act": "silu",
            "routed_scaling_factor": 2.446,
            "model_max_length": 1048576,
            "transformers_version": "4.56.2",
        })
        return text
    text["linear_attn_config"].update({"gate_lower_bound": -5.0, "use_full_rank_gate": True})
    text.update(_k3_text_extras(p))
    n_ranks = p["vocab"] - NUM_SPECIAL
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "model_type": "kimi_k3",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "dtype": "bfloat16",
        "ignore_index": -100,
        "media_placeholder_token_id": n_ranks + _MEDIA_PAD,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "tie_word_embeddings": False,
        "transformers_version": "4.56.2",
        "text_config": text,
        "vision_config": _vision_config(p["hidden"]),
    }


def _k3_text_extras(p: dict) -> dict:
    """The text model's K3-only config keys (AttnRes, latent MoE, SiTU, MXFP4 experts)."""
    return {
        "mla_use_output_gate": True,
        "attn_res_block_size": p["attn_res"],
        "routed_expert_hidden_size": p["latent"],
        "latent_moe_use_norm": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0,
        "transformers_version": "4.56.2",
        "quantization_config": _quantization_config(),
    }


def _quantization_config() -> dict:
    """K3's quantization_config: MXFP4 routed experts, everything else unquantized (a new
    dict per call: callers may edit the config they get)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8",
                    "observer": "minmax",
                },
                "input_activations": None,
            },
        },
        "ignore": [
            "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": None,
    }


def _vision_config(text_hidden: int) -> dict:
    """A small vision_config stub (the text reader ignores the vision tower)."""
    vt_hidden = 32
    vision = {
        "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "vt_num_hidden_layers": 1, "vt_hidden_size": vt_hidden,
        "vt_num_attention_heads": 2, "vt_intermediate_size": 4 * vt_hidden, "qkv_hidden_size": 48,
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": vt_hidden, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "norm_type": "rmsnorm", "activation_func": "gelu_pytorch_tanh", "text_hidden_size": text_hidden,
    }
    return vision



def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
