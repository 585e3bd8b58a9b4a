"""Conversation state files: round trips that continue exactly, every refusal, the
atomic write, and in-memory snapshots (undoing an interrupted forward pass)."""

from __future__ import annotations


import pytest
import torch

from k3.checkpoint.writer import write_safetensors
from k3.errors import K3Error
from k3.model.stack import Observer
from k3.state import FORMAT, StateFileError, load_state, read_state_header, save_state
from k3.synth import synthesize

from engines import greedy_ids, open_engine


@pytest.fixture(scope="module")
def k3engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    synthesize(d, preset="tiny", arch="k3", seed=21)
    with open_engine(d) as eng:
        yield eng


@pytest.fixture(scope="module")
def klengine(tmp_path_factory):
    d = tmp_path_factory.mktemp("kl")
    synthesize(d, preset="tiny", arch="kimi_linear", seed=21)
    with open_engine(d) as eng:
        yield eng


@pytest.fixture(scope="module")
def k3model(k3engine):
    return k3engine.model


@pytest.fixture(scope="module")
def klmodel(klengine):
    return klengine.model


PROMPT = list(range(100, 130))


def _continue(eng, state, pending, n=6):
    return greedy_ids(eng, pending, n, state=state)


@pytest.mark.parametrize("which", ["k3engine", "klengine"])
def test_round_trip_gives_identical_continuation(request, tmp_path, which):
    eng = request.getfixturevalue(which)
    model = eng.model
    st = model.new_state()
    out = greedy_ids(eng, PROMPT, 5, state=st)
    path = tmp_path / "conv.k3state"
    save_state(path, st, model.cfg, pending=out[-1:], extra={"note": "é"})
    loaded = load_state(path, model.cfg, max_positions=100)
    assert loaded.state.ids == st.ids and loaded.pending == out[-1:] and loaded.extra == {"note": "é"}
    assert loaded.tokens == PROMPT + out
    a = _continue(eng, st, out[-1:])
    b = _continue(eng, loaded.state, loaded.pending)
    assert a == b
    # and both equal a fresh run over the whole sequence (re-prefill; full recompute for two steps)
    assert a == greedy_ids(eng, PROMPT + out, 6, incremental=True)
    assert a[:2] == greedy_ids(eng, PROMPT + out, 2, incremental=False)
    # a new prompt appended after the saved sequence
    again = load_state(path, model.cfg)
    extra = [7, 8, 9]
    c = _continue(eng, again.state, again.pending + extra, 3)
    assert c == greedy_ids(eng, PROMPT + out + extra, 3, incremental=True)


def test_empty_and_partial_layer_states(tmp_path, k3model):
    p = tmp_path / "empty.st"
    save_state(p, k3model.new_state(), k3model.cfg, pending=[5, 6])
    ld = load_state(p, k3model.cfg)
    assert ld.state.ids == [] and ld.pending == [5, 6] and all(
        getattr(l, "S", None) is None and getattr(l, "k", None) is None for l in ld.state.layers)
    # --layers N: a state for the first N layers only
    from k3.model.stack import Model
    small = Model(k3model.provider, n_layers=3)
    st = small.new_state()
    small.forward(PROMPT, st)
    save_state(p, st, k3model.cfg)
    assert len(load_state(p, k3model.cfg, n_layers=3).state.layers) == 3
    with pytest.raises(StateFileError, match="3 layers and this run binds 8"):
        load_state(p, k3model.cfg)


def test_file_is_plain_safetensors(tmp_path, k3model):
    from safetensors.torch import load_file

    st = k3model.new_state()
    k3model.forward(PROMPT, st)
    p = tmp_path / "s.st"
    save_state(p, st, k3model.cfg, pending=[1])
    t = load_file(str(p))
    assert t["ids"].tolist() == PROMPT + [1]
    assert torch.equal(t["layers.3.k"], st.layers[3].k) and torch.equal(t["layers.0.S"], st.layers[0].S)
    meta, _, _, _ = read_state_header(p)
    assert meta["format"] == FORMAT and meta["version"] == "1" and meta["config_fingerprint"] == k3model.cfg.fingerprint()
    assert meta["positions"] == str(len(PROMPT)) and meta["tokens"] == str(len(PROMPT) + 1)
    assert b"pickle" not in p.read_bytes()[:4096]


