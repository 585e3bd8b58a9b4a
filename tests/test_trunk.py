"""Packed trunk: pack/verify round trip, refusals, the pin/ring planner (property
tests), the streamer (byte identity over several passes at ring 1/2/3, slot isolation,
injected read faults) and a Model over it (bit-identical logits to the resident model).
The streamer receives its plan from the memory planner (plan_trunk); `streamer` below
builds one for a budget, as the engine does."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3 import synth
from k3.checkpoint.io import FaultHook, ShardFiles, load_tensor
from k3.checkpoint.layout import CheckpointLayout
from k3.checkpoint.safetensors import CheckpointIndex
from k3.cli import build_parser
from k3.cli import main as k3_main
from k3.config import load_config
from k3.errors import EXIT_CHECKPOINT, EXIT_READ, EXIT_RUNTIME, CheckpointError, K3Error, ReadError
from k3.memory.planner import min_budget_for, plan_trunk
from k3.memory.trunk import PackedTrunk, TrunkStreamer, pack_trunk
from k3.memory.trunk import format as TF
from k3.memory.trunk import pack as TP
from k3.schema import layer_specs
from k3.model.stack import Model

from engines import open_engine

MB = 1 << 20
GB = 10**9
A = 4096


def al(n):
    return (n + A - 1) // A * A


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(model dir, trunk dir, cfg, index) for the small preset, packed once."""
    base = tmp_path_factory.mktemp("small")
    m = synth.synthesize(base / "m", preset="small", seed=1)
    pack_trunk(m, base / "t", progress=False)
    return m, base / "t", load_config(m), CheckpointIndex.open(m)


@pytest.fixture(scope="module")
def small_ref(small):
    """Reference bytes of every layer tensor, read straight from the shards."""
    m, _, cfg, ix = small
    lay = CheckpointLayout(cfg, ix)
    return [{rel: load_tensor(lay.info(f"layers.{i}.{rel}")) for rel in layer_specs(cfg, i)}
            for i in range(cfg.num_hidden_layers)]


def streamer(pt, budget, ring=2, order="largest", *, n_layers=None, **kw) -> TrunkStreamer:
    """A TrunkStreamer over the planner's plan for `budget` bytes (the first `n_layers`
    layers of the packed trunk, all by default)."""
    n = pt.n_layers if n_layers is None else n_layers
    return TrunkStreamer(pt, plan_trunk(pt.layer_bytes[:n], budget, ring, order), **kw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def check_layer(w, ref):
    assert set(w) == set(ref)
    for k, v in w.items():
        assert same_bits(v, ref[k]), k


# ------------------------------------------------------------------------------ pack
def test_pack_open_round_trip(small, small_ref):
    m, t, cfg, ix = small
    meta = json.loads((t / "trunk.json").read_text())
    assert meta["format"] == "k3-trunk" and meta["version"] == 2 and meta["align"] == 4096
    assert meta["config_fingerprint"] == cfg.fingerprint()
    assert meta["n_layers"] == cfg.num_hidden_layers == len(meta["layers"])
    off = 0
    for e in meta["layers"]:
        assert e["file_off"] == off and e["file_off"] % A == 0 and e["nbytes"] == al(e["run_nbytes"])
        assert set(e["tensors"]) == set(layer_specs(cfg, e["layer"]))
        off += e["nbytes"]
    assert os.path.getsize(t / "trunk.bin") == off
    assert not (t / "trunk.bin.partial").exists() and not (t / "trunk.progress.json").exists()
    for name, rec in meta["source"].items():
        assert rec["size"] == os.path.getsize(m / name)
    pt = PackedTrunk.open(t, cfg, ix)
    raw = bytearray((t / "trunk.bin").read_bytes())
    for i, L in enumerate(pt.layers):
        # the release layout: each layer one run in one shard, copied verbatim, zero padding after it
        (g,) = L.segments
        assert g.off == 0 and g.nbytes == L.run_nbytes
        with open(m / g.shard, "rb") as f:
            f.seek(g.src_off)
            assert bytes(raw[L.file_off : L.file_off + L.run_nbytes]) == f.read(L.run_nbytes)
        assert bytes(raw[L.file_off + L.run_nbytes : L.file_off + L.nbytes]) == bytes(L.nbytes - L.run_nbytes)
        import numpy as np
        buf = np.frombuffer(raw, dtype=np.uint8)[L.file_off : L.file_off + L.nbytes]
        check_layer(pt.views(i, buf), small_ref[i])


def test_repack_is_noop_unless_forced(small, tmp_path):
    m, t, cfg, ix = small
    out = tmp_path / "t"
    shutil.copytree(t, out)
    before = os.stat(out / "trunk.bin").st_mtime_ns
    lines = []
    pack_trunk(m, out, progress=lines.append)
    assert any("nothing to do" in s for s in lines)
    assert os.stat(out / "trunk.bin").st_mtime_ns == before
    lines.clear()
    pack_trunk(m, out, progress=lines.append, force=True)
    assert any("wrote" in s for s in lines)
    PackedTrunk.open(out, cfg, ix)


def _refused(fn, *words):
    with pytest.raises(CheckpointError) as ei:
        fn()
    assert ei.value.exit_code == EXIT_CHECKPOINT
    for w in words:
        assert w in str(ei.value), str(ei.value)
    return str(ei.value)


def test_refuses_stale_trunk(small, tmp_path):
    m1, t1, cfg, _ = small
    m2 = synth.synthesize(tmp_path / "m2", preset="small", seed=2)  # same model, other weights
    _refused(lambda: PackedTrunk.open(t1, cfg, CheckpointIndex.open(m2)), "k3 pack-trunk", "stale")


def test_refuses_changed_bytes_under_identical_header(small, tmp_path):
    """Same shard sizes and headers, other bytes in a layer's run: only the sample hash sees it."""
    m1, t1, cfg, ix1 = small
    m2 = tmp_path / "m2"
    shutil.copytree(m1, m2)
    (g,) = PackedTrunk.open(t1, cfg, ix1).layers[3].segments
    with open(m2 / g.shard, "r+b") as f:
        f.seek(g.src_off)
        b = f.read(16)
        f.seek(g.src_off)
        f.write(bytes(x ^ 0xFF for x in b))
    ix2 = CheckpointIndex.open(m2)
    _refused(lambda: PackedTrunk.open(t1, cfg, ix2), "not the file it was packed from", "--verify")
    _refused(lambda: PackedTrunk.open(t1, cfg, ix2, check_identity=False), "layer 3", "differ", "k3 pack-trunk")
    PackedTrunk.open(t1, cfg, ix2, verify_samples=False, check_identity=False)


def test_refuses_foreign_model(small, tmp_path):
    _, t, _, _ = small
    m = synth.synthesize(tmp_path / "tiny", preset="tiny")
    _refused(lambda: PackedTrunk.open(t, load_config(m), CheckpointIndex.open(m)), "fingerprint", "k3 pack-trunk")


def test_refuses_missing_truncated_damaged(small, tmp_path):
    m, t, cfg, ix = small
    out = tmp_path / "t"
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "trunk.json is missing", "k3 pack-trunk")
    shutil.copytree(t, out)
    size = os.path.getsize(out / "trunk.bin")
    os.truncate(out / "trunk.bin", size - A)
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "truncated", "k3 pack-trunk")
    os.truncate(out / "trunk.bin", size)  # right size, zeros at the end: the sample hash differs
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "differ", "k3 pack-trunk")
    meta = json.loads((out / "trunk.json").read_text())
    meta["layers"][2]["tensors"].pop(next(iter(meta["layers"][2]["tensors"])))
    (out / "trunk.json").write_text(json.dumps(meta))
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "layer 2", "tensor list")
    (out / "trunk.json").write_text("{not json")
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "JSON")
    (out / "trunk.json").unlink()
    (out / "trunk.bin").unlink()
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "no packed trunk")


