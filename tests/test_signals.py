"""Ctrl-C and SIGTERM at any moment of a run (k3.interrupt): the documented exit code
(130 / 143), never "internal error" or a traceback, no --out from an interrupted run
unless its writes had begun (then whole), a --save-state file whole or absent.

The moments are spread over one uninterrupted run of the same command (its wall time
measured first): from k3's first line (its handlers in), through loading, the prefill's pieces
and the compiled decode regions, to the writes at the end. Processes share one small
synthetic checkpoint and this process's warm kernel cache; two run at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines import own_cache
from k3.config import load_config
from k3.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
#: the moments are fractions of a measured run: another test beside it would skew them
pytestmark = pytest.mark.realtime
GEN = 60
#: 600 ids: three prefill pieces of 256 or fewer, then GEN decode steps
IDS = ",".join(str(i * 7 % 1000) for i in range(600))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("sig") / "m", preset="tiny", arch="k3", seed=9)


def _env(tmp: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", K3_CACHE=str(own_cache(tmp / "cache")))


def _start(model, d: Path, env) -> tuple[subprocess.Popen, str, float]:
    """The run started, once k3 speaks (its first line on stderr: its handlers are in;
    before, the interpreter is starting and Python's own handling applies,
    docs/RELIABILITY.md): (process, that line, when it came)."""
    d.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "k3", "run", str(model), "--ids", IDS, "--gen", str(GEN), "--greedy",
                          "--save-state", str(d / "s.k3state"), "--out", str(d / "o.json")], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = p.stderr.readline()
    return p, first, time.perf_counter()


def _check_files(model, d: Path) -> dict:
    """What the run left: --out absent or whole (every token), the state file absent or
    loadable, nothing half-written beside them."""
    from k3.state import load_state
    out, st = d / "o.json", d / "s.k3state"
    assert not [f for f in os.listdir(d) if ".tmp-" in f]
    got = {"out": out.exists(), "state": st.exists()}
    if got["out"]:
        assert len(json.loads(out.read_text())["generated_ids"]) == GEN
        assert got["state"]  # the state file is written before --out
    if got["state"]:
        loaded = load_state(st, load_config(model))
        assert len(loaded.tokens) == 600 + GEN and len(loaded.pending) == 1
    return got


def _moments(model, tmp: Path, n: int) -> None:
    env = _env(tmp)
    p, _, t0 = _start(model, tmp / "whole", env)
    _, err = p.communicate(timeout=300)
    whole = time.perf_counter() - t0
    assert p.returncode == 0, err[-2000:]
    assert _check_files(model, tmp / "whole") == {"out": True, "state": True}
    moments = [whole * k / (n - 1) for k in range(n)]
    seen = []
    for pair in range(0, n, 2):
        runs = []
        for k in range(pair, min(n, pair + 2)):
            sig = signal.SIGINT if k % 2 == 0 else signal.SIGTERM
            d = tmp / f"m{k}"
            runs.append((k, sig, d, *_start(model, d, env)))
        for k, sig, d, p, _, started in sorted(runs, key=lambda r: moments[r[0]]):
            time.sleep(max(0.0, started + moments[k] - time.perf_counter()))
            finished_before = p.poll() is not None
            if not finished_before:
                p.send_signal(sig)
        for k, sig, d, p, first, _ in runs:
            _, err = p.communicate(timeout=300)
            err = first + err
            where = f"moment {k} ({moments[k]:.2f} s of {whole:.2f} s, {sig.name}): exit {p.returncode}\n{err[-2000:]}"
            assert "internal error" not in err and "Traceback" not in err, where
            if p.returncode == 0:  # it had ended before the signal was sent
                assert _check_files(model, d) == {"out": True, "state": True}, where
                seen.append("done")
                continue
            assert p.returncode == (130 if sig == signal.SIGINT else 143), where
            assert ("interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)") in err, where
            files = _check_files(model, d)
            seen.append("written" if files["out"] else "nothing")
    # the moments reached the run's inside, not only its start or end
    assert seen.count("nothing") >= n // 3, seen


def test_a_signal_at_ten_moments_of_a_run(model, tmp_path):
    _moments(model, tmp_path, 10)


@pytest.mark.slow
def test_a_signal_at_thirty_moments_of_a_run(model, tmp_path):
    _moments(model, tmp_path, 30)


# ---------------------------------------------------------------- k3 chat
pexpect = pytest.importorskip("pexpect")


def test_chat_ctrl_c_and_sigterm_mid_answer(model, tmp_path):
    """Ctrl-C during answers (twice at once too) stops each and the chat goes on; a
    SIGTERM mid-answer ends it with 143; --save-state is not written by the SIGTERM."""
    state = tmp_path / "c.k3state"
    child = pexpect.spawn(sys.executable, ["-m", "k3", "chat", str(model), "--max-tokens", "100000",
                                           "--max-context", "200000", "--no-history", "--seed", "11",
                                           "--save-state", str(state)],
                          cwd=str(ROOT), env=dict(_env(tmp_path), TERM="dumb"), encoding="utf-8", timeout=120,
                          dimensions=(40, 200))
    try:
        for times in (1, 2, 1):
            child.expect(">>> ")
            child.sendline("Write forever.")
            child.expect(r"\[think\] ")
            child.expect(r"\S{4}")
            for _ in range(times):
                child.sendintr()
            child.expect(r"\[\d+ tokens, .* - interrupted\]")
        child.expect(">>> ")
        child.sendline("Write forever.")
        child.expect(r"\[think\] ")
        child.expect(r"\S{4}")
        child.kill(signal.SIGTERM)
        child.expect(pexpect.EOF)
        text = child.before
    finally:
        child.close()
    assert child.exitstatus == 143, text
    assert "internal error" not in text and "Traceback" not in text and "terminated" in text
    assert not state.exists() and not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


# ---------------------------------------------------------------- k3 serve
def test_serve_signals_while_loading_and_listening(model, tmp_path):
    """While loading (before it listens): 130 / 143; once listening, a drained stop (0)."""
    env = _env(tmp_path)
    args = [sys.executable, "-m", "k3", "serve", str(model), "--port", "0"]
    for delay, sig, want in ((0.5, signal.SIGTERM, 143), (1.5, signal.SIGINT, 130)):
        p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(delay)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
        assert "internal error" not in err and "Traceback" not in err, err[-2000:]
        assert p.returncode == want or (p.returncode == 0 and "listening" in out), (delay, p.returncode, err[-2000:])
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert "listening on" in p.stdout.readline()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "stopped" in err and "Traceback" not in err, err[-2000:]
