"""The one decision point between a layer's compiled regions and the plain forward
(k3.model.compiled): both positions give the same bits, K3_FUSED=0 switches the regions
off, and the choice is reported (Engine.paths, the load log, `k3 run --out`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import k3
from k3 import synth
from k3.kernels import vml
from k3.model import compiled

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 99, 300, 42, 7, 3]


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def model_dir(request, tmp_path_factory):
    return synth.synthesize(tmp_path_factory.mktemp(request.param) / "m", preset="small", arch=request.param,
                            seed=13, layers=4)


def _logits(eng, n: int = 5) -> torch.Tensor:
    """Prompt, then n greedy steps one token at a time (the decode steps the regions
    take), every step's logits stacked."""
    st = eng.new_state()
    out = [eng.model.forward(PROMPT, st, last_only=True)]
    for _ in range(n):
        out.append(eng.model.forward([int(out[-1].argmax())], st, last_only=True))
    return torch.cat(out)


@pytest.mark.parametrize("threads", [1, 2])
def test_regions_and_plain_forward_give_the_same_bits(model_dir, threads, monkeypatch):
    with k3.load(model_dir, threads=threads, log=lambda *a, **k: None) as eng:
        assert eng.model.fast is not None or not vml.AVAILABLE
        fused = _logits(eng)
        paths = eng.paths()
        mla_layers = sum(eng.cfg.is_mla(i) for i in range(eng.n_layers))
    monkeypatch.setenv("K3_FUSED", "0")
    with k3.load(model_dir, threads=threads, log=lambda *a, **k: None) as eng:
        assert eng.model.fast is None
        plain = _logits(eng)
        off = eng.paths()
    assert torch.equal(fused.view(torch.int32), plain.view(torch.int32))
    assert off["regions"] is False and off["plain_because"] == "K3_FUSED=0" and "ran" not in off
    if vml.AVAILABLE:
        assert paths["regions"] is True and paths["plain_because"] is None
        ran = paths["ran"]   # every decode step ran its mixers in regions; only the prompt's MLA pass is plain
        assert ran.get("kda region", 0) + ran.get("mla region", 0) == 5 * 4
        assert ran.get("plain mixer", 0) == mla_layers


def test_the_choice_is_made_once_and_reported(model_dir):
    lines = []
    with k3.load(model_dir, log=lambda m="", **k: lines.append(m)) as eng:
        cfg = eng.cfg
        d = compiled.describe(cfg, range(eng.n_layers), eng.model.fast, eng.model.plain_because)
        assert d["layers"]["kda"] == compiled._ranges([i for i in range(eng.n_layers) if not cfg.is_mla(i)])
    assert sum(m.startswith("layers: ") for m in lines) == 1
    assert compiled._ranges([0, 1, 2, 4, 6, 7]) == "0-2,4,6-7" and compiled._ranges([3]) == "3"


def test_run_out_reports_the_paths_and_k3_fused_0_turns_them_off(model_dir, tmp_path):
    from engines import own_cache
    env = dict(os.environ, K3_CACHE=str(own_cache(tmp_path / "cache")))
    got = {}
    for fused in ("1", "0"):
        out = tmp_path / f"out{fused}.json"
        r = subprocess.run([sys.executable, "-m", "k3", "run", str(model_dir), "--ids", "5,17,99", "--gen", "3", "--greedy",
                            "--out", str(out)], env=dict(env, K3_FUSED=fused), capture_output=True, text=True,
                           cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr
        got[fused] = json.loads(out.read_text())
    assert got["1"]["generated_ids"] == got["0"]["generated_ids"]
    assert got["0"]["layer_paths"]["regions"] is False
    assert got["1"]["layer_paths"]["regions"] is vml.AVAILABLE
    # what the warm-up did: every job the model needs, none compiled (the shared cache is warm)
    assert got["1"]["kernels"]["jobs"] and got["1"]["kernels"]["compiled"] == []