def test_killed_pack_resumes_or_restarts(small, small_ref, tmp_path, monkeypatch):
    m, _, cfg, ix = small
    out = tmp_path / "t"
    real = TP._copy_layer
    calls = []

    def dying(reader, src, L, *a):
        calls.append(L.layer)
        if L.layer == 5:
            raise KeyboardInterrupt  # the pack is killed while copying layer 5
        return real(reader, src, L, *a)

    monkeypatch.setattr(TP, "_copy_layer", dying)
    with pytest.raises(KeyboardInterrupt):
        pack_trunk(m, out, progress=False)
    assert (out / "trunk.bin.partial").exists() and not (out / "trunk.json").exists()
    assert not (out / "trunk.bin").exists()
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "interrupted", "k3 pack-trunk")
    # resume: starts at layer 5, the result is a good trunk
    monkeypatch.setattr(TP, "_copy_layer", real)
    calls.clear()
    monkeypatch.setattr(TP, "_copy_layer", lambda reader, src, L, *a: (calls.append(L.layer), real(reader, src, L, *a))[1])
    lines = []
    pack_trunk(m, out, progress=lines.append)
    assert calls == list(range(5, cfg.num_hidden_layers))
    assert any("resuming at layer 5" in s for s in lines)
    pt = PackedTrunk.open(out, cfg, ix)
    with streamer(pt, 10 * GB) as s:
        for i in range(pt.n_layers):
            check_layer(s.layer(i), small_ref[i])
            s.release_layer(i)
    assert not (out / "trunk.bin.partial").exists() and not (out / "trunk.progress.json").exists()


def test_killed_after_rename_before_json_finishes_without_copying(small, tmp_path, monkeypatch):
    m, _, cfg, ix = small
    out = tmp_path / "t"
    real_sync = TP.fsync_dir
    n = []

    def sync(d):
        n.append(d)
        if len(n) == 2:  # the one right after trunk.bin.partial -> trunk.bin
            raise KeyboardInterrupt
        real_sync(d)

    monkeypatch.setattr(TP, "fsync_dir", sync)
    with pytest.raises(KeyboardInterrupt):
        pack_trunk(m, out, progress=False)
    monkeypatch.setattr(TP, "fsync_dir", real_sync)
    assert (out / "trunk.bin").exists() and not (out / "trunk.json").exists()
    _refused(lambda: PackedTrunk.open(out, cfg, ix), "interrupted")
    calls = []
    real = TP._copy_layer
    monkeypatch.setattr(TP, "_copy_layer", lambda reader, src, L, *a: (calls.append(L.layer), real(reader, src, L, *a))[1])
    pack_trunk(m, out, progress=False)
    assert calls == []
    PackedTrunk.open(out, cfg, ix)


