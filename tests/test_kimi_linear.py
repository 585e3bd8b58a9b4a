"""Kimi-Linear end to end against transformers' native port (spec 6 and 7, ladder step 2).

A tiny random `KimiLinearForCausalLM` (fla hidden, fp32, eval) is the oracle. Its weights
are written in the released Moonshot layout (safetensors names as `save_pretrained`
writes them, except the dense layer, see `moonshot_tensors`) together with a
`config.json` in the released flat Kimi-Linear format that we write ourselves. k3
loads that folder with `k3.load` and must reproduce transformers' logits,
per-position argmax (teacher forcing) and greedy tokens (full recompute and
incremental decode).

Two checkpoints: F32 (the exact fp32 weights) and BF16 (every weight rounded to bf16;
transformers runs the same rounded values in fp32) -- the BF16-weight x fp32-activation
contract k3 implements.

Non-trivial on purpose: weights drawn wider than the default init, every norm gain
random around 1, and e_score_correction_bias non-zero so that it changes which experts
are chosen (asserted). transformers' router (like k3's) weights the chosen experts by
the UNBIASED scores; the Moonshot remote code would not (spec 6).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from refutil import KERNEL_FUNCS, bound_implementation, import_kimi_linear_modeling, torch_fallback, torch_threads


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


# ---- the tiny model ----------------------------------------------------------
VOCAB, HIDDEN, LAYERS = 300, 64, 5
MLA_LAYERS_1B = [3, 5]  # 1-based, as in the release: layers 2 and 4 (the last) are MLA
KDA_LAYERS_1B = [1, 2, 4]
KDA_HEADS, KDA_DIM = 3, 16
N_EXPERTS, TOPK, N_SHARED = 8, 2, 1
INIT_STD = 0.1
SEED = 20261129
PROMPT_LEN, N_GEN = 40, 16  # prompt >= 32 so k3's KDA prefill takes the chunked path

# max |diff| <= rtol * max |logit|. Measured 4.5e-6 for both (1.5e-5 on logits of max 3.3):
# fp32 noise; every sublayer agrees with a float64 transformers run to ~1e-6, like
# transformers fp32 itself.
LOGIT_RTOL = {"f32": 2e-5, "bf16": 2e-5}


def hf_config_kwargs():
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=96,
        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        num_experts=N_EXPERTS, num_experts_per_token=TOPK, num_shared_experts=N_SHARED,
        routed_scaling_factor=2.446, moe_renormalize=True, num_expert_group=1, topk_group=1,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        hidden_act="silu", rms_norm_eps=1e-5, first_k_dense_replace=1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        initializer_range=INIT_STD,
        linear_attn_config={"num_heads": KDA_HEADS, "head_dim": KDA_DIM, "short_conv_kernel_size": 4,
                            "full_attn_layers": MLA_LAYERS_1B, "kda_layers": KDA_LAYERS_1B},
    )


def moonshot_config(hf_cfg, torch_dtype: str) -> dict:
    """config.json in the released flat Kimi-Linear format, from the transformers values."""
    c = hf_cfg
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "mla_use_nope": True,
        "linear_attn_config": {
            "num_heads": c.linear_num_heads,
            "head_dim": c.linear_head_dim,
            "short_conv_kernel_size": c.linear_conv_kernel_dim,
            "full_attn_layers": [i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(c.layer_types) if t == "linear_attention"],
        },
        "num_experts": c.num_experts,
        "num_experts_per_token": c.num_experts_per_token,
        "num_shared_experts": c.num_shared_experts,
        "moe_intermediate_size": c.moe_intermediate_size,
        "intermediate_size": c.intermediate_size,
        "first_k_dense_replace": c.mlp_layer_types.index("sparse"),
        "moe_layer_freq": 1,
        "routed_scaling_factor": c.routed_scaling_factor,
        "moe_renormalize": c.moe_renormalize,
        "moe_router_activation_func": "sigmoid",
        "num_expert_group": c.num_expert_group,
        "topk_group": c.topk_group,
        "use_grouped_topk": True,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "head_dim": 72,  # present (and unused) in the release
        "model_max_length": 1048576,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.56.2",
    }


def _randomise(model, gen, kv_lora: int):
    """Non-default values for what the init leaves at 1 or 0, and a small MLA latent."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # every RMSNorm gain incl. KDA o_norm, MLA kv_a
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            if name.endswith("kv_a_proj_with_mqa.weight"):
                # mean(c_kv^2) ~ 3e-4, so kv_a_layernorm's eps (1e-6 in HF, spec 3.1) is
                # visible: 1e-5 there moves the logits by ~6e-2, far above the tolerance.
                p[:kv_lora] *= 0.02
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.15 * torch.randn(b.shape, generator=gen))


