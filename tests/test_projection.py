"""`k3 doctor --project` (k3/projection.py): the released K3's sizes, the plans and bytes
per token at each memory size against the C engine's published reads, and the
command's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3 import projection as pj

ROOT = Path(__file__).resolve().parents[1]
# kimi-k3-in-c reads the whole trunk plus every routed expert at 8 GB, the experts alone from 128 GB
C_ENGINE_8GB = 108.81e9 + 25.83e9
C_ENGINE_128GB = 25.83e9


@pytest.fixture(scope="module")
def k3_release():
    return pj.release_model()


def test_the_released_k3s_sizes(k3_release):
    cfg, sizes = k3_release
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_token, cfg.vocab_size) == (93, 896, 16, 163840)
    assert sizes.trunk_bytes == pytest.approx(108.81e9, rel=2e-3)  # 4096-rounded layers
    assert sizes.table_bytes == pytest.approx(4.70e9, rel=1e-2)
    assert sizes.moe_layers * sizes.top_k * sizes.expert_bytes == pytest.approx(25.83e9, rel=2e-3)


def test_projected_reads_never_exceed_the_c_engines(k3_release):
    cfg, sizes = k3_release
    rates = pj.Rates(seq=4.6e9, random=4.6e9, bf16=30e9, mxfp4=25e9)
    rows = pj.project(cfg, sizes, rates, [8, 16, 32, 64, 128, 224], baseline=int(1.2e9))
    assert all(r.fits for r in rows)
    gb = [r.plain_gb_per_token * 1e9 for r in rows]
    assert gb == sorted(gb, reverse=True)  # more memory never reads more
    assert gb[0] <= C_ENGINE_8GB * (1 + 1e-4)
    assert all(g <= C_ENGINE_128GB for g in gb[4:])
    big = rows[-1]
    assert big.pinned_gb * 1e9 == pytest.approx(sizes.trunk_bytes)  # the whole trunk pinned at 224 GB
    # batch 8 shares the streamed trunk and every expert chosen twice: fewer bytes a token
    for r in rows[1:]:
        assert 0 < r.batch_gb_per_token < r.plain_gb_per_token
    # the pass model: a token at 224 GB reads the missed share of its 16 experts per layer
    miss = 1 - big.cache_slots / (sizes.moe_layers * sizes.experts)
    assert big.plain_gb_per_token * 1e9 == pytest.approx(sizes.moe_layers * 16 * sizes.expert_bytes * miss, rel=1e-6)
    # seconds follow the stated rates: at 8 GB the streamed trunk at 4.6 GB/s bounds a token
    r8 = rows[0]
    assert r8.plain_s_per_token >= (sizes.trunk_bytes - r8.pinned_gb * 1e9) / 4.6e9
    # speculation at 70 %: fewer seconds a token where reads dominate
    assert r8.spec_drafts >= 1 and r8.spec_s_per_token < r8.plain_s_per_token


def test_doctor_project_prints_and_reports_the_table(tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3", "doctor", "--project", "--disk-gbps", "4.6", "--no-probe",
                        "--ram", "8,128", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    p = rep["projection"]
    assert [row["ram_gb"] for row in p["rows"]] == [8, 128] and p["rates"]["sequential"] == 4.6e9
    assert p["rows"][0]["plain_gb_per_token"] > p["rows"][1]["plain_gb_per_token"]
    assert any("spec 70%" in line for line in rep["sections"]["projection"])
    bad = subprocess.run([sys.executable, "-m", "k3", "doctor", "--ram", "8"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--project" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "k3", "doctor", "--project", "--ram", "8,x", "--no-probe"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--ram" in bad.stderr and "Traceback" not in bad.stderr
