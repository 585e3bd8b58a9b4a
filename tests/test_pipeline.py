"""A pipeline over several processes (k3.pipeline): ranks started as torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1), gloo on loopback only. Every rank's
tokens and first-step logits must be those of one process, bit for bit."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import k3
from k3.config import load_config
from k3.errors import EXIT_PIPELINE, PipelineError
from k3.pipeline import MICRO_TOKENS, _split, assign_layers, carry_bytes
from k3.synth import synthesize

PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rank_env(r: int, world: int, port: int) -> dict:
    env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("K3_DEBUG", None)
    return env


def start(world: int, argv_of, tmp_path):
    port = free_port()
    procs = []
    for r in range(world):
        err = open(tmp_path / f"err{r}.txt", "w+")
        procs.append((subprocess.Popen([sys.executable, "-m", "k3"] + argv_of(r), env=rank_env(r, world, port),
                                       stdout=subprocess.PIPE, stderr=err, text=True), err))
    return procs


def finish(procs, timeout=300):
    out = []
    for p, err in procs:
        try:
            o, _ = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
        err.seek(0)
        out.append((p.returncode, o, err.read()))
    return out


def run_ranks(world, argv, tmp_path, timeout=300):
    return finish(start(world, lambda r: argv, tmp_path), timeout)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(preset, arch):
        if (preset, arch) not in made:
            made[preset, arch] = synthesize(tmp_path_factory.mktemp(f"{preset}-{arch}") / "m", preset=preset,
                                            arch=arch, seed=21)
        return made[preset, arch]
    return get


def reference(model, gen, spec=0):
    """One process, through the Python API: tokens and first-step logits."""
    with k3.load(model, max_context=len(PROMPT) + gen + spec + 1, spec=spec, threads=1) as eng:
        steps = list(eng.generate(PROMPT, max_tokens=gen, greedy=True, spec=spec))
    return [s.token for s in steps], steps[0].logits.numpy()


# Three ranks of the small models (~25 s each on a slow 2-core host) add nothing the
# tiny three-rank and small two-rank cases do not cover, nor do two ranks of the tiny
# models (the small ones of each arch run two): run with the slow tests. The fast cases
# hold every (preset, arch) and every (arch, ranks) pair.
CASES = [pytest.param("tiny", "k3", 2, marks=pytest.mark.slow), ("tiny", "k3", 3),
         pytest.param("tiny", "kimi_linear", 2, marks=pytest.mark.slow), ("tiny", "kimi_linear", 3),
         ("small", "k3", 2), ("small", "kimi_linear", 2),
         pytest.param("small", "k3", 3, marks=pytest.mark.slow), pytest.param("small", "kimi_linear", 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("preset,arch,world", CASES)
def test_pipeline_matches_one_process(models, tmp_path, preset, arch, world, monkeypatch):
    """Incremental decode, then exact speculative decoding (--spec 4, a prompt that
    repeats so that drafts are made and kept; every draft read, as the pass cost model
    would read none on a tiny model): tokens and first-step logits equal."""
    monkeypatch.setenv("K3_SPEC_EVERY_DRAFT", "1")
    model = models(preset, arch)
    gen = 12
    want, want_logits = reference(model, gen)
    corpus = tmp_path / "own.ids"  # the continuation itself: drafts that the model keeps
    corpus.write_text(" ".join(map(str, PROMPT + want)))
    for spec in (0, 4):
        out = tmp_path / f"out{spec}.json"
        lg = tmp_path / f"logits{spec}.bin"
        argv = ["run", str(model), "--ids", ",".join(map(str, PROMPT)), "--gen", str(gen), "--greedy", "--threads",
                "1", "--out", str(out), "--dump-logits", str(lg), "--pipeline-timeout", "60"] + \
            (["--spec", str(spec), "--spec-corpus", str(corpus)] if spec else [])
        res = run_ranks(world, argv, tmp_path)
        for r, (code, _, err) in enumerate(res):
            assert code == 0, f"rank {r} exit {code}: {err[-2000:]}"
        got = json.loads(out.read_text())
        assert got["generated_ids"] == want, f"spec={spec}"
        np.testing.assert_array_equal(np.fromfile(lg, dtype="<f4"), want_logits)
        pipe = got["pipeline"]
        assert pipe["world_size"] == world
        layers = [tuple(r["layers"]) for r in pipe["ranks"]]
        assert layers[0][0] == 0 and layers[-1][1] == load_config(model).num_hidden_layers
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(layers, layers[1:]))
        assert pipe["net_bytes"] > 0
        if not spec:  # a decode step sends one token's carry across every boundary and back (+ small headers)
            cfg = load_config(model)
            carry = sum(carry_bytes(cfg, hi) for _, hi in layers)
            assert pipe["carry_bytes_per_token"] == carry
            for st in got["steps"][1:]:
                assert carry <= st["net_bytes"] <= carry + 1024 * world
        if spec:
            assert got["spec"]["accepted"] > 0  # drafts were verified across the ranks and kept
        assert "pipeline:" in res[0][2] and all(not e.strip() for _, _, e in res[1:])  # rank 0 speaks alone


def test_pipeline_batch_micro_batches(models, tmp_path):
    """Three sequences on two ranks: their prefill (more than MICRO_TOKENS tokens) goes
    as micro-batches, their decode passes whole; each gets its tokens alone."""
    model = models("tiny", "k3")
    prompts = [PROMPT * 3, [9, 8, 7] * 10, [1, 2, 3, 4, 5, 6] * 2]
    assert sum(map(len, prompts)) >= MICRO_TOKENS
    want = []
    for p in prompts:
        with k3.load(model, max_context=64, threads=1) as eng:
            want.append([s.token for s in eng.generate(p, max_tokens=6, greedy=True)])
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"ids": p, "max_tokens": 6}) + "\n" for p in prompts))
    out = tmp_path / "batch.json"
    res = run_ranks(2, ["run", str(model), "--batch", str(jobs), "--greedy", "--threads", "1", "--out", str(out),
                        "--pipeline-timeout", "60"], tmp_path)
    assert [c for c, _, _ in res] == [0, 0], res[0][2][-2000:] + res[1][2][-2000:]
    got = json.loads(out.read_text())
    assert [s["generated_ids"] for s in got["sequences"]] == want
    assert got["pipeline"]["micro_batched_passes"] == 1  # the prefill; decode passes go whole


def test_rank_with_other_checkpoint_is_refused(models, tmp_path):
    a = models("tiny", "k3")
    b = synthesize(tmp_path / "other", preset="tiny", arch="k3", seed=22)  # same shapes, other weights
    res = finish(start(2, lambda r: ["run", str(a if r == 0 else b), "--ids", "1,2,3", "--gen", "2", "--threads",
                                     "1", "--pipeline-timeout", "60"], tmp_path))
    assert [c for c, _, _ in res] == [EXIT_PIPELINE, EXIT_PIPELINE]
    assert "rank 1" in res[0][2] and "checkpoint" in res[0][2] and "Traceback" not in res[0][2]


def _wait_for(path, text, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.mark.realtime   # the other ranks must stop within their --pipeline-timeout
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_lost_rank_stops_the_others(models, tmp_path, how):
    """A rank killed (or stopped) mid-run: the others stop within the timeout, exit 5,
    one message, no --out result."""
    model = models("tiny", "kimi_linear")
    out = tmp_path / "out.json"
    timeout = 8
    procs = start(3, lambda r: ["run", str(model), "--ids", "1,2,3", "--gen", "4000", "--threads", "1", "--greedy",
                                "--out", str(out), "--pipeline-timeout", str(timeout), "-v"], tmp_path)
    try:
        _wait_for(tmp_path / "err0.txt", "STEP")  # rank 0 is decoding
        time.sleep(1.0)
        victim = procs[1][0]
        t0 = time.time()
        victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        for r in (0, 2):
            procs[r][0].wait(timeout=timeout * 3 + 10)
        took = time.time() - t0
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    res = finish(procs, 30)
    assert res[0][0] == EXIT_PIPELINE and res[2][0] == EXIT_PIPELINE, (res[0][2][-1500:], res[2][2][-1500:])
    assert took < timeout * 2.5 + 5
    assert "lost contact" in res[0][2] and "Traceback" not in res[0][2]
    assert not out.exists()


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(
    sys.executable), "torchrun")), reason="torchrun not installed")
def test_torchrun_two_nodes(models, tmp_path):
    """The documented launch: two torchrun agents (--nnodes 2) meeting at one endpoint."""
    model = models("tiny", "k3")
    want, _ = reference(model, 6)
    port = free_port()
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    outs = [tmp_path / f"o{r}.json" for r in range(2)]
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        procs.append(subprocess.Popen(
            [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", "k3test", "--max-restarts", "0", "-m", "k3", "run", str(model),
             "--ids", ",".join(map(str, PROMPT)), "--gen", "6", "--greedy", "--threads", "1", "--out",
             str(outs[r]), "--pipeline-timeout", "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    res = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], res
    written = [json.loads(o.read_text()) for o in outs if o.exists()]
    assert len(written) == 1 and written[0]["generated_ids"] == want  # rank 0 alone writes --out


# ---------------------------------------------------------------- the layer assignment
def test_assign_layers_even_when_everything_fits():
    r = assign_layers([10] * 12, [1000, 1000, 1000])
    assert [len(x) for x in r] == [4, 4, 4] and r[0].start == 0 and r[-1].stop == 12


def test_assign_layers_by_room():
    # rank 1 has room for 3 layers only, rank 0 for 9: nothing streams
    r = assign_layers([10] * 12, [90, 30])
    assert [len(x) for x in r] == [9, 3]


def test_assign_layers_minimises_the_slowest_stream():
    # 120 bytes in all, room for 40 + 40: 40 must stream; split it evenly (20 + 20)
    r = assign_layers([10] * 12, [40, 40])
    assert [len(x) for x in r] == [6, 6]


def test_assign_layers_needs_a_layer_per_rank():
    with pytest.raises(PipelineError):
        assign_layers([1, 2], [10, 10, 10])


def test_carry_bytes():
    class C:
        hidden_size = 8
        attn_res_block_size = 4
    assert carry_bytes(C, 0) == 8 * 4  # P only
    assert carry_bytes(C, 1) == 2 * 8 * 4  # the embedding entered the bank at layer 0
    assert carry_bytes(C, 5) == 3 * 8 * 4
    C.attn_res_block_size = None
    assert carry_bytes(C, 5, tokens=3) == 3 * 8 * 4


@pytest.mark.realtime   # idle past its --pipeline-timeout, then served within timeouts
def test_serve_over_two_ranks(models, tmp_path):
    """`k3 serve` the same way: rank 0 answers HTTP, rank 1 runs its layers; the tokens
    are one process's. Idle for longer than the timeout, the ranks stay up (rank 0
    pings the ring). Ctrl-C on rank 0 stops both."""
    import urllib.request
    model = models("tiny", "kimi_linear")
    want, _ = reference(model, 6)
    port = free_port()
    procs = start(2, lambda r: ["serve", str(model), "--port", str(port), "--host", "127.0.0.1", "--threads", "1",
                                "--max-context", "64", "--pipeline-timeout", "6"], tmp_path)
    try:
        _wait_for(tmp_path / "err0.txt", "k3 serve:", timeout=120)
        time.sleep(15)  # idle: past the timeout
        assert procs[1][0].poll() is None
        t0 = time.time()
        while True:
            try:
                body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                   "return_token_ids": True}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    got = json.loads(r.read())
                break
            except OSError:
                if time.time() - t0 > 60:
                    raise
                time.sleep(0.2)
        assert got["choices"][0]["token_ids"] == want
        procs[0][0].send_signal(signal.SIGINT)
        res = finish(procs, 60)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    assert [c for c, _, _ in res] == [0, 0], (res[0][2][-1500:], res[1][2][-1500:])


@pytest.mark.parametrize("flag,value", [("--stage-budget", "0"), ("--stage-budget", "nan"),
                                        ("--pipeline-timeout", "0"), ("--pipeline-timeout", "-5")])
def test_bad_pipeline_flags_are_usage_errors(models, capsys, flag, value):
    from k3.cli import main
    from k3.errors import EXIT_USAGE
    code = main(["run", str(models("tiny", "k3")), "--ids", "1,2", "--gen", "1", flag, value])
    assert code == EXIT_USAGE
    assert flag in capsys.readouterr().err


def test_pipeline_full_recompute_and_streamed_tables(models, tmp_path):
    """Full recompute (a fresh state on every rank each step) with the model tables
    streamed on rank 0 (--ultra-low-memory): still one process's tokens."""
    model = models("tiny", "kimi_linear")
    want, _ = reference(model, 6)
    out = tmp_path / "o.json"
    res = run_ranks(2, ["run", str(model), "--ids", ",".join(map(str, PROMPT)), "--gen", "6", "--greedy",
                        "--threads", "1", "--full-recompute", "--ultra-low-memory", "--out", str(out),
                        "--pipeline-timeout", "60"], tmp_path)
    assert [c for c, _, _ in res] == [0, 0], res[0][2][-1500:] + res[1][2][-1500:]
    assert json.loads(out.read_text())["generated_ids"] == want


