"""ExpertCache (the C engine's test_cache, reference-engine.md 4.4 / 7): identity against
direct reads, batch == serial, eviction under pressure, LRU order, a call's own experts
never evicted by that call, accounting identities, refusal below top-k + 1 slots,
injected read failures (nothing partial published, retry reads it right), trace
round-trip; and on a synthetic K3 checkpoint, logits bit-identical to the resident
provider at several cache sizes (full recompute and incremental).

The cache takes its slot count from the memory plan; the planner's
``expert_cache_slots`` turns a byte budget into slots (and refuses fewer than top-k + 1)."""

from __future__ import annotations

import gc
import json
import types
import weakref

import numpy as np
import pytest
import torch

from k3 import synth
from k3.checkpoint.io import FaultHook, ShardFiles
from k3.checkpoint.safetensors import read_header
from k3.errors import K3Error, ReadError, UsageError
from k3.memory import planner
from k3.memory.cache_sim import load_trace
from k3.memory.expert_cache import ExpertCache, expert_slot_bytes, locate_expert
from k3.memory.expert_location import _span_of
from k3.memory.planner import expert_cache_slots
from k3.memory.streaming import model_sizes
from k3.model.stack import Model
from k3.model.weights import ExpertSet, Mxfp4Weight

from engines import open_engine
from k3fixtures import FIXTURES

SHARD = FIXTURES / "cache" / "model-00001-of-00001.safetensors"
RELS = ("w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale",
        "w3.weight_packed", "w3.weight_scale")
TOPK = 4


class FixtureLayout:
    """The seam ExpertCache needs, over the C engine's cache fixture (one MoE layer 0)."""

    def __init__(self, remap=None, topk=TOPK):
        self.h = read_header(SHARD)
        self.n_experts = len(self.h) // 6
        self.cfg = types.SimpleNamespace(num_experts=self.n_experts, num_experts_per_token=topk,
                                         is_moe=lambda i: i == 0)
        self.n_layers = 1
        self.remap = remap or {}

    def name(self, e, rel):
        return f"language_model.model.layers.0.block_sparse_moe.experts.{e}.{rel}"

    def expert_tensors(self, layer, e):
        assert layer == 0
        return {rel: self.h[self.name(self.remap.get((e, rel), e), rel)] for rel in RELS}


def fixture_sizes(lay) -> planner.ModelSizes:
    """The planner's view of the fixture: one MoE layer of 24 experts, top-k 4."""
    return planner.ModelSizes(layer_bytes=(0,), table_bytes=0, head_bytes=0, slot_bytes=expert_slot_bytes(lay),
                              expert_bytes=sum(ti.nbytes for ti in lay.expert_tensors(0, 0).values()),
                              moe_layers=1, experts=lay.n_experts, top_k=lay.cfg.num_experts_per_token)


@pytest.fixture(scope="module")
def lay():
    return FixtureLayout()


@pytest.fixture(scope="module")
def truth(lay):
    """Direct (buffered, per-tensor) reads of every expert's six tensors."""
    with ShardFiles(use_direct=False) as r:
        return {e: {rel: r.read_bytes(ti) for rel, ti in lay.expert_tensors(0, e).items()}
                for e in range(lay.n_experts)}


def as_bytes(ew) -> dict:
    out = {}
    for w in ("w1", "w2", "w3"):
        m = getattr(ew, w)
        assert isinstance(m, Mxfp4Weight)
        out[f"{w}.weight_packed"] = m.packed.numpy().reshape(-1)
        out[f"{w}.weight_scale"] = m.scale.numpy().reshape(-1)
    return out


def check(got: dict, truth, lay=None):
    for e, ew in got.items():
        b = as_bytes(ew)
        for rel in RELS:
            assert np.array_equal(b[rel], truth[e][rel]), (e, rel)
        if lay is not None:
            for rel, ti in lay.expert_tensors(0, e).items():
                m = getattr(ew, rel[:2])
                t = m.packed if rel.endswith("packed") else m.scale
                assert tuple(t.shape) == ti.shape and t.dtype == torch.uint8


