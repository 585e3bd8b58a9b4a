"""The public Python API, used as a user would: k3.load -> Engine.generate / chat.

Reference for the tokens: the CLI (`k3 run --out`), a separate front end over the same
engine, and the model's own full-recompute forward pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import k3
from k3.errors import K3Error, UsageError
from k3.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 99, 300, 42, 7, 1000, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("api") / "m"
    synthesize(d, preset="tiny", arch="k3", seed=5)
    return d


@pytest.fixture(scope="module")
def eng(model_dir):
    with k3.load(model_dir) as e:
        yield e


def test_import_k3_does_not_import_torch():
    r = subprocess.run([sys.executable, "-c", "import sys, k3; print('torch' in sys.modules, k3.__version__)"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split()[0] == "False", r.stdout + r.stderr


def test_load_returns_an_engine_with_plan_and_tokenizer(eng):
    assert isinstance(eng, k3.Engine)
    assert eng.tokenizer is not None and eng.plan.check() is None
    assert eng.plan.total <= eng.plan.available
    assert "memory plan:" in eng.plan.summary()


def test_streamed_steps_carry_text_timing_and_io(eng):
    steps = list(eng.generate("Hello there", max_tokens=6, greedy=True))
    assert [s.step for s in steps] == list(range(6))
    assert steps[0].fed == len(eng.encode("Hello there")) and all(s.fed == 1 for s in steps[1:])
    assert all(s.seconds > 0 for s in steps)
    assert steps[0].expert_requests > 0 and all(0 <= s.expert_hits <= s.expert_requests for s in steps)
    assert steps[-1].finish == "length" and all(s.finish is None for s in steps[:-1])
    text = "".join(s.text for s in steps)
    assert text == eng.tokenizer.decode([s.token for s in steps])
    assert steps[0].logits is not None and steps[0].logits.shape == (eng.cfg.vocab_size,)


def test_greedy_equals_the_model_and_the_cli(eng, model_dir, tmp_path):
    got = eng.generate(PROMPT, max_tokens=5, greedy=True, stream=False)
    # the model's own full recompute, argmax step by step
    seq = list(PROMPT)
    for _ in range(5):
        seq.append(int(torch.argmax(eng.model.forward(seq).reshape(-1))))
    assert got.tokens == seq[len(PROMPT):]
    assert got.prompt_ids == PROMPT and got.text == eng.tokenizer.decode(got.tokens)
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-m", "k3", "run", str(model_dir), "--ids", ",".join(map(str, PROMPT)),
                        "--gen", "5", "--greedy", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["generated_ids"] == got.tokens


def test_seeded_sampling_repeats_and_differs_from_greedy(eng):
    a = eng.generate(PROMPT, max_tokens=8, temperature=1.5, seed=11, stream=False).tokens
    b = eng.generate(PROMPT, max_tokens=8, temperature=1.5, seed=11, stream=False).tokens
    c = eng.generate(PROMPT, max_tokens=8, temperature=1.5, seed=12, stream=False).tokens
    assert a == b and a != c


def test_stop_ids_end_the_generation(eng):
    first = eng.generate(PROMPT, max_tokens=4, greedy=True, stream=False).tokens
    steps = list(eng.generate(PROMPT, max_tokens=4, greedy=True, stop_ids=[first[1]]))
    assert [s.token for s in steps] == first[:2] and steps[-1].finish == "stop"


def test_state_continues_a_sequence(eng):
    whole = eng.generate(PROMPT + [9, 10], max_tokens=3, greedy=True, stream=False).tokens
    st = eng.new_state()
    list(eng.decode(PROMPT, state=st, max_tokens=1))  # reads the prompt, samples one (not yet fed)
    assert st.ids == PROMPT
    cont = eng.generate([9, 10], state=st, max_tokens=3, greedy=True, stream=False).tokens
    assert cont == whole


def test_chat_helper_answers_and_keeps_state(eng):
    chat = eng.chat(system="Be brief.", max_tokens=5)
    r1 = chat.send("Hello!")
    r2 = chat.send("And again?")
    assert r1.tokens and r2.tokens and len(chat.messages) == 5  # system, user, assistant, user, assistant
    assert chat.state.ids == chat.seq[:len(chat.state.ids)]


def test_bad_requests_are_clear_errors(eng, model_dir):
    with pytest.raises(UsageError, match="max_context"):
        list(eng.generate(PROMPT, max_tokens=eng.max_context))
    with pytest.raises(UsageError, match="outside this model's vocabulary"):
        list(eng.generate([eng.cfg.vocab_size + 5], max_tokens=1))
    with pytest.raises(UsageError, match="unknown preset"):
        k3.load(model_dir, preset="huge")
    with pytest.raises(UsageError, match="not a folder"):
        k3.load(model_dir / "nope")
    with pytest.raises(K3Error, match="Raise --cache-gb"):
        k3.load(model_dir, cache_gb=1e-7)


def test_budgets_dataclass_is_accepted(model_dir):
    b = k3.Budgets(preset="auto", cache_gb=0.01)
    with k3.load(model_dir, budgets=b, max_context=64) as e:
        assert e.plan.cache_budget == int(0.01 * 1e9) and e.plan.preset == "custom"
        assert e.generate(PROMPT, max_tokens=2, greedy=True, stream=False).tokens
