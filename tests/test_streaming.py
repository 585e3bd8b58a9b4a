"""The budgeted engine gives the same numbers as the resident one.

Bit-identical logits and tokens at every expert-cache budget (down to top-k + 1
slots), trunk budget and ring size (1, 2, 3), pinning order, thread count, with and
without a packed trunk, ultra-low-memory or not; a run far below the checkpoint size
stays under its memory plan; a failed read ends the run with exit code 4 and writes
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from k3 import synth
from k3.config import load_config
from k3.engine import generate, load_model
from k3.memory.expert_cache import expert_cache_min_bytes
from k3.memory.resident import CheckpointLayout
from k3.memory.streaming import StreamingWeights
from k3.model.stack import Model
from k3.quant import get_num_threads, set_num_threads

PROMPT = [5, 17, 99, 300, 42, 7, 1000, 12, 64, 3, 250, 77, 31, 8, 500, 2, 9, 600, 11, 13,
          14, 15, 16, 400, 401, 402, 33, 34, 35, 36, 37, 38, 39, 40]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    d = synth.synthesize(root / "m", preset="tiny", arch="k3", seed=5)
    trunk = None
    try:
        from k3.memory.trunk import pack_trunk
        trunk = pack_trunk(d, root / "trunk")
    except ImportError:  # pragma: no cover - trunk module not present
        pass
    return d, trunk


@pytest.fixture(scope="module")
def reference(ckpt):
    d, _ = ckpt
    m = load_model(d)
    return m.forward(PROMPT, last_only=False), [s.token for s in generate(m, PROMPT, 6)]


def streaming_model(d, **kw):
    cfg = load_config(d)
    prov = StreamingWeights(cfg, d, **kw)
    return Model(prov), prov


def layer_sizes(d):
    from k3.checkpoint.safetensors import CheckpointIndex
    from k3.runner import layer_run_bytes
    cfg = load_config(d)
    lay = CheckpointLayout(cfg, CheckpointIndex.open(d))
    return [layer_run_bytes(lay, i) for i in range(cfg.num_hidden_layers)], lay


def check_same(model, reference):
    ref_logits, ref_tokens = reference
    assert torch.equal(model.forward(PROMPT, last_only=False), ref_logits)
    assert [s.token for s in generate(model, PROMPT, 6)] == ref_tokens
    inc = [s.token for s in generate(model, PROMPT, 6, incremental=True)]
    assert inc == ref_tokens


@pytest.mark.parametrize("cache", ["min", "mid", "all"])
def test_resident_trunk_any_cache_budget(ckpt, reference, cache):
    d, _ = ckpt
    _, lay = layer_sizes(d)
    lo = expert_cache_min_bytes(lay)
    budget = {"min": lo, "mid": 3 * lo, "all": 10**10}[cache]
    model, prov = streaming_model(d, cache_budget=budget)
    check_same(model, reference)
    st = prov.cache.stats()
    assert st["requests"] == st["hits"] + st["misses"]
    if cache == "min":
        assert st["evictions"] > 0


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_streamed_trunk_ring_and_budget(ckpt, reference, ring, frac):
    d, trunk = ckpt
    sizes, lay = layer_sizes(d)
    # frac 0: nothing pinned (ring only); 1: everything fits
    budget = int((ring + 1) * max(sizes) + frac * sum(sizes)) + 1
    model, prov = streaming_model(d, cache_budget=expert_cache_min_bytes(lay), trunk_dir=trunk,
                                  trunk_budget=budget, ring=ring)
    try:
        check_same(model, reference)
        ts = prov.trunk.stats()
        assert ts["bytes_read"] > 0
    finally:
        prov.close()


@pytest.mark.parametrize("order", ["largest", "prefix"])
def test_pin_order_and_ultra(ckpt, reference, order):
    d, trunk = ckpt
    sizes, lay = layer_sizes(d)
    model, prov = streaming_model(d, cache_budget=expert_cache_min_bytes(lay), trunk_dir=trunk,
                                  trunk_budget=3 * max(sizes) + sum(sizes) // 3, ring=2, pin_order=order,
                                  ultra=True)
    try:
        check_same(model, reference)
        assert prov.table_bytes() > 0  # embedding rows and lm_head really streamed
    finally:
        prov.close()


def test_thread_counts(ckpt, reference):
    d, trunk = ckpt
    sizes, lay = layer_sizes(d)
    before = torch.get_num_threads(), get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            set_num_threads(n)
            model, prov = streaming_model(d, cache_budget=expert_cache_min_bytes(lay), trunk_dir=trunk,
                                          trunk_budget=3 * max(sizes), ring=2)
            try:
                assert torch.equal(model.forward(PROMPT, last_only=False), reference[0])
            finally:
                prov.close()
    finally:
        torch.set_num_threads(before[0])
        set_num_threads(before[1])


# ------------------------------------------------------------------ through the CLI
def k3(*args, env=None):
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "k3", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=e)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A ~200 MB checkpoint, run inside budgets far below its size."""
    root = tmp_path_factory.mktemp("small")
    d = synth.synthesize(root / "m", preset="small", arch="k3", seed=1)
    from k3.memory.trunk import pack_trunk
    return d, pack_trunk(d, root / "trunk")