def cache(lay, slots, **kw):
    return ExpertCache(lay, slots, **kw)


def accounting(st):
    assert st["requests"] == st["hits"] + st["misses"]
    assert st["evictions"] <= st["misses"]
    assert st["retention"] == st["requests"] - st["evictions"]
    assert st["reads"] + st["failed_reads"] == st["misses"]


# ---------------------------------------------------------------- layout / sizing
def test_fixture_is_awkward_and_slot_arithmetic_exact(lay):
    sizes = {sum(ti.nbytes for ti in lay.expert_tensors(0, e).values()) for e in range(lay.n_experts)}
    (size,) = sizes
    assert size % 4096 and lay.n_experts == 24
    locs = [locate_expert(lay, 0, e) for e in range(lay.n_experts)]
    assert all(l.contiguous for l in locs)
    spans = {l.span for l in locs}
    assert spans == {4096, 8192}
    assert all(_span_of(lay.expert_tensors(0, e)) == locs[e].span for e in range(24))  # some experts straddle a page boundary
    assert expert_slot_bytes(lay) == 8192
    sizes = fixture_sizes(lay)
    assert sizes.slot_bytes == 8192 and sizes.routed_experts == 24
    for budget, n in [(5 * 8192, 5), (5 * 8192 + 8191, 5), (11 * 8192, 11), (10**9, 24)]:
        assert expert_cache_slots(sizes, budget) == n
        c = ExpertCache(lay, expert_cache_slots(sizes, budget))
        assert c.n_slots == n and c.slot_bytes == 8192 and c.arena_bytes == n * 8192
        assert c.max_experts_per_call == n - 1
        c.close()


def test_refuses_budget_below_topk_plus_one(lay):
    sizes = fixture_sizes(lay)
    with pytest.raises(K3Error) as ei:
        expert_cache_slots(sizes, 5 * 8192 - 1)
    e = ei.value
    assert e.exit_code == 1
    msg = str(e)
    assert "holds 4 slots" in msg and "top-k + 1 = 5 slots" in msg and "Raise --cache-gb to at least" in msg
    gb = float(msg.split("at least ")[1].split(" GB")[0])
    n = expert_cache_slots(sizes, int(round(gb * 1e9)))  # the suggested figure is enough
    assert n >= TOPK + 1
    ExpertCache(lay, n).close()
    # the cache itself refuses fewer slots than the plan allows
    for n in (TOPK, 0, -1):
        with pytest.raises(ValueError, match="top-k \\+ 1 = 5 slots"):
            ExpertCache(lay, n)
    # a negative or zero --cache-gb never reaches the planner
    for bad in (-1, 0):
        with pytest.raises(UsageError):
            planner.Budgets(cache_gb=bad).check()


# ---------------------------------------------------------------- bytes
def test_identity_vs_direct_read(lay, truth):
    with cache(lay, 24) as c:
        for g in range(0, 24, 4):
            check(c.experts(0, list(range(g, g + 4))), truth, lay)
        # all resident now: served again (hits) with the same bytes
        for g in range(0, 24, 4):
            check(c.experts(0, list(range(g, g + 4))[::-1]), truth)
        st = c.stats()
        assert st["misses"] == 24 and st["hits"] == 24 and st["evictions"] == 0
        accounting(st)


def test_batch_equals_serial(lay, truth):
    rng = np.random.default_rng(0)
    a, b = cache(lay, 7), cache(lay, 7, io_threads=1)
    for _ in range(40):
        ids = rng.choice(24, size=rng.integers(1, 7), replace=False).tolist()
        got_a = a.experts(0, ids)
        got_b = {}
        for e in ids:
            got_b.update(b.experts(0, [e]))
            check({e: got_b[e]}, truth)  # serial: only the latest call is guaranteed
        check(got_a, truth)
        assert list(got_a) == ids
    accounting(a.stats())
    accounting(b.stats())
    a.close(), b.close()


