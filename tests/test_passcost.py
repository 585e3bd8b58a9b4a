"""The pass cost model (k3/memory/passcost.py) and the speculation it steers: the
expected distinct experts of a pass against a simulation of uniform routing, what a run
learns from its passes, and drafts read only where they are expected to pay, with the
tokens of plain decoding whatever is read."""

from __future__ import annotations

import numpy as np
import pytest

from k3.memory import planner
from k3.memory.passcost import (PassCost, PassShape, distinct, drafts_to_read, expected_emitted, pass_bytes, pool_for,
                                union)
from k3.spec import Drafter, NgramIndex
from k3.synth import synthesize

from engines import open_engine

K3 = PassShape(moe_layers=92, experts=896, top_k=16, expert_bytes=17_563_648, cache_slots=0,
               streamed_trunk_bytes=0, table_bytes=0)


def simulated_distinct(T, k, E, reps=3000, seed=0):
    """Mean distinct experts of T tokens each drawing k of E without replacement."""
    rng = np.random.default_rng(seed)
    tot = 0
    for _ in range(reps):
        tot += len({int(e) for _ in range(T) for e in rng.choice(E, k, replace=False)})
    return tot / reps


@pytest.mark.parametrize("T", [1, 2, 4, 8, 64])
def test_distinct_experts_match_a_simulation_of_uniform_routing(T):
    assert distinct(T, 16, 896) == pytest.approx(simulated_distinct(T, 16, 896, reps=600), rel=0.01)
    assert distinct(T, 8, 32) == pytest.approx(simulated_distinct(T, 8, 32, reps=600), rel=0.01)


def test_union_and_its_inverse():
    rng = np.random.default_rng(1)
    sizes = [16, 30, 45]
    sim = np.mean([len(set().union(*(set(rng.choice(896, s, replace=False).tolist()) for s in sizes)))
                   for _ in range(2000)])
    assert union(sizes, 896) == pytest.approx(sim, rel=0.01)
    for pool in (20.0, 100.0, 896.0):
        assert pool_for(8, 16, distinct(8, 16, pool), 896) == pytest.approx(pool, rel=1e-6)
    assert pool_for(8, 16, 8 * 16, 896) == 896  # no overlap at all: the whole pool
    assert pool_for(8, 16, 16, 896) == 16  # every token chose the same experts


def test_a_pass_reads_the_trunk_once_and_each_distinct_expert_once():
    s = PassShape(2, 896, 16, 1000, cache_slots=0, streamed_trunk_bytes=10**6, table_bytes=5000)
    one = pass_bytes(s, [1])
    assert one == pytest.approx(10**6 + 5000 + 2 * 16 * 1000)
    eight = pass_bytes(s, [1] * 8)
    assert eight == pytest.approx(10**6 + 5000 + 2 * distinct(8, 16, 896) * 1000)
    assert eight < 8 * one
    # a cache holding half the pool halves the expert bytes (uniform prior)
    half = PassShape(2, 896, 16, 1000, cache_slots=896, streamed_trunk_bytes=0, table_bytes=0)
    assert pass_bytes(half, [1]) == pytest.approx(16 * 1000)


def test_the_planner_prices_the_batch_it_will_run():
    sizes = planner.ModelSizes(layer_bytes=(10**9,) * 4, table_bytes=10**8, head_bytes=5 * 10**7,
                               slot_bytes=17_567_744, expert_bytes=17_563_648, moe_layers=3, experts=896, top_k=16)
    tp = planner.plan_trunk(list(sizes.layer_bytes), 2 * 10**9, 2)
    one = planner.bytes_per_token(sizes, tp, 30, True)
    eight = planner.bytes_per_token(sizes, tp, 30, True, sequences=8)
    assert eight < one / 3  # the streamed trunk and lm_head are shared by the eight
    per_tok_experts = 3 * 16 * 17_563_648 * (1 - 30 / (3 * 896))
    assert one == pytest.approx(tp.streamed_bytes + 5 * 10**7 + per_tok_experts, rel=1e-6)