def test_partial_with_foreign_progress_restarts(small, tmp_path, monkeypatch):
    m, t, cfg, ix = small
    out = tmp_path / "t"
    out.mkdir()
    (out / "trunk.bin.partial").write_bytes(b"\xff" * 100000)
    (out / "trunk.progress.json").write_text(json.dumps({"plan_sha256": "0" * 64, "layers_done": 3, "samples": []}))
    calls = []
    real = TP._copy_layer
    monkeypatch.setattr(TP, "_copy_layer", lambda reader, src, L, *a: (calls.append(L.layer), real(reader, src, L, *a))[1])
    pack_trunk(m, out, progress=False)
    assert calls == list(range(cfg.num_hidden_layers))
    assert (out / "trunk.bin").read_bytes() == (t / "trunk.bin").read_bytes()
    PackedTrunk.open(out, cfg, ix)
    # --restart ignores a matching progress record too
    calls.clear()
    pack_trunk(m, out, progress=False, force=True, restart=True)
    assert calls == list(range(cfg.num_hidden_layers))


def _index_with(ix, edit):
    tensors = dict(ix.items())
    edit(tensors)
    return CheckpointIndex(ix.model_dir, tensors, {p: ix.shard_header(p) for p in ix.shards()})


def test_layout_of_layers_with_gaps_or_spread_over_shards(small):
    """A layer whose tensors are not one run in one shard (re-saved checkpoints) is laid
    out as several segments, each copied as it is, at 64-byte boundaries."""
    m, _, cfg, ix = small
    name = "language_model.model.layers.2.self_attn.o_proj.weight"
    rel = name.split("layers.2.")[1]
    release = TF._plan_layout(cfg, ix)[2]

    def gap(ts):
        ts[name] = dataclasses.replace(ts[name], offset=ts[name].offset + 64)

    def split(ts):
        other = [p for p in ix.shards() if p != ts[name].file][0]
        ts[name] = dataclasses.replace(ts[name], file=other)

    for edit in (gap, split):
        ix2 = _index_with(ix, edit)
        L = TF._plan_layout(cfg, ix2)[2]
        assert len(L.segments) >= 2 and len(release.segments) == 1
        assert all(g.off % TF.SEGMENT_ALIGN == 0 for g in L.segments)
        assert sum(g.nbytes for g in L.segments) == sum(t.nbytes for t in L.tensors.values())
        t = L.tensors[rel]
        seg = next(g for g in L.segments if g.off <= t.off < g.off + g.nbytes)
        assert seg.src_off + t.off - seg.off == ix2.get(name).offset  # where the copy of its bytes comes from
        assert os.path.basename(ix2.get(name).file) == seg.shard
        spans = sorted((x.off, x.off + x.nbytes) for x in L.tensors.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two tensors overlap

    def drop(ts):
        del ts[name]

    # the layout check (CheckpointLayout.validate) refuses it, naming the missing tensor
    with pytest.raises(CheckpointError, match=r"1 of 14 layers are missing tensors.*missing `" + name.replace(".", r"\.") + "`"):
        TF._plan_layout(cfg, _index_with(ix, drop))


def test_cli_main(small, tmp_path, capsys):
    m, t, cfg, ix = small
    assert k3_main(["pack-trunk", str(m), str(tmp_path / "t")]) == 0
    err = capsys.readouterr().err
    assert "layer 13" in err and "wrote" in err  # plain lines: stderr is not a terminal here
    PackedTrunk.open(tmp_path / "t", cfg, ix)
    assert k3_main(["pack-trunk", str(tmp_path / "nope"), str(tmp_path / "t2")]) in (2, 3)
    args = build_parser().parse_args(["pack-trunk", str(m), str(tmp_path / "t3"), "--restart"])
    assert args.restart and not args.force
    assert args.fn(args) == 0
    PackedTrunk.open(tmp_path / "t3", cfg, ix)


# --------------------------------------------------------------------------- planner
def brute_feasible(a, B, k):
    """Is there any pinned set with k slots (slot = largest unpinned) within B?"""
    return any(sum(x for x in a if x > s) + k * s <= B for s in set(a))


def check_plan(sizes, B, ring, order, p):
    a = [al(x) for x in sizes]
    n = len(a)
    assert p.total_bytes == sum(a)
    assert p.pinned == sorted(set(p.pinned)) and all(0 <= j < n for j in p.pinned)
    assert p.pinned_bytes == sum(a[j] for j in p.pinned)
    unp = [j for j in range(n) if j not in set(p.pinned)]
    if not unp:  # all pinned: no ring
        assert p.ring_slots == 0 and p.slot_bytes == 0 and sum(a) <= B and p.message is None
        return
    assert sum(a) > B
    assert 1 <= p.ring_slots <= ring
    assert p.slot_bytes == max(a[j] for j in unp)  # slot = largest unpinned (so it always fits)
    assert p.slot_bytes % A == 0
    assert p.used_bytes <= B  # budget never exceeded
    # fixed point: no unpinned layer can be added (the slot re-sized accordingly)
    for j in unp:
        rest = [a[u] for u in unp if u != j]
        if not rest:
            continue
        cost = p.pinned_bytes + a[j] + p.ring_slots * max(rest)
        if order == "largest":
            assert cost > B, f"layer {j} would still fit"
    if order == "prefix":
        assert p.pinned == list(range(len(p.pinned)))
        m = len(p.pinned)  # no longer prefix fits
        for mm in range(m + 1, n):
            assert sum(a[:mm]) + p.ring_slots * max(a[mm:]) > B
    else:
        # largest first: every layer larger than the slot is pinned, and every unpinned
        # layer was tried in (size desc, index asc) order and did not fit at its turn
        assert all(j in p.pinned for j in range(n) if a[j] > p.slot_bytes)
        rank = {j: r for r, j in enumerate(sorted(range(n), key=lambda j: (-a[j], j)))}
        pset = set(p.pinned)
        for u in unp:
            at_turn = {j for j in pset if rank[j] < rank[u]} | {u}
            left = [a[j] for j in range(n) if j not in at_turn]
            if left:
                assert sum(a[j] for j in at_turn) + p.ring_slots * max(left) > B, f"layer {u} was skipped but fits"
    # ring: as many slots as fit (up to `ring`); the message exactly when fewer
    if order == "largest":
        for k in range(p.ring_slots + 1, ring + 1):
            assert not brute_feasible(a, B, k)
        assert (p.ring_slots >= 2 or ring == 1) == (ring == 1 or brute_feasible(a, B, 2))
    if p.ring_slots < ring:
        assert p.message is not None
        if p.ring_slots == 1:
            assert p.message.startswith("ring held at 1 slot: a second slot needs ")
            assert "read ahead only into the" in p.message and "Raise --trunk-gb above" in p.message
            x = min_budget_for(sizes, 2, order)
            assert x > B
            quoted = float(p.message.split("needs ")[1].split(" GB")[0])
            assert x <= quoted * 1e9 < x + 0.01e9 + 1
    else:
        assert p.message is None
    # re-planning is stable
    q = plan_trunk(sizes, B, ring, order)
    assert (q.pinned, q.ring_slots, q.slot_bytes, q.message) == (p.pinned, p.ring_slots, p.slot_bytes, p.message)


sizes_st = st.one_of(
    st.lists(st.integers(1, 40) .map(lambda x: x * A), min_size=1, max_size=12),
    st.lists(st.integers(1, 200_000), min_size=1, max_size=12),
    st.lists(st.sampled_from([3 * A, 5 * A, 8 * A]), min_size=2, max_size=20),
)


@settings(max_examples=400, deadline=None)
@given(sizes_st, st.floats(0.0, 1.2), st.integers(1, 4), st.sampled_from(["largest", "prefix"]))
def test_planner_properties(sizes, frac, ring, order):
    a = [al(x) for x in sizes]
    B = int(frac * sum(a)) + (1 if frac >= 1 else 0)
    try:
        p = plan_trunk(sizes, B, ring, order)
    except K3Error as e:
        assert e.exit_code == EXIT_RUNTIME
        assert min_budget_for(sizes, 1, order) > B
        assert "largest layer" in str(e) and "budget" in str(e)
        return
    check_plan(sizes, B, ring, order, p)


def k3_like(rnd_sizes):
    """93 layers: layer 0 dense 2.34 GB, the others 0.9-1.3 GB."""
    return [2_341_213_184] + rnd_sizes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(900_000_000, 1_300_000_000), min_size=92, max_size=92),
       st.floats(2.0, 115.0), st.integers(1, 3), st.sampled_from(["largest", "prefix"]))
