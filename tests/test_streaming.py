"""The budgeted engine gives the same numbers as the resident one.

Bit-identical logits and tokens at every expert-cache budget (down to top-k + 1
slots), trunk budget and ring size (1, 2, 3), pinning order, thread count, with and
without a packed trunk, ultra-low-memory or not; a run far below the checkpoint size
stays under its memory plan; a failed read ends the run with exit code 4 and writes
nothing.

The engines are opened through k3.load (tests/engines.py) with explicit budgets; the
budgets are bytes here, passed as GB (`gb` below) and checked to arrive exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from k3 import synth
from k3.checkpoint.layout import CheckpointLayout
from k3.config import load_config
from k3.memory.streaming import model_sizes
from k3.kernels import get_num_threads, set_num_threads

from engines import greedy_ids, open_engine

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
    """The resident engine: trunk held in RAM, every routed expert in the cache."""
    d, _ = ckpt
    with open_engine(d) as eng:
        assert eng.plan.trunk is None and not eng.plan.stream_tables
        assert eng.plan.cache_slots == model_sizes(eng.provider.layout).routed_experts
        return eng.model.forward(PROMPT, last_only=False), greedy_ids(eng, PROMPT, 6, incremental=False)


def gb(nbytes: int) -> float:
    """A byte budget as the GB figure k3.load takes (decimal GB); the half byte keeps
    int(gb * 1e9) from rounding down to nbytes - 1."""
    return (nbytes + 0.5) / 1e9


def layer_sizes(d):
    """The trunk layers' bytes as stored, and the layout."""
    cfg = load_config(d)
    lay = CheckpointLayout.open(cfg, d)
    return [lay.layer_nbytes(i) for i in range(cfg.num_hidden_layers)], lay


def min_cache_bytes(lay) -> int:
    """The smallest expert cache: top-k + 1 slots."""
    sizes = model_sizes(lay)
    return (sizes.top_k + 1) * sizes.slot_bytes


def budgeted(d, *, cache_bytes, trunk=None, trunk_bytes=None, **kw):
    """An engine with these exact budgets (k3.load; close it)."""
    extra = {} if trunk_bytes is None else {"trunk_gb": gb(trunk_bytes)}
    eng = open_engine(d, trunk=trunk, cache_gb=gb(cache_bytes), **extra, **kw)
    try:
        assert eng.plan.cache_budget == cache_bytes
        if trunk is not None:
            assert eng.plan.trunk_budget == trunk_bytes and eng.plan.trunk.budget_bytes == trunk_bytes
            assert eng.provider.trunk is not None and eng.provider.trunk.plan is eng.plan.trunk
        else:
            assert eng.plan.trunk is None and eng.provider.trunk is None
    except BaseException:
        eng.close()
        raise
    return eng


def check_same(eng, reference):
    ref_logits, ref_tokens = reference
    assert torch.equal(eng.model.forward(PROMPT, last_only=False), ref_logits)
    assert greedy_ids(eng, PROMPT, 6, incremental=False) == ref_tokens
    inc = greedy_ids(eng, PROMPT, 6, incremental=True)
    assert inc == ref_tokens


