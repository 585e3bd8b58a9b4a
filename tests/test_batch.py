"""Batched decode: sequences decoded together, joining and finishing between steps, each
bit-identical (tokens and every step's logits) to running it alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.synth import synthesize

from engines import open_engine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 300, 42, 7], [1000, 12, 64], list(range(40, 90)), [7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def model_dir(request, tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp(request.param) / "m", preset="tiny", arch=request.param, seed=8)


def alone(eng, prompt, n):
    return [(s.token, s.logits) for s in eng.decode(prompt, max_tokens=n, keep_logits=True)]


def test_batch_equals_each_sequence_alone(model_dir):
    lengths = [9, 4, 7, 12, 1]
    with open_engine(model_dir, max_context=128, max_batch=5) as eng:
        want = [alone(eng, p, n) for p, n in zip(PROMPTS, lengths)]
        batch = eng.batch()
        reqs = {}
        got = {}
        passes = 0
        # three start together; two join later, while the others are decoding
        for i in range(3):
            reqs[i] = batch.add(PROMPTS[i], max_tokens=lengths[i], keep_logits=True)
        while batch.active or len(reqs) < len(PROMPTS):
            if passes == 2:
                reqs[3] = batch.add(PROMPTS[3], max_tokens=lengths[3], keep_logits=True)
            if passes == 5:
                reqs[4] = batch.add(PROMPTS[4], max_tokens=lengths[4], keep_logits=True)
            for r, steps in batch.step():
                got.setdefault(r.id, []).extend((s.token, s.logits) for s in steps)
            passes += 1
        assert passes < sum(lengths)  # sequences shared passes
        for i, r in reqs.items():
            g = got[r.id]
            assert [t for t, _ in g] == [t for t, _ in want[i]], i
            for (_, a), (_, b) in zip(g, want[i]):
                assert torch.equal(a, b), i
            assert r.finished and r.tokens == [t for t, _ in want[i]]


def _state_bytes(st) -> int:
    n = 0
    for ls in st.layers:
        for name in ("conv_q", "conv_k", "conv_v", "S", "_kb", "_vb"):
            t = getattr(ls, name, None)
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
    return n


def test_the_plan_holds_the_state_of_every_sequence_in_the_batch(model_dir):
    # the plan's recurrent state + KV rows cover what B live sequences really hold
    B = 4
    with open_engine(model_dir, max_context=64, max_batch=B) as eng:
        rows = {name: n for name, n, _ in eng.plan.rows}
        batch = eng.batch()
        reqs = [batch.add(p[:20], max_tokens=6) for p in PROMPTS[:B]]
        held = 0
        while batch.active:
            batch.step()
            held = max(held, sum(_state_bytes(r.state) for r in reqs))
        assert held > 0
        assert held <= rows["recurrent state"] + rows["KV cache"]
        with open_engine(model_dir, max_context=64, max_batch=1) as one:
            one_rows = {name: n for name, n, _ in one.plan.rows}
        assert rows["recurrent state"] == B * one_rows["recurrent state"]


def test_a_long_prompt_joins_in_pieces(model_dir):
    from k3.decode import PREFILL_CHUNK

    long = [(13 * i + 7) % 1000 for i in range(PREFILL_CHUNK * 2 + 40)]
    with open_engine(model_dir, max_context=PREFILL_CHUNK * 3, max_batch=2, prefill_chunk=PREFILL_CHUNK) as eng:
        want = alone(eng, long, 3)
        short_want = alone(eng, PROMPTS[0], 6)
        batch = eng.batch()
        a = batch.add(PROMPTS[0], max_tokens=6, keep_logits=True)
        b = batch.add(long, max_tokens=3, keep_logits=True)
        emitted_before_b = 0
        while batch.active:
            for r, steps in batch.step():
                if r is a and not b.tokens:
                    emitted_before_b += len(steps)
        assert emitted_before_b >= 2  # a kept decoding while b read its prompt piece by piece
        assert a.tokens == [t for t, _ in short_want] and b.tokens == [t for t, _ in want]


def test_cli_batch(model_dir, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps({"ids": p, "max_tokens": n}) for p, n in zip(PROMPTS[:3], (5, 3, 4))) + "\n")
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "k3", "run", str(model_dir), "--batch", str(jobs), "--greedy",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    with open_engine(model_dir) as eng:
        for seq, p, n in zip(res["sequences"], PROMPTS, (5, 3, 4)):
            assert seq["prompt_ids"] == p and seq["generated_ids"] == [t for t, _ in alone(eng, p, n)]
    assert res["passes"] < 5 + 3 + 4 and "aggregate" in r.stderr


def test_cli_batch_refuses_a_bad_seed(model_dir, tmp_path):
    from k3.errors import EXIT_USAGE
    jobs = tmp_path / "jobs.jsonl"
    for bad in (-1, 1.5, "7", True):
        jobs.write_text(json.dumps({"ids": [1, 2], "seed": 3}) + "\n" + json.dumps({"ids": [1, 2], "seed": bad}) + "\n")
        r = subprocess.run([sys.executable, "-m", "k3", "run", str(model_dir), "--batch", str(jobs), "--seed", "1"],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == EXIT_USAGE and "line 2: seed must be an integer >= 0" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
