"""Sampling: the draw rule, reproducibility for a seed (across thread counts and
memory budgets), defaults from generation_config.json, and the command-line flags."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from k3.commands.common import add_sampling_args, sampling_from_args
from k3.decode import greedy
from k3.errors import K3Error, UsageError
from k3.sampling import Sampler, SamplingSettings, generation_defaults, resolve
from k3.synth import synthesize
from k3.units import GB

from engines import open_engine

#: Sampler(seed=7).uniform(0, 1, 5): a change to the generator (or numpy's Philox) shows here
PINNED_UNIFORMS = [0.468817486956, 0.138735464595, 0.84120663496]


@pytest.fixture(scope="module")
def k3dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    synthesize(d, preset="tiny", arch="k3", seed=11)
    return d


@pytest.fixture(scope="module")
def kldir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kl")
    synthesize(d, preset="tiny", arch="kimi_linear", seed=11)
    return d


@pytest.fixture(scope="module")
def engine(k3dir):
    with open_engine(k3dir) as eng:
        yield eng


def parse(argv):
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    return p.parse_args(argv)


def _draws(s, rows, start=0):
    return [s(r, start + i) for i, r in enumerate(rows)]


def test_same_seed_same_tokens_different_seed_differs():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(1000, generator=g) * 3 for _ in range(50)]
    a = _draws(Sampler(1.0, 0.95, 0, seed=42), rows)
    assert a == _draws(Sampler(1.0, 0.95, 0, seed=42), rows)
    assert a != _draws(Sampler(1.0, 0.95, 0, seed=43), rows)
    # streams (the chat uses one per turn) are independent and reproducible
    assert _draws(Sampler(0.8, 1.0, 0, 42, stream=3), rows) == _draws(Sampler(0.8, 1.0, 0, 42, stream=3), rows)
    assert _draws(Sampler(0.8, 1.0, 0, 42, stream=3), rows) != _draws(Sampler(0.8, 1.0, 0, 42, stream=4), rows)


def test_the_noise_is_keyed_by_position_not_by_call_order():
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(4000, generator=g) * 2 for _ in range(40)]
    s = Sampler(1.0, 0.9, 50, seed=9)
    want = _draws(s, rows, start=100)
    # backwards, each twice, interleaved with other positions: the same token at each position
    for i in reversed(range(len(rows))):
        s(rows[i], 7 + i)
        assert s(rows[i], 100 + i) == want[i] == s(rows[i], 100 + i)
    # and the uniform is pinned: Philox4x64-10, key SeedSequence([seed, stream]), counter [p, 0, 0, 0]
    key = np.random.SeedSequence([9, 0]).generate_state(2, np.uint64)
    raw = int(np.random.Philox(key=key, counter=np.array([123, 0, 0, 0], np.uint64)).random_raw())
    assert s.uniform(123) == (raw >> 11) / 2**53
    assert [round(Sampler(1.0, 1.0, 0, seed=7).uniform(p), 12) for p in (0, 1, 5)] == PINNED_UNIFORMS
    us = [s.uniform(p) for p in range(2000)]
    assert len(set(us)) == 2000 and 0 <= min(us) and max(us) < 1 and abs(np.mean(us) - 0.5) < 0.05


def test_greedy_rules():
    x = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert Sampler(0.0, 1.0, 0, seed=1)(x, 0) == 1 == greedy(x)  # first index of the maximum
    assert all(Sampler(1.0, 1.0, 1, seed=1)(x, p) == 1 for p in range(20))  # top-k 1: the first of the tied maxima
    assert all(Sampler(5.0, 1e-6, 0, seed=1)(x, p) == 1 for p in range(20))  # top-p ~0: the single top token
    assert {Sampler(1.0, 1.0, 2, seed=1)(x, p) for p in range(50)} == {1, 3}  # top-k 2 keeps the tie, both ids
    assert Sampler(1.0, 1.0, 2, seed=1).probabilities(x) == {1: 0.5, 3: 0.5}
    # -0.0 and +0.0 tie (lower id first), and masked (-inf) tokens are never kept
    z = torch.tensor([-1.0, 0.0, -0.0, float("-inf"), -0.0])
    assert set(Sampler(1.0, 1.0, 2, seed=1).probabilities(z)) == {1, 2}
    assert 3 not in Sampler(1.0, 1.0, 0, seed=1).probabilities(z)
    assert all(Sampler(1.0, 1.0, 0, seed=1)(z, p) != 3 for p in range(200))


def _want(logits, T, top_p, top_k):
    """The truncated softmax the contract describes, computed independently (float64)."""
    x = np.asarray(logits, np.float64)
    order = np.argsort(-x, kind="stable")[: top_k or None]
    p = np.exp((x[order] - x.max()) / T)
    c = np.cumsum(p)
    keep = int(np.searchsorted(c, top_p * c[-1])) + 1 if top_p < 1 else len(order)
    want = np.zeros_like(x)
    want[order[:keep]] = p[:keep] / p[:keep].sum()
    return want


def _chi2_p(counts, probs, n):
    """p-value of Pearson's chi-square test of `counts` against `probs` (Wilson-Hilferty
    approximation of the tail; scipy-free)."""
    import math
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)
    k = max(1, sum(1 for p in probs if p > 0) - 1)
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("T, top_p, top_k", [(0.7, 0.9, 0), (1.0, 1.0, 0), (1.6, 1.0, 4), (1.3, 0.8, 5)])
def test_distribution_matches_truncated_softmax(T, top_p, top_k):
    """20,000 positions of one fixed row: the tokens' frequencies against the truncated
    softmax (chi-square, p > 1e-6: seeded, so it cannot flake, and a wrong temperature,
    top-k or top-p moves the statistic far past that); tokens outside the kept set never."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.7])
    want = _want(logits, T, top_p, top_k)
    s = Sampler(T, top_p, top_k, seed=123)
    got = s.probabilities(logits)
    assert set(got) == set(np.flatnonzero(want)) and all(abs(got[i] - want[i]) < 1e-12 for i in got)
    n = 20000
    counts = np.bincount([s(logits, p) for p in range(n)], minlength=len(want))
    assert counts[want == 0].sum() == 0
    assert _chi2_p(counts, want, n) > 1e-6, (counts / n, want)
    # the test has power: the same draws against the untempered (T = 1) or the unfiltered distribution fail
    for wrong in (_want(logits, 1.0, top_p, top_k), _want(logits, T, 1.0, 0)):
        if np.abs(wrong - want).max() > 0.02:
            assert counts[wrong == 0].sum() > 0 or _chi2_p(counts, wrong, n) < 1e-6