def test_planner_k3_like(rest, budget_gb, ring, order):
    sizes = k3_like(rest)
    B = int(budget_gb * GB)
    try:
        p = plan_trunk(sizes, B, ring, order)
    except K3Error:
        assert min_budget_for(sizes, 1, order) > B
        return
    check_plan(sizes, B, ring, order, p)
    if order == "largest" and p.pinned and p.ring_slots >= 2:
        assert 0 in p.pinned  # the 2.34 GB dense layer goes first


def test_planner_examples():
    sizes = [2_341_213_184] + [1_255_354_496] * 60 + [831_945_856] * 32
    a = [al(x) for x in sizes]
    # 3.0 GB laptop budget: 2 x 2.34 GB slots (4.6824 GB, quoted rounded up) do not fit, 1 slot does
    p = plan_trunk(sizes, 3 * GB, 2)
    assert p.ring_slots == 1 and p.message is not None
    assert "a second slot needs 4.69 GB and the trunk budget is 3.00 GB" in p.message
    assert p.message.endswith("Raise --trunk-gb above 4.69 GB to enable it.")
    # pinning layer 0 makes the slot 1.26 GB: 2.34 + 2 x 1.26 = 4.85 GB, but 4.68 GB already gives 2 slots
    p = plan_trunk(sizes, int(4.7 * GB), 2)
    assert p.ring_slots == 2 and p.pinned == [] and p.slot_bytes == a[0] and p.message is None
    p = plan_trunk(sizes, int(4.9 * GB), 2)
    assert p.ring_slots == 2 and p.pinned == [0] and p.slot_bytes == a[1]
    p = plan_trunk(sizes, 20 * GB, 2, "largest")
    assert p.pinned[:1] == [0] and len(p.pinned) == 1 + (20 * GB - a[0] - 2 * a[1]) // a[1]
    q = plan_trunk(sizes, 20 * GB, 2, "prefix")
    assert q.pinned == list(range(len(q.pinned)))
    p = plan_trunk(sizes, sum(a), 2)
    assert p.ring_slots == 0 and len(p.pinned) == 93
    p = plan_trunk(sizes, 10 * GB, 3)
    assert p.ring_slots == 3 and p.message is None
    p = plan_trunk(sizes, int(3.9 * GB), 3)  # 3 x 1.26 + 2.34 > 3.9; 3 x 2.34 > 3.9; 2 slots do not fit either
    assert p.ring_slots == 1 and "second slot" in p.message
    p = plan_trunk(sizes, int(6 * GB), 3)  # 2 slots fit, 3 slots need 2.34 + 3 x 1.26 = 6.11 GB
    assert p.ring_slots == 2 and p.message.startswith("ring held at 2 slots: 3 slots need 6.11 GB")
    with pytest.raises(K3Error, match=r"largest layer is 2\.34 GB") as ei:
        plan_trunk(sizes, 1 * GB, 2)
    assert ei.value.exit_code == EXIT_RUNTIME
    # a big first layer that only pays for itself pinned: ring of 2 via pinning it
    p = plan_trunk([10 * A] + [A] * 5, 13 * A, 2)  # streaming it would need 2 x 10 pages
    assert p.pinned == [0, 1] and p.ring_slots == 2 and p.slot_bytes == A


