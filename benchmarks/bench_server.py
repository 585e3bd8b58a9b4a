"""`k3 serve` throughput: aggregate generated tokens/s with 1 and with 8 concurrent clients
(docs/SERVER.md).

Starts one `k3 serve MODEL --max-batch 8` on loopback, warms it up, then per rep runs
each arm once, in alternating order: C clients each send one /v1/completions request
(distinct prompt and seed, `max_tokens` N) at the same moment; aggregate tokens/s = the
completion tokens of all C answers / the wall time from the first send to the last
answer. Appends one row per rep and arm to benchmarks/results/server.tsv (CPU model and
SIMD flags in every row) and prints a markdown table of arm means.

    python benchmarks/bench_server.py                      # a tiny synthetic K3 model, 3 reps
    python benchmarks/bench_server.py --preset small --reps 3
    python benchmarks/bench_server.py --model PATH --clients 1,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RESULTS, ROOT, Tsv, cpu_flags, loadavg, mean_sd_spread, table  # noqa: E402

COLS = ["arm", "clients", "rep", "tokens", "seconds", "tok_s", "mean_latency_s", "passes", "mean_batch", "load1",
        "cpu", "model", "flags"]


def start(model: str, max_batch: int, max_context: int, threads: int | None):
    cmd = [sys.executable, "-m", "k3", "serve", model, "--port", "0", "--max-batch", str(max_batch),
           "--max-context", str(max_context), "--prefix-cache", "0"]
    if threads:
        cmd += ["--threads", str(threads)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for line in iter(p.stdout.readline, ""):
        m = re.search(r"listening on (http://\S+)/v1", line)
        if m:
            threading.Thread(target=lambda: [None for _ in iter(p.stdout.readline, "")], daemon=True).start()
            return p, m.group(1)
    raise SystemExit("k3 serve did not start")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" in line:
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def arm(url: str, model_name: str, clients: int, max_tokens: int, rep: int) -> dict:
    res = [None] * clients
    go = threading.Barrier(clients + 1)

    def one(i):
        go.wait()
        t0 = time.perf_counter()
        r = post(url + "/v1/completions", {"model": model_name, "prompt": f"Client {i}, rep {rep}: tell a story.",
                                           "max_tokens": max_tokens, "seed": 1000 * rep + i})
        res[i] = (r["usage"]["completion_tokens"], time.perf_counter() - t0)

    m0 = scrape(url)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m1 = scrape(url)
    tokens = sum(r[0] for r in res)
    passes = m1["k3_passes_total"] - m0["k3_passes_total"]
    seqs = m1["k3_batch_sequences_total"] - m0["k3_batch_sequences_total"]
    return {"clients": clients, "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "mean_latency_s": sum(r[1] for r in res) / clients, "passes": int(passes),
            "mean_batch": seqs / passes if passes else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: synthesize one with --preset)")
    ap.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", default="1,8", help="comma-separated arms (default 1,8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    arms = [int(x) for x in a.clients.split(",")]
    tmp = None
    model = a.model
    if model is None:
        from k3.synth import synthesize
        tmp = tempfile.TemporaryDirectory()
        model = str(synthesize(Path(tmp.name) / f"{a.preset}-k3", preset=a.preset, arch="k3", seed=1))
    name = Path(model).resolve().name
    p, url = start(model, a.max_batch, 512 + a.max_tokens, a.threads)
    tsv = Tsv(RESULTS / "server.tsv", COLS)
    flags = cpu_flags()
    rows: dict[int, list[dict]] = {c: [] for c in arms}
    try:
        arm(url, name, max(arms), 8, 0)  # warm-up (kernels, caches)
        for rep in range(1, a.reps + 1):
            for c in (arms if rep % 2 else arms[::-1]):
                r = arm(url, name, c, a.max_tokens, rep)
                rows[c].append(r)
                tsv.add(arm=f"{c}-clients", rep=rep, load1=loadavg(), cpu=os.cpu_count(), model=name, flags=flags,
                        **r)
                print(f"rep {rep}: {c} client(s): {r['tokens']} tokens in {r['seconds']:.2f} s = "
                      f"{r['tok_s']:.1f} tok/s (mean batch {r['mean_batch']:.1f})", flush=True)
    finally:
        p.send_signal(2)
        p.wait(60)
        if tmp is not None:
            tmp.cleanup()
    out = []
    for c in arms:
        m, sd, spread = mean_sd_spread([r["tok_s"] for r in rows[c]])
        lat = sum(r["mean_latency_s"] for r in rows[c]) / len(rows[c])
        out.append([c, f"{m:.1f}", f"{sd:.1f}", f"{100 * spread:.0f}%", " / ".join(f"{r['tok_s']:.1f}" for r in rows[c]),
                    f"{lat:.2f}", f"{sum(r['mean_batch'] for r in rows[c]) / len(rows[c]):.1f}"])
    print(f"\n{name}, {a.max_tokens} tokens per request, --max-batch {a.max_batch}; {flags}; {os.cpu_count()} CPUs")
    print(table(out, ["clients", "aggregate tok/s", "sd", "spread", "reps", "mean latency s", "mean batch"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