def test_split_keeps_sequences_whole_and_in_order():
    b = [([1] * n, None) for n in (5, 1, 7, 2, 3)]
    for parts in (1, 2, 3, 5, 8):
        g = _split(b, parts)
        assert len(g) == min(parts, len(b)) and [x for grp in g for x in grp] == b


def test_non_finite_numbers_on_another_rank_are_named(models, tmp_path):
    """A NaN in a layer held by rank 1 of 3: rank 0 stops with the usual refusal (exit 1)
    naming the rank and the layer, writes nothing, and the other ranks are told to stop."""
    from test_reliability import _poison
    bad = _poison(models("tiny", "k3"), "layers.2.self_attn.o_proj.weight", tmp_path / "bad")
    out = tmp_path / "r.json"
    res = run_ranks(3, ["run", str(bad), "--ids", ",".join(map(str, PROMPT)), "--gen", "3", "--threads", "1",
                        "--greedy", "--out", str(out), "--pipeline-timeout", "60"], tmp_path)
    assert res[0][0] == 1, res[0][2][-1500:]
    err = res[0][2]
    assert "after layer 2" in err and "NaN or inf" in err and "rank 1" in err and "Traceback" not in err
    assert [c for c, _, _ in res[1:]] == [0, 0] and not out.exists()