def test_eviction_under_pressure(lay, truth):
    with cache(lay, TOPK + 1) as c:
        for rep in range(3):
            for g in range(0, 24, 4):
                ids = [(g + j * 5 + rep) % 24 for j in range(4)]
                check(c.experts(0, ids), truth)
                assert c.resident_count <= c.n_slots
        st = c.stats()
        accounting(st)
        assert st["evictions"] > 0 and st["evictions"] == st["misses"] - c.n_slots
        assert st["resident"] == c.n_slots


def test_lru_order_and_call_ids_never_victims(lay, truth):
    with cache(lay, 5) as c:
        for e in range(5):
            c.experts(0, [e])  # 0 oldest ... 4 newest
        c.experts(0, [0])  # touch 0: LRU order 1 2 3 4 0
        c.experts(0, [5])  # evicts 1
        assert not c.resident(0, 1) and all(c.resident(0, e) for e in (0, 2, 3, 4, 5))
        # 2 and 3 are the oldest but part of the call: victims must be others (4, then 0)
        got = c.experts(0, [2, 3, 10, 11])
        check(got, truth)
        assert {e for e in range(24) if c.resident(0, e)} == {2, 3, 5, 10, 11}
        # a call of max_experts_per_call misses into a full cache: none aliases another
        got = c.experts(0, [20, 21, 22, 23])
        check(got, truth)
        slots = {m.w1.packed.data_ptr() for m in got.values()}
        assert len(slots) == 4
        assert {e for e in range(24) if c.resident(0, e)} == {20, 21, 22, 23, 11}


def test_call_size_and_argument_checks(lay):
    with cache(lay, 5) as c:
        with pytest.raises(ValueError, match="at most 4"):
            c.experts(0, [0, 1, 2, 3, 4])
        with pytest.raises(ValueError, match=r"expert id 24 out of range 0\.\.23"):
            c.experts(0, [24])
        with pytest.raises(ValueError, match=r"expert id -1 out of range"):
            c.experts(0, [3, -1])
        with pytest.raises(ValueError):
            c.experts(1, [0])
        assert c.experts(0, []) == {}
        # a repeated id is one fetch, counted as a request that hits
        got = c.experts(0, [7, 7, 8])
        assert list(got) == [7, 8]
        st = c.stats()
        assert (st["requests"], st["hits"], st["misses"]) == (3, 1, 2)


def test_groups_hand_out_every_id_once_in_bounded_groups(lay, truth):
    """What the MoE math asks for: any number of distinct ids, in groups of at most
    max_experts_per_call, each group's bytes right while it is the latest."""
    with cache(lay, 5) as c:
        ids = [3, 9, 0, 17, 22, 5, 11, 14, 2, 20]
        seen, sizes = [], []
        for g in c.groups(0, ids):
            sizes.append(len(g))
            check(g, truth, lay)
            seen += list(g)
        assert seen == ids and sizes == [4, 4, 2]
        st = c.stats()
        assert (st["requests"], st["misses"]) == (10, 10) and st["evictions"] == 10 - 5
        accounting(st)
        assert list(c.groups(0, [])) == []


def test_streamed_groups_hand_out_hits_first_then_each_read_as_it_completes(lay, truth):
    """stream=True: the cached experts of a group at once (the reads of the others
    already started), then each missing one alone; every id once, bytes right, the
    accounting as without streaming; a stream left early hands every unpublished slot
    back and frees the cache for the next call."""
    with cache(lay, 6, io_threads=3) as c:
        c.experts(0, [1, 2])
        pieces = list(c.groups(0, [2, 7, 1, 8, 9], stream=True))
        assert list(pieces[0]) == [2, 1] and all(len(p) == 1 for p in pieces[1:])
        assert sorted(e for p in pieces[1:] for e in p) == [7, 8, 9]
        for p in pieces:
            check(p, truth, lay)
        st = c.stats()
        assert (st["requests"], st["hits"], st["misses"], st["reads"]) == (7, 2, 5, 5)
        accounting(st)
        assert [list(g) for g in c.groups(0, [7, 8], stream=True)] == [[7, 8]]  # all cached: one group
        g = c.groups(0, [10, 11, 12, 13], stream=True)
        first = next(g)
        check(first, truth, lay)
        g.close()  # the consumer went away with three reads in flight or unpublished
        assert c.resident_count <= 6 and c._busy.acquire(blocking=False)
        c._busy.release()
        check(c.experts(0, [10, 11, 12, 13, 14]), truth)  # no slot was lost


