"""cache-sim: LRU / Belady replay of expert traces (the C engine's tools/sim_cache.py,
reference-engine.md 6.4) on the real K3 routing trace and on small hand-checked traces."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from k3.cli import main as k3_main
from k3.errors import UsageError
from k3.memory.cache_sim import capacities, load_trace, next_use, simulate

from k3fixtures import FIXTURES

TRACE = FIXTURES / "expert_trace.bin"


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE)


def test_load_trace_shape_and_ranges(trace):
    assert trace.dtype == np.int32 and trace.shape == (100_096, 2)
    assert trace[:, 0].min() >= 1 and trace[:, 0].max() <= 92
    assert trace[:, 1].min() >= 0 and trace[:, 1].max() <= 895


def test_load_trace_refuses_bad_files(tmp_path):
    p = tmp_path / "t.bin"
    p.write_bytes(b"\0" * 12)
    with pytest.raises(UsageError, match="not a multiple of 8"):
        load_trace(p)
    with pytest.raises(UsageError, match="cannot read"):
        load_trace(tmp_path / "missing.bin")
    np.array([[1, -3]], dtype="<i4").tofile(p)
    with pytest.raises(UsageError, match="negative"):
        load_trace(p)


def _naive(trace, cap, policy):
    """Obvious O(N * C) reference implementations."""
    keys = [tuple(r) for r in np.asarray(trace).tolist()]
    cache, last, hits = [], {}, 0
    for i, k in enumerate(keys):
        if k in cache:
            hits += 1
        else:
            if len(cache) >= cap:
                if policy == "lru":
                    v = min(cache, key=lambda c: last[c])
                else:
                    def nxt(c):
                        for j in range(i + 1, len(keys)):
                            if keys[j] == c:
                                return j
                        return len(keys) + 1
                    v = max(cache, key=nxt)
                cache.remove(v)
            cache.append(k)
        last[k] = i
    return hits


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cap", [1, 2, 3, 5, 8])
def test_matches_naive_reference(seed, cap):
    rng = np.random.default_rng(seed)
    tr = np.stack([rng.integers(0, 3, 300), rng.integers(0, 6, 300)], 1).astype(np.int32)
    for pol in ("lru", "belady"):
        assert simulate(tr, cap, pol)["hits"] == _naive(tr, cap, pol), pol


def test_next_use():
    keys = np.array([5, 1, 5, 2, 1, 5])
    assert next_use(keys).tolist() == [2, 4, 5, 6, 6, 6]


def test_cyclic_scan_defeats_lru():
    tr = np.array([[1, e] for _ in range(10) for e in range(6)], dtype=np.int32)
    assert simulate(tr, 5, "lru")["hits"] == 0  # LRU over a cyclic scan: 0 %
    b = simulate(tr, 5, "belady")
    assert b["hits"] > 0 and b["distinct"] == 6
    assert simulate(tr, 6, "lru")["hits"] == 60 - 6


# The C engine's figures for this trace (reference-engine.md 6.4); the exact values this
# implementation gives are in the comments.
C_LRU = {455: 36.24, 911: 36.24, 1822: 36.24, 3644: 36.24, 7289: 49.19}   # got 36.24 x4, 49.18
C_BELADY = {455: 39.4, 911: 42.6, 1822: 49.0, 3644: 61.7, 7289: 84.6}      # got 39.42 42.61 48.98 61.72 84.57


@pytest.mark.realtime
def test_reference_trace_against_c_engine(trace):
    caps = capacities(gb=(8, 16, 32, 64, 128), slot_mb=17.56)
    assert caps == [455, 911, 1822, 3644, 7289]
    for c in caps:
        t0 = time.perf_counter()
        lru = simulate(trace, c, "lru")
        bel = simulate(trace, c, "belady")
        assert time.perf_counter() - t0 < 4.0  # < 2 s a policy
        assert lru["requests"] == 100_096 and lru["distinct"] == 10_010
        assert lru["hits"] + lru["misses"] == lru["requests"]
        assert bel["hits"] >= lru["hits"]
        assert bel["hits"] <= lru["requests"] - lru["distinct"]  # compulsory misses
        assert abs(100 * lru["hit_rate"] - C_LRU[c]) < 1.0, (c, lru["hit_rate"])
        assert abs(100 * bel["hit_rate"] - C_BELADY[c]) < 1.0, (c, bel["hit_rate"])
    assert simulate(trace, 20_000, "lru")["hit_rate"] == pytest.approx(1 - 10_010 / 100_096)


def test_belady_never_below_lru_random_capacities(trace):
    sub = trace[:20_000]
    for c in (16, 100, 700, 2000):
        assert simulate(sub, c, "belady")["hits"] >= simulate(sub, c, "lru")["hits"]


def main(argv) -> int:
    """`k3 cache-sim ARGS...` in process."""
    return k3_main(["cache-sim", *argv])


def test_cli_table_and_json(capsys):
    assert main([str(TRACE), "--capacity", "455", "7290", "--gb", "64"]) == 0
    out = capsys.readouterr().out
    assert "100,096 requests" in out and "10,010 distinct" in out and "90.00%" in out
    rows = [l.split() for l in out.splitlines() if l.strip() and l.split()[0].replace(",", "").isdigit()]
    assert [r[0] for r in rows] == ["455", "3,644", "7,290"]
    assert float(rows[0][2]) == pytest.approx(36.24, abs=0.01)
    assert main([str(TRACE), "--capacity", "455", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["rows"][0]["slots"] == 455 and js["rows"][0]["belady"] >= js["rows"][0]["lru"]


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\1\2\3")
    assert main([str(bad)]) == 2
    assert "not a multiple of 8" in capsys.readouterr().err
    assert main([str(TRACE), "--capacity", "0"]) == 2
    assert main([str(TRACE), "--gb", "0.001"]) == 2
