"""Exact speculative decoding (--spec): n-gram drafts, verification in one pass, exact
rollback of the carried state, and tokens identical to plain decoding at every budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.errors import UsageError
from k3.memory.planner import min_budget_for
from k3.memory.trunk import PackedTrunk, pack_trunk
from k3.spec import Drafter, NgramIndex, read_corpus
from k3.synth import synthesize
from k3.units import GB

from engines import open_engine

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 99, 300, 42, 7, 1000, 12] * 3




@pytest.fixture(autouse=True)
def every_draft(monkeypatch):
    """These tests check drafting's mechanics (verification, rollback, the figures), so
    every draft found is read; test_passcost.py tests which drafts the cost model reads
    (on the tiny model a verification pass costs more than the tokens it saves, and the
    cost model reads none)."""
    monkeypatch.setenv("K3_SPEC_EVERY_DRAFT", "1")


# ---------------------------------------------------------------- drafts
def test_drafts_follow_the_most_recent_earlier_occurrence():
    assert Drafter([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4], 8).draft() == [5, 6, 7, 1, 2, 3, 4]
    assert Drafter([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4], 3).draft() == [5, 6, 7]  # at most N
    # two earlier continuations that disagree at once: no draft from this key
    assert Drafter([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 9, 9, 1, 2, 3, 4], 8).draft() == []
    # they agree on one token, then disagree: draft up to there
    assert Drafter([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4], 8).draft() == [5]
    # no 4-gram match: the 3-gram
    assert Drafter([9, 2, 3, 4, 8, 8, 1, 2, 3, 4][0:0] + [7, 2, 3, 4, 8, 5, 2, 3, 4], 2).draft() == [8, 5]
    assert Drafter([1, 2, 3], 4).draft() == []


def test_corpus_drafts_and_reading_it(tmp_path):
    corpus = NgramIndex([7, 1, 2, 3, 42, 43, 44, 45, 46])
    assert Drafter([10, 11, 1, 2, 3], 4, corpus=corpus).draft() == [42, 43, 44, 45]
    (tmp_path / "c.ids").write_text("7, 1 2,3 42")
    assert read_corpus(tmp_path / "c.ids", None).ids == [7, 1, 2, 3, 42]
    (tmp_path / "bad.ids").write_text("7 x")
    with pytest.raises(UsageError, match="token ids"):
        read_corpus(tmp_path / "bad.ids", None)
    with pytest.raises(UsageError, match="no tokenizer"):
        read_corpus(tmp_path / "c.txt", None) if (tmp_path / "c.txt").write_text("hi") else None
    with pytest.raises(UsageError, match="1..8"):
        Drafter([1], 9)


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def model_dir(request, tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp(request.param) / "m", preset="tiny", arch=request.param, seed=6)


def _same_state(a, b, exact: bool = False) -> bool:
    """Same ids and the same carried tensors: bit for bit with `exact`, else to fp32
    rounding (a verification pass reads up to 9 tokens at once; attention's BLAS calls
    round one query differently from several, so plain decoding can differ in the last
    bits - the tokens are the same, which is the contract)."""
    if a.ids != b.ids:
        return False

    def same(p, q):
        return torch.equal(p, q) if exact else bool((p - q).abs().max() <= 1e-5 * q.abs().max())

    for x, y in zip(a.layers, b.layers):
        if hasattr(x, "S"):
            if not all(same(p, q) for p, q in ((x.S, y.S), (x.conv_q, y.conv_q), (x.conv_k, y.conv_k),
                                                 (x.conv_v, y.conv_v))):
                return False
        elif not (same(x.k, y.k) and same(x.v, y.v)):
            return False
    return True


def test_rollback_gives_the_state_of_the_tokens_kept(model_dir):
    """Reading 1 + 8 tokens and rolling back to the first `keep` of them leaves the state a
    pass over those `keep` tokens leaves: bit for bit in the layers before the first MLA
    layer (the rollback replays the recorded recurrence), to rounding after it (attention
    over 9 and over `keep` keys is two different BLAS calls)."""
    with open_engine(model_dir, spec=8, max_context=200) as eng:
        block = [3, 4, 5, 6, 7, 8, 9, 10, 11]
        for keep in (2, 5, 8):
            a = eng.new_state()
            eng.model.forward(PROMPT, a)
            snap = a.snapshot()
            a.record(True)
            eng.model.forward(block, a, last_only=False)
            a.rollback(snap, keep)
            a.record(False)
            b = eng.new_state()
            eng.model.forward(PROMPT, b)
            eng.model.forward(block[:keep], b, last_only=False)
            assert _same_state(a, b), keep
            first_mla = next(i for i, ls in enumerate(a.layers) if not hasattr(ls, "S"))
            for x, y in zip(a.layers[:first_mla], b.layers[:first_mla]):
                assert all(torch.equal(p, q) for p, q in ((x.S, y.S), (x.conv_q, y.conv_q), (x.conv_k, y.conv_k),
                                                            (x.conv_v, y.conv_v))), keep


def test_greedy_spec_equals_plain_decoding_and_rolls_back_exactly(model_dir):
    with open_engine(model_dir, spec=8, max_context=200) as eng:
        plain_state = eng.new_state()
        plain = list(eng.decode(PROMPT, state=plain_state, max_tokens=40))
        want = [s.token for s in plain]
        # the best case: a corpus holding the model's own continuation
        st = eng.new_state()
        steps = list(eng.decode(PROMPT, state=st, max_tokens=40, spec=8, spec_corpus=NgramIndex(PROMPT + want)))
        assert [s.token for s in steps] == want
        assert len({s.pass_index for s in steps}) <= 1 + (40 - 1 + 8) // 9 + 1  # ~9 tokens per pass
        assert _same_state(st, plain_state)
        # the worst case: drafts that are always wrong (every 4-gram of the sequence followed,
        # in the corpus, by another token than the model's)
        full = PROMPT + want
        wrong = [t for i in range(len(PROMPT), len(full)) for t in full[i - 4:i] + [full[i] + 1]]
        st2 = eng.new_state()
        steps2 = list(eng.decode(PROMPT, state=st2, max_tokens=40, spec=8, spec_corpus=NgramIndex(wrong)))
        assert [s.token for s in steps2] == want and _same_state(st2, plain_state)
        assert sum(s.drafted for s in steps2) > 0 and sum(s.accepted for s in steps2) == 0
        # partial acceptance: a corpus that is right but for two tokens
        mixed = PROMPT + [t + 1 if i in (9, 20) else t for i, t in enumerate(want)]
        st3 = eng.new_state()
        steps3 = list(eng.decode(PROMPT, state=st3, max_tokens=40, spec=5, spec_corpus=NgramIndex(mixed)))
        assert [s.token for s in steps3] == want and _same_state(st3, plain_state)
        assert 0 < sum(s.accepted for s in steps3) < sum(s.drafted for s in steps3)


def test_spec_stops_at_stop_ids_and_max_tokens(model_dir):
    with open_engine(model_dir, spec=8, max_context=200) as eng:
        want = [s.token for s in eng.decode(PROMPT, max_tokens=20)]
        corpus = NgramIndex(PROMPT + want)
        for n in (1, 2, 7, 11):
            assert [s.token for s in eng.decode(PROMPT, max_tokens=n, spec=8, spec_corpus=corpus)] == want[:n]
        stop = want[10]
        first = want.index(stop)
        st = eng.new_state()
        got = list(eng.decode(PROMPT, state=st, max_tokens=20, spec=8, spec_corpus=corpus, stop_ids=[stop]))
        assert [s.token for s in got] == want[:first + 1] and got[-1].finish == "stop"
        assert st.ids == PROMPT + want[:first]  # the stop token is never fed


def test_spec_is_refused_where_it_cannot_work(model_dir):
    with open_engine(model_dir, spec=2) as eng:
        with pytest.raises(UsageError, match="incremental"):
            list(eng.decode(PROMPT, max_tokens=2, incremental=False, spec=2))
        with pytest.raises(UsageError, match="spec=2"):
            eng.generate(PROMPT, max_tokens=2, spec=4)


def test_spec_at_every_budget_through_the_cli(tmp_path):
    """Streamed trunk at its one-slot minimum, tables streamed, the smallest cache: the
    same tokens as plain decoding, and the --out JSON reports the figures."""
    m = synthesize(tmp_path / "m", preset="tiny", arch="k3", seed=2)
    pack_trunk(m, tmp_path / "t", progress=False)
    pt_bytes = min_budget_for(PackedTrunk.open(tmp_path / "t", *_cfg_index(m)).layer_bytes, 1)
    ids = ",".join(map(str, PROMPT))

    def run(*extra):
        out = tmp_path / "r.json"
        r = subprocess.run([sys.executable, "-m", "k3", "run", str(m), "--ids", ids, "--gen", "24", "--greedy",
                            "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(out.read_text()), r.stderr

    plain, _ = run()
    (tmp_path / "c.ids").write_text(" ".join(map(str, PROMPT + plain["generated_ids"])))
    for extra in ([], ["--trunk", str(tmp_path / "t"), "--trunk-gb", f"{pt_bytes / 1e9:.9f}", "--ultra-low-memory",
                       "--cache-gb", "0.0001"]):
        res, err = run("--spec", "8", "--spec-corpus", str(tmp_path / "c.ids"), *extra)
        assert res["generated_ids"] == plain["generated_ids"]
        sp = res["spec"]
        assert sp["n"] == 8 and sp["drafted"] >= sp["accepted"] > 0 and 0 < sp["acceptance"] <= 1
        assert sp["tokens_per_pass"] > 2 and sp["passes"] < 24
        assert "weight passes" in err and sum(r["accepted"] for r in res["steps"]) == sp["accepted"]


def _cfg_index(m):
    from k3.checkpoint.safetensors import CheckpointIndex
    from k3.config import load_config
    return load_config(m), CheckpointIndex.open(m)


# ---------------------------------------------------------------- seeded sampling with drafts
@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (0.8, 0), (0.95, 3)])
def test_verification_picks_plain_samplings_tokens(top_p, top_k):
    """A draft is kept exactly when it is the token plain sampling picks at its position;
    the first token not kept is that pick; so every emitted token is plain sampling's
    (and has its distribution: tests/test_sampling.py), likely drafts or not."""
    from k3.sampling import Sampler

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 6, generator=g) * 1.5
    s = Sampler(1.0, top_p, top_k, seed=11)
    kept_any = mismatched = 0
    for pos in range(0, 3000, 3):
        plain = [s(rows[i], pos + i) for i in range(4)]
        for drafts in ([plain[0], plain[1], plain[2]], [plain[0], (plain[1] + 1) % 6], [(plain[0] + 2) % 6], [5, 5]):
            toks, k = s.verify(rows, drafts, pos)
            want = 0
            while want < len(drafts) and drafts[want] == plain[want]:
                want += 1
            assert k == want and toks == plain[:k + 1], (pos, drafts, toks, plain)
            kept_any += k > 0
            mismatched += k < len(drafts)
    assert kept_any > 500 and mismatched > 500
    greedy = Sampler(0.0, 1.0, 0, seed=11)
    top = [int(torch.argmax(r)) for r in rows]
    assert greedy.verify(rows, top[:3], 0) == (top, 3)


class _Clock:
    """A pass cost model whose passes cost little more with drafts, timed with jitter
    (as a real clock): the decode loop's policy then reads some drafts, and how many
    varies from pass to pass."""

    timed = True

    def __init__(self, seed: int):
        import random
        self.rng = random.Random(seed)

    def seconds(self, groups):
        return 1.0 + sum(groups) * self.rng.uniform(0.0, 0.3)

    def observe(self, *a, **kw):
        pass

    def fresh(self, T):
        return True


def test_a_seeded_sampled_run_gives_the_same_tokens_with_spec_in_a_batch_and_at_any_budget(tmp_path, monkeypatch):
    """Seed 7, temperature 1, top-p 0.95: again; with --spec 4 and a corpus of its own
    text, every draft read, and under the pass cost policy (reading a varying number);
    as a job of a --batch beside others (the CLI); with the smallest expert cache. The
    same tokens each time, drafts read and kept where they are read."""
    from k3.sampling import SamplingSettings
    from k3.spec import NgramIndex

    m = synthesize(tmp_path / "m", preset="tiny", arch="k3", seed=2)

    def run(eng, n=32, seed=7, prompt=PROMPT, **kw):
        steps = list(eng.decode(prompt, max_tokens=n, sampler=SamplingSettings(1.0, 0.95, 0, seed).sampler(), **kw))
        return [s.token for s in steps], sum(s.accepted for s in steps), sum(s.drafted for s in steps)

    with open_engine(m, spec=4, max_context=128) as eng:
        plain, _, _ = run(eng)
        assert len(set(plain)) > 8   # sampled text, not one repeated token
        assert run(eng)[0] == plain
        other = run(eng, seed=8)[0]
        assert other != plain
        corpus = NgramIndex(PROMPT + plain)
        toks, accepted, drafted = run(eng, spec=4, spec_corpus=corpus)   # every draft read (the fixture)
        assert toks == plain and accepted > 16
        monkeypatch.setenv("K3_SPEC_EVERY_DRAFT", "0")
        real, reads = eng.pass_cost, []
        for seed in range(3):
            eng.pass_cost = _Clock(seed)
            toks, accepted, drafted = run(eng, spec=4, spec_corpus=corpus)
            assert toks == plain and accepted > 0
            reads.append(drafted)
        assert len(set(reads)) > 1   # the "clock" changed which drafts were read
        eng.pass_cost = real   # the tiny model's own timings (its policy may read no draft)
        assert run(eng, spec=4, spec_corpus=corpus)[0] == plain
        monkeypatch.setenv("K3_SPEC_EVERY_DRAFT", "1")
        first = run(eng, n=9, prompt=[3, 1, 4, 1, 5])[0]
        smallest = (eng.cfg.num_experts_per_token + 1.5) * eng.provider.cache.slot_bytes / GB   # slots the plan allows
    # a batch through the CLI: the job beside two others (one with its own seed) gives its tokens alone
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps(j) for j in (
        {"ids": [3, 1, 4, 1, 5], "max_tokens": 9}, {"ids": PROMPT, "max_tokens": 32},
        {"ids": PROMPT, "max_tokens": 32, "seed": 8})) + "\n")
    (tmp_path / "c.ids").write_text(" ".join(map(str, PROMPT + plain)))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "k3", "run", str(m), "--batch", str(jobs), "--seed", "7",
                        "--temperature", "1", "--top-p", "0.95", "--spec", "4", "--spec-corpus",
                        str(tmp_path / "c.ids"), "--cache-gb", "0.0001", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    seqs = json.loads(out.read_text())["sequences"]
    assert [s["generated_ids"] for s in seqs] == [first, plain, other] and [s["seed"] for s in seqs] == [7, 7, 8]
    # the smallest expert cache the plan allows, alone
    with open_engine(m, spec=4, max_context=128, cache_gb=smallest) as eng:
        assert eng.provider.cache.n_slots == eng.cfg.num_experts_per_token + 1
        assert run(eng)[0] == plain and run(eng, spec=4, spec_corpus=corpus)[0] == plain


def test_chat_with_spec_answers_as_without(tmp_path):
    d = synthesize(tmp_path / "m", preset="tiny", arch="k3", seed=6)  # K3: a chat format ships with it
    with open_engine(d, spec=4, max_context=1024) as eng:
        a = eng.chat(max_tokens=12)
        b = eng.chat(max_tokens=12, spec=4)
        for q in ("Hello there, hello there, hello there!", "Again: hello there, hello there."):
            assert a.send(q).tokens == b.send(q).tokens
        assert a.seq == b.seq