def _round_bf16(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).to(torch.float32))
    return m


DENSE_ALIASES = ("gate_proj", "up_proj", "down_proj")


def moonshot_tensors(saved: dict, hf_cfg) -> dict:
    """The transformers-saved tensors under the released Moonshot names.

    transformers reverses its `.block_sparse_moe.` -> `.mlp.` load renaming on every
    layer, so the DENSE layer comes out as `block_sparse_moe.{gate,up,down}_proj`;
    the Moonshot code (and its checkpoint) names it `mlp.{gate,up,down}_proj`. Everything
    else `save_pretrained` writes is already the Moonshot layout (asserted in
    `test_save_pretrained_writes_moonshot_names`)."""
    out = {}
    for k, v in saved.items():
        parts = k.split(".")
        if (len(parts) == 6 and parts[0] == "model" and parts[1] == "layers"
                and hf_cfg.mlp_layer_types[int(parts[2])] == "dense"
                and parts[3] == "block_sparse_moe" and parts[4] in DENSE_ALIASES):
            k = ".".join(parts[:3] + ["mlp"] + parts[4:])
        out[k] = v
    return out


class Built:
    pass


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    mod = import_kimi_linear_modeling()
    for fname in KERNEL_FUNCS:  # the oracle runs transformers' torch code, not fla kernels
        fn = getattr(mod, fname)
        assert bound_implementation(fn) in (None, torch_fallback(fn)), fname
    from safetensors.torch import load_file, save_file
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(**hf_config_kwargs())
    torch.manual_seed(SEED)
    model = mod.KimiLinearForCausalLM(cfg).eval()
    _randomise(model, torch.Generator().manual_seed(SEED + 1), cfg.kv_lora_rank)
    assert model.dtype == torch.float32

    b = Built()
    b.mod, b.cfg = mod, cfg
    b.models = {"f32": model, "bf16": _round_bf16(model)}
    hf_dir = tmp_path_factory.mktemp("hf_saved")
    model.save_pretrained(hf_dir, safe_serialization=True)
    b.saved = load_file(str(hf_dir / "model.safetensors"))
    b.dirs = {}
    for kind, dtype, dname in (("f32", torch.float32, "float32"), ("bf16", torch.bfloat16, "bfloat16")):
        d = tmp_path_factory.mktemp(f"kimi_linear_{kind}")
        tensors = {k: v.to(dtype).contiguous() for k, v in moonshot_tensors(b.saved, cfg).items()}
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(moonshot_config(cfg, dname), indent=2))
        b.dirs[kind] = d

    gen = torch.Generator().manual_seed(SEED + 2)
    b.prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
    b.hf_greedy = {k: hf_greedy(m, b.prompt, N_GEN) for k, m in b.models.items()}
    return b


@pytest.fixture(scope="module")
def k3_engines(built):
    from engines import open_engine
    engines = {}
    try:
        for kind, d in built.dirs.items():
            engines[kind] = open_engine(d)
        yield engines
    finally:
        for eng in engines.values():
            eng.close()


@pytest.fixture(scope="module")
def k3_models(k3_engines):
    return {kind: eng.model for kind, eng in k3_engines.items()}


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, prompt, n):
    """Greedy by full recompute every step (no cache), manual argmax."""
    ids = list(prompt)
    out, margins = [], []
    for _ in range(n):
        lg = hf_logits(model, ids)[-1]
        top = torch.topk(lg, 2).values
        tok = int(torch.argmax(lg))
        out.append(tok)
        margins.append(float(top[0] - top[1]))
        ids.append(tok)
    return out, margins