def _reference_kept(x, T, top_p, top_k):
    """The contract's kept set, computed the plain way: a full stable sort."""
    x = np.asarray(x, np.float32).astype(np.float64)
    order = np.argsort(-x, kind="stable")
    if top_k:
        order = order[:top_k]
    w = np.exp((x - x.max()) / T) if T != 1.0 else np.exp(x - x.max())
    if top_p < 1.0:
        mass = np.cumsum(w[np.sort(order)])[-1]   # id order, sequential
        c = np.cumsum(w[order])
        hit = np.flatnonzero(c >= top_p * mass)
        order = order[: hit[0] + 1 if len(hit) else len(order)]
    return np.sort(order), w


@pytest.mark.parametrize("vocab, scale", [(163840, 3.0), (163840, 0.5), (5000, 12.0), (300, 1.0)])
def test_filter_and_pick_equal_the_contract_exactly(vocab, scale):
    """The bucketed filter keeps exactly the set a full stable sort gives, and the pick is
    the inverse CDF of the position's uniform over it in id order (K3's vocabulary,
    peaked and flat rows, ties)."""
    rng = np.random.default_rng(vocab)
    for T, top_p, top_k in ((1.0, 0.95, 0), (0.7, 0.9, 40), (1.5, 1.0, 100), (1.0, 0.5, 0), (0.3, 0.999, 0)):
        x = (rng.standard_normal(vocab) * scale).astype(np.float32)
        x[rng.integers(0, vocab, 50)] = x.max()   # ties at the top
        s = Sampler(T, top_p, top_k, seed=4)
        ids, w = _reference_kept(x, T, top_p, top_k)
        assert sorted(s.probabilities(x)) == ids.tolist(), (T, top_p, top_k)
        c = np.cumsum(w[ids])
        for p in range(5):
            u = s.uniform(p)
            j = int(np.searchsorted(c, u * c[-1], side="right"))
            assert s(x, p) == ids[min(j, len(ids) - 1)]


def test_the_plain_sampler_gives_the_kernels_tokens(monkeypatch):
    """K3_FUSED=0 filters with a full sort and picks with numpy, no sample kernel: the same
    kept sets, weights and tokens as the bucketed kernels (K3's vocabulary, peaked and
    flat rows, ties at the top)."""
    rng = np.random.default_rng(7)
    rows = []
    for vocab, scale in ((163840, 3.0), (163840, 0.5), (300, 1.0)):
        x = (rng.standard_normal(vocab) * scale).astype(np.float32)
        x[rng.integers(0, vocab, 50)] = x.max()
        rows.append(x)
    settings = ((1.0, 0.95, 0), (0.7, 0.9, 40), (1.5, 1.0, 100), (0.3, 0.999, 0), (1.0, 1.0, 0))
    want = [(Sampler(*st, seed=4).probabilities(x), [Sampler(*st, seed=4)(x, p) for p in range(8)])
            for x in rows for st in settings]
    monkeypatch.setenv("K3_FUSED", "0")
    got = [(Sampler(*st, seed=4).probabilities(x), [Sampler(*st, seed=4)(x, p) for p in range(8)])
           for x in rows for st in settings]
    assert got == want


