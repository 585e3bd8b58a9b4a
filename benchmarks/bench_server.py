"""`k3 serve` under concurrent load: aggregate tokens/s, requests/s and time to first
token at 1, 4 and 16 concurrent clients (docs/SERVER.md, issue 12).

Starts one `k3 serve MODEL --max-batch B --prefix-cache 0 --greedy` on loopback
(optionally inside a fresh cgroup-v1 memory group with a hard ceiling, as
benchlib.run_k3 does; the group is removed afterwards), warms it up, then per rep runs
each arm once, arms in alternating order. An arm: C clients each send one streamed
(SSE) /v1/completions request at the same moment (a distinct token-id prompt of
--prompt-tokens ids each, temperature 0 so the answers are deterministic, `max_tokens`
N). Per request it measures

* time to first token (TTFT) = send -> the first chunk carrying a generated token
  (`return_token_ids` makes every generated token arrive in a chunk, even one whose text
  is still held back), prefill and queueing included;
* latency = send -> `data: [DONE]`; completion tokens from the last chunk's `usage`
  (`stream_options.include_usage`), checked against the token ids streamed.

Per arm: aggregate tok/s = completion tokens of all C answers / wall time from the
first send to the last answer; requests/s = C / that wall time; mean TTFT; mean
latency; mean inter-token latency after the first token; mean batch per pass (from
/metrics). One TSV row per rep and arm (CPU model and SIMD flags, the serve flags,
the cgroup's peak usage and failcnt in every row) goes to
benchmarks/results/server-ttft.tsv; a markdown table of arm means +- sd and spread over
reps is printed at the end.

    python benchmarks/bench_server.py                               # a tiny synthetic K3 model, 3 reps
    python benchmarks/bench_server.py --synth small --clients 1,8
    python benchmarks/bench_server.py --model /work/rd4 --trunk /work/rd4-trunk --ceiling-gb 8 \\
        --clients 1,4,16 --reps 3 --max-tokens 32

``--constrained`` runs every client count twice, free and with the answer constrained
to JSON (``response_format`` json_schema: an object holding one long string, so both
kinds run to ``max_tokens``), the kinds alternating: the per-token cost of the mask is
the difference of their inter-token latencies. ``--tools`` adds two chat kinds: 6
agent-shaped tools under ``tool_choice: auto`` (the whole answer under K3's answer
grammar, k3.answer_grammar), and the same tools' declaration sent as plain system text
without ``tools`` (a free answer from a prompt of about the same length).

    python benchmarks/bench_server.py --synth small --clients 1,8 --constrained --tools --reps 3

(benchmarks/results/server.tsv holds the older 1-vs-8-client rows, non-streamed, without TTFT.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (CGROUP_V1, GB, RESULTS, ROOT, Tsv, _read_int, cgroup_available, cpu_flags,  # noqa: E402
                      loadavg, mean_sd_spread, table)

SYNTH_PRESETS = ("tiny", "small")  # realdims: synthesize it once (k3 synth) and pass --model
COLS = ["arm", "clients", "rep", "requests", "errors", "tokens", "seconds", "tok_s", "req_s", "ttft_mean_s",
        "ttft_p50_s", "ttft_max_s", "mean_latency_s", "itl_mean_s", "passes", "mean_batch", "prompt_tokens",
        "max_tokens", "max_batch", "max_context", "ceiling_gb", "cg_max_gb", "cg_failcnt", "serve_flags", "load1",
        "cpu", "model", "flags"]


# ---------------------------------------------------------------- the server
class Serve:
    """`k3 serve MODEL --port 0 ...` (in a fresh memory cgroup with ``ceiling_gb``) until
    it prints its URL; stderr goes to a log file."""

    def __init__(self, model: str, flags: list[str], *, ceiling_gb: float | None, log_path: Path,
                 start_timeout: float = 3600):
        self.group = None
        self.log_path = log_path
        cmd = [sys.executable, "-m", "k3", "serve", model, "--port", "0", *flags]
        if ceiling_gb is not None:
            if not cgroup_available():
                raise SystemExit("--ceiling-gb: the cgroup v1 memory controller is not writable here "
                                 f"({CGROUP_V1}); run as root or drop --ceiling-gb")
            self.group = CGROUP_V1 / f"k3serve_{os.getpid()}_{int(time.time() * 1000) % 10**9}"
            self.group.mkdir()
            (self.group / "memory.limit_in_bytes").write_text(str(int(ceiling_gb * (1 << 30))))
            cmd = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.group), *cmd]
        self.cmd = cmd
        self.log = open(log_path, "w")  # noqa: SIM115 (open while the server runs; closed in close())
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"))
        self.url = None
        timer = threading.Timer(start_timeout, self.p.kill)
        timer.start()
        try:
            for line in iter(self.p.stdout.readline, ""):
                m = re.search(r"listening on (http://\S+)/v1", line)
                if m:
                    self.url = m.group(1)
                    break
        finally:
            timer.cancel()
        if self.url is None:
            self.p.wait(60)
            tail = self.log_tail()
            self.close()
            why = " (SIGKILL: the OOM killer, most likely, under the memory ceiling)" if (
                self.p.returncode == -9 and ceiling_gb is not None) else ""
            raise SystemExit(f"k3 serve did not start (exit {self.p.returncode}){why}:\n{tail}")
        threading.Thread(target=lambda: [None for _ in iter(self.p.stdout.readline, "")], daemon=True).start()

    def alive(self) -> bool:
        return self.p.poll() is None

    def log_tail(self, n: int = 1500) -> str:
        self.log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cgroup(self) -> tuple[float | None, int | None]:
        """(peak usage since the group was made in GB, failcnt), or (None, None)."""
        if self.group is None:
            return None, None
        mx = _read_int(self.group / "memory.max_usage_in_bytes")
        return (mx / GB if mx is not None else None), _read_int(self.group / "memory.failcnt")

    def close(self) -> tuple[float | None, int | None]:
        """Ctrl-C (drain and stop), then the cgroup's figures and the group removed."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(120)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(30)
        self.log.close()
        figures = self.cgroup()
        if self.group is not None:
            for _ in range(100):
                try:
                    self.group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                print(f"warning: could not remove the cgroup {self.group}", file=sys.stderr)
            self.group = None
        return figures


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" in line:
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# ---------------------------------------------------------------- one streamed request
def stream_completion(url: str, body: dict, timeout: float, endpoint: str = "completions") -> dict:
    """POST a streamed /v1/completions (or /v1/chat/completions) and read its SSE events
    as they come.

    Returns {"ttft", "latency", "tokens" (usage.completion_tokens), "ids" (the token ids
    streamed), "token_times" (arrival of each chunk with ids), "finish"}; raises on an
    HTTP error, an error event, or a stream without usage."""
    body = dict(body, stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    path = "chat/completions" if endpoint == "chat" else "completions"
    req = urllib.request.Request(f"{url}/v1/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    times: list[float] = []
    usage = finish = None
    done = False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error'].get('message')}")
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices") or []:
                got = c.get("token_ids") or []
                if got or c.get("text"):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    if got:
                        ids += got
                        times.append(now)
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
    latency = time.perf_counter() - t0
    if not done or usage is None:
        raise RuntimeError("the stream ended without usage and [DONE]")
    if usage["completion_tokens"] != len(ids):
        raise RuntimeError(f"usage says {usage['completion_tokens']} tokens, {len(ids)} streamed")
    return {"ttft": ttft if ttft is not None else latency, "latency": latency, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"], "ids": ids, "token_times": times, "finish": finish}


def prompt_ids(n: int, vocab: int, avoid: set[int], key: int) -> list[int]:
    """A deterministic token-id prompt of ``n`` ordinary ids (no tokenizer needed: the
    realdims synths have none)."""
    rng = random.Random(key)
    hi = min(vocab, 2000)
    out = []
    while len(out) < n:
        t = rng.randrange(1, hi)
        if t not in avoid:
            out.append(t)
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


#: the constrained arms' JSON: one string long enough that most answers run to max_tokens
#: (a pattern: large minLength / minItems bounds make the grammar itself slow to build)
LONG_JSON = {"type": "json_schema", "json_schema": {"name": "text", "schema": {
    "type": "object", "required": ["text"], "additionalProperties": False,
    "properties": {"text": {"type": "string", "pattern": "^[a-z ]{40,}$"}}}}}


def agent_tools(n: int = 6) -> list[dict]:
    """``n`` tools shaped like a coding agent's (a few typed arguments, some optional)."""
    params = {"type": "object", "additionalProperties": False, "required": ["path", "mode"],
              "properties": {"path": {"type": "string"}, "mode": {"enum": ["read", "write", "append"]},
                             "line": {"type": "integer", "minimum": 0}, "dry_run": {"type": "boolean"},
                             "globs": {"type": "array", "items": {"type": "string"}}}}
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}.",
                                              "parameters": params}} for i in range(n)]