def test_step_statistics(lay):
    with cache(lay, 6) as c:
        c.experts(0, [0, 1, 2])
        s0 = c.end_step()
        c.experts(0, [1, 2, 3])
        c.experts(0, [4, 5, 6, 7, 8])
        s1 = c.step_stats()
        assert (s0["requests"], s0["hits"], s0["misses"]) == (3, 0, 3)
        assert (s1["requests"], s1["hits"], s1["misses"]) == (8, 2, 6)
        assert s1["evictions"] == 3 and s1["bytes_read"] == 6 * 1632
        run = c.stats()
        for k in ("requests", "hits", "misses", "evictions", "bytes_read", "io_bytes", "reads"):
            assert run[k] == s0[k] + s1[k]
        accounting(run), accounting(s1)
        assert s1["hit_rate"] == pytest.approx(2 / 8)
        assert c.end_step()["requests"] == 8 and c.step_stats()["requests"] == 0
        json.dumps(c.stats())


def test_non_contiguous_expert_falls_back_to_tensor_reads(truth):
    # expert e's w2 tensors taken from expert e+5: not one run, read tensor by tensor
    remap = {(e, rel): (e + 5) % 24 for e in range(24) for rel in RELS[2:4]}
    lay = FixtureLayout(remap)
    assert not locate_expert(lay, 0, 3).contiguous
    for e in range(24):
        assert _span_of(lay.expert_tensors(0, e)) == locate_expert(lay, 0, e).span
    with cache(lay, 5) as c:
        for g in range(0, 24, 3):
            got = c.experts(0, [g, g + 1, g + 2])
            for e, ew in got.items():
                b = as_bytes(ew)
                for rel in RELS:
                    src = (e + 5) % 24 if rel in RELS[2:4] else e
                    assert np.array_equal(b[rel], truth[src][rel])
        assert c.stats()["scattered_reads"] == c.stats()["reads"] > 0


def test_hugepage_arena_path(lay, truth, monkeypatch):
    import mmap

    from k3 import buffers
    monkeypatch.setattr(buffers, "HUGE", 8192)  # a small arena takes the mmap + madvise path
    monkeypatch.delenv("K3_NOHUGE", raising=False)
    with cache(lay, 6) as c:
        assert isinstance(c._arena.base.base.obj, mmap.mmap) and c._arena.ctypes.data % 8192 == 0
        for g in range(0, 24, 5):
            check(c.experts(0, list(range(g, min(g + 5, 24)))), truth)


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize("kind", ["eio", "eof"])
def test_failed_read_not_published_and_retry_reads_right(lay, truth, kind):
    at = lay.expert_tensors(0, 7)["w2.weight_packed"].offset
    hook = FaultHook(kind, at=at)  # every read covering that byte fails (O_DIRECT and buffered)
    with ShardFiles(hook=hook) as r, cache(lay, 6, reader=r) as c:
        c.experts(0, [0])
        with pytest.raises(ReadError) as ei:
            c.experts(0, [2, 7, 20])  # 2 and 20 lie in other 4096 pages than 7
        e = ei.value
        assert e.exit_code == 4
        msg = str(e)
        assert "EXPERT READ FAILED: layer 0 expert 7" in msg and SHARD.name in msg
        assert "no output from it is valid" in msg
        assert hook.fired >= 1
        r.hook = None  # the disk recovers
        assert not c.resident(0, 7)
        assert c.resident(0, 2) and c.resident(0, 20) and c.resident(0, 0)
        st = c.stats()
        assert st["failed_reads"] == 1 and st["reads"] == 3
        accounting(st)
        check(c.experts(0, [7, 2]), truth)  # retry without the fault
        assert c.resident(0, 7)
        # the failed slot went back to EMPTY: filling up needs no eviction
        check(c.experts(0, [8, 9]), truth)
        assert c.stats()["evictions"] == 0 and c.resident_count == 6