def test_a_run_learns_its_overlap_hits_and_times():
    c = PassCost(K3)
    assert c.distinct([4]) == pytest.approx(distinct(4, 16, 896))
    assert not c.timed and c.seconds([1]) is None
    for _ in range(30):  # one sequence's 4 tokens choose 24 distinct experts per layer
        c.observe([4], 2.0, {"expert_requests": 92 * 24, "expert_hits": 92 * 6, "expert_bytes_read": 10**9,
                             "expert_read_seconds": 1.0})
    assert c.distinct([4]) == pytest.approx(24, rel=0.1)
    assert c.hit.value == pytest.approx(0.25, rel=0.05)
    assert c.rate.value == pytest.approx(1e9)
    for _ in range(30):
        c.observe([1], 0.5, {"expert_requests": 92 * 16, "expert_hits": 92 * 4, "expert_bytes_read": 10**8,
                             "expert_read_seconds": 0.1})
    assert c.timed and c.outside_seconds(1) == pytest.approx(0.4)
    assert c.outside_seconds(4) == pytest.approx(1.0)  # 2.0 s less 1.0 s of expert reads
    assert c.outside_seconds(2) == pytest.approx(0.6)  # interpolated
    assert c.outside_seconds(6) == pytest.approx(1.0 + 2 * 0.1 * 0.4)  # extrapolated
    assert c.seconds([1]) == pytest.approx(0.4 + c.expert_bytes([1]) / 1e9)
    # a batch's sequences are independent: their pool is learnt apart from a draft's
    for _ in range(30):
        c.observe([1] * 8, 3.0, {"expert_requests": 92 * 120, "expert_hits": 0, "expert_bytes_read": 0,
                                 "expert_read_seconds": 0.0})
    assert c.distinct([1] * 8) == pytest.approx(120, rel=0.1)
    assert c.distinct([4]) == pytest.approx(24, rel=0.1)


def test_pass_sizes_are_priced_from_decode_passes_and_retried_when_stale():
    """A prompt piece's time never prices drafts; a size timed once, or not lately, is
    priced at what a fresh smaller pass took (so the policy tries it); twice within
    STALE decode passes, at the least of its recent times (noise only adds)."""
    from k3.memory.passcost import STALE

    shape = PassShape(1, 896, 16, 17_563_648, cache_slots=0, streamed_trunk_bytes=0, table_bytes=0)
    c = PassCost(shape)
    c.observe([5], 9.0, {}, decode=False)   # a cold prompt piece of 5 tokens
    assert not c.timed and c.seconds([5]) is None
    for _ in range(3):
        c.observe([1], 0.10, {})
    assert c.seconds([5]) == pytest.approx(0.10)   # its lower bound, not the prompt piece's 9 s
    c.observe([5], 0.50, {})   # a first (cold) decode pass of 5 tokens: still the lower bound
    assert c.seconds([5]) == pytest.approx(0.10)
    c.observe([5], 0.20, {})
    c.observe([5], 0.30, {})
    assert c.fresh(5) and c.seconds([5]) == pytest.approx(0.20)   # the least of its recent passes
    assert c.seconds([3]) == pytest.approx(0.10)   # never timed: the largest fresh smaller size's time
    for _ in range(STALE):
        c.observe([1], 0.10, {})
    assert not c.fresh(5) and c.seconds([5]) == pytest.approx(0.10)   # not run lately: tried again
    assert c.as_dict()["prefill_seconds_outside_expert_reads"] == {5: pytest.approx(9.0)}


def _timed(shape, outside: dict, rate=1e9, hit=None):
    c = PassCost(shape)
    for T, sec in outside.items():
        c.observe([T], sec, {})
        c.observe([T], sec, {})
    c.rate.add(rate)
    if hit is not None:
        for _ in range(50):
            c.hit.add(hit)
    return c


def test_drafts_are_read_only_where_they_pay():
    streamed = PassShape(1, 896, 16, 17_563_648, cache_slots=0, streamed_trunk_bytes=0, table_bytes=0)
    # the experts all cached, a pass's time barely grows with its tokens: drafts pay
    free = _timed(streamed, {1: 1.0, 5: 1.1}, hit=1.0)
    assert drafts_to_read(free, [], 0.0, 4, [0.9] * 4) == 4
    assert drafts_to_read(free, [], 0.0, 4, [0.02] * 4) == 0  # ... unless they are nearly always wrong
    # every drafted token brings 16 uncached experts at 0.5 GB/s, more than a token saves
    bound = _timed(streamed, {1: 0.05, 5: 0.06}, rate=0.5e9, hit=0.0)
    assert drafts_to_read(bound, [], 0.0, 4, [0.6] * 4) == 0
    assert drafts_to_read(bound, [], 0.0, 4, [1.0] * 4) >= 1  # certain drafts still beat their experts' cost
    assert drafts_to_read(PassCost(streamed), [], 0.0, 4, [1.0] * 4) == 0  # nothing timed yet: no drafts
    assert expected_emitted([0.5, 0.5], 2) == pytest.approx(1.75)