@pytest.mark.parametrize("cache", ["min", "mid", "all"])
def test_resident_trunk_any_cache_budget(ckpt, reference, cache):
    d, _ = ckpt
    _, lay = layer_sizes(d)
    lo = min_cache_bytes(lay)
    budget = {"min": lo, "mid": 3 * lo, "all": 10**10}[cache]
    with budgeted(d, cache_bytes=budget) as eng:
        sizes = model_sizes(lay)
        assert eng.provider.cache.n_slots == min(budget // sizes.slot_bytes, sizes.routed_experts)
        assert not eng.plan.stream_tables
        check_same(eng, reference)
        st = eng.provider.cache.stats()
        assert st["requests"] == st["hits"] + st["misses"]
        if cache == "min":
            assert eng.provider.cache.n_slots == sizes.top_k + 1
            assert st["evictions"] > 0


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_streamed_trunk_ring_and_budget(ckpt, reference, ring, frac):
    d, trunk = ckpt
    sizes, lay = layer_sizes(d)
    # frac 0: nothing pinned (ring only); 1: everything fits
    budget = int((ring + 1) * max(sizes) + frac * sum(sizes)) + 1
    with budgeted(d, cache_bytes=min_cache_bytes(lay), trunk=trunk, trunk_bytes=budget, trunk_ring=ring) as eng:
        tp = eng.plan.trunk
        if frac == 1.0:
            assert tp.ring_slots == 0 and len(tp.pinned) == len(sizes)
        elif frac == 0.0:
            assert tp.ring_slots == ring and len(tp.pinned) < len(sizes)
        check_same(eng, reference)
        ts = eng.provider.trunk.stats()
        assert ts["bytes_read"] > 0


@pytest.mark.parametrize("order", ["largest", "prefix"])
def test_pin_order_and_ultra(ckpt, reference, order, monkeypatch):
    d, trunk = ckpt
    sizes, lay = layer_sizes(d)
    if order == "prefix":
        monkeypatch.setenv("K3_PIN_PREFIX", "1")
    else:
        monkeypatch.delenv("K3_PIN_PREFIX", raising=False)
    with budgeted(d, cache_bytes=min_cache_bytes(lay), trunk=trunk, trunk_bytes=3 * max(sizes) + sum(sizes) // 3,
                  trunk_ring=2, ultra_low_memory=True) as eng:
        assert eng.plan.trunk.order == order and eng.plan.stream_tables
        check_same(eng, reference)
        assert eng.provider.table_bytes() > 0  # embedding rows and lm_head really streamed


def test_thread_counts(ckpt, reference):
    d, trunk = ckpt
    sizes, lay = layer_sizes(d)
    before = torch.get_num_threads(), get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            set_num_threads(n)
            with budgeted(d, cache_bytes=min_cache_bytes(lay), trunk=trunk, trunk_bytes=3 * max(sizes),
                          trunk_ring=2) as eng:
                assert torch.get_num_threads() == n and get_num_threads() == n
                assert torch.equal(eng.model.forward(PROMPT, last_only=False), reference[0])
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


def test_cli_refusals(small, tmp_path):
    d, trunk = small
    r = k3("run", d, "--ids", "5", "--gen", 1, "--cache-gb", "0.0001")
    assert r.returncode == 1 and "top-k + 1" in r.stderr
    r = k3("run", d, "--ids", "5", "--gen", 1, "--preset", "nope")
    assert r.returncode == 2 and "unknown preset 'nope'" in r.stderr and "choose one of" in r.stderr
    assert "Traceback" not in r.stderr
    # --preset ultra no longer needs --trunk (README, "What changed in 0.2"): the model
    # tables are streamed and the trunk is held in RAM
    o = tmp_path / "ultra.json"
    r = k3("run", d, "--ids", "5", "--gen", 1, "--preset", "ultra", "--out", o)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(o.read_text())
    assert res["ultra_low_memory"] and res["table_bytes_read"] > 0 and res["trunk"] == {}
    assert res["memory_plan"]["components"]["trunk (resident)"] > 0
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
    r = k3("run", d, "--ids", "9", "--gen", 1, "--load-state", s, "--full-recompute")
    assert r.returncode == 2 and "--full-recompute" in r.stderr
    r = k3("run", d, "--ids", "9", "--gen", 1, "--save-state", tmp_path / "x.k3state", "--full-recompute")
    assert r.returncode == 2 and "--full-recompute" in r.stderr and not (tmp_path / "x.k3state").exists()


def test_kv_refusal_names_both_numbers(ckpt):
    """With incremental decoding, a KV cache above 90% of available memory is refused
    before anything is allocated, with what it needs and what there is."""
    from k3.errors import UsageError
    from k3.memory import planner
    from k3.units import human

    d, _ = ckpt
    _, lay = layer_sizes(d)
    sizes = model_sizes(lay)
    per = planner.kv_bytes_per_position(lay.cfg)
    avail = 1000 * per
    budgets = planner.Budgets(cache_gb=gb(min_cache_bytes(lay)))
    with pytest.raises(UsageError) as e:
        planner.plan(lay.cfg, sizes, budgets, tokens=5000, incremental=True, available=avail, baseline=1)
    msg = str(e.value)
    assert "KV cache for 5000 positions" in msg and human(5000 * per) in msg
    assert human(avail) in msg and e.value.exit_code == 2
    # 900 positions are 90% of it: still planned (the whole plan may not fit; check() says so)
    plan = planner.plan(lay.cfg, sizes, budgets, tokens=900, incremental=True, available=avail, baseline=1)
    assert dict((n, b) for n, b, _ in plan.rows)["KV cache"] == 900 * per
    with pytest.raises(UsageError):
        planner.plan(lay.cfg, sizes, budgets, tokens=901, incremental=True, available=avail, baseline=1)
    plan = planner.plan(lay.cfg, sizes, budgets, tokens=100, incremental=True, available=avail, baseline=1)
    assert dict((n, b) for n, b, _ in plan.rows)["KV cache"] == 100 * per
    # full recompute rebuilds the KV cache of the whole sequence during every step (it reads
    # the sequence in prefill pieces): it is planned, and refused, the same way
    with pytest.raises(UsageError, match="KV cache for 5000 positions"):
        planner.plan(lay.cfg, sizes, budgets, tokens=5000, incremental=False, available=avail, baseline=1)
    plan = planner.plan(lay.cfg, sizes, budgets, tokens=100, incremental=False, available=avail, baseline=1)
    assert dict((n, b) for n, b, _ in plan.rows)["KV cache"] == 100 * per