# ---- the checkpoint layout ------------------------------------------------------

def test_save_pretrained_writes_moonshot_names(built):
    s = built.saved
    dense = [i for i, t in enumerate(built.cfg.mlp_layer_types) if t == "dense"]
    assert dense == [0]
    for i, t in enumerate(built.cfg.layer_types):
        p = f"model.layers.{i}."
        if t == "linear_attention":
            for n in ("q", "k", "v"):
                assert s[p + f"self_attn.{n}_conv1d.weight"].shape == (KDA_HEADS * KDA_DIM, 1, 4)
            assert s[p + "self_attn.A_log"].shape == (1, 1, KDA_HEADS, 1)
            assert s[p + "self_attn.dt_bias"].shape == (KDA_HEADS * KDA_DIM,)
            for n in ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj", "o_norm", "o_proj"):
                assert p + f"self_attn.{n}.weight" in s
            assert p + "self_attn.conv1d.weight" not in s and p + "self_attn.forget_gate.A_log" not in s
        else:
            for n in ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
                assert p + f"self_attn.{n}.weight" in s
        if i in dense:
            # transformers writes the dense MLP under `block_sparse_moe.` (its reverse
            # rename); the release has `mlp.` -- see moonshot_tensors.
            assert p + "block_sparse_moe.gate_proj.weight" in s
        else:
            q = p + "block_sparse_moe."
            for e in range(N_EXPERTS):
                assert s[q + f"experts.{e}.w1.weight"].shape == (32, HIDDEN)
                assert s[q + f"experts.{e}.w3.weight"].shape == (32, HIDDEN)
                assert s[q + f"experts.{e}.w2.weight"].shape == (HIDDEN, 32)
            assert s[q + "gate.weight"].shape == (N_EXPERTS, HIDDEN)
            assert s[q + "gate.e_score_correction_bias"].abs().max() > 0
            for n in ("gate_proj", "up_proj", "down_proj"):
                assert q + f"shared_experts.{n}.weight" in s
    assert "lm_head.weight" in s and "model.norm.weight" in s and "model.embed_tokens.weight" in s


@pytest.mark.parametrize("kind", ("f32", "bf16"))
def test_moonshot_layout_reloads_into_transformers(built, kind):
    """Our renamed checkpoint + our config.json load back into transformers as exactly the
    oracle's weights (so the layout is the one transformers maps from the release, and
    the BF16 oracle holds exactly the file's values)."""
    from transformers import KimiLinearForCausalLM
    re = KimiLinearForCausalLM.from_pretrained(built.dirs[kind], dtype=torch.float32).eval()
    ref = built.models[kind].state_dict()
    got = re.state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_config_json_parses(built):
    from k3.config import ARCH_KIMI_LINEAR, load_config
    cfg = load_config(built.dirs["f32"])
    assert cfg.arch == ARCH_KIMI_LINEAR == "kimi_linear"
    assert cfg.mla_layers == (2, 4)
    assert [cfg.is_mla(i) for i in range(LAYERS)] == [t == "full_attention" for t in built.cfg.layer_types]
    assert [cfg.is_moe(i) for i in range(LAYERS)] == [t == "sparse" for t in built.cfg.mlp_layer_types]
    assert cfg.gate_lower_bound is None and not cfg.kda_full_rank_gate and not cfg.mla_use_output_gate
    assert cfg.attn_res_block_size is None and cfg.latent_size is None and cfg.q_lora_rank is None
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel) == (KDA_HEADS, KDA_DIM, 4)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (N_EXPERTS, TOPK, N_SHARED)
    assert cfg.routed_scaling_factor == 2.446 and cfg.moe_renormalize and cfg.hidden_act == "silu"


