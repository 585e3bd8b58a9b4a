"""The prompt cache (k3.prompt_cache): continuing from a snapshot another engine wrote
gives the bits of a fresh prefill; damaged, foreign and unwritable caches are a warning
and a miss, never a wrong token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import k3
from k3.decode import pieces_with_snapshots, prefill_pieces, set_threads
from k3.model.kda import CHUNK, CHUNK_MIN_T
from k3.prompt_cache import Prompt
from k3.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
CTX = 900


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("pc")
    return {"tiny": synthesize(d / "tiny", preset="tiny", arch="k3", seed=5),
            "pool": synthesize(d / "pool", preset="pool", arch="k3", seed=6)}


def _ids(n, salt):
    return [(7 * i + salt) % 1000 for i in range(n)]


def _fresh(model, ids, n=4):
    with k3.load(model, max_context=CTX) as eng:
        steps = list(eng.decode(list(ids), max_tokens=n))
    return steps[0].logits, [s.token for s in steps]


def _cached(model, folder, ids, n=4, every=256, warn=None):
    """Greedy decode with a prompt cache in ``folder``: (logits of the last prompt
    position, tokens, cached tokens, the cache)."""
    with k3.load(model, max_context=CTX) as eng:
        pc = eng.open_prompt_cache(folder, max_bytes=1 << 30, warn=warn or (lambda m: None))
        pc.every = every
        steps = list(eng.decode(ids, max_tokens=n))
    return steps[0].logits, [s.token for s in steps], steps[0].cached, pc


def test_snapshot_points_cut_pieces_only_where_the_kda_form_stays():
    for n in (40, 100, 300, 1000):
        for chunk in (32, 64, 256):
            for points in ([], [16], [32, 48], [64, 80, 96], [(n - 16) // 16 * 16], [(n - 32) // 16 * 16], list(range(16, n, 16))):
                pieces = pieces_with_snapshots(n, chunk, points)
                assert pieces[0][0] == 0 and pieces[-1][1] == n
                assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
                assert all(a % CHUNK == 0 for a, _ in pieces)
                assert all(b - a >= CHUNK_MIN_T for a, b in pieces)
                assert all(b - a <= chunk + CHUNK_MIN_T - 1 for a, b in pieces)
            assert pieces_with_snapshots(n, chunk) == prefill_pieces(n, chunk)
    assert [b for _, b in pieces_with_snapshots(300, 256, [80, 96, 160])][:2] == [80, 160]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("which", ["tiny", "pool"])
def test_continuing_from_another_engines_snapshot_is_a_fresh_prefill(models, tmp_path, which, threads):
    model = models[which]
    old = torch.get_num_threads()
    set_threads(threads)
    try:
        first = _ids(600, 3)
        _, _, cached, pc = _cached(model, tmp_path, first)   # snapshots at 256 and 512 (600 - 32 = 568)
        assert cached == 0 and pc.disk.writes == 2
        # another prompt sharing 530 tokens, with message boundaries at 300 and 790
        second = Prompt(first[:530] + _ids(330, 11), boundaries=[300, 790])
        logits, toks, cached, pc = _cached(model, tmp_path, second, every=1024)
        assert cached == 512 and pc.disk.writes == 1
        ref_logits, ref_toks = _fresh(model, second)
        assert torch.equal(logits, ref_logits) and toks == ref_toks
        # the boundary snapshot (768, the grid position at 790) was written and serves a third prompt
        third = list(second[:800]) + _ids(60, 17)
        logits, toks, cached, _ = _cached(model, tmp_path, third, every=1024)
        assert cached == 768
        ref_logits, ref_toks = _fresh(model, third)
        assert torch.equal(logits, ref_logits) and toks == ref_toks
    finally:
        set_threads(old)


def _run(model, folder, ids, out):
    (out.parent / f"{out.stem}.ids").write_text(",".join(map(str, ids)))
    r = subprocess.run([sys.executable, "-m", "k3", "run", str(model), "--ids", f"@{out.parent / f'{out.stem}.ids'}",
                        "--gen", "4", "--greedy", "--prompt-cache", str(folder), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text()), r.stderr


def test_k3_run_continues_from_what_an_earlier_run_left(models, tmp_path):
    """Two `k3 run --prompt-cache` processes: the second reads only what the first did
    not, reports it as cached_tokens, and gives the tokens of a fresh run."""
    folder = tmp_path / "cache"
    first = _ids(1100, 23)   # a snapshot at SNAPSHOT_EVERY = 1024
    r1, _ = _run(models["tiny"], folder, first, tmp_path / "r1.json")
    assert r1["cached_tokens"] == 0
    second = first[:1060] + _ids(40, 29)
    r2, _ = _run(models["tiny"], folder, second, tmp_path / "r2.json")
    assert r2["cached_tokens"] == 1024
    with k3.load(models["tiny"], max_context=1200) as eng:
        assert r2["generated_ids"] == [s.token for s in eng.decode(second, max_tokens=4)]


def test_a_damaged_entry_is_one_warning_then_removed(models, tmp_path):
    ids = _ids(600, 31)
    _cached(models["tiny"], tmp_path, ids)
    snaps = sorted(tmp_path.glob("k3pc-*/snap-*"), key=lambda p: p.stat().st_size)
    assert len(snaps) == 2
    victim = snaps[-1]    # the longest prefix's snapshot, cut short
    victim.write_bytes(victim.read_bytes()[:-100])
    seg = sorted(tmp_path.glob("k3pc-*/kv-*"))
    warnings = []
    logits, toks, cached, pc = _cached(models["tiny"], tmp_path, ids[:580] + _ids(40, 37), warn=warnings.append)
    # one of the two snapshots is damaged: the other serves (or none), never a wrong token
    assert cached in (0, 256) and len(warnings) == 1 and "damaged" in warnings[0] and "truncated" in warnings[0]
    assert not victim.exists() or victim.stat().st_size != 0
    ref_logits, ref_toks = _fresh(models["tiny"], ids[:580] + _ids(40, 37))
    assert torch.equal(logits, ref_logits) and toks == ref_toks
    # a flipped byte in a KV segment: the checksum refuses it
    for s in seg:
        b = bytearray(s.read_bytes())
        b[-1] ^= 0xFF
        s.write_bytes(bytes(b))
    warnings.clear()
    logits, toks, cached, _ = _cached(models["tiny"], tmp_path, ids[:580] + _ids(40, 37), warn=warnings.append)
    assert torch.equal(logits, ref_logits) and toks == ref_toks
    assert all("checksum" in w for w in warnings)


def test_another_checkpoint_never_uses_the_entries(models, tmp_path):
    ids = _ids(600, 41)
    _cached(models["tiny"], tmp_path, ids)
    assert _cached(models["tiny"], tmp_path, ids)[2] == 512
    shard = sorted(Path(models["tiny"]).glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))   # "re-downloaded": another checkpoint
    try:
        assert _cached(models["tiny"], tmp_path, ids)[2] == 0
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_folder_that_cannot_be_written_is_one_warning(models, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    warnings = []
    ids = _ids(600, 43)
    logits, toks, cached, pc = _cached(models["tiny"], blocker / "cache", ids, warn=warnings.append)
    assert cached == 0 and len(warnings) == 1 and "cannot be written" in warnings[0]
    ref_logits, ref_toks = _fresh(models["tiny"], ids)
    assert torch.equal(logits, ref_logits) and toks == ref_toks


def test_a_full_disk_stops_the_writes_with_one_warning(models, tmp_path, monkeypatch):
    from k3.errors import K3Error
    import k3.checkpoint.writer as writer

    def full(*a, **k):
        raise K3Error("x: could not write a prompt cache entry (No space left on device).")
    monkeypatch.setattr(writer, "write_safetensors", full)
    warnings = []
    _, toks, _, pc = _cached(models["tiny"], tmp_path, _ids(600, 47), warn=warnings.append)
    assert len(warnings) == 1 and "disk is full" in warnings[0] and not pc.disk.writable
    assert toks == _fresh(models["tiny"], _ids(600, 47))[1]


def test_the_budget_evicts_the_least_recently_used(models, tmp_path):
    _cached(models["tiny"], tmp_path, _ids(600, 53))
    files = [f for f in tmp_path.glob("k3pc-*/*")]
    total = sum(f.stat().st_size for f in files)
    with k3.load(models["tiny"], max_context=CTX) as eng:
        pc = eng.open_prompt_cache(tmp_path, max_bytes=total)
        pc.every = 256
        list(eng.decode(_ids(600, 59), max_tokens=1))
        assert pc.disk.evicted > 0
        assert sum(f.stat().st_size for f in tmp_path.glob("k3pc-*/*")) <= total
        assert pc.lookup(_ids(600, 59), CTX).cached == 512   # the newest stay


def test_a_chat_turn_continues_from_the_snapshots_of_its_messages(models, tmp_path):
    """k3 chat's session with a prompt cache: each turn is the bits of a fresh prefill of
    the conversation (the last answer re-read from the last snapshot); another session
    with the same system prompt starts from its snapshot."""
    system = " ".join(f"rule {i}: be brief." for i in range(80))
    with k3.load(models["tiny"], max_context=1500) as eng:
        eng.open_prompt_cache(tmp_path, max_bytes=1 << 30)
        s = eng.chat(system=system, max_tokens=6, thinking=False)
        r1 = s.send("hello there")
        assert r1.new_tokens == r1.prompt_len   # nothing kept yet
        r2 = s.send("and again")
        assert r2.new_tokens < r2.prompt_len - 200
        prompt2 = s.seq[:r2.prompt_len]
        other = eng.chat(system=system, max_tokens=6, thinking=False).send("something else")
        assert other.new_tokens <= other.prompt_len - 256
    with k3.load(models["tiny"], max_context=1500) as eng:
        fresh = [st.token for st in eng.decode(prompt2, max_tokens=len(r2.tokens), stop_ids=s.fmt.stop_ids)]
    assert r2.tokens == fresh


def test_flags_that_cannot_work_are_refused_before_loading(tmp_path):
    import argparse

    from k3.commands.common import check_prompt_cache_args
    from k3.errors import UsageError

    f = tmp_path / "file"
    f.write_text("")
    ns = dict(prompt_cache=str(tmp_path / "c"), prompt_cache_gb=1.0, load_state=None, incremental=True, batch=None)
    check_prompt_cache_args(argparse.Namespace(**ns))
    for bad, match in (({"prompt_cache": str(f)}, "that is a file"), ({"prompt_cache_gb": 0.0}, "must be > 0"),
                       ({"load_state": "s"}, "--load-state"), ({"incremental": False}, "--full-recompute")):
        with pytest.raises(UsageError, match=match):
            check_prompt_cache_args(argparse.Namespace(**{**ns, **bad}))


class _Loop:
    """The HTTP side's loop, as the scheduler's jobs see it: events land in a queue."""

    def call_soon_threadsafe(self, f, *a):
        f(*a)


def _serve_one(model, folder, prompt):
    """One request through a fresh server scheduler (a restart each call): its tokens,
    the cached count its end event reports, and the scheduler's metrics text."""
    import queue

    from k3.server.metrics import Metrics
    from k3.server.protocol import GenRequest
    from k3.server.scheduler import Job, Scheduler

    sched = Scheduler(lambda: k3.load(model, max_context=CTX, max_batch=2), max_queue=4, metrics=Metrics(),
                      prefix_entries=4, prompt_cache=str(folder), prompt_cache_bytes=1 << 30)
    sched.start()
    try:
        events = queue.Queue()
        job = Job(GenRequest("chat", prompt, 4, None, frozenset(), [], False, False, False), _Loop(), events)
        sched.submit(job)
        tokens = []
        while True:
            ev = events.get(timeout=300)
            assert ev["type"] != "error", ev
            tokens += ev.get("tokens", [])
            if ev["type"] == "end":
                return tokens, ev["cached"], sched.metrics.render("tiny")
    finally:
        sched.stop()


