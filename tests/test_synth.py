"""The synthetic checkpoint generator (k3/synth/): format, layout, determinism,
tokenizer, MXFP4 encoder, and that a model built from it generates sensibly.

Fast tests use the tiny preset only; `small` is marked slow. realdims is checked from
its plan (shapes, sizes, names) without writing 7 GB.
"""

from __future__ import annotations

import collections
import json
import math
import os
from pathlib import Path

import pytest
import torch

from k3 import synth
from k3.kernels.mxfp4 import encode_mxfp4
from k3.checkpoint.safetensors import INDEX_NAME, CheckpointIndex, read_shard_header
from k3.config import load_config
from k3.errors import UsageError
from k3.schema import expert_nbytes, global_specs, layer_specs

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])
F32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias", "_conv1d.weight", "o_norm.weight")
EXPERT_ORDER = ["w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale",
                "w3.weight_packed", "w3.weight_scale"]


def ref_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Spec 4 decoding, written out plainly: low nibble = even element."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    return E2M1[codes] * torch.exp2(scale.float() - 127).repeat_interleave(32, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth.synthesize(tmp_path_factory.mktemp("tiny") / "m", preset="tiny", arch="k3", seed=0)


@pytest.fixture(scope="module")
def tiny_kl(tmp_path_factory):
    return synth.synthesize(tmp_path_factory.mktemp("tinykl") / "m", preset="tiny", arch="kimi_linear", seed=0)


def headers(d: Path) -> dict[str, dict]:
    """shard file name -> {tensor name: TensorInfo} (vision tensors included)."""
    return {p.name: read_shard_header(p).tensors for p in sorted(d.glob("model-*.safetensors"))}


def all_tensors(d: Path) -> dict:
    out = {}
    for tensors in headers(d).values():
        out.update(tensors)
    return out


def load(info) -> torch.Tensor:
    dt = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}[info.dtype]
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        raw = bytearray(f.read(info.nbytes))
    return torch.frombuffer(raw, dtype=dt).reshape(info.shape)


# ------------------------------------------------------------------ files, determinism
def test_files_and_names(tiny, tiny_kl):
    for d in (tiny, tiny_kl):
        for f in ("config.json", INDEX_NAME, "tiktoken.model", "tokenizer_config.json",
                  "generation_config.json", "k3_synth.json"):
            assert (d / f).is_file(), f
    k3_shards = sorted(p.name for p in tiny.glob("model-*.safetensors"))
    n = len(k3_shards)
    assert k3_shards == [f"model-{i:05d}-of-{n:06d}.safetensors" for i in range(1, n + 1)]  # release naming
    kl_shards = sorted(p.name for p in tiny_kl.glob("model-*.safetensors"))
    m = len(kl_shards)
    assert kl_shards == [f"model-{i:05d}-of-{m:05d}.safetensors" for i in range(1, m + 1)]


def test_deterministic(tiny, tmp_path):
    again = synth.synthesize(tmp_path / "again", preset="tiny", seed=0)
    names = sorted(os.listdir(tiny))
    assert names == sorted(os.listdir(again))
    for n in names:
        assert (tiny / n).read_bytes() == (again / n).read_bytes(), n
    other = synth.synthesize(tmp_path / "seed1", preset="tiny", seed=1)
    for n in names:
        if n.startswith("model-"):
            assert (tiny / n).read_bytes() != (other / n).read_bytes(), n
    # the vocabulary and the config do not depend on the seed
    assert (tiny / "tiktoken.model").read_bytes() == (other / "tiktoken.model").read_bytes()
    assert (tiny / "config.json").read_bytes() == (other / "config.json").read_bytes()


def test_values_keyed_by_name_not_layout(tiny, tmp_path):
    """A tensor's values depend on (seed, name) only: fewer layers/experts keep them."""
    ts = all_tensors(tiny)
    plan = synth.make_plan("tiny", "k3", 0)
    for name in ("language_model.model.layers.1.self_attn.q_proj.weight",
                 "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_packed",
                 "language_model.lm_head.weight"):
        assert torch.equal(load(ts[name]), synth.tensor_value(plan, name))
    smaller = synth.make_plan("tiny", "k3", 0, layers=5, experts=12)
    for name in ("language_model.model.layers.1.self_attn.q_proj.weight",
                 "language_model.model.layers.0.mlp.up_proj.weight",
                 "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_packed"):
        assert torch.equal(load(ts[name]), synth.tensor_value(smaller, name))


