"""The KDA state's matrix is reused between steps (k3.model.kda's pool): only what no
snapshot, loaded file or caller-visible copy can still hold."""
from __future__ import annotations

import pytest
import torch

from k3.model import compiled, kda, kda_state
from k3.synth import synthesize

from engines import open_engine

PROMPT = [5, 17, 99, 300, 42, 7, 1000, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("kl") / "m", preset="tiny", arch="kimi_linear", seed=3)


def _kda_layers(st):
    return [ls for ls in st.layers if isinstance(ls, kda_state.KDAState)]


def test_snapshots_keep_their_matrices_while_the_state_reuses_the_rest(model_dir):
    with open_engine(model_dir, max_context=64) as eng:
        st = eng.new_state()
        eng.model.forward(PROMPT, st)
        snap = st.snapshot()
        held = [ls.S for ls in _kda_layers(st)]
        copies = [s.clone() for s in held]
        ptrs = set()
        for t in range(6):                                   # several decode steps after the snapshot
            eng.model.forward([40 + t], st)
            ptrs |= {ls.S.data_ptr() for ls in _kda_layers(st)}
        # the steps reused buffers (fewer distinct matrices than layer-steps) ...
        assert len(ptrs) < 6 * len(held)
        # ... but never one a snapshot holds
        assert all(torch.equal(a, b) for a, b in zip(held, copies))
        assert not ({s.data_ptr() for s in held} & ptrs)
        after = eng.model.forward([99], st)
        # back to the snapshot: the same logits as a fresh state reading the same tokens
        st.restore(snap)
        for t in range(6):
            eng.model.forward([40 + t], st)
        again = eng.model.forward([99], st)
        assert torch.equal(after, again)
        ref = eng.new_state()
        eng.model.forward(PROMPT + [40 + t for t in range(6)], ref)
        ref_logits = eng.model.forward([99], ref)
        assert torch.equal(again, ref_logits)
        # the state's own matrices after a restore are the snapshot's: still untouched
        assert all(torch.equal(a, b) for a, b in zip(held, copies))


def test_a_matrix_the_state_did_not_make_is_never_reused():
    st = kda_state.KDAState()
    foreign = torch.zeros(2, 4, 4)
    st.S = foreign                                            # e.g. read from a state file
    st.advance(torch.ones(2, 4, 4))
    assert kda_state.pool_take((2, 4, 4)) is None
    mine = st.S
    st.advance(torch.ones(2, 4, 4))                           # a matrix it made, unpinned: reused
    assert kda_state.pool_take((2, 4, 4)) is mine
    st.pin()
    pinned = st.S
    st.advance(torch.ones(2, 4, 4))
    assert kda_state.pool_take((2, 4, 4)) is None and pinned.sum() == 2 * 4 * 4


def test_decode_reuses_matrices_through_its_per_pass_snapshots(model_dir, monkeypatch):
    """The decode loop snapshots each state before a pass (to undo a failed one) and
    releases the snapshot once the pass is settled: from the second step on, every KDA
    layer's step writes into a matrix the pool hands back, while a snapshot the caller
    took (and never released) keeps its matrices and restores exactly."""
    taken = []
    take = kda_state.pool_take

    def counted(shape):
        t = take(shape)
        taken.append(t is not None)
        return t

    monkeypatch.setattr(kda, "pool_take", counted)
    monkeypatch.setattr(compiled, "pool_take", counted)
    with open_engine(model_dir, max_context=64) as eng:
        st = eng.new_state()
        list(eng.decode(PROMPT, state=st, max_tokens=1))
        snap = st.snapshot()                                  # the caller's: never released
        held = [ls.S for ls in _kda_layers(st)]
        copies = [s.clone() for s in held]
        n = len(held)
        taken.clear()
        steps = list(eng.decode([PROMPT[-1]], state=st, max_tokens=6))
        assert len(taken) == 6 * n and all(taken[2 * n:]), taken
        assert all(torch.equal(a, b) for a, b in zip(held, copies))
        st.restore(snap)
        again = list(eng.decode([PROMPT[-1]], state=st, max_tokens=6))
        assert [s.token for s in again] == [s.token for s in steps]
        assert all(torch.equal(a, b) for a, b in zip(held, copies))