def test_bad_logits_and_settings():
    with pytest.raises(K3Error, match="NaN"):
        Sampler(1.0, 1.0, 0, 1)(torch.tensor([0.0, float("nan")]), 0)
    for bad in ([float("-inf")] * 3, [0.0, float("inf")]):
        with pytest.raises(K3Error, match="NaN or no finite"):
            Sampler(1.0, 0.9, 0, 1)(torch.tensor(bad), 0)
    for kw in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(UsageError):
            Sampler(**{"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 1, **kw})


def test_generation_config_defaults(k3dir, kldir, tmp_path):
    assert generation_defaults(k3dir) == {"do_sample": True, "temperature": 1.0, "top_p": 0.95}
    s = sampling_from_args(parse(["--seed", "5"]), k3dir)
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 0.95, 0, 5) and "generation_config" in s.source
    assert sampling_from_args(parse([]), kldir) is None  # no do_sample: greedy
    assert sampling_from_args(parse(["--seed", "5"]), kldir) is None  # a seed alone does not switch sampling on
    assert sampling_from_args(parse([]), tmp_path) is None  # no generation_config.json: greedy
    assert sampling_from_args(parse(["--greedy"]), k3dir) is None
    assert sampling_from_args(parse(["--temperature", "0"]), k3dir) is None
    s = sampling_from_args(parse(["--top-k", "40", "--seed", "1"]), kldir)
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 40)
    s = sampling_from_args(parse(["--temperature", "0.6", "--seed", "2"]), k3dir)
    assert (s.temperature, s.top_p) == (0.6, 0.95) and s.source.startswith("flags over")
    fresh = sampling_from_args(parse([]), k3dir)
    assert fresh is not None and 0 <= fresh.seed < 2**31 and "--seed" in fresh.source
    assert "seed" in fresh.describe() and "top-p 0.95" in fresh.describe()
    with pytest.raises(UsageError, match="--greedy"):
        sampling_from_args(parse(["--greedy", "--top-p", "0.5"]), k3dir)
    with pytest.raises(UsageError, match="top-p"):
        sampling_from_args(parse(["--top-p", "2"]), k3dir)
    (tmp_path / "generation_config.json").write_text("{broken")
    with pytest.raises(UsageError, match="generation_config.json"):
        sampling_from_args(parse([]), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 7, "temperature": 0.5}))
    s = sampling_from_args(parse(["--seed", "0"]), tmp_path)
    assert (s.temperature, s.top_p, s.top_k) == (0.5, 1.0, 7)
    # the flags are only a front end to k3.sampling.resolve (the library's entry point)
    assert resolve(k3dir, seed=5) == sampling_from_args(parse(["--seed", "5"]), k3dir)
    assert resolve(k3dir, greedy=True) is None and resolve(kldir, seed=5) is None
    assert resolve(kldir, top_k=40, seed=1) == sampling_from_args(parse(["--top-k", "40", "--seed", "1"]), kldir)
    with pytest.raises(UsageError, match="--greedy"):
        resolve(k3dir, greedy=True, top_p=0.5)


def _run(engine, ids, seed, n=8, incremental=True):
    return [s.token for s in engine.decode(ids, incremental=incremental, max_tokens=n,
                                           sampler=SamplingSettings(1.0, 0.95, 0, seed).sampler())]


def small_groups(provider, size: int):
    """Make `provider` hand out a layer's experts at most `size` at a time (what a
    small expert cache does); returns the undo."""
    inner = provider.expert_groups
    sizes = []

    def expert_groups(i, ids):
        for group in inner(i, ids):
            items = list(group.items())
            for g in range(0, len(items), size):
                sizes.append(len(items[g:g + size]))
                yield dict(items[g:g + size])

    provider.expert_groups = expert_groups
    return sizes, lambda: delattr(provider, "expert_groups")


def test_seeded_generation_reproducible_across_threads_and_budgets(engine, k3dir):
    ids = list(range(40, 64))
    base = _run(engine, ids, seed=2024)
    assert base == _run(engine, ids, seed=2024)
    assert base != _run(engine, ids, seed=2025)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _run(engine, ids, seed=2024) == base
    finally:
        torch.set_num_threads(old)
    # a bounded provider fetching experts a few at a time (what a small expert cache does)
    sizes, undo = small_groups(engine.provider, 3)
    try:
        assert _run(engine, ids, seed=2024) == base
    finally:
        undo()
    assert sizes and max(sizes) <= 3 and sizes.count(3) > 0, "the experts were not split into small groups"
    # full recompute gives the same logits, so the same sampled tokens
    assert _run(engine, ids, seed=2024, incremental=False) == base
    # the engine's generate, with the seed over generation_config.json (temperature 1, top-p 0.95)
    assert [s.token for s in engine.generate(ids, max_tokens=8, seed=2024)] == base
    # the plan-built (streaming) provider at several expert-cache budgets: the smallest
    # allowed (top-k + 1 slots), a few more, and every routed expert of the model
    cfg = engine.cfg
    slot = engine.provider.cache.slot_bytes
    floor = cfg.num_experts_per_token + 1
    every = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)) * cfg.num_experts
    assert every > floor + 3
    with pytest.raises(K3Error, match="cache"):  # below one token's working set: refused
        open_engine(k3dir, cache_gb=(floor - 0.5) * slot / GB)
    for slots in (floor, floor + 3, every):
        with open_engine(k3dir, cache_gb=(slots + 0.5) * slot / GB) as eng:
            assert eng.provider.cache.n_slots == slots
            assert _run(eng, ids, seed=2024) == base, f"{slots} expert cache slots"