# ------------------------------------------------------------------ config
def test_k3_config(tiny):
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["architectures"] == ["KimiK3ForConditionalGeneration"] and raw["model_type"] == "kimi_k3"
    t = raw["text_config"]
    assert t["model_type"] == "kimi_linear"
    lac = t["linear_attn_config"]
    assert lac["gate_lower_bound"] == -5.0 and lac["use_full_rank_gate"] is True
    assert lac["full_attn_layers"] == [4, 8] and lac["kda_layers"] == [1, 2, 3, 5, 6, 7]  # 1-based
    assert t["routed_scaling_factor"] == 1.0 and t["hidden_act"] == "situ"
    assert t["activation_situ_beta"] == 4.0 and t["activation_situ_linear_beta"] == 25.0
    qc = t["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "re:.*self_attn.*" in qc["ignore"]
    assert raw["vision_config"]["text_hidden_size"] == t["hidden_size"]
    cfg = load_config(tiny)
    assert cfg.arch == "k3" and cfg.shape_kind == "nested"
    assert cfg.mla_layers == (3, 7) and cfg.n_mla >= 2 and cfg.is_mla(cfg.num_hidden_layers - 1)
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, cfg.num_hidden_layers))
    assert cfg.attn_res_block_size == 3 and cfg.expert_quant == "mxfp4"
    assert cfg.latent_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0
    assert 2 <= cfg.num_experts_per_token <= 4 and 8 <= cfg.num_experts <= 16


def test_kimi_linear_config(tiny_kl):
    raw = json.loads((tiny_kl / "config.json").read_text())
    assert "text_config" not in raw and raw["architectures"] == ["KimiLinearForCausalLM"]
    assert raw["q_lora_rank"] is None and raw["hidden_act"] == "silu"
    assert raw["routed_scaling_factor"] == 2.446 and "quantization_config" not in raw
    assert "attn_res_block_size" not in raw
    cfg = load_config(tiny_kl)
    assert cfg.arch == "kimi_linear" and cfg.shape_kind == "flat"
    assert cfg.attn_res_block_size is None and cfg.latent_size is None and cfg.num_shared_experts == 1
    assert not cfg.kda_full_rank_gate and cfg.gate_lower_bound is None and cfg.q_lora_rank is None
    assert cfg.is_mla(cfg.num_hidden_layers - 1)


# ------------------------------------------------------------------ index and tensors
@pytest.mark.parametrize("which", ["tiny", "tiny_kl"])
def test_index_lists_every_tensor(which, request):
    d = request.getfixturevalue(which)
    idx = json.loads((d / INDEX_NAME).read_text())
    on_disk = {}
    for shard, tensors in headers(d).items():
        for name in tensors:
            on_disk[name] = shard
    assert idx["weight_map"] == on_disk
    assert idx["metadata"]["total_size"] == sum(t.nbytes for t in all_tensors(d).values())
    # and the set is exactly the tensor graph the reader validates against
    from k3.checkpoint.layout import CheckpointLayout

    cfg = load_config(d)
    layout = CheckpointLayout(cfg, CheckpointIndex.open(d))
    layout.validate()
    expected = {layout.full(r) for r in global_specs(cfg)}
    for i in range(cfg.num_hidden_layers):
        expected |= {layout.full(f"layers.{i}.{r}") for r in layer_specs(cfg, i)}
    text = {n for n in on_disk if not n.startswith(("vision_tower.", "mm_projector."))}
    experts = {n for n in text if ".experts." in n}
    assert text - experts == expected
    per = 6 if cfg.expert_quant else 3
    assert len(experts) == per * cfg.num_experts * sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))


def test_prefixes(tiny, tiny_kl):
    k3_names = set(all_tensors(tiny))
    assert "language_model.lm_head.weight" in k3_names
    assert "language_model.model.embed_tokens.weight" in k3_names
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in k3_names)
    kl_names = set(all_tensors(tiny_kl))
    assert "lm_head.weight" in kl_names and "model.embed_tokens.weight" in kl_names
    assert all(n.startswith("model.") or n == "lm_head.weight" for n in kl_names)


def _trunk_names(d, cfg, prefix, i):
    return {f"{prefix}layers.{i}.{r}" for r in layer_specs(cfg, i)}