#: the kinds of request an arm sends: (endpoint, label)
KINDS = {"free": ("completions", ""), "json": ("completions", " JSON"), "chat": ("chat", " chat"),
         "tools": ("chat", " tools")}


def request_body(kind: str, name: str, rep: int, i: int, a, vocab: int, avoid: set[int]) -> dict:
    body = {"model": name, "max_tokens": a.max_tokens, "temperature": a.temperature, "seed": 1000 * rep + i}
    if KINDS[kind][0] == "completions":
        body["prompt"] = prompt_ids(a.prompt_tokens, vocab, avoid, 7919 * rep + i)
        if kind == "json":
            body["response_format"] = LONG_JSON
        return body
    user = {"role": "user", "content": f"Request {rep}.{i}: look at the files and fix the failing test."}
    if kind == "tools":
        return dict(body, messages=[user], tools=agent_tools(), tool_choice="auto")
    declared = json.dumps(agent_tools(), sort_keys=True, separators=(",", ":"))
    return dict(body, messages=[{"role": "system", "content": "# Tools\n" + declared}, user])


def arm(srv: Serve, name: str, clients: int, rep: int, a, vocab: int, avoid: set[int], kind: str = "free") -> dict:
    res: list = [None] * clients
    go = threading.Barrier(clients + 1)

    def one(i):
        body = request_body(kind, name, rep, i, a, vocab, avoid)
        go.wait()
        try:
            res[i] = stream_completion(srv.url, body, a.timeout, KINDS[kind][0])
        except urllib.error.HTTPError as e:
            res[i] = RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
        except (OSError, RuntimeError, ValueError, urllib.error.URLError) as e:
            res[i] = e

    m0 = scrape(srv.url)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in res if isinstance(r, dict)]
    errs = [r for r in res if not isinstance(r, dict)]
    for e in errs[:3]:
        print(f"  request failed: {type(e).__name__}: {e}", file=sys.stderr)
    try:
        m1 = scrape(srv.url)
        passes = m1["k3_passes_total"] - m0["k3_passes_total"]
        seqs = m1["k3_batch_sequences_total"] - m0["k3_batch_sequences_total"]
    except (OSError, KeyError):
        passes = seqs = 0
    tokens = sum(r["tokens"] for r in ok)
    ttfts = [r["ttft"] for r in ok]
    itl = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
           for r in ok if len(r["token_times"]) > 1]
    nan = float("nan")
    return {"clients": clients, "requests": clients, "errors": len(errs), "tokens": tokens, "seconds": wall,
            "tok_s": tokens / wall, "req_s": len(ok) / wall,
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else nan,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_max_s": max(ttfts) if ttfts else nan,
            "mean_latency_s": sum(r["latency"] for r in ok) / len(ok) if ok else nan,
            "itl_mean_s": sum(itl) / len(itl) if itl else nan,
            "passes": int(passes), "mean_batch": seqs / passes if passes else 0.0,
            "ids": [r["ids"] if isinstance(r, dict) else None for r in res]}


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: synthesize one with --synth)")
    ap.add_argument("--synth", default="tiny", choices=SYNTH_PRESETS,
                    help="without --model: the synthetic preset to make (seed 1; default tiny)")
    ap.add_argument("--trunk", metavar="DIR", help="packed trunk, passed to k3 serve --trunk")
    ap.add_argument("--preset", metavar="NAME", help="memory preset, passed to k3 serve --preset (for backward "
                    "compatibility tiny/small without --model mean --synth)")
    ap.add_argument("--trunk-gb", metavar="X", help="passed to k3 serve --trunk-gb")
    ap.add_argument("--cache-gb", metavar="X", help="passed to k3 serve --cache-gb")
    ap.add_argument("--threads", type=int, default=None, help="passed to k3 serve --threads")
    ap.add_argument("--ceiling-gb", type=float, default=None, metavar="X",
                    help="run the server in a fresh cgroup-v1 memory group limited to X GiB (page cache counts); "
                         "its peak usage and failcnt go into every row")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated arms: concurrent clients (default 1,4,16)")
    ap.add_argument("--max-batch", type=int, default=None, help="k3 serve --max-batch (default: the largest "
                    "--clients value)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in token ids (default 32)")
    ap.add_argument("--max-context", type=int, default=None,
                    help="k3 serve --max-context (default: prompt + max tokens + 64)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="request temperature (default 0: greedy, deterministic answers); seeds are sent anyway")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--constrained", action="store_true",
                    help="each client count also with the answers constrained to JSON (the mask's per-token cost)")
    ap.add_argument("--tools", action="store_true",
                    help="each client count also as chat requests with 6 tools under tool_choice auto (the whole "
                         "answer constrained), and as chat requests with the same declaration as plain text")
    ap.add_argument("--timeout", type=float, default=3600, help="per-request timeout in seconds (default 3600)")
    ap.add_argument("--tsv", default=str(RESULTS / "server-ttft.tsv"), help="rows go here (appended)")
    a = ap.parse_args(argv)
    arms = [int(x) for x in a.clients.split(",") if x.strip()]
    if not arms or min(arms) < 1:
        ap.error("--clients needs positive integers")
    if a.preset in SYNTH_PRESETS:
        if a.model is not None:
            ap.error(f"--preset {a.preset} is a synthetic preset; with --model give a memory preset "
                     "(laptop, desktop, ...)")
        a.synth, a.preset = a.preset, None
    max_batch = a.max_batch or max(arms)
    max_context = a.max_context or a.prompt_tokens + a.max_tokens + 64 + (3072 if a.tools else 0)  # tools: declared
    if a.prompt_tokens + a.max_tokens > max_context:
        ap.error("--max-context must hold --prompt-tokens + --max-tokens")

    from k3.config import load_config
    tmp = None
    model = a.model
    if model is None:
        from k3.synth import synthesize
        tmp = tempfile.TemporaryDirectory()
        model = str(synthesize(Path(tmp.name) / f"{a.synth}-k3", preset=a.synth, arch="k3", seed=1))
    cfg = load_config(model)
    vocab = cfg.vocab_size
    avoid: set[int] = set()  # special ids stay out of the prompts
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, k, None)
        avoid.update(t for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, int))
    name = Path(model).resolve().name
    flags = ["--max-batch", str(max_batch), "--max-context", str(max_context), "--prefix-cache", "0", "--greedy"]
    for flag, v in (("--trunk", a.trunk), ("--preset", a.preset), ("--trunk-gb", a.trunk_gb),
                    ("--cache-gb", a.cache_gb), ("--threads", a.threads)):
        if v is not None:
            flags += [flag, str(v)]
    serve_flags = " ".join(flags)
    cpu = cpu_flags()
    log_dir = Path(os.environ.get("K3_BENCH_TMP", "/tmp/k3bench"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"serve-{os.getpid()}-{int(time.time())}.log"
    print(f"k3 serve {name} {serve_flags}" + (f" in a {a.ceiling_gb:g} GiB memory cgroup" if a.ceiling_gb else "")
          + f" (log {log_path})", file=sys.stderr, flush=True)
    t_load = time.perf_counter()
    srv = Serve(model, flags, ceiling_gb=a.ceiling_gb, log_path=log_path)
    print(f"listening on {srv.url} after {time.perf_counter() - t_load:.1f} s", file=sys.stderr, flush=True)
    tsv = Tsv(Path(a.tsv), COLS)
    kinds = [(c, k) for c in arms for k in ["free"] + (["json"] if a.constrained else [])
             + (["chat", "tools"] if a.tools else [])]
    rows: dict[tuple, list[dict]] = {ck: [] for ck in kinds}
    answers: dict[int, list] = {}
    cg_final = (None, None)
    try:
        w = arm(srv, name, max(arms), 0, argparse.Namespace(**dict(vars(a), max_tokens=min(8, a.max_tokens))),
                vocab, avoid)  # warm-up (kernels, caches, the trunk's first reads)
        if w["errors"]:
            raise SystemExit(f"the warm-up failed ({w['errors']} of {w['requests']} requests):\n{srv.log_tail()}")
        for rep in range(1, a.reps + 1):
            for c, k in (kinds if rep % 2 else kinds[::-1]):
                r = arm(srv, name, c, rep, a, vocab, avoid, k)
                cg_max, failcnt = srv.cgroup()
                ids = r.pop("ids")
                if rep == 1 and k == "free":
                    answers[c] = ids
                rows[(c, k)].append(r)
                tsv.add(arm=f"{c}-clients" + ("" if k == "free" else f"-{k}"), rep=rep, prompt_tokens=a.prompt_tokens,
                        max_tokens=a.max_tokens,
                        max_batch=max_batch, max_context=max_context, ceiling_gb=a.ceiling_gb or "",
                        cg_max_gb=cg_max if cg_max is not None else "", cg_failcnt=failcnt if failcnt is not None
                        else "", serve_flags=serve_flags, load1=loadavg(), cpu=os.cpu_count(), model=name,
                        flags=cpu, **r)
                print(f"rep {rep}: {c:>2} client(s){KINDS[k][1]}: {r['tokens']} tokens in "
                      f"{r['seconds']:.2f} s = "
                      f"{r['tok_s']:.2f} tok/s, {r['req_s']:.3f} req/s, TTFT mean {r['ttft_mean_s']:.2f} s "
                      f"(max {r['ttft_max_s']:.2f}), latency {r['mean_latency_s']:.2f} s, mean batch "
                      f"{r['mean_batch']:.1f}" + (f", {r['errors']} FAILED" if r["errors"] else "")
                      + (f", cgroup peak {cg_max:.2f} GB failcnt {failcnt}" if cg_max is not None else ""),
                      flush=True)
                if not srv.alive():
                    raise SystemExit(f"k3 serve died (exit {srv.p.returncode}; killed by the OOM killer if "
                                     f"-9 under --ceiling-gb):\n{srv.log_tail()}")
    finally:
        cg_final = srv.close()
        if tmp is not None:
            tmp.cleanup()
    out = []
    for c, k in kinds:
        rs = rows[(c, k)]
        if not rs:
            continue
        tm, tsd, tsp = mean_sd_spread([r["tok_s"] for r in rs])
        fm, fsd, fsp = mean_sd_spread([r["ttft_mean_s"] for r in rs])
        qm, qsd, _ = mean_sd_spread([r["req_s"] for r in rs])
        lm, lsd, _ = mean_sd_spread([r["mean_latency_s"] for r in rs])
        im, isd, _ = mean_sd_spread([r["itl_mean_s"] * 1e3 for r in rs])
        out.append([f"{c}" + KINDS[k][1], f"{tm:.2f} ± {tsd:.2f}", f"{100 * tsp:.0f}%",
                    " / ".join(f"{r['tok_s']:.2f}" for r in rs),
                    f"{fm:.2f} ± {fsd:.2f}", f"{100 * fsp:.0f}%", f"{qm:.3f} ± {qsd:.3f}", f"{lm:.2f} ± {lsd:.2f}",
                    f"{im:.2f} ± {isd:.2f}", f"{sum(r['mean_batch'] for r in rs) / len(rs):.1f}",
                    sum(r["errors"] for r in rs)])
    print(f"\n{name}, k3 serve {serve_flags}; {a.prompt_tokens}-token prompts, {a.max_tokens} tokens per request, "
          f"temperature {a.temperature:g}; {len(rows[kinds[0]])} rep(s); {cpu}; {os.cpu_count()} CPUs"
          + (f"; cgroup ceiling {a.ceiling_gb:g} GiB: peak {cg_final[0]:.2f} GB, failcnt {cg_final[1]}"
             if a.ceiling_gb and cg_final[0] is not None else ""))
    print(table(out, ["clients", "aggregate tok/s", "spread", "reps", "mean TTFT s", "spread", "req/s",
                      "mean latency s", "inter-token ms", "mean batch", "errors"]))
    firsts = [answers[c][0] for c in arms if c in answers and answers[c][0] is not None]
    if a.temperature == 0 and len(firsts) > 1:
        # greedy: client 0 sends the same prompt in every arm of rep 1; batching must not change its answer
        print(f"greedy answers of client 0 identical across arms: {all(f == firsts[0] for f in firsts)}")
    print(f"rows: {a.tsv}")
    return 0 if all(r["errors"] == 0 for rs in rows.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