def test_drafts_are_scored_read_or_not_so_drafting_stops_and_resumes():
    d = Drafter([1, 2, 3, 4], 4, corpus=NgramIndex([1, 2, 3, 4, 5, 6, 7, 8]))
    start = d.acceptance.rates[0]
    for i in range(6):  # the text never goes where the draft says (whether or not it was read)
        p = d.propose()
        assert p
        d.extend([p[0] + 1000 + i])
        d.extend([1, 2, 3, 4])
    assert d.acceptance.rates[0] < 0.15 < start
    for _ in range(6):  # then it repeats what the drafts say
        p = d.propose()
        assert len(p) == 4
        d.extend(p)
        d.extend([1, 2, 3, 4])
    assert d.acceptance.rates[0] > 0.7 and d.acceptance.rates[3] > 0.6


@pytest.fixture(scope="module")
def pool_model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("pool") / "m", preset="pool", seed=3)


PROMPT = [5, 17, 99, 300, 42, 7, 1000, 12] * 3


def test_on_k3s_pool_wrong_drafts_stop_and_tokens_stay_plain(pool_model):
    """896 experts, top-16, a cache of 3% of the pool: a corpus whose drafts are always
    wrong is read at first and then withheld; the right corpus is read where drafts are
    priced as free; the tokens are plain decoding's either way."""
    with open_engine(pool_model, spec=4, max_context=200, cache_gb=0.0008) as eng:
        assert eng.plan.cache_slots < 0.05 * 3 * 896
        want = [s.token for s in eng.decode(PROMPT, max_tokens=32)]
        full = PROMPT + want
        wrong = NgramIndex([t for i in range(len(PROMPT), len(full)) for t in full[i - 4:i] + [full[i] + 1]])
        steps = list(eng.decode(PROMPT, max_tokens=32, spec=4, spec_corpus=wrong))
        assert [s.token for s in steps] == want
        drafted, withheld = sum(s.drafted for s in steps), sum(s.withheld for s in steps)
        assert sum(s.accepted for s in steps) == 0 and withheld > 2 * drafted
        assert withheld + drafted >= 4 * 20  # a draft was offered at almost every pass


@pytest.mark.realtime   # the policy prices passes by this host's clock
def test_on_k3s_pool_right_drafts_are_read_with_real_timings(pool_model):
    """The policy with its own clock (no forced drafts, no constant prices), in a fresh
    engine whose prompt pass ran cold: a corpus holding the continuation is read - pass
    sizes it has not timed on decode passes are tried, not priced from the prefill - and
    a corpus whose first 2 of 4 drafted tokens are right is tried, and its wrong drafts are
    not read once known."""
    with open_engine(pool_model, spec=4, max_context=200, cache_gb=0.0008) as eng:
        want = [s.token for s in eng.decode(PROMPT, max_tokens=32)]
    full = PROMPT + want
    half = NgramIndex([t for i in range(len(PROMPT), len(full) - 4)
                       for t in full[i - 4:i + 2] + [full[i + 2] + 1, full[i + 3] + 1]])
    for corpus, right in ((NgramIndex(full), 4), (half, 2)):
        with open_engine(pool_model, spec=4, max_context=200, cache_gb=0.0008) as eng:
            steps = list(eng.decode(PROMPT, max_tokens=32, spec=4, spec_corpus=corpus))
            assert [s.token for s in steps] == want
            passes = len({s.pass_index for s in steps})
            why = (len(steps), passes, eng.pass_cost.as_dict())
            if right == 4:  # every draft right: reading them pays on any host
                assert len(steps) / passes >= 2.0, why
            else:
                # whether 2 right drafts pay depends on this host's prices (at small dims, on a
                # busy machine, they may not): they are tried, and the two wrong ones behind them
                # (nothing to gain) are read in one pass at most
                accepted = sum(s.accepted for s in steps)
                wrong = sum(s.drafted - s.accepted for s in steps)
                assert accepted >= 2 and wrong <= 2, why
            assert eng.pass_cost.as_dict()["prefill_seconds_outside_expert_reads"]  # timed apart from decode
