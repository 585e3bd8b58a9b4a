"""Every op fixture of kimi-k3-in-c v1 (tests/fixtures/k3-in-c-v1/ops) within the
tolerance its MANIFEST states (fp32: abs 1e-5, rel 1e-4). The fixtures come from a
plain-PyTorch re-implementation of Moonshot's modeling code, independent of ours."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import parse_config
from k3.model import kda as kda_mod
from k3.model.kda import kda_chunked, kda_decay, kda_layer, kda_recurrent
from k3.model.kda_state import KDAState
from k3.model.mla import MLAState, mla_layer
from k3.model.moe import moe_block, route
from k3.model.ops import attn_res, rms_norm, short_conv, situ_glu
from k3.model.stack import InferenceState, Model
from k3.model.weights import DictWeights

from k3fixtures import arr, layer_name, manifest, op, tiny_model

TOL = manifest()["tolerance"]
ATOL, RTOL = TOL["fp32_abs"], TOL["fp32_rel"]


def close(got, want, atol=ATOL, rtol=RTOL):
    got = got.reshape(want.shape).to(torch.float32)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def cfg():
    c, _ = tiny_model()
    return parse_config(c, "tiny_k3.json")


def test_rmsnorm():
    f = op("rmsnorm")
    close(rms_norm(arr(f["in"]), arr(f["weight"]), f["eps"]), arr(f["out"]))


def test_situ_glu_with_saturating_caps():
    f = op("situ_glu")
    x = arr(f["in"])
    n = x.shape[1] // 2
    out = situ_glu(x[:, :n], x[:, n:], f["beta"], f["linear_beta"])
    close(out, arr(f["out"]))
    assert out.abs().max() <= f["beta"] * f["linear_beta"]


def test_shortconv_and_decode_state():
    f = op("shortconv")
    x = arr(f["in"])[0]
    out, state = short_conv(x, arr(f["weight"]), None)
    close(out, arr(f["out"])[0])
    close(state.T, arr(f["state_after"])[0])  # fixture stores [channels, K-1]
    out2, _ = short_conv(arr(f["in_next"])[0], arr(f["weight"]), state)
    close(out2, arr(f["out_next"])[0])


def test_kda_decay_lower_bound_form():
    f = op("kda_decay")
    z = arr(f["z"])[0]
    g = kda_decay(z, arr(f["A_log"]), arr(f["dt_bias"]), 4, f["lower_bound"])
    close(g, arr(f["g"])[0])
    close(torch.exp(g), arr(f["alpha"])[0])
    # (lb, 0] mathematically; fp32 sigmoid saturation reaches both ends exactly
    assert (g >= f["lower_bound"]).all() and (g <= 0).all()


@pytest.mark.parametrize("name", ["kda_recur1", "kda_recur8"])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_kda_recurrence(name, form):
    f = op(name)
    q = arr(f["q"]) * f["q_scale"]
    g = torch.log(arr(f["alpha"]))
    fn = kda_recurrent if form == "recurrent" else (lambda *a: kda_chunked(*a, chunk=4))
    o, S = fn(q, arr(f["k"]), arr(f["v"]), g, arr(f["beta"]), None)
    close(o, arr(f["out"]))
    close(S, arr(f["state_out"]))


def _kda_weights(f):
    m = {"q_proj": "q_proj.weight", "k_proj": "k_proj.weight", "v_proj": "v_proj.weight",
         "g_proj": "g_proj.weight", "o_proj": "o_proj.weight", "f_a": "f_a_proj.weight",
         "f_b": "f_b_proj.weight", "b_proj": "b_proj.weight", "q_conv": "q_conv1d.weight",
         "k_conv": "k_conv1d.weight", "v_conv": "v_conv1d.weight", "A_log": "A_log",
         "dt_bias": "dt_bias", "o_norm": "o_norm.weight"}
    return {"self_attn." + v: arr(f[k]) for k, v in m.items()}


@pytest.mark.parametrize("name", ["kda_layer1", "kda_layer8"])
@pytest.mark.parametrize("chunked", [False, True])
def test_kda_layer(cfg, name, chunked, monkeypatch):
    f = op(name)
    monkeypatch.setattr(kda_mod, "CHUNK", 4)
    st = KDAState()
    out = kda_layer(cfg, _kda_weights(f), arr(f["in"])[0], st, chunked=chunked)
    close(out, arr(f["out"])[0])
    close(st.S, arr(f["state_out"])[0])


def test_kda_layer_token_by_token_equals_sequence(cfg):
    """Decode (one token at a time, carried conv + recurrent state) == whole sequence."""
    f = op("kda_layer8")
    w, x = _kda_weights(f), arr(f["in"])[0]
    st = KDAState()
    outs = [kda_layer(cfg, w, x[t:t + 1], st) for t in range(x.shape[0])]
    close(torch.cat(outs), arr(f["out"])[0])
    close(st.S, arr(f["state_out"])[0])


def test_router_bias_selects_unbiased_weights(cfg):
    f = op("router")
    ids, wts = route(cfg, arr(f["in"]), arr(f["gate_weight"]), arr(f["bias"]))
    want_ids = arr(f["topk_idx"]).long()
    want_w = arr(f["topk_weight"])
    # compare as sets per row (order of equal-rank picks is not part of the contract)
    for r in range(ids.shape[0]):
        got = dict(zip(ids[r].tolist(), wts[r].tolist()))
        want = dict(zip(want_ids[r].tolist(), want_w[r].tolist()))
        assert set(got) == set(want), f"row {r}: selected {sorted(got)} want {sorted(want)}"
        for e in want:
            assert math.isclose(got[e], want[e], rel_tol=RTOL, abs_tol=ATOL)
    assert f["rows_where_bias_changed_selection"] > 0
    # and the bias matters: without it the selection differs on those rows
    ids_nb, _ = route(cfg, arr(f["in"]), arr(f["gate_weight"]), None)
    changed = sum(set(a) != set(b) for a, b in zip(ids_nb.tolist(), want_ids.tolist()))
    assert changed == f["rows_where_bias_changed_selection"]


def test_attnres_mixes_raw_values():
    f = op("attnres")
    bank = arr(f["block_residual"])  # [T, blocks, d]
    sources = [bank[:, j] for j in range(bank.shape[1])] + [arr(f["prefix_sum"])]
    assert len(sources) == f["n_sources"]
    close(attn_res(sources, arr(f["norm_weight"]), arr(f["proj_weight"]), f["eps"]), arr(f["out"]))


def _prefixed(f, prefix, strip):
    return {prefix + k[len(strip):]: arr(v) for k, v in f.items()
            if k.startswith(strip) and isinstance(v, dict) and "data" in v}


@pytest.mark.parametrize("latent", [True, False], ids=["latent-kv", "expanded-kv"])
def test_mla(cfg, latent):
    f = op("mla")
    w = {"self_attn." + k[: -len("_weight")] + ".weight": arr(v) for k, v in f.items()
         if k.endswith("_weight")}
    x = arr(f["in"])[0]
    close(mla_layer(cfg, w, x, None), arr(f["out"])[0])
    close(mla_layer(cfg, w, x, MLAState(latent=latent)), arr(f["out"])[0])
    # the same through a KV cache, token by token
    st = MLAState(latent=latent)
    outs = [mla_layer(cfg, w, x[t:t + 1], st) for t in range(x.shape[0])]
    close(torch.cat(outs), arr(f["out"])[0])


def _layer_weights(f):
    w = {}
    for k, v in f.items():
        if isinstance(v, dict) and "data" in v and k not in (
                "in", "out", "block_residual_in", "block_residual_out"):
            w[layer_name(k)] = arr(v)
    return w


class _OneLayer:
    def __init__(self, cfg, i, w):
        self.config = cfg
        self.i = i
        self.w = w

    def expert_groups(self, i, ids):
        return DictWeights(self.config, {f"layers.{i}.{k}": v for k, v in self.w.items()}).expert_groups(i, ids)


def test_moe(cfg):
    f = op("moe")
    w = {}
    for k, v in f.items():
        if isinstance(v, dict) and "data" in v and k not in ("in", "out"):
            w[layer_name("mlp_" + k)] = arr(v)
    prov = _OneLayer(cfg, 1, w)
    close(moe_block(cfg, w, arr(f["in"])[0], 1, prov), arr(f["out"])[0])


@pytest.mark.parametrize("latent", [True, False], ids=["latent-kv", "expanded-kv"])
@pytest.mark.parametrize("name", ["layer_kda", "layer_mla"])
def test_decoder_layer_with_attn_res(cfg, name, latent):
    f = op(name)
    i = f["layer_idx"]
    assert cfg.is_mla(i) == f["is_mla"]
    w = _layer_weights(f)
    model = Model(_OneLayer(cfg, i, w))
    bank_in = arr(f["block_residual_in"])
    bank = [bank_in[:, j] for j in range(bank_in.shape[1])]
    st = MLAState(latent=latent) if f["is_mla"] else KDAState()
    x = arr(f["in"])[0]
    seq = InferenceState([None] * i + [st], [])  # one sequence; the layer uses its layer-i state
    P = model.attn_res_layer(i, w, bank, x, [seq], [0, x.shape[0]])
    close(P, arr(f["out"])[0])
    bank_out = arr(f["block_residual_out"])
    assert len(bank) == bank_out.shape[1]
    close(torch.stack(bank, 1), bank_out)