def test_cli_same_tokens_every_preset_and_under_plan(small, tmp_path):
    d, trunk = small
    ids = "5,6,7,8,9,10,11,12"
    runs = {
        "resident": [],
        "auto": ["--trunk", trunk, "--preset", "auto"],
        "tight": ["--trunk", trunk, "--trunk-gb", "0.04", "--cache-gb", "0.004", "--trunk-ring", "1"],
        "ring3": ["--trunk", trunk, "--trunk-gb", "0.08", "--cache-gb", "0.01", "--trunk-ring", "3"],
        "ultra": ["--trunk", trunk, "--preset", "ultra"],
        "order": ["--preset", "laptop", "--cache-gb", "0.006", "--trunk", trunk, "--trunk-gb", "0.06"],
    }
    out = {}
    for name, extra in runs.items():
        o, lg = tmp_path / f"{name}.json", tmp_path / f"{name}.f32"
        # seeded sampling (the synthetic model's generation_config asks for temperature 1.0,
        # top-p 0.95): the same seed must give the same tokens at every budget
        r = k3("run", d, "--ids", ids, "--gen", 4, "--incremental", "--seed", 7, "--out", o, "--dump-logits", lg, *extra,
               env={"K3_PIN_PREFIX": "1"} if name == "order" else None)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        res = json.loads(o.read_text())
        out[name] = (res["generated_ids"], lg.read_bytes())
        # the plan is an upper bound of the measured peak
        assert res["peak_rss_bytes"] <= res["memory_plan"]["total"], (name, res["peak_rss_bytes"], res["memory_plan"])
        if name == "ultra":
            assert res["ultra_low_memory"] and res["table_bytes_read"] > 0
        if name == "tight":
            assert "ring held at 1 slot" in r.stderr or res["trunk"]["ring_slots"] == 1
    first = out["resident"]
    for name, v in out.items():
        assert v[0] == first[0], f"{name}: tokens differ"
        assert v[1] == first[1], f"{name}: first-step logits differ"


