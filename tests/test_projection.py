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


@pytest.mark.parametrize("baseline_gb", [0.5, 0.85, 1.2, 2.0])
def test_projected_reads_never_exceed_the_c_engines(k3_release, baseline_gb):
    cfg, sizes = k3_release
    rates = pj.Rates(seq=4.6e9, random=4.6e9, bf16=30e9, mxfp4=25e9)
    rows = pj.project(cfg, sizes, rates, [8, 16, 32, 64, 128, 224], baseline=int(baseline_gb * 1e9))
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
    # one drive, one rate: no row reads its bytes faster than the drive gives them
    for r in rows:
        assert r.plain_s_per_token >= r.plain_gb_per_token * 1e9 / 4.6e9 * (1 - 1e-9)
        assert r.spec_s_per_token >= r.spec_gb_per_token * 1e9 / 4.6e9 * (1 - 1e-9)
        if r.batch_s_per_token:
            assert r.batch_s_per_token >= r.batch_gb_per_token * 1e9 / 4.6e9 * (1 - 1e-9)


def test_one_drive_one_rate_and_drives_divide_it(k3_release):
    """Reads that share a drive share its rate; experts' shards spread over two drives
    halve the experts' share of a pass (the packed trunk and lm_head stay on one drive),
    and compute still bounds it from below."""
    cfg, sizes = k3_release
    one = pj.Rates(seq=4.6e9, random=4.6e9, bf16=30e9, mxfp4=25e9)
    two = pj.Rates(seq=4.6e9, random=4.6e9, bf16=30e9, mxfp4=25e9, drives=2)
    r1, = pj.project(cfg, sizes, one, [8], baseline=int(1.2e9))
    r2, = pj.project(cfg, sizes, two, [8], baseline=int(1.2e9))
    assert r1.plain_gb_per_token == r2.plain_gb_per_token
    assert r1.parts["drive_s"] == pytest.approx(r1.plain_gb_per_token * 1e9 / 4.6e9, rel=1e-9)
    assert r2.parts["expert_read_s"] == pytest.approx(r1.parts["expert_read_s"] / 2, rel=1e-9)
    assert r2.parts["drive_s"] == pytest.approx(r1.parts["drive_s"] - r2.parts["expert_read_s"], rel=1e-9)
    assert r2.plain_s_per_token == pytest.approx(max(r2.parts["drive_s"], r2.parts["compute_chain_s"]), rel=1e-9)
    assert r2.plain_s_per_token >= r2.parts["trunk_math_s"] + r2.parts["expert_read_s"]


@pytest.mark.parametrize("baseline_gb,step", [(0.5, 1), (2.0, 7)])
def test_more_memory_never_plans_more_bytes(k3_release, baseline_gb, step):
    """auto at K3's config, 6 to 256 GB in 0.1 GB steps (0.7 GB steps for the second
    baseline): the bytes read per token never rise (for one sequence, and priced for
    batch 8)."""
    from k3.memory import planner
    from k3.units import GB

    cfg, sizes = k3_release
    for seqs in (1, 8):
        prev = None
        for tenth in range(60, 2561, step):
            b = planner.Budgets(preset="auto", trunk="(packed)")
            try:
                p = planner.plan(cfg, sizes, b, tokens=4096, incremental=True, available=int(tenth / 10 * GB),
                                 baseline=int(baseline_gb * 1e9), sequences=seqs, spec=4 if seqs == 1 else 0,
                                 prefill_tokens=64 * seqs)
                p.check()
            except Exception:
                assert prev is None, f"{tenth / 10} GB fits no plan, a smaller size did"
                continue
            if prev is not None:
                assert p.read_per_token <= prev[1], f"{prev[0]} GB plans {prev[1]}, {tenth / 10} GB {p.read_per_token}"
            prev = (tenth / 10, p.read_per_token)
        assert prev is not None


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


PROMPTS = [1024, 8192, 32768]
RAMS = [8, 16, 32, 64, 128, 224]


def _ttft(k3_release, bf16_flops, mxfp4_flops, rams=RAMS):
    from k3 import projection_ttft as tt

    cfg, sizes = k3_release
    rates = pj.Rates(seq=4.6e9, random=4.6e9, bf16=30e9, mxfp4=25e9, bf16_flops=bf16_flops, mxfp4_flops=mxfp4_flops)
    rows = tt.project_prompts(cfg, sizes, rates, rams, PROMPTS, baseline=int(1.2e9))
    return {(r.ram_gb, r.tokens): r for r in rows}