def test_oracle_is_nontrivial(built):
    """The comparison means something: the correction bias changes expert choice, every
    layer moves the hidden state, and the greedy continuation is not one repeated token."""
    model = built.models["f32"]
    ids = built.prompt
    changed, total = 0, 0
    deltas = []

    def router_hook(mod, args, out):
        nonlocal changed, total
        x = args[0].reshape(-1, HIDDEN).float()
        s = torch.sigmoid(x @ mod.weight.float().T)
        a = torch.topk(s, TOPK, dim=-1).indices.sort(-1).values
        b = torch.topk(s + mod.e_score_correction_bias, TOPK, dim=-1).indices.sort(-1).values
        changed += int((a != b).any(-1).sum())
        total += a.shape[0]

    def layer_hook(mod, args, out):
        h_in = args[0]
        deltas.append(float((out - h_in).norm() / h_in.norm()))

    hooks = [m.register_forward_hook(router_hook) for m in model.modules()
             if type(m).__name__ == "KimiLinearTopkRouter"]
    hooks += [layer.register_forward_hook(layer_hook) for layer in model.model.layers]
    try:
        hf_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    assert total == PROMPT_LEN * (LAYERS - 1)
    assert 0.1 < changed / total, f"bias changed only {changed}/{total} selections"
    assert min(deltas) > 0.05, deltas
    toks, _ = built.hf_greedy["f32"]
    assert len(set(toks)) >= 3, toks


# ---- k3 vs transformers -----------------------------------------------------------

KINDS = ("f32", "bf16")


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forcing_logits(built, k3_models, kind):
    """All positions of prompt + greedy continuation in one call (k3: chunked KDA prefill)."""
    toks, _ = built.hf_greedy[kind]
    ids = built.prompt + toks
    ref = hf_logits(built.models[kind], ids)
    got = k3_models[kind].forward(ids, None, last_only=False)
    assert got.dtype == torch.float32 and got.shape == ref.shape == (len(ids), VOCAB)
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= LOGIT_RTOL[kind] * scale, f"{kind}: max |diff| {err:.3g} vs max |logit| {scale:.3g}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # and a short prefix (k3's recurrent KDA prefill path, T < 32)
    ref = hf_logits(built.models[kind], ids[:9])
    got = k3_models[kind].forward(ids[:9], None, last_only=False)
    assert (got - ref).abs().max().item() <= LOGIT_RTOL[kind] * ref.abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_full_recompute(built, k3_models, k3_engines, kind):
    from engines import greedy_ids
    m = k3_models[kind]
    want, margins = built.hf_greedy[kind]
    ids, got = list(built.prompt), []
    for _ in range(N_GEN):
        lg = m.forward(ids, None)
        tok = int(torch.argmax(lg.reshape(-1)))
        got.append(tok)
        ids.append(tok)
    assert got == want, f"{kind}: smallest top-2 margin on the reference path {min(margins):.3g}"
    # and through the engine's decode loop
    assert greedy_ids(k3_engines[kind], built.prompt, N_GEN, incremental=False) == want


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_incremental(built, k3_models, k3_engines, kind):
    """Prefill once, then one token at a time with carried KDA/conv state and MLA KV;
    each step's logits also match transformers' full recompute of that prefix."""
    m = k3_models[kind]
    ref_model = built.models[kind]
    want, _ = built.hf_greedy[kind]
    st = m.new_state()
    lg = m.forward(list(built.prompt), st)
    ids, got = list(built.prompt), []
    for step in range(N_GEN):
        tok = int(torch.argmax(lg.reshape(-1)))
        got.append(tok)
        ids.append(tok)
        if step in (0, N_GEN // 2):
            ref = hf_logits(ref_model, ids[:-1])[-1]
            assert (lg.reshape(-1) - ref).abs().max().item() <= LOGIT_RTOL[kind] * ref.abs().max().item()
        lg = m.forward([tok], st)
    assert got == want
    assert st.position == len(ids)
    # and through the engine's decode loop
    from engines import greedy_ids
    assert greedy_ids(k3_engines[kind], built.prompt, N_GEN, incremental=True) == want