# -------------------------------------------------------------------------- streamer
def _budgets(sizes):
    """(budget, ring, order) cases: ring 1/2/3, none/some/all pinned, both orders."""
    a = [al(x) for x in sizes]
    out = []
    for ring in (1, 2, 3):
        for order in ("largest", "prefix"):
            base = min_budget_for(sizes, ring, order)
            out.append((base, ring, order))
            out.append((base + 3 * max(a[1:]), ring, order))
    out.append((sum(a), 2, "largest"))
    out.append((min_budget_for(sizes, 2) - 1, 2, "largest"))  # ring held at 1
    return out


#: _budgets' cases in the fast run: ring 1 (none and some pinned, 1 and 3 I/O threads),
#: ring 2 and ring 3 with some pinned (prefix and largest order), all pinned, ring held
#: at 1; every case under `slow`
_FAST_BUDGETS = (0, 1, 7, 9, 12, 13)


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_streamer_passes_byte_identical(small, small_ref, every):
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    seen = set()
    for n, (budget, ring, order) in enumerate(_budgets(pt.layer_bytes)):
        if not every and n not in _FAST_BUDGETS:
            continue
        for io_threads in ((1, 3) if n < 2 else (1 + 2 * (n % 2),)):
            s = streamer(pt, budget, ring, order, io_threads=io_threads, chunk_bytes=1 * MB)
            try:
                p = s.plan
                seen.add((p.ring_slots, bool(p.pinned), len(p.pinned) == pt.n_layers))
                for tok in range(3):
                    for i in range(pt.n_layers):
                        check_layer(s.layer(i), small_ref[i])
                        s.release_layer(i)
                st_ = s.stats()
                assert st_["binds"] == 3 * pt.n_layers == st_["hits"] + st_["misses"]
                assert st_["pinned"] == len(p.pinned) and st_["ring_slots"] == p.ring_slots
                unpinned = [i for i in range(pt.n_layers) if i not in p.pinned]
                # pinned layers are read once; a cyclic walk re-reads the unpinned layers each
                # pass, except what spare slots still hold (at most ring_slots per pass), plus
                # the prefetch for a next token after the last pass
                reads = st_["layer_reads"]
                assert [reads[i] for i in p.pinned] == [1] * len(p.pinned)
                assert all(1 <= reads[i] <= 4 for i in unpinned)
                assert sum(reads[i] for i in unpinned) >= 3 * len(unpinned) - 2 * p.ring_slots
                assert st_["bytes_read"] == sum(r * b for r, b in zip(reads, pt.layer_bytes))
                assert st_["allocated_bytes"] <= budget
                assert st_["device_seconds"] > 0 and st_["wait_seconds"] >= 0
            finally:
                s.close()
    assert {r for r, _, _ in seen} == {0, 1, 2, 3}
    assert (1, True, False) in seen and (2, True, False) in seen and (3, True, False) in seen