def test_a_restarted_server_continues_from_the_snapshots_of_the_last(models, tmp_path):
    first = Prompt(_ids(400, 61), boundaries=[300])
    _, cached, _ = _serve_one(models["tiny"], tmp_path, first)
    assert cached == 0
    second = Prompt(list(first[:310]) + _ids(90, 67), boundaries=[310])
    tokens, cached, text = _serve_one(models["tiny"], tmp_path, second)
    assert cached == 256 and tokens == _fresh(models["tiny"], second)[1]
    assert 'k3_prompt_cache_disk_total{model="tiny",op="reads"} 1' in text
    assert 'k3_prompt_tokens_cached_total{model="tiny"} 256' in text


def test_two_writers_sharing_a_folder_never_leave_a_half_entry(models, tmp_path):
    """Two writers (two servers on one folder) saving the same snapshots at once: every
    entry read back is whole and verified, and continuing from it is exact."""
    import threading

    from k3.prompt_cache.disk import DiskTier, checkpoint_identity

    ids = _ids(600, 71)
    with k3.load(models["tiny"], max_context=CTX) as eng:
        st = eng.new_state()
        list(eng.decode(ids[:512], state=st, max_tokens=1))
        assert st.position == 512
        ident = checkpoint_identity(models["tiny"], eng.cfg, eng.n_layers, True)
        tiers = [DiskTier(tmp_path, ident, eng.cfg, eng.n_layers, True, 1 << 30, print) for _ in range(2)]
        errors = []

        def write(t):
            try:
                for _ in range(10):
                    assert t.save(st, None) is not None
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and not list(tmp_path.glob("k3pc-*/.*"))
        got = DiskTier(tmp_path, ident, eng.cfg, eng.n_layers, True, 1 << 30, print).lookup(ids, [512], CTX)
        assert got is not None and got[0] == 512
        for a, b in zip(got[1].layers, st.layers):
            for k in ("conv_q", "conv_k", "conv_v", "S", "k", "v"):
                if hasattr(a, k) and getattr(a, k) is not None:
                    assert torch.equal(getattr(a, k), getattr(b, k)), k