def test_interrupt_while_reading_returns_every_reserved_slot(lay, truth):
    """Ctrl-C while the batch's reads are in flight: nothing is published, every slot
    reserved for the batch goes back to EMPTY (no capacity lost), and the next call
    reads correctly."""
    import threading

    gate = threading.Event()

    def slow_hook(path, offset, nbytes, direct):
        gate.wait(5)  # hold the I/O threads until the main thread has been interrupted
        return None

    with ShardFiles(hook=slow_hook) as r, cache(lay, 6, reader=r, io_threads=4) as c:
        import concurrent.futures as cf

        real_result = cf.Future.result
        calls = {"n": 0}

        def interrupted(self, timeout=None):
            calls["n"] += 1
            if calls["n"] == 1:
                gate.set()
                raise KeyboardInterrupt
            return real_result(self, timeout)

        cf.Future.result = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                c.experts(0, [1, 2, 3])
        finally:
            cf.Future.result = real_result
        assert c.resident_count == 0
        r.hook = None
        check(c.experts(0, [1, 2, 3, 4, 5]), truth)  # 5 of 6 slots: none was lost
        assert c.stats()["evictions"] == 0


def test_short_reads_are_survived(lay, truth):
    with ShardFiles(hook=FaultHook("short", short_bytes=100)) as r, cache(lay, 8, reader=r) as c:
        for g in range(0, 24, 6):
            check(c.experts(0, list(range(g, g + 6))), truth)


# ---------------------------------------------------------------- trace
def test_trace_round_trip(lay, tmp_path):
    rng = np.random.default_rng(1)
    reqs = []
    with cache(lay, 6, trace=True) as c:
        for _ in range(30):
            ids = rng.choice(24, size=rng.integers(1, 6), replace=False).tolist()
            c.experts(0, ids)
            reqs += [(0, e) for e in ids]
        info = c.dump_trace(tmp_path / "out")
    assert info["requests"] == len(reqs)
    tr = load_trace(tmp_path / "out" / "expert_trace.bin")
    assert tr.tolist() == [list(r) for r in reqs]
    hist = json.loads((tmp_path / "out" / "expert_hist.json").read_text())
    assert hist["n_layers"] == 1 and hist["n_experts"] == 24
    assert sum(hist["counts"].values()) == len(reqs)
    for k, n in hist["counts"].items():
        assert reqs.count(tuple(int(x) for x in k.split(","))) == n
    with cache(lay, 6) as c, pytest.raises(UsageError):
        c.dump_trace(tmp_path / "x")


