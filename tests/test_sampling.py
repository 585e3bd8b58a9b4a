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


def test_same_seed_same_tokens_different_seed_differs():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(1000, generator=g) * 3 for _ in range(50)]
    a = [Sampler(1.0, 0.95, 0, seed=42)(r) for r in rows]
    b = [Sampler(1.0, 0.95, 0, seed=42)(r) for r in rows]
    assert a == b
    s1, s2 = Sampler(1.0, 0.95, 0, seed=42), Sampler(1.0, 0.95, 0, seed=43)
    assert [s1(r) for r in rows] != [s2(r) for r in rows]
    # streams (the chat uses one per turn) are independent and reproducible
    assert [Sampler(0.8, 1.0, 0, 42, stream=3)(r) for r in rows] == [Sampler(0.8, 1.0, 0, 42, stream=3)(r) for r in rows]


def test_exactly_one_draw_per_step():
    s = Sampler(1.0, 0.9, 5, seed=9)
    twin = np.random.Generator(np.random.PCG64(np.random.SeedSequence([9, 0])))
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    for _ in range(20):
        s(logits)
        twin.random()
    assert s.draws == 20
    assert s.rng.random() == twin.random()  # the generators are in step


def test_greedy_rules():
    x = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert Sampler(0.0, 1.0, 0, seed=1)(x) == 1 == greedy(x)  # first index of the maximum
    assert all(Sampler(1.0, 1.0, 1, seed=s)(x) == 1 for s in range(20))  # top-k 1: the first of the tied maxima
    assert all(Sampler(5.0, 1e-6, 0, seed=s)(x) == 1 for s in range(20))  # top-p ~0: the single top token
    assert {Sampler(1.0, 1.0, 2, seed=s)(x) for s in range(50)} == {1, 3}  # top-k 2 keeps the tie, both ids


def test_distribution_matches_truncated_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    T, top_p = 0.7, 0.9
    p = torch.softmax(logits.double() / T, 0).numpy()
    keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
    want = np.zeros_like(p)
    want[:keep] = p[:keep] / p[:keep].sum()
    s = Sampler(T, top_p, 0, seed=123)
    n = 20000
    counts = np.bincount([s(logits) for _ in range(n)], minlength=len(p)) / n
    assert np.abs(counts - want).max() < 0.015
    assert counts[keep:].sum() == 0


def test_bad_logits_and_settings():
    with pytest.raises(K3Error, match="NaN"):
        Sampler(1.0, 1.0, 0, 1)(torch.tensor([0.0, float("nan")]))
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