@pytest.fixture()
def saved(tmp_path, k3model):
    st = k3model.new_state()
    k3model.forward(PROMPT, st)
    p = tmp_path / "good.st"
    save_state(p, st, k3model.cfg, pending=[3])
    return p


def _rewrite(src, dst, meta_edit=None, tensor_edit=None):
    """Copy a state file, editing its metadata / tensors (written the same way)."""
    from safetensors.torch import load_file

    meta, _, _, _ = read_state_header(src)
    tensors = load_file(str(src))
    if tensor_edit:
        tensors = tensor_edit(tensors)
    if meta_edit:
        meta = meta_edit(dict(meta))
    layer_order = {"conv_q": 0, "conv_k": 1, "conv_v": 2, "S": 3, "k": 0, "v": 1}
    items = [("ids", tensors["ids"])] + sorted(
        ((n, t) for n, t in tensors.items() if n != "ids"),
        key=lambda kv: (int(kv[0].split(".")[1]), layer_order[kv[0].split(".")[2]]))
    write_safetensors(dst, items, metadata=meta, fsync=False)
    return dst


def test_refusals(tmp_path, saved, k3model, klmodel):
    cfg = k3model.cfg
    assert load_state(saved, cfg).pending == [3]
    with pytest.raises(StateFileError, match="no such state file"):
        load_state(tmp_path / "nope.st", cfg)
    junk = tmp_path / "junk.st"
    junk.write_bytes(b"\x00" * 3)
    with pytest.raises(StateFileError, match="too short"):
        load_state(junk, cfg)
    junk.write_bytes(b"this is just some text, not a state file at all")
    with pytest.raises(StateFileError, match="not a k3 conversation state file"):
        load_state(junk, cfg)
    # a model shard: safetensors, but not a state
    shard = sorted(k3model.provider.layout.index.shards())[0]
    with pytest.raises(StateFileError, match="model shard"):
        load_state(shard, cfg)
    # another format version
    other = _rewrite(saved, tmp_path / "v2.st", meta_edit=lambda m: {**m, "version": "2"})
    with pytest.raises(StateFileError, match="version '2'; this k3 reads version 1"):
        load_state(other, cfg)
    # another model
    with pytest.raises(StateFileError, match="different model architecture"):
        load_state(saved, klmodel.cfg)
    # more positions than this run's KV capacity
    with pytest.raises(StateFileError, match=f"holds {len(PROMPT) + 1} positions, more than this run's KV capacity of 10"):
        load_state(saved, cfg, max_positions=10)
    assert load_state(saved, cfg, max_positions=len(PROMPT) + 1)
    # truncated anywhere: in the data, in the header
    raw = saved.read_bytes()
    for cut in (len(raw) - 1, len(raw) // 2, 200, 9):
        t = tmp_path / f"cut{cut}.st"
        t.write_bytes(raw[:cut])
        with pytest.raises(StateFileError, match="truncated"):
            load_state(t, cfg)
    t = tmp_path / "tail.st"
    t.write_bytes(raw + b"\0" * 16)
    with pytest.raises(StateFileError, match="after its last tensor"):
        load_state(t, cfg)
    # a flipped byte in the data
    b = bytearray(raw)
    b[-100] ^= 0x40
    t.write_bytes(bytes(b))
    with pytest.raises(StateFileError, match="checksum"):
        load_state(t, cfg)
    # wrong shapes (consistent header, metadata and checksum are not enough)
    bad = _rewrite(saved, tmp_path / "shape.st",
                   tensor_edit=lambda ts: {**ts, "layers.0.S": ts["layers.0.S"][:, :, :-1].contiguous()})
    with pytest.raises(StateFileError, match="layers.0.S"):
        load_state(bad, cfg)
    bad = _rewrite(saved, tmp_path / "meta.st", meta_edit=lambda m: {k: v for k, v in m.items() if k != "positions"})
    with pytest.raises(StateFileError, match="incomplete"):
        load_state(bad, cfg)
    # refusal messages are one paragraph and carry exit code 2
    try:
        load_state(saved, klmodel.cfg)
    except K3Error as e:
        assert e.exit_code == 2 and "\n" not in str(e)


def test_write_is_atomic(tmp_path, saved, k3model, monkeypatch):
    import k3.checkpoint.writer as w

    before = saved.read_bytes()
    st = k3model.new_state()
    k3model.forward(PROMPT[:5], st)

    def boom(e):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w, "_as_bytes", boom)
    with pytest.raises(K3Error, match="could not write the state file"):
        save_state(saved, st, k3model.cfg)
    assert saved.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_save_refuses_inconsistent_state(tmp_path, k3model):
    st = k3model.new_state()
    k3model.forward(PROMPT[:4], st)
    st.ids.append(9)  # ids say 5 positions, the MLA caches hold 4
    with pytest.raises(K3Error, match="inconsistent"):
        save_state(tmp_path / "x.st", st, k3model.cfg)


