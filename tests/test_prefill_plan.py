"""Prefill priced like decode (k3/memory/prefill.py): the plan widens the prefill piece
to read the longest prompt in the fewest passes that fit, taking memory from the expert
cache (not the trunk), and every piece gives the same numbers."""

from __future__ import annotations

import pytest
import torch

from engines import open_engine
from k3 import projection as pj
from k3.decode import PREFILL_CHUNK, max_piece
from k3.memory import planner, prefill
from k3.synth import synthesize
from k3.units import GB


@pytest.fixture(scope="module")
def pool_model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("pool") / "m", preset="pool", seed=3)


def test_on_k3s_pool_a_prompt_is_one_pass_with_the_numbers_of_256_token_pieces(pool_model):
    """896 experts, top-16, a cache of 3% of the pool, a 1,024-token prompt: 256-token
    pieces read each touched expert once a piece (~99% of them each time); the plan's
    piece reads the prompt in one pass, about a quarter of the bytes, predicted within
    10%, with the same logits and tokens bit for bit."""
    ids = [(7 * i + 3) % 1200 for i in range(1024)]
    got = {}
    for chunk in (None, PREFILL_CHUNK):
        with open_engine(pool_model, max_context=1100, cache_gb=0.0008, prefill_chunk=chunk) as eng:
            steps = list(eng.decode(ids, max_tokens=3))
            got[chunk] = (eng.prefill_plan, steps)
    auto, pieces = got[None], got[PREFILL_CHUNK]
    assert auto[0].piece >= 1024 and auto[0].passes == 1
    assert [s.token for s in auto[1]] == [s.token for s in pieces[1]]
    assert torch.equal(auto[1][0].logits, pieces[1][0].logits)
    one, four = auto[1][0].bytes_read, pieces[1][0].bytes_read
    assert four > 3 * one
    assert auto[0].read_bytes == pytest.approx(one, rel=0.10)


def _k3_plan(ram_gb: float, **budgets):
    cfg, sizes = pj.release_model()
    b = planner.Budgets(preset="auto", trunk="(packed)", **budgets)
    p = planner.plan(cfg, sizes, b, tokens=8192, incremental=True, available=int(ram_gb * GB), baseline=int(1.5e9),
                     prefill_tokens=max_piece(PREFILL_CHUNK))
    return cfg, sizes, p


@pytest.mark.parametrize("ram_gb", [128, 224])
def test_the_released_k3s_piece_takes_expert_cache_not_trunk(ram_gb):
    """K3's shapes, where the trunk is pinned whole and the rest is cache: the widened
    plan keeps the trunk and tables as planned, leaves the cache at least its floor,
    fits, and reads an 8,192-token prompt in fewer passes and bytes than 256-token pieces
    (each of which re-reads nearly the whole pool). (Below that the auto plan gives the
    trunk all but the cache's floor, and the piece stays near 256: docs/TUNING.md.)"""
    cfg, sizes, base = _k3_plan(ram_gb)
    p, pp = prefill.widen(base, cfg, sizes, span=8192, floor_piece=PREFILL_CHUNK)
    p.check()
    assert p.trunk == base.trunk and p.stream_tables == base.stream_tables
    assert sizes.top_k + 1 <= p.cache_slots <= base.cache_slots
    assert pp.piece > PREFILL_CHUNK and pp.piece % PREFILL_CHUNK == 0
    assert pp.passes < 8192 // PREFILL_CHUNK and pp.read_bytes < pp.floor_read_bytes / 4
    assert p.total <= planner.PLAN_FRACTION * p.available
    assert pp.short() in p.summary()


def test_a_cache_the_user_fixed_is_not_lent():
    cfg, sizes, base = _k3_plan(128, cache_gb=1.0)
    p, pp = prefill.widen(base, cfg, sizes, span=8192, floor_piece=PREFILL_CHUNK)
    assert p.cache_slots == base.cache_slots and pp.lent_bytes == 0
    p.check()


def test_a_piece_the_user_chose_is_kept_and_priced():
    cfg, sizes, base = _k3_plan(64)
    p, pp = prefill.widen(base, cfg, sizes, span=8192, floor_piece=512, auto=False)
    assert pp.piece == 512 and pp.passes == 16 and p.cache_slots == base.cache_slots
    assert pp.read_bytes == pp.floor_read_bytes