@pytest.mark.parametrize("flops", [1e18, 50e9])
def test_time_to_first_token_is_monotone_and_one_drive_bound(k3_release, flops):
    """Drive-bound (compute all but free) and compute-bound (50 GFLOP/s): a longer prompt
    is never faster, more memory never slower, and no prompt reads its bytes faster than
    the one drive gives them."""
    rows = _ttft(k3_release, flops, flops)
    assert all(r.fits and r.passes >= 1 and r.piece >= 256 for r in rows.values())
    for ram in RAMS:
        secs = [rows[ram, n].seconds for n in PROMPTS]
        assert secs == sorted(secs) and secs[0] < secs[-1]
        for n in PROMPTS:
            r = rows[ram, n]
            assert r.seconds >= r.gb_read * 1e9 / 4.6e9 * (1 - 1e-9)
            assert r.seconds >= max(r.drive_s, r.compute_chain_s) * (1 - 1e-9)
    for n in PROMPTS:
        secs = [rows[ram, n].seconds for ram in RAMS]
        # compute-bound, the chain waits on the missed experts, not on the ring: a plan
        # that pins more trunk may keep one cache slot fewer (a few parts in a million)
        tol = 1e-9 if flops > 1e15 else 1e-5
        assert all(b <= a * (1 + tol) for a, b in zip(secs, secs[1:])), (n, secs)
    # the whole trunk pinned and more cache at 224 GB: the longest prompt in fewer passes, fewer bytes
    assert rows[224, 32768].passes < rows[8, 32768].passes and rows[224, 32768].gb_read < rows[8, 32768].gb_read


def test_time_to_first_token_drive_or_compute_bound(k3_release):
    """With compute all but free a streamed-trunk plan is drive-bound: its seconds are its
    bytes at 4.6 GB/s; at 50 GFLOP/s the prefill's FLOPs bound it: 2 x P x (trunk
    weights + k experts' weights) a pass, not the distinct experts' bytes."""
    from k3 import projection_ttft as tt

    cfg, sizes = k3_release
    fast = _ttft(k3_release, 1e18, 1e18, [8])
    for n in PROMPTS:
        r = fast[8, n]
        assert r.bound == "drive"
        assert r.seconds == pytest.approx(r.gb_read * 1e9 / 4.6e9, rel=1e-9)
    slow = _ttft(k3_release, 50e9, 50e9, [8, 224])
    trunk_w, expert_w = tt.weight_params(cfg, sizes)
    assert expert_w == pytest.approx(3 * 3072 * 3584, rel=1e-6)  # K3's stored expert, MXFP4
    for ram in (8, 224):
        for n in PROMPTS:
            r = slow[ram, n]
            assert r.bound == "compute" and r.seconds == pytest.approx(r.compute_chain_s, rel=1e-9)
            flops = 2 * n * (trunk_w + sizes.moe_layers * sizes.top_k * expert_w)
            assert r.seconds > flops / 50e9
    # one pass's chain: the FLOPs, the missed experts' reads, one row of lm_head
    from k3.memory import planner
    plan, pp = tt.prompt_plan(cfg, sizes, 224, 1024, baseline=int(1.2e9))
    shape = planner.pass_shape(sizes, plan.trunk, plan.cache_slots, plan.stream_tables)
    rates = pj.Rates(seq=4.6e9, random=4.6e9, bf16=30e9, mxfp4=25e9, bf16_flops=50e9, mxfp4_flops=50e9)
    b, drive, chain = tt.pass_seconds(shape, cfg, sizes, rates, 1024)
    assert pp.passes == 1 and shape.streamed_trunk_bytes == 0 and shape.table_bytes == 0
    assert drive == pytest.approx(b / 4.6e9, rel=1e-9)
    assert chain == pytest.approx(2 * 1024 * (trunk_w + sizes.moe_layers * 16 * expert_w) / 50e9 + drive
                                  + sizes.head_bytes / 30e9, rel=1e-9)


def test_doctor_project_prompt_tokens():
    r = subprocess.run([sys.executable, "-m", "k3", "doctor", "--project", "--disk-gbps", "4.6", "--no-probe",
                        "--ram", "8,128", "--prompt-tokens", "1024,4096", "--json"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(r.stdout)["projection"]
    assert p["rates"]["bf16_prefill_flops"] > 0 and p["rates"]["mxfp4_prefill_flops"] > 0
    rows = p["time_to_first_token"]
    assert [(t["ram_gb"], t["tokens"]) for t in rows] == [(8, 1024), (8, 4096), (128, 1024), (128, 4096)]
    assert all(t["fits"] and t["seconds"] >= t["gb_read"] / 4.6 and t["bound"] in ("drive", "compute")
               for t in rows)
    sec = json.loads(r.stdout)["sections"]["projection"]
    head = sec.index(next(line for line in sec if line.startswith("time to first token")))
    assert "1024 tokens" in sec[head + 1] and sec[head + 2].split()[:2] == ["8", "GB"]
    assert "GFLOP/s" in sec[0]
    for args, what in ((["--prompt-tokens", "1024"], "--project"), (["--project", "--prompt-tokens", "0"], "got '0'"),
                       (["--project", "--prompt-tokens", "-5"], "whole numbers"),
                       (["--project", "--prompt-tokens", "1k"], "whole numbers")):
        bad = subprocess.run([sys.executable, "-m", "k3", "doctor", "--no-probe", *args], cwd=ROOT,
                             capture_output=True, text=True)
        assert bad.returncode == 2 and what in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)