@pytest.mark.parametrize("which", ["tiny", "tiny_kl"])
def test_layout(which, request):
    d = request.getfixturevalue(which)
    cfg = load_config(d)
    prefix = "language_model.model." if cfg.arch == "k3" else "model."
    hs = headers(d)
    where = {n: (shard, ti) for shard, ts in hs.items() for n, ti in ts.items()}
    # every shard is gap-free from the start of its data section
    for shard, ts in hs.items():
        spans = sorted((ti.offset, ti.end) for ti in ts.values())
        hdr = read_shard_header(d / shard)
        assert spans[0][0] == hdr.data_start and spans[-1][1] == hdr.file_size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # each layer's non-expert tensors: one shard, one contiguous run
    for i in range(cfg.num_hidden_layers):
        names = _trunk_names(d, cfg, prefix, i)
        shards = {where[n][0] for n in names}
        assert len(shards) == 1, (i, shards)
        infos = sorted((where[n][1] for n in names), key=lambda t: t.offset)
        assert all(a.end == b.offset for a, b in zip(infos, infos[1:])), i
        run = set(names)
        others = [ti for ti in hs[shards.pop()].values()
                  if ti.name not in run and infos[0].offset <= ti.offset < infos[-1].end]
        assert not others  # nothing interleaved inside the run
    # each expert: one contiguous run, in the release's tensor order
    order = EXPERT_ORDER if cfg.expert_quant else ["w1.weight", "w2.weight", "w3.weight"]
    out_of_order = False
    for shard, ts in hs.items():
        ids = collections.defaultdict(list)  # layer -> expert ids in file order
        seq = sorted(ts.values(), key=lambda t: t.offset)
        for j, ti in enumerate(seq):
            if ".experts." in ti.name and ti.name.endswith(order[0]):
                base = ti.name[: -len(order[0])]
                run = seq[j:j + len(order)]
                assert [t.name for t in run] == [base + o for o in order], base
                assert all(a.end == b.offset for a, b in zip(run, run[1:]))
                layer = int(base.split(".layers.")[1].split(".")[0])
                ids[layer].append(int(base.split(".experts.")[1].split(".")[0]))
        for layer, e in ids.items():
            out_of_order |= e != sorted(e)
    assert out_of_order, "experts should not be stored in id order"
    # the embedding is not in a layer shard
    emb_shard = where[prefix + "embed_tokens.weight"][0]
    assert not any(".layers." in n for n in hs[emb_shard])


def test_dtypes_and_shapes(tiny, tiny_kl):
    cfg = load_config(tiny)
    for name, ti in all_tensors(tiny).items():
        if ".experts." in name:
            want = "U8"
        elif name.endswith(F32_SUFFIXES):
            want = "F32"
        else:
            want = "BF16"
        assert ti.dtype == want, name
    ts = all_tensors(tiny)
    alog = ts["language_model.model.layers.0.self_attn.A_log"]
    assert alog.shape == (128,) and alog.dtype == "F32"  # 4 heads zero-padded to 128
    v = load(alog)
    H = cfg.kda_num_heads
    assert torch.allclose(v[:H], torch.linspace(-0.4, 1.2, H)) and not v[H:].any()
    e = ts["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    assert e.shape == (cfg.moe_intermediate_size, cfg.latent_size // 2)
    assert sum(t.nbytes for n, t in ts.items() if ".layers.1.block_sparse_moe.experts.0." in n) == expert_nbytes(cfg)
    for name, ti in all_tensors(tiny_kl).items():
        assert ti.dtype == "BF16", name
    kl = all_tensors(tiny_kl)["model.layers.0.self_attn.A_log"]
    assert kl.shape == (1, 1, load_config(tiny_kl).kda_num_heads, 1)


def test_vision_tensors_present_but_ignored(tiny):
    hs = headers(tiny)
    last = sorted(hs)[-1]
    assert set(hs[last]) == {"vision_tower.patch_embed.proj.weight", "mm_projector.post_norm.weight"}
    idx = CheckpointIndex.open(tiny)
    assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in idx.names())
    wm = json.loads((tiny / INDEX_NAME).read_text())["weight_map"]
    assert wm["vision_tower.patch_embed.proj.weight"] == last