def test_cli_read_failure_exit_4(small, tmp_path):
    d, trunk = small
    for target in ("experts", "trunk"):
        o = tmp_path / f"{target}.json"
        r = k3("run", d, "--ids", "5,6,7", "--gen", 3, "--trunk", trunk, "--trunk-gb", "0.05",
               "--cache-gb", "0.005", "--out", o, env={"K3_TEST_FAULT": f"eio:{target}:after=3"})
        assert r.returncode == 4, (target, r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stderr
        assert "RUN INVALID" in r.stderr and "layer" in r.stderr
        assert not o.exists()


def test_cli_refusals(small):
    d, trunk = small
    r = k3("run", d, "--ids", "5", "--gen", 1, "--cache-gb", "0.0001")
    assert r.returncode == 1 and "top-k + 1" in r.stderr
    r = k3("run", d, "--ids", "5", "--gen", 1, "--preset", "ultra")
    assert r.returncode == 2 and "--trunk" in r.stderr
    r = k3("run", d, "--ids", "5", "--gen", 1, "--preset", "nope")
    assert r.returncode == 2 and "unknown --preset" in r.stderr
    r = k3("run", "--list-presets")
    assert r.returncode == 0 and "laptop" in r.stdout and "auto" in r.stdout


CGROUP = "/sys/fs/cgroup/memory"


@pytest.mark.skipif(not (os.path.isdir(CGROUP) and os.access(CGROUP, os.W_OK)),
                    reason="needs a writable cgroup v1 memory controller (root)")
def test_plan_refuses_when_it_cannot_fit(small, tmp_path):
    """Under a 450 MB memory ceiling the resident trunk + interpreter cannot fit: the
    run is refused before allocating, with the shortfall and the options."""
    d, trunk = small
    grp = os.path.join(CGROUP, f"k3test{os.getpid()}")
    os.makedirs(grp, exist_ok=True)
    try:
        with open(os.path.join(grp, "memory.limit_in_bytes"), "w") as f:
            f.write(str(450 * 1000 * 1000))
        cmd = [sys.executable, "-m", "k3", "run", str(d), "--ids", "5", "--gen", "1", "--cache-gb", "0.01"]
        r = subprocess.run(["sh", "-c", f'echo $$ > {grp}/cgroup.procs && exec "$@"', "sh", *cmd],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stderr[-2000:]
        assert "REFUSING TO START" in r.stderr and "shortfall" in r.stderr and "--preset" in r.stderr
    finally:
        try:
            os.rmdir(grp)
        except OSError:
            pass


def test_cli_save_and_load_state_continues_like_one_run(small, tmp_path):
    d, trunk = small
    s, a, b, c = (tmp_path / n for n in ("s.k3state", "a.json", "b.json", "c.json"))
    base = ["--incremental", "--greedy", "--trunk", trunk, "--trunk-gb", "0.05", "--cache-gb", "0.01"]
    assert k3("run", d, "--ids", "5,6,7,8", "--gen", 3, "--save-state", s, "--out", a, *base).returncode == 0
    first = json.loads(a.read_text())["full_ids"]
    assert k3("run", d, "--ids", "9,10", "--gen", 3, "--load-state", s, "--out", b, *base).returncode == 0
    whole = first + [9, 10]
    assert k3("run", d, "--ids", ",".join(map(str, whole)), "--gen", 3, "--out", c, *base).returncode == 0
    assert json.loads(b.read_text())["full_ids"] == json.loads(c.read_text())["full_ids"]
    r = k3("run", d, "--ids", "9", "--gen", 1, "--load-state", s)
    assert r.returncode == 2 and "--incremental" in r.stderr


def test_kv_refusal_names_both_numbers(ckpt, monkeypatch):
    """With --incremental, a KV cache above 90% of available memory is refused before
    anything is allocated, with what it needs and what there is."""
    import argparse

    from k3.errors import UsageError
    from k3.memory import planner
    from k3.runner import Budgets, build_plan

    d, _ = ckpt
    sizes, lay = layer_sizes(d)
    per = planner.kv_bytes_per_position(lay.cfg)
    monkeypatch.setattr(planner, "meminfo", lambda: {"MemAvailable": 1000 * per, "MemTotal": 2000 * per})
    args = argparse.Namespace(incremental=True, trunk_ring=2)
    budgets = Budgets(None, 10**6, "custom", False)
    with pytest.raises(UsageError) as e:
        build_plan(lay.cfg, lay, budgets, args, 5000, 1, 1, sizes)
    msg = str(e.value)
    assert "KV cache for 5000 positions" in msg and planner.human(5000 * per) in msg
    assert planner.human(1000 * per) in msg and e.value.exit_code == 2
    plan, _ = build_plan(lay.cfg, lay, budgets, args, 100, 1, 1, sizes)  # fits: no refusal
    assert dict((n, b) for n, b, _ in plan.rows)["KV cache"] == 100 * per