def test_streamer_prefetches_ahead(small, small_ref):
    """With a ring of 2 and time between binds, reads hide behind 'compute': hits, overlap."""
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    with streamer(pt, min_budget_for(pt.layer_bytes, 2), 2) as s:
        for tok in range(2):
            for i in range(pt.n_layers):
                s.layer(i)
                time.sleep(0.03)  # compute
                s.release_layer(i)
        st_ = s.stats()
        desc = s.plan.describe()
    assert st_["hits"] >= 2 * pt.n_layers - 3
    assert st_["overlap_seconds"] > 0.5 * st_["device_seconds"] > 0
    assert st_["binds"] == 2 * pt.n_layers and st_["hits"] + st_["misses"] == st_["binds"]
    assert (st_["pinned"], st_["n_layers"], st_["ring_slots"]) == (len(s.plan.pinned), pt.n_layers, 2)
    assert st_["arena_bytes"] == s.plan.arena_bytes >= 2 * s.plan.slot_bytes
    assert desc.startswith(f"trunk: pinned {len(s.plan.pinned)}/{pt.n_layers} layers LARGEST FIRST")
    assert "ring 2 slots" in desc


def test_streamer_subset_of_layers(small, small_ref):
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    with streamer(pt, min_budget_for(pt.layer_bytes[:5], 2), 2, n_layers=5, chunk_bytes=MB) as s:
        for tok in range(3):
            for i in range(5):
                check_layer(s.layer(i), small_ref[i])
                s.release_layer(i)
        assert s.stats()["layer_reads"][5:] == [] and len(s.stats()["layer_reads"]) == 5
        assert s.plan.n_layers == 5 and s.stats()["n_layers"] == 5
        with pytest.raises(IndexError):
            s.layer(5)
    # a plan for more layers than the packed trunk has is refused
    with pytest.raises(ValueError, match="covers"):
        TrunkStreamer(pt, plan_trunk(pt.layer_bytes + [A], 10 * GB, 2))


def test_slot_isolation(small, small_ref):
    """A held layer's bytes are never overwritten while the prefetcher keeps reading."""
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    for ring in (2, 3):
        with streamer(pt, min_budget_for(pt.layer_bytes, ring), ring, chunk_bytes=MB) as s:
            held = next(i for i in range(pt.n_layers) if i not in s.plan.pinned)
            w = s.layer(held)  # held, never released during the walk below
            for step in range(2 * pt.n_layers):
                j = (held + 1 + step) % pt.n_layers
                if j == held:
                    continue
                check_layer(s.layer(j), small_ref[j])
                s.release_layer(j)
                check_layer(w, small_ref[held])
            time.sleep(0.05)
            check_layer(w, small_ref[held])
            s.release_layer(held)


def test_one_slot_fully_held_is_refused(small, small_ref):
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    with streamer(pt, min_budget_for(pt.layer_bytes, 1), 2) as s:
        assert s.plan.ring_slots == 1
        unp = [i for i in range(pt.n_layers) if i not in s.plan.pinned]
        s.layer(unp[0])
        with pytest.raises(K3Error, match=r"does not fit in the .* ring beside layers \[\d+\], which are held"):
            w = s.layer(unp[1])  # raises here, or on the first lookup that would wait forever
            for k in w:
                w[k]
        s.release_layer(unp[1])
        s.release_layer(unp[0])
        check_layer(s.layer(unp[1]), small_ref[unp[1]])
        s.release_layer(unp[1])



class _Gate:
    """A read hook that holds back trunk.bin reads at or past ``at`` until ``open`` is
    set (a safety timer opens it, so a wrong implementation fails instead of hanging);
    ``seen`` records every (offset, nbytes) requested."""

    def __init__(self, at: int):
        import threading

        self.at, self.open, self.seen = at, threading.Event(), []
        self._timer = threading.Timer(20.0, self.open.set)
        self._timer.daemon = True
        self._timer.start()

    def __call__(self, path, offset, nbytes, direct):
        if os.path.basename(path) == "trunk.bin":
            self.seen.append((offset, nbytes))
            if offset + nbytes > self.at:
                self.open.wait()
        return None


def test_tensors_are_handed_over_before_their_layer_is_read(small, small_ref):
    """A one-slot ring still overlaps: the first tensors of a layer can be used while its
    later chunks have not been read."""
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    plan = plan_trunk(pt.layer_bytes, min_budget_for(pt.layer_bytes, 1), 2)
    u = next(i for i in range(pt.n_layers) if i not in plan.pinned)
    L = pt.layers[u]
    first = min(L.tensors, key=lambda k: L.tensors[k].off)
    last = max(L.tensors, key=lambda k: L.tensors[k].off)
    assert L.tensors[first].off + L.tensors[first].nbytes <= 64 * 1024 < L.tensors[last].off
    gate = _Gate(L.file_off + 64 * 1024)
    with streamer(pt, min_budget_for(pt.layer_bytes, 1), 2, reader=ShardFiles(hook=gate),
                       chunk_bytes=64 * 1024) as s:
        assert s.plan.ring_slots == 1 and s.plan.pinned == plan.pinned
        w = s.layer(u)  # the walk restarts at u
        v = w[first]
        assert not gate.open.is_set(), "the first tensor waited for the whole layer"
        assert same_bits(v, small_ref[u][first])
        gate.open.set()
        check_layer(w, small_ref[u])
        s.release_layer(u)
        assert s.stats()["misses"] == 1


