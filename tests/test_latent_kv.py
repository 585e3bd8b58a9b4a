"""The latent MLA KV cache (k3.model.mla, `--kv latent`, the default): the same logits
as the expanded per-head cache to fp32 rounding, the same greedy tokens, incremental
decode equal to full recompute, state files in both forms with a refusal on a form
mismatch, and the plan counting ~53x fewer KV bytes per position at K3's shapes."""

from __future__ import annotations

import pytest
import torch

from k3 import synth
from k3.config import parse_config
from k3.memory.planner import kv_bytes_per_position
from k3.model.mla import MLAState, mla_layer
from k3.state import StateFileError, load_state, save_state

from engines import greedy_ids, open_engine

PROMPT = list(range(300, 341))


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def engines(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    synth.synthesize(d, preset="tiny", arch=request.param, seed=5)
    with open_engine(d, kv="latent") as lat, open_engine(d, kv="expanded") as exp:
        yield lat, exp


def _logits(eng, ids):
    st = eng.new_state()
    return eng.model.forward(ids, st)[-1], st


def test_latent_and_expanded_forms_give_the_same_logits(engines):
    lat, exp = engines
    a, sa = _logits(lat, PROMPT)
    b, sb = _logits(exp, PROMPT)
    assert all(ls.latent for ls in sa.layers if isinstance(ls, MLAState))
    assert not any(ls.latent for ls in sb.layers if isinstance(ls, MLAState))
    scale = b.abs().max()
    assert (a - b).abs().max() <= 1e-5 * scale
    # and token by token through the caches
    for t in (7, 11):
        a = lat.model.forward([t], sa)[-1]
        b = exp.model.forward([t], sb)[-1]
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_latent_greedy_tokens_equal_expanded_and_full_recompute(engines):
    lat, exp = engines
    inc = greedy_ids(lat, PROMPT, 12)
    assert inc == greedy_ids(lat, PROMPT, 12, incremental=False)
    assert inc == greedy_ids(exp, PROMPT, 12)


def test_latent_layer_matches_expanded_with_random_weights():
    """One MLA layer at realistic proportions (rope and nope halves, several heads),
    prefill then decode, both forms against the stateless (expanded) computation."""
    cfg = parse_config(synth.build_config("tiny"))
    g = torch.Generator().manual_seed(3)
    H, nope, rope, vd = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    d, ql, kl = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    shapes = {"q_a_proj": (ql, d), "q_a_layernorm": (ql,), "q_b_proj": (H * (nope + rope), ql),
              "kv_a_proj_with_mqa": (kl + rope, d), "kv_a_layernorm": (kl,), "kv_b_proj": (H * (nope + vd), kl),
              "o_proj": (d, H * vd), "g_proj": (H * vd, d)}
    w = {}
    for name, shp in shapes.items():
        if len(shp) == 1:
            w[f"self_attn.{name}.weight"] = 1 + 0.1 * torch.randn(shp, generator=g)
        else:
            w[f"self_attn.{name}.weight"] = torch.randn(shp, generator=g) / shp[1] ** 0.5
    x = torch.randn(9, d, generator=g)
    ref = mla_layer(cfg, w, x, None)
    for latent in (True, False):
        st = MLAState(latent=latent)
        got = torch.cat([mla_layer(cfg, w, x[:5], st)] + [mla_layer(cfg, w, x[t:t + 1], st) for t in range(5, 9)])
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), latent
        assert st.k.shape == ((9, kl) if latent else (9, H, nope + rope))


def test_state_files_in_both_forms(tmp_path, engines):
    lat, exp = engines
    for eng, form, other in ((lat, "latent", "expanded"), (exp, "expanded", "latent")):
        st = eng.new_state()
        eng.model.forward(PROMPT, st)
        p = tmp_path / f"{form}.st"
        save_state(p, st, eng.model.cfg, pending=[9])
        ld = load_state(p, eng.model.cfg, latent=form == "latent")
        want = greedy_ids(eng, PROMPT + [9], 4)
        assert greedy_ids(eng, [9], 4, state=ld.state) == want
        with pytest.raises(StateFileError, match=f"--kv {form}"):
            load_state(p, eng.model.cfg, latent=other == "latent")


def test_plan_counts_latent_kv_bytes():
    c = parse_config(synth.build_config("realdims", layers=93, experts=896))
    lat, exp = kv_bytes_per_position(c), kv_bytes_per_position(c, latent=False)
    mla = sum(c.is_mla(i) for i in range(93))
    assert lat == mla * (512 + 64) * 4  # one normalised latent + the shared rope key per MLA layer
    assert exp == mla * 96 * (192 + 128) * 4
    assert exp >= 30 * lat


def test_longest_context_is_the_edge_of_what_the_plan_fits():
    from k3.errors import K3Error
    from k3.memory import planner
    from k3.memory.planner import Budgets, ModelSizes

    c = parse_config(synth.build_config("realdims", layers=93, experts=896))
    sizes = ModelSizes(layer_bytes=(1_170_001_920,) * 93, table_bytes=4_700_000_000, head_bytes=2_350_000_000,
                       slot_bytes=17_563_648, expert_bytes=17_547_264, moe_layers=92, experts=896, top_k=16)
    kw = dict(available=8 << 30, baseline=10**9, incremental=True, prefill_tokens=287)
    budgets = Budgets(preset="auto", trunk="/packed")
    for latent in (True, False):
        n = planner.longest_context(c, sizes, budgets, kv_latent=latent, **kw)
        assert n > 0
        planner.plan(c, sizes, budgets, tokens=n, kv_latent=latent, **kw).check()
        too_long = planner.plan(c, sizes, budgets, tokens=n + 1, kv_latent=latent, **kw)
        with pytest.raises(K3Error, match=r"longest context that fits is about \d+ positions") as e:
            too_long.check()
        # the refusal's figure is within a position of the searched edge
        said = int(str(e.value).split("longest context that fits is about ")[1].split()[0])
        assert abs(said - n) <= 1
        if latent:
            n_latent = n
    assert n_latent > 30 * n  # 8 GiB holds >30x more positions in the latent form