def test_k3_serve_reports_disk_hits_in_both_apis_after_a_restart(models, tmp_path):
    """`k3 serve --prompt-cache DIR --prefix-cache 0`, restarted: a chat with the same
    system prompt continues from the first server's snapshot, reported as OpenAI's
    cached_tokens and Anthropic's cache_read_input_tokens, with a fresh prefill's tokens."""
    import anthropic
    from test_server import ServerProc

    from k3.chat_format import chat_format_for
    from k3.config import load_config
    from k3.tokenizer import Tokenizer

    model = models["tiny"]
    system = " ".join(f"rule {i}: be brief." for i in range(25))
    args = ("--prompt-cache", str(tmp_path / "pc"), "--prefix-cache", "0", "--max-context", "1024")
    fmt = chat_format_for(Tokenizer(model), load_config(model))

    def ask(s, text):
        m = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        r = s.client().chat.completions.create(model="tiny", messages=m, max_tokens=4, temperature=0,
                                               extra_body={"return_token_ids": True})
        assert r.usage.prompt_tokens == len(fmt.prompt_ids(m))
        return r, fmt.prompt_ids(m)

    s = ServerProc(model, *args)
    try:
        r, _ = ask(s, "first")
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert s.stop() == 0, "".join(s.err)
    s = ServerProc(model, *args)
    try:
        r, p = ask(s, "second")
        assert r.usage.prompt_tokens_details.cached_tokens >= 256
        with k3.load(model, max_context=1024) as eng:
            assert r.choices[0].token_ids == [st.token for st in eng.decode(p, max_tokens=4, stop_ids=fmt.stop_ids)]
        a = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=120).messages.create(
            model="tiny", system=system, messages=[{"role": "user", "content": "third"}], max_tokens=4)
        assert a.usage.cache_read_input_tokens >= 256
        from test_server import metrics
        assert metrics(s)['k3_prompt_cache_disk_total{op="reads"}'] >= 2
    finally:
        assert s.stop() == 0, "".join(s.err)