def test_spare_ring_bytes_read_the_next_layer_ahead(small, small_ref):
    """With one slot plus spare budget, the next layer's reads start while the current
    one is still held."""
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    base = min_budget_for(pt.layer_bytes, 1)
    budget = base + 256 * 1024
    gate = _Gate(1 << 62)  # never holds anything back: records only
    gate.open.set()
    with streamer(pt, budget, 2, reader=ShardFiles(hook=gate), chunk_bytes=64 * 1024) as s:
        p = s.plan
        unp = [i for i in range(pt.n_layers) if i not in p.pinned]
        assert p.ring_slots == 1 and s.stats()["arena_bytes"] >= p.slot_bytes + 256 * 1024
        for i in range(pt.n_layers):
            w = s.layer(i)
            check_layer(w, small_ref[i])  # fully read, still held
            if i in unp and i != unp[-1]:
                nxt = pt.layers[unp[unp.index(i) + 1]]
                for _ in range(400):  # the reader needs no release to start the next layer
                    if any(nxt.file_off <= o < nxt.file_off + nxt.nbytes for o, _ in list(gate.seen)):
                        break
                    time.sleep(0.01)
                else:
                    raise AssertionError(f"nothing of layer {nxt.layer} was read while layer {i} was held")
            s.release_layer(i)


def test_layers_wrapping_round_the_arena_end(small, small_ref):
    """Arenas that are not a multiple of the layer sizes split layers across their end
    (at a tensor boundary); every tensor still comes out bit-identical, pass after pass."""
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    wrapped = 0
    for ring in (1, 2):
        for extra in (12288, 100 * 1024, 333 * 4096):
            with streamer(pt, min_budget_for(pt.layer_bytes, ring) + extra, ring, chunk_bytes=64 * 1024) as s:
                for tok in range(3):
                    for i in range(pt.n_layers):
                        check_layer(s.layer(i), small_ref[i])
                        s.release_layer(i)
                st_ = s.stats()
                wrapped += st_["wrapped_layers"]
                assert st_["allocated_bytes"] <= min_budget_for(pt.layer_bytes, ring) + extra
    assert wrapped > 0