# ---------------------------------------------------------------- the model over the cache
class CachedProvider:
    """Trunk and globals from the reference engine's provider (trunk held in RAM), routed
    experts from an ExpertCache of its own."""

    def __init__(self, resident, cache, stream=False):
        self.config = resident.config
        self.r = resident
        self.cache = cache
        self.stream = stream

    def global_weight(self, name):
        return self.r.global_weight(name)

    def embed(self, ids):
        return self.r.embed(ids)

    def layer(self, i):
        return self.r.layer(i)

    def release_layer(self, i):
        pass

    def expert_groups(self, i, ids):
        return self.cache.groups(i, ids, stream=self.stream)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The reference engine: trunk held in RAM, an expert cache holding every routed expert."""
    d = synth.synthesize(tmp_path_factory.mktemp("tinyk3") / "m", preset="tiny", arch="k3", seed=11)
    with open_engine(d) as eng:
        assert eng.plan.trunk is None
        assert eng.provider.cache.n_slots == model_sizes(eng.provider.layout).routed_experts
        yield eng


PROMPT = [5, 17, 99, 300, 42, 7, 1000, 12, 64, 3, 250, 77, 31, 8, 500, 2, 9, 600, 11, 13]


def test_synth_layout_is_contiguous_and_quantized(tiny):
    lay = tiny.provider.layout
    cfg = lay.cfg
    moe = [i for i in range(lay.n_layers) if cfg.is_moe(i)]
    for i in moe:
        for e in range(cfg.num_experts):
            assert all(lay.expert_quantized(i, e).values())
            loc = locate_expert(lay, i, e)
            assert loc.contiguous and len(loc.parts) == 6


@pytest.mark.parametrize("slots", ["min", 9, "all"])
@pytest.mark.parametrize("stream", [False, True])
def test_logits_bit_identical_to_resident(tiny, slots, stream):
    res = tiny.provider
    ref_model = tiny.model
    lay = res.layout
    topk = lay.cfg.num_experts_per_token
    n = {"min": topk + 1, "all": 10**6}.get(slots, slots)
    c = ExpertCache(lay, expert_cache_slots(model_sizes(lay), n * expert_slot_bytes(lay)), io_threads=3)
    assert c.n_slots == min(n, sum(lay.cfg.is_moe(i) for i in range(lay.n_layers)) * lay.cfg.num_experts)
    m = Model(CachedProvider(res, c, stream))
    # full recompute, twice (the second pass runs on a warm cache)
    ref = ref_model.forward(PROMPT, last_only=False)
    for _ in range(2):
        assert torch.equal(m.forward(PROMPT, last_only=False), ref)
    # incremental: prefill then single tokens
    st_ref, st = ref_model.new_state(), m.new_state()
    a = [ref_model.forward(PROMPT[:12], st_ref, last_only=False)]
    b = [m.forward(PROMPT[:12], st, last_only=False)]
    for t in PROMPT[12:]:
        a.append(ref_model.forward([t], st_ref))
        b.append(m.forward([t], st))
    assert torch.equal(torch.cat(a), torch.cat(b))
    s = c.stats()
    accounting(s)
    if slots == "min":
        assert s["evictions"] > 0
    if slots == "all":
        assert s["evictions"] == 0 and s["hits"] > 0
    c.close()


def test_resident_layer_while_every_expert_stays(tiny):
    """resident_layer: None until every routed expert of the layer is in the cache, then
    one tuple (the same object call after call, each entry the expert a fetch gives),
    None again once one of them is evicted, a new tuple when all are back; note_hits
    counts as a fetch that hits them all (requests, hits, LRU order, trace)."""
    lay = tiny.provider.layout
    cfg = lay.cfg
    E = cfg.num_experts
    a, b = [i for i in range(lay.n_layers) if cfg.is_moe(i)][:2]
    with ExpertCache(lay, E + 2, trace=True) as c:   # room for a layer and two more
        assert c.resident_layer(a) is None and c.resident_layer(-1) is None and c.resident_layer(lay.n_layers) is None
        for _ in c.groups(a, range(E - 1)):
            pass
        assert c.resident_layer(a) is None
        c.experts(a, [E - 1])
        every = c.resident_layer(a)
        assert isinstance(every, ExpertSet) and len(every) == E and c.resident_layer(a) is every
        for e in range(E):
            got = c.experts(a, [e])[e]
            assert got.w1.packed.data_ptr() == every[e].w1.packed.data_ptr()
        assert c.resident_layer(a) is every   # hits move nothing
        s0 = c.stats()
        c.note_hits(a, [3, 1, 3])
        s1 = c.stats()
        assert (s1["requests"] - s0["requests"], s1["hits"] - s0["hits"], s1["misses"] - s0["misses"]) == (3, 3, 0)
        assert c.trace_array()[-3:].tolist() == [[a, 3], [a, 1], [a, 3]]
        # the two just used are the newest: a fetch of layer b's experts evicts others first
        c.experts(b, list(range(cfg.num_experts_per_token)))
        assert c.resident_layer(a) is None
        assert c.resident(a, 3) and c.resident(a, 1)
        for _ in c.groups(a, range(E)):
            pass
        again = c.resident_layer(a)
        assert again is not None and again is not every
        gone = weakref.ref(every)
        del every
        gc.collect()
        assert gone() is None   # the cache holds no set of a layer it no longer holds whole
        accounting(c.stats())