class InterruptAt(Observer):
    """Raises KeyboardInterrupt when layer `at` is done (a Ctrl-C at a layer boundary)."""

    def __init__(self, at: int):
        self.at = at
        self.calls = []

    def on_layer(self, i):
        self.calls.append(i)
        if i == self.at:
            raise KeyboardInterrupt


def test_snapshot_restore_undoes_an_interrupted_forward(k3engine):
    eng = k3engine
    model = eng.model
    st = model.new_state()
    model.forward(PROMPT, st)
    ref_state = model.new_state()
    model.forward(PROMPT, ref_state)
    want = _continue(eng, ref_state, [5, 6, 7])
    snap = st.snapshot()
    obs = InterruptAt(5)
    with pytest.raises(KeyboardInterrupt):
        model.forward([5, 6, 7], st, observer=obs)
    assert obs.calls == [0, 1, 2, 3, 4, 5]
    assert st.layers[3].length == len(PROMPT) + 3  # layer 3 (MLA) had been extended
    st.restore(snap)
    assert st.ids == PROMPT and st.layers[3].length == len(PROMPT)
    assert _continue(eng, st, [5, 6, 7]) == want


def test_decode_loop_undoes_an_interrupted_forward(k3engine):
    """engine.decode(undo_on_interrupt=True) restores the state when a forward pass is
    cut short, in the prefill and in a later step; without it the state is left torn."""
    eng = k3engine
    model = eng.model
    ref_state = model.new_state()
    want = greedy_ids(eng, PROMPT, 4, state=ref_state)
    # cut short during the prefill: nothing of the prompt stays in the state
    st = model.new_state()
    with pytest.raises(KeyboardInterrupt):
        for _ in eng.decode(PROMPT, state=st, max_tokens=4, observer=InterruptAt(5), undo_on_interrupt=True):
            pass
    assert st.ids == [] and all(getattr(l, "S", None) is None and getattr(l, "k", None) is None for l in st.layers)
    # cut short at the third step: the state is back to the two steps before it
    st = model.new_state()

    class Late(InterruptAt):
        passes = 0

        def on_layer(self, i):
            if i == 0:
                self.passes += 1
            if self.passes == 3:
                super().on_layer(i)

    got = []
    with pytest.raises(KeyboardInterrupt):
        for s in eng.decode(PROMPT, state=st, max_tokens=4, observer=Late(5), undo_on_interrupt=True):
            got.append(s.token)
    assert got == want[:2]
    assert st.ids == PROMPT + want[:1] and st.layers[3].length == len(PROMPT) + 1
    assert _continue(eng, st, want[1:2], 2) == want[2:4]
    # without undo_on_interrupt the interrupted pass stays half applied
    st = model.new_state()
    with pytest.raises(KeyboardInterrupt):
        for _ in eng.decode(PROMPT, state=st, max_tokens=4, observer=InterruptAt(5)):
            pass
    assert st.layers[3].length == len(PROMPT)