@pytest.mark.parametrize("cases", [3, pytest.param(10, marks=pytest.mark.slow)])
def test_random_walks_and_budgets(small, small_ref, cases):
    """Seeded fuzz: random budgets, rings, pin orders, thread counts and chunk sizes, and
    walks that mostly go forward but sometimes abandon a pass and restart elsewhere (an
    interrupted forward) or stop early: every tensor handed out is the packed bytes. The
    fast run walks the first 3 of the 10 seeded cases."""
    import random

    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    rng = random.Random(1234)
    a = [al(x) for x in pt.layer_bytes]
    for case in range(cases):
        ring = rng.choice((1, 2, 3))
        order = rng.choice(("largest", "prefix"))
        budget = min_budget_for(pt.layer_bytes, ring, order) + rng.choice((0, 4096, rng.randrange(sum(a) // 2)))
        with streamer(pt, budget, ring, order, io_threads=rng.choice((1, 2, 4)),
                           chunk_bytes=rng.choice((16, 64, 256)) * 1024) as s:
            i = rng.randrange(pt.n_layers)
            for step in range(4 * pt.n_layers):
                w = s.layer(i)
                names = list(w)
                if rng.random() < 0.1:  # an interrupted layer: only some tensors looked at
                    names = rng.sample(names, max(1, len(names) // 3))
                for k in names:
                    assert same_bits(w[k], small_ref[i][k]), (case, i, k)
                s.release_layer(i)
                i = rng.randrange(pt.n_layers) if rng.random() < 0.15 else (i + 1) % pt.n_layers
            assert s.stats()["allocated_bytes"] <= budget


@pytest.mark.parametrize("kind", ["eio", "eof"])
@pytest.mark.parametrize("ring,pinned_target", [(1, False), (2, False), (3, False), (2, True)])
def test_read_fault_raises_then_recovers(small, small_ref, kind, ring, pinned_target):
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    budget = min_budget_for(pt.layer_bytes, ring) + (pt.layer_bytes[0] if pinned_target else 0)
    plan = plan_trunk(pt.layer_bytes, budget, ring)
    cands = [i for i in range(pt.n_layers) if (i in plan.pinned) == pinned_target]
    target = cands[len(cands) // 2]
    L = pt.layers[target]
    hook = FaultHook(kind, file="trunk.bin", at=L.file_off + L.nbytes // 2)  # a chunk mid-layer
    reader = ShardFiles(hook=hook)
    s = streamer(pt, budget, ring, io_threads=4, reader=reader, chunk_bytes=MB)
    try:
        assert s.plan.pinned == plan.pinned
        for i in range(target):
            check_layer(s.layer(i), small_ref[i])
            s.release_layer(i)
        with pytest.raises(ReadError) as ei:  # from layer() or, if not failed yet, from a tensor lookup
            check_layer(s.layer(target), small_ref[target])
        assert ei.value.exit_code == EXIT_READ
        msg = str(ei.value)
        assert f"layer {target}" in msg and f"offset {L.file_off}" in msg and "trunk.bin" in msg
        assert hook.fired >= 1
        reader.hook = None  # the fault goes away: the next call reads the layer again
        for tok in range(2):
            for i in list(range(target, pt.n_layers)) + list(range(target)):
                check_layer(s.layer(i), small_ref[i])
                s.release_layer(i)
    finally:
        s.close()


def test_short_reads_are_survived(small, small_ref):
    _, t, cfg, ix = small
    pt = PackedTrunk.open(t, cfg, ix)
    reader = ShardFiles(hook=FaultHook("short", file="trunk.bin", short_bytes=5000))
    with streamer(pt, min_budget_for(pt.layer_bytes, 2), 2, reader=reader, chunk_bytes=MB) as s:
        for i in range(pt.n_layers):
            check_layer(s.layer(i), small_ref[i])
            s.release_layer(i)


# ------------------------------------------------------------------- model over it
class StreamProvider:
    """Layers from a TrunkStreamer; globals and experts from the reference engine's
    provider (trunk held in RAM)."""

    def __init__(self, resident, streamer):
        self.config = resident.config
        self.r, self.s = resident, streamer

    def global_weight(self, name):
        return self.r.global_weight(name)

    def embed(self, ids):
        return self.r.embed(ids)

    def expert_groups(self, i, ids):
        return self.r.expert_groups(i, ids)

    def layer(self, i):
        return self.s.layer(i)

    def release_layer(self, i):
        self.s.release_layer(i)


@pytest.mark.parametrize("arch", ["k3", "kimi_linear"])
def test_model_over_streamer_bit_identical(tmp_path, arch):
    m = synth.synthesize(tmp_path / "m", preset="tiny", arch=arch, seed=4)
    pack_trunk(m, tmp_path / "t", progress=False)
    with open_engine(m) as eng:
        assert eng.plan.trunk is None and eng.provider.trunk is None  # the reference holds the trunk in RAM
        ref_model = eng.model
        cfg = ref_model.cfg
        ids = [5, 17, 99, 300, 42, 7, 100, 12, 64, 3]
        ref = ref_model.forward(ids, last_only=False)
        st0 = ref_model.new_state()
        ref_model.forward(ids, st0)
        ref_steps = [ref_model.forward([t], st0) for t in (11, 12, 13)]
        pt = PackedTrunk.open(tmp_path / "t", cfg, CheckpointIndex.open(m))
        resident = eng.provider
        cases = [(min_budget_for(pt.layer_bytes, r, o) + extra, r, o)
                 for r in (1, 2, 3) for o, extra in (("largest", 0), ("prefix", max(pt.layer_bytes)))]
        cases.append((pt.total_bytes, 2, "largest"))
        for budget, ring, order in cases:
            with streamer(pt, budget, ring, order, io_threads=2, chunk_bytes=64 * 1024) as s:
                model = Model(StreamProvider(resident, s))
                for rep in range(2):
                    assert torch.equal(model.forward(ids, last_only=False), ref), (budget, ring, order, rep)
                st1 = model.new_state()
                model.forward(ids, st1)
                for t, r in zip((11, 12, 13), ref_steps):
                    assert torch.equal(model.forward([t], st1), r)


def test_pack_and_stream_a_resaved_layout(tmp_path):
    """A checkpoint re-saved in another tensor order (here a scrambled one, so a layer's
    trunk tensors are interleaved with experts and other layers, and spread over every
    shard) packs, and streaming it gives the tokens and logits of the release layout held
    in RAM."""
    import hashlib

    from safetensors import safe_open

    from k3.checkpoint.writer import write_checkpoint
    from k3.loader import load

    orig = synth.synthesize(tmp_path / "orig", preset="tiny", seed=4)
    ix = CheckpointIndex.open(orig)
    tensors = {}
    for shard in ix.shards():
        with safe_open(shard, "pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    names = sorted(tensors, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    cut = [len(names) * k // 3 for k in range(4)]
    resaved = tmp_path / "resaved"
    write_checkpoint(resaved, [[(n, tensors[n]) for n in names[a:b]] for a, b in zip(cut, cut[1:])],
                     name_fmt="model-{i:05d}-of-{n:05d}.safetensors", fsync=False)
    for f in orig.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, resaved / f.name)
    cfg = load_config(resaved)
    layers = TF._plan_layout(cfg, CheckpointIndex.open(resaved))
    assert max(len(L.segments) for L in layers) > 1 and max(len(L.shards) for L in layers) > 1
    pack_trunk(resaved, tmp_path / "t", progress=False)
    pt = PackedTrunk.open(tmp_path / "t", cfg, CheckpointIndex.open(resaved))
    ids = [5, 17, 99, 300, 42, 7, 1000, 12]
    with load(orig) as ref:
        want = list(ref.decode(ids, max_tokens=6))
    budget = min_budget_for(pt.layer_bytes, 1) / GB
    with load(resaved, trunk=tmp_path / "t", trunk_gb=budget, ultra_low_memory=True) as eng:
        assert eng.plan.trunk is not None and len(eng.plan.trunk.pinned) < pt.n_layers
        got = list(eng.decode(ids, max_tokens=6))
    assert [s.token for s in got] == [s.token for s in want]
    assert torch.equal(got[0].logits, want[0].logits)