def test_weight_statistics(tiny):
    """Scales that keep activations O(1) and routing non-degenerate."""
    ts = all_tensors(tiny)
    cfg = load_config(tiny)
    p = "language_model.model.layers.1."
    q = load(ts[p + "self_attn.q_proj.weight"]).float()
    assert abs(q.std().item() * math.sqrt(cfg.hidden_size) - 1) < 0.1
    n = load(ts[p + "input_layernorm.weight"]).float()
    assert abs(n.mean().item() - 1) < 0.01 and 0.005 < n.std().item() < 0.05
    b = load(ts[p + "block_sparse_moe.gate.e_score_correction_bias"])
    assert b.dtype == torch.float32 and b.unique().numel() == cfg.num_experts and b.abs().max() <= 0.05 + 1e-6
    w = ref_decode(load(ts[p + "block_sparse_moe.experts.3.w1.weight_packed"]),
                   load(ts[p + "block_sparse_moe.experts.3.w1.weight_scale"]))
    assert abs(w.std().item() * math.sqrt(cfg.latent_size) - 1) < 0.25


# ------------------------------------------------------------------ tokenizer
def test_tiktoken_loads_and_round_trips(tiny):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from k3.tokenizer import PAT_STR

    ranks = load_tiktoken_bpe(str(tiny / "tiktoken.model"))
    cfg = load_config(tiny)
    n = cfg.vocab_size - 256
    assert len(ranks) == n == 1024 and sorted(ranks.values()) == list(range(n))
    assert all(ranks[bytes([b])] == b for b in range(256))
    lines = (tiny / "tiktoken.model").read_bytes().splitlines()
    assert len(lines) == n and lines[0] == b"AA== 0"
    tc = json.loads((tiny / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding("synth", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    for text in ["The capital of France is Paris.", "机器学习模型通过调整参数来降低损失函数。",
                 "def f(x):\n    return x ** 2  # 🚀 ünïcödé", "2024-05-17 12:30 item 42: 7 + 35 = 42",
                 "\x00\xff odd bytes \t\r\n  trailing   "]:
        ids = enc.encode(text)
        assert enc.decode(ids) == text
        assert max(ids) < n
    eng = "The capital of France is Paris, and the capital of Japan is Tokyo."
    assert len(enc.encode(eng)) < len(eng.encode()) / 2  # real merges are in effect
    ids = enc.encode("<|open|>message<|sep|>", allowed_special="all")
    assert ids[0] == n + 3 and ids[-1] == n + 5
    # the project's tokenizer reads the folder the same way
    from k3.tokenizer import Tokenizer

    tok = Tokenizer(tiny)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.decode(tok.encode("Hello, 世界")) == "Hello, 世界"


@pytest.mark.parametrize("which", ["tiny", "tiny_kl"])
def test_special_ids_consistent(which, request):
    d = request.getfixturevalue(which)
    raw = json.loads((d / "config.json").read_text())
    cfg = load_config(d)
    n = cfg.vocab_size - 256
    tc = json.loads((d / "tokenizer_config.json").read_text())
    by_name = {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}
    assert all(n <= i < n + 256 for i in by_name.values())
    assert by_name["[BOS]"] == n and by_name["[EOS]"] == n + 1
    assert by_name["[UNK]"] == n + 254 and by_name["[PAD]"] == n + 255
    assert by_name[tc["bos_token"]] == cfg.bos_token_id == n
    assert by_name[tc["eos_token"]] == cfg.eos_token_id == n + 2
    assert by_name[tc["pad_token"]] == cfg.pad_token_id == n + 255
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg.bos_token_id, cfg.eos_token_id)
    if cfg.arch == "k3":
        # the release's offsets from 163584 (spec 5)
        want = {"<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5, "[start_header_id]": 6,
                "[end_header_id]": 7, "[EOT]": 9, "<|media_begin|>": 18, "<|media_content|>": 19,
                "<|media_end|>": 20, "<|media_pad|>": 21, "<osagent_mode>": 65}
        for name, off in want.items():
            assert by_name[name] == n + off, name
        assert tc["eos_token"] == "<|end_of_msg|>"
        assert {v["content"] for v in tc["added_tokens_decoder"].values() if not v["special"]} == {
            "<|open|>", "<|close|>", "<|sep|>"}
        assert raw["media_placeholder_token_id"] == n + 21
        assert gen["temperature"] == 1.0 and gen["top_p"] == 0.95
    else:
        assert tc["eos_token"] == "<|im_end|>"


def test_bpe_trainer_small_cases():
    v = synth.train_bpe("aaab aaab aaab", 260)
    assert len(v) == 260 and len(set(v)) == 260 and v[:256] == [bytes([b]) for b in range(256)]
    assert b"aa" in v
    with pytest.raises(ValueError):
        synth.train_bpe("ab", 300)


# ------------------------------------------------------------------ MXFP4 encoder
def _nearest_ok(w, packed, scale, decoded):
    s = torch.exp2(scale.float() - 127).repeat_interleave(32, 1)
    cand = E2M1.view(1, 1, 16) * s.unsqueeze(-1)
    best = (cand - w.unsqueeze(-1)).abs().min(-1).values
    return bool(((decoded - w).abs() <= best).all())


def test_encoder_nearest_and_minimal_scale():
    torch.manual_seed(0)
    for mag in (1e-30, 1e-3, 0.05, 1.0, 1e4):
        w = torch.randn(32, 256) * mag
        w[0, :32] = torch.linspace(-6, 6, 32) * 2.0 ** -5  # on-grid and tie values
        w[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * mag
        w[2, :32] = 0.0
        packed, scale = encode_mxfp4(w)
        assert packed.dtype == torch.uint8 and packed.shape == (32, 128) and scale.shape == (32, 8)
        d = ref_decode(packed, scale)
        assert _nearest_ok(w, packed, scale, d)
        amax = w.abs().reshape(32, 8, 32).amax(-1)
        f = torch.exp2(scale.float() - 127)
        assert bool((amax <= 6 * f).all())
        nz = amax > 0
        assert bool((amax[nz] > 3 * f[nz]).all())  # the smallest scale that fits
    # ties go to the even code (round half to even)
    t = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])
    d = ref_decode(*encode_mxfp4(t))
    assert d[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_encoder_reproduces_frozen_real_vector():
    """Spec 4's frozen K3 group decodes to the published bf16 bits, and encoding those
    values gives the release's bytes back (quantisation-aware weights are fixed points)."""
    packed = torch.tensor([[0xAB, 0x4C, 0x18, 0x65, 0x2C, 0x91, 0x04, 0x39, 0x48, 0x94, 0x58, 0x33, 0x94, 0xB5,
                            0x5B, 0x30]], dtype=torch.uint8)
    scale = torch.tensor([[0x79]], dtype=torch.uint8)
    bits = ("BCC0 BC80 BD00 3D00 8000 3C00 3D40 3D80 BD00 3C80 3C00 BC00 3D00 0000 BC00 3CC0 "
            "8000 3D00 3D00 BC00 8000 3D40 3CC0 3CC0 3D00 BC00 3D40 BCC0 BCC0 3D40 0000 3CC0").split()
    d = ref_decode(packed, scale)
    got = d.to(torch.bfloat16).view(torch.int16).reshape(-1).tolist()
    assert [f"{b & 0xFFFF:04X}" for b in got] == bits
    p2, s2 = encode_mxfp4(d)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)


def test_encoder_against_project_decoder():
    mx = pytest.importorskip("k3.kernels.mxfp4")
    if not hasattr(mx, "decode_mxfp4"):
        pytest.skip("k3.kernels.mxfp4.decode_mxfp4 not written yet")
    torch.manual_seed(1)
    w = torch.randn(64, 128) * 0.02
    packed, scale = encode_mxfp4(w)
    d = mx.decode_mxfp4(packed, scale).float()
    assert torch.equal(d, ref_decode(packed, scale))
    assert _nearest_ok(w, packed, scale, d)


def test_direct_mxfp4_sampler_is_k3_like():
    bg = synth._stream(0, "test")
    packed, scale = synth._sample_mxfp4(bg, 64, 3584, 32)
    assert packed.shape == (64, 1792) and scale.shape == (64, 112)
    assert 112 <= int(scale.min()) and int(scale.max()) <= 122  # the release's observed range
    w = ref_decode(packed, scale)
    assert abs(w.std().item() * math.sqrt(3584) - 1) < 0.15
    codes = torch.cat([packed & 15, packed >> 4]).flatten()
    assert codes.unique().numel() == 16


# ------------------------------------------------------------------ presets and options
def test_realdims_plan_has_k3_real_shapes():
    plan = synth.make_plan("realdims", "k3")
    cfg = plan.cfg
    assert expert_nbytes(cfg) == 17_547_264
    assert (cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.mla_num_heads) == (7168, 96, 128, 96)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (cfg.latent_size, cfg.moe_intermediate_size, cfg.intermediate_size, cfg.shared_width) == (
        3584, 3072, 33792, 6144)
    assert cfg.num_hidden_layers == 4 and cfg.mla_layers == (3,) and cfg.attn_res_block_size == 12
    assert (cfg.num_experts, cfg.num_experts_per_token) == (32, 16) and cfg.vocab_size > 256
    shapes = {t.name: t.shape for t in plan.tensors()}
    p = "language_model.model.layers."
    assert shapes[p + "1.self_attn.q_proj.weight"] == (12288, 7168)
    assert shapes[p + "1.self_attn.A_log"] == (128,)
    assert shapes[p + "0.mlp.gate_proj.weight"] == (33792, 7168)
    assert shapes[p + "3.self_attn.kv_b_proj.weight"] == (24576, 512)
    assert shapes[p + "2.block_sparse_moe.experts.7.w2.weight_scale"] == (3584, 96)
    assert plan.shard_names[0].endswith("-of-000006.safetensors")
    assert 6e9 < plan.total_bytes < 9e9
    more = synth.make_plan("realdims", "k3", experts=16, layers=6)
    assert more.cfg.num_experts == 16 and more.cfg.mla_layers == (3, 5)


def test_option_validation(tmp_path):
    with pytest.raises(UsageError):
        synth.make_plan("tiny", "k3", layers=1)
    with pytest.raises(UsageError):
        synth.make_plan("realdims", "k3", experts=8)  # top-16 needs >= 16 experts
    with pytest.raises(UsageError):
        synth.make_plan("huge", "k3")
    with pytest.raises(UsageError):
        synth.make_plan("tiny", "k4")
    with pytest.raises(UsageError):
        synth.make_plan("tiny", "k3", seed=-1)
    p = synth.make_plan("tiny", "kimi_linear", layers=5, experts=4)
    assert p.cfg.mla_layers == (3, 4) and p.cfg.num_experts == 4
    d = tmp_path / "busy"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(UsageError):
        synth.synthesize(d, preset="tiny")
    synth.synthesize(d, preset="tiny", force=True, layers=2)
    assert (d / "notes.txt").read_text() == "mine"
    # regenerating with fewer shards leaves no stale shard behind
    synth.synthesize(d, preset="tiny", force=True, layers=3)
    shards = list(d.glob("model-*.safetensors"))
    assert len(shards) == 5  # 3 layers + globals + vision
    assert all(p.name.endswith("-of-000005.safetensors") for p in shards)
    assert set(json.loads((d / INDEX_NAME).read_text())["weight_map"].values()) == {p.name for p in shards}


def test_cli_hooks(tmp_path, capsys):
    import argparse

    from k3.cli import build_parser
    from k3.commands import synth as synth_cmd

    ap = argparse.ArgumentParser()
    synth_cmd.add_arguments(ap)
    args = ap.parse_args([str(tmp_path / "x"), "--preset", "realdims", "--dry-run"])
    assert synth_cmd.run(args) == 0
    assert not (tmp_path / "x").exists()
    assert "total" in capsys.readouterr().err  # the plan, on stderr
    args = ap.parse_args([str(tmp_path / "y"), "--arch", "kimi_linear", "--seed", "3", "--layers", "3",
                          "--experts", "8"])
    assert build_parser().parse_args(["synth", str(tmp_path / "y")]).fn is synth_cmd.run  # `k3 synth`
    assert synth_cmd.run(args) == 0
    cfg = load_config(tmp_path / "y")
    assert cfg.num_hidden_layers == 3 and cfg.num_experts == 8
    assert json.loads((tmp_path / "y" / "k3_synth.json").read_text())["seed"] == 3


# ------------------------------------------------------------------ a model runs on it
def _kernels(monkeypatch):
    """Plain reference matmuls (bf16 widened, MXFP4 decoded by the spec's rules): this
    test is about the generated weights, not the project's kernels, which have their
    own tests."""
    import k3.kernels as q

    monkeypatch.setattr(q, "bf16_linear", lambda x, w: x @ w.to(torch.float32).T, raising=False)
    monkeypatch.setattr(q, "mxfp4_linear", lambda x, p, s: x @ ref_decode(p, s).T, raising=False)


def _routes():
    from k3.model.stack import Observer

    class Routes(Observer):
        """The experts each layer's router chose, over the whole run."""

        def __init__(self):
            self.used = collections.defaultdict(set)

        def on_route(self, layer, ids):
            self.used[layer].update(ids.flatten().tolist())

    return Routes()


def _generate_check(d, n_gen=8):
    from engines import open_engine

    routes = _routes()
    prompt = [5, 300, 77, 901, 12, 640]
    with open_engine(d) as eng:
        cfg = eng.cfg
        # greedy, full recompute (the whole prefix re-read every step)
        steps = list(eng.decode(prompt, incremental=False, max_tokens=n_gen, keep_logits=True, observer=routes))
    assert len(steps) == n_gen
    logits = torch.stack([s.logits for s in steps])
    toks = [s.token for s in steps]
    assert bool(torch.isfinite(logits).all())
    assert len(set(toks)) > 1, toks
    assert logits.std(-1).min() > 0.3  # a real spread, not a flat distribution
    assert all(t < cfg.vocab_size - 256 for t in toks)  # ordinary tokens, not reserved specials
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe(i):
            assert len(routes.used[i]) > cfg.num_experts_per_token, (i, routes.used[i])
        else:
            assert i not in routes.used, i  # a dense layer routes nothing
    return toks


@pytest.mark.parametrize("which", ["tiny", "tiny_kl"])
def test_generation_is_sane(which, request, monkeypatch):
    _kernels(monkeypatch)
    _generate_check(request.getfixturevalue(which))


@pytest.mark.slow
def test_small_preset(tmp_path, monkeypatch):
    d = synth.synthesize(tmp_path / "small", preset="small")
    plan = synth.make_plan("small", "k3")
    assert 50e6 < plan.total_bytes < 500e6
    assert sum(p.stat().st_size for p in d.glob("model-*.safetensors")) > plan.total_bytes
    _kernels(monkeypatch)
    _generate_check(d, n_gen=3)


# ------------------------------------------------------------------ K3's pool, its vocabulary, parallel drawing
def test_workers_write_the_same_bytes(tiny, tmp_path):
    """Pieces drawn by worker processes and written at their offsets are the bytes one
    process writes (small pieces, so that every shard is split among the workers)."""
    old = synth.write._PIECE
    synth.write._PIECE = 4096
    try:
        par = synth.synthesize(tmp_path / "par", preset="tiny", seed=0, workers=2)
    finally:
        synth.write._PIECE = old
    for n in sorted(os.listdir(tiny)):
        assert (tiny / n).read_bytes() == (par / n).read_bytes(), n
    with pytest.raises(UsageError, match="--workers"):
        synth.synthesize(tmp_path / "bad", preset="tiny", workers=0)


def test_pool_preset_has_k3s_expert_ratio(tmp_path):
    p = synth.make_plan("pool", "k3")
    assert (p.cfg.num_experts, p.cfg.num_experts_per_token) == (896, 16)
    assert p.total_bytes < 40e6  # seconds to write: a test's checkpoint
    d = synth.synthesize(tmp_path / "pool", preset="pool")
    idx = CheckpointIndex.open(d)
    for i in range(1, p.cfg.num_hidden_layers):
        assert sum(f".layers.{i}.block_sparse_moe.experts." in n and n.endswith("w1.weight_packed")
                   for n in idx.names()) == 896


def test_release_sized_vocabulary(tmp_path):
    from tiktoken.load import load_tiktoken_bpe

    from k3.tokenizer import Tokenizer

    d = synth.synthesize(tmp_path / "v", preset="tiny", layers=2, vocab=synth.K3_BASE + 256)
    cfg = load_config(d)
    assert cfg.vocab_size == 163840
    ranks = load_tiktoken_bpe(str(d / "tiktoken.model"))
    assert len(ranks) == synth.K3_BASE and sorted(ranks.values()) == list(range(synth.K3_BASE))
    tok = Tokenizer(d)
    text = "The capital of France is Paris. 机器学习"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # the learned merges are kept; fillers are never reached
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert int(next(k for k, v in tc["added_tokens_decoder"].items() if v["content"] == "[BOS]")) == synth.K3_BASE
    for bad in (100, 1 << 30, True):
        with pytest.raises(UsageError, match="--vocab"):
            synth.make_plan("tiny", "k3", vocab=bad)
