"""Tokens-per-pass features at K3's expert pool (issue 45): 896 routed experts per MoE
layer, top-16, K3's real shapes and vocabulary.

The checkpoint: `k3 synth OUT --preset realdims --experts 896 --layers 2 --vocab 163840`
(the dense layer and one MoE layer with all 896 experts, 23.6 GB) and its packed trunk
(`k3 pack-trunk`). Two memory caps (cgroup v1 ceilings that count the page cache):

  stream   a cap where the trunk streams through a ring (default 5.5 GiB with --trunk-gb 2.4:
           nothing pinned, one ring slot of the largest layer; auto sizes the rest, so
           each arm's plan differs only in its cache and tables)
  pinned   a cap where the trunk is pinned and the expert cache is held to at most 5% of
           the pool (default 12 GiB with --cache-gb 0.7: 39 slots, 4.4% of 896)

Arms, interleaved within each rep (the plain arm first, so rep 0 gives the corpora):

  plain        --gen N on a prompt of distinct ids
  batch8       k3 run --batch with 8 sequences of distinct prompts, N tokens each
  spec         --spec 4, no corpus (drafts only from the sequence's own n-grams)
  spec-right   --spec 4 --spec-corpus holding plain's continuation
  spec-half    --spec 4 --spec-corpus right half the time: each context's first 2
               drafted tokens right, the next 2 wrong
  spec-wrong   --spec 4 --spec-corpus with the same n-grams and wrong continuations

A cap is `stream`, `pinned` (above) or `autoX`: X GiB and nothing else fixed, what auto
chooses there (e.g. auto8). After each cap's arms in a rep, `k3 doctor MODEL --trunk T
--project` (its storage probe and kernel calibration run then, beside the reps) projects
the cap's plain, batch 8 and spec s/token, the spec row at the acceptance the right
corpus's run measured (printed beside it); the table sets them against the measured
ones (`--no-project` skips it). No constant of the projection is fitted on these runs.

Per run: s/token (decode, emitted tokens; batch: aggregate), tokens per pass, expert GB
per emitted token, expert hit %, drafted / accepted / withheld, the plan's predicted
read per token (priced for the batch it runs), and the ids (every arm's must be plain's;
batch sequences are checked against their own plain runs only by tests, here against
nothing). One TSV row per run (benchmarks/results/k3scale.tsv) with the CPU flags.

    python benchmarks/bench_k3scale.py --model /tmp/k3bench/pool896 --trunk /tmp/k3bench/pool896-trunk
                                       [--gen 64] [--reps 3] [--caps stream,pinned] [--arms ...]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (K3, RESULTS, Tsv, cpu_flags, evict, mean_sd_spread, metrics, pool_parser, run_k3,  # noqa: E402
                      table)

ARMS = ("plain", "batch8", "spec", "spec-right", "spec-half", "spec-wrong")
COLS = ["cap", "ceiling_gb", "arm", "rep", "s_tok", "tok_s", "tokens", "passes", "tokens_per_pass", "expert_gb_tok",
        "gb_tok", "hit_pct", "slots", "pinned", "drafted", "accepted", "withheld", "plan_read_gb_tok", "plan_batch",
        "peak_rss_gb", "cg_max_gb", "ids_ok", "load1", "cpu", "flags", "expert_gbps", "speed_vs_plain",
        "proj_s_tok", "proj_gb_tok", "proj_acceptance", "proj_seq_gbps", "proj_random_gbps", "proj_vs_measured",
        "drive_gb_tok"]
# the projection's row for each arm it projects: (seconds column, GB column)
PROJECTED = {"plain": ("plain_s_per_token", "plain_gb_per_token"), "batch8": ("batch_s_per_token", "batch_gb_per_token"),
             "spec-right": ("spec_s_per_token", "spec_gb_per_token")}


def distinct_prompt(n: int, seed: int, ranks: int = 2048) -> list[int]:
    return [(seed + 37 * i) % ranks + 300 for i in range(n)]


def ids_str(xs) -> str:
    return ",".join(map(str, xs))


def one(a, cap: str, ceiling: float, flags: list[str], arm: str, prompt: list[int], tmp: Path) -> dict:
    base = ["--trunk", a.trunk, "--prefill-chunk", "32"] + flags  # short prompts: activations planned for 32
    evict(a.model, a.trunk)  # what the run reads from memory, its ceiling counts
    if arm == "batch8":
        jobs = tmp / "batch8.jsonl"
        jobs.write_text("".join(json.dumps({"ids": distinct_prompt(len(prompt), 100 + 7 * i), "max_tokens": a.gen})
                                + "\n" for i in range(8)))
        f = ["--batch", str(jobs), "--greedy"] + base
        d = run_k3(a.model, f, ceiling_gb=ceiling, tag=f"k3scale-{cap}-{arm}", raw=True, timeout=7200)
        if "_error" in d:
            return {"error": d["_error"], "flags": f}
        n = d["tokens"]
        ec = d.get("expert_cache") or {}
        req = ec.get("requests", 0)
        return {"s_tok": 1 / d["tokens_per_second"] if d["tokens_per_second"] else float("nan"),
                "tok_s": d["tokens_per_second"], "tokens": n, "passes": d["passes"],
                "tokens_per_pass": n / max(1, d["passes"]), "expert_gb_tok": ec.get("bytes_read", 0) / max(1, n) / 1e9,
                "gb_tok": d["bytes_per_token"] / 1e9, "hit_pct": 100 * ec.get("hits", 0) / req if req else 0.0,
                "expert_gbps": ec.get("bytes_read", 0) / ec["read_seconds"] / 1e9 if ec.get("read_seconds") else 0.0,
                "slots": ec.get("n_slots", 0), "pinned": (d.get("trunk") or {}).get("pinned", 0),
                "plan_read_gb_tok": d["memory_plan"]["estimated_read_per_token"] / 1e9,
                "plan_batch": d["memory_plan"].get("priced_for_batch", 1), "available": d["memory_plan"]["available"],
                "peak_rss_gb": d["peak_rss_bytes"] / 1e9, "cg_max_gb": (d.get("_cg_max_usage") or 0) / 1e9,
                "ids": None, "load1": d["_load1"], "flags": f}
    f = list(base)
    if arm.startswith("spec"):
        f += ["--spec", "4"]
        if arm != "spec":
            f += ["--spec-corpus", str(tmp / f"{cap}-{arm}.ids")]
    d = run_k3(a.model, f, ceiling_gb=ceiling, ids=ids_str(prompt), gen=a.gen, tag=f"k3scale-{cap}-{arm}",
               timeout=7200)
    if "_error" in d:
        return {"error": d["_error"], "flags": f}
    m = metrics(d)
    sp = d.get("spec") or {}
    n = len(d["generated_ids"])
    passes = len({s.get("pass", i) for i, s in enumerate(d["steps"])})
    return {"s_tok": m["s_tok"], "tok_s": 1 / m["s_tok"] if m["s_tok"] else float("nan"), "tokens": n,
            "passes": passes, "tokens_per_pass": n / max(1, passes), "expert_gb_tok": m["expert_gb_tok"],
            "gb_tok": m["dec_read_gb"] / max(1, n - 1), "hit_pct": m["hit_pct"],
            "expert_gbps": ((d.get("expert_cache") or {}).get("bytes_read", 0) /
                            (d.get("expert_cache") or {}).get("read_seconds") / 1e9
                            if (d.get("expert_cache") or {}).get("read_seconds") else 0.0), "slots": m["slots"], "pinned": m["pinned"],
            "drafted": sp.get("drafted", 0), "accepted": sp.get("accepted", 0), "withheld": sp.get("withheld", 0),
            "drive_gb_tok": d.get("decode_drive_bytes", 0) / max(1, n - 1) / 1e9,
            "plan_read_gb_tok": d["memory_plan"]["estimated_read_per_token"] / 1e9,
            "plan_batch": d["memory_plan"].get("priced_for_batch", 1), "available": d["memory_plan"]["available"],
            "peak_rss_gb": m["peak_rss_gb"],
            "cg_max_gb": m["cg_max_gb"], "ids": d["generated_ids"], "load1": m["load1"], "flags": f}


def cap_settings(a, cap: str) -> tuple[float, list[str]]:
    """(ceiling GiB, budget flags) of a cap name."""
    if cap == "stream":
        return a.stream_gib, ["--trunk-gb", str(a.stream_trunk_gb)]
    if cap == "pinned":
        return a.pinned_gib, ["--cache-gb", str(a.pinned_cache_gb)]
    if cap.startswith("auto"):
        try:
            return float(cap[4:]), []
        except ValueError:
            pass
    raise SystemExit(f"--caps: {cap!r} is not stream, pinned or autoX (X GiB)")


def project(a, flags: list[str], available: int, acceptance: float) -> dict:
    """`k3 doctor --project` for the run's model, budgets and measured memory: the
    projection's rows and rates (its probe and calibration run now)."""
    cmd = [K3, "doctor", a.model, "--trunk", a.trunk, "--project", "--ram", f"{available / 1e9:.3f}", "--json",
           "--acceptance", f"{min(max(acceptance, 0.01), 0.99):.3f}", "--prefill-chunk", "32",
           "--max-context", str(a.prompt_len + a.gen + 5), *flags]  # the runs' context and pieces
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return {"error": r.stderr[-400:]}
    p = json.loads(r.stdout)["projection"]
    return {"row": p["rows"][0], "rates": p["rates"], "acceptance": p["acceptance"]}


def main(argv=None) -> int:
    ap = pool_parser(__doc__, reps=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--stream-gib", type=float, default=5.5)
    ap.add_argument("--stream-trunk-gb", type=float, default=2.4)
    ap.add_argument("--pinned-gib", type=float, default=12.0)
    ap.add_argument("--pinned-cache-gb", type=float, default=0.7)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--no-project", action="store_true", help="skip the projection beside each cap")
    ap.add_argument("--tsv", default=str(RESULTS / "k3scale.tsv"))
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if arms[0] != "plain":
        ap.error("--arms must start with plain (it gives the corpora and the reference ids)")
    caps = {c: cap_settings(a, c) for c in a.caps.split(",") if c}
    tsv = Tsv(Path(a.tsv), COLS)
    cpu = cpu_flags()
    print(f"cpu: {cpu}; run {tsv.run}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="k3scale-"))
    prompt = distinct_prompt(a.prompt_len, 11)
    want: dict[str, list[int]] = {}
    res: dict[tuple[str, str], list[dict]] = {}
    for rep in range(a.reps):
        for cap, (ceiling, flags) in caps.items():
            got = {}
            for arm in arms:
                r = one(a, cap, ceiling, flags, arm, prompt, tmp)
                if "error" in r:
                    print(f"{cap} {arm} rep {rep}: {r['error'][-400:]}", file=sys.stderr)
                    tsv.add(cap=cap, ceiling_gb=ceiling, arm=arm, rep=rep, ids_ok="ERROR", cpu=cpu,
                            flags=" ".join(r["flags"]))
                    continue
                if arm == "plain" and cap not in want:
                    want[cap] = r["ids"]
                    full = prompt + r["ids"]
                    (tmp / f"{cap}-spec-right.ids").write_text(" ".join(map(str, full)))
                    wrong = [t for i in range(len(prompt), len(full)) for t in full[i - 4:i] + [full[i] + 1]]
                    (tmp / f"{cap}-spec-wrong.ids").write_text(" ".join(map(str, wrong)))
                    half = [t for i in range(len(prompt), len(full) - 4)
                            for t in full[i - 4:i + 2] + [full[i + 2] + 1, full[i + 3] + 1]]
                    (tmp / f"{cap}-spec-half.ids").write_text(" ".join(map(str, half)))
                r["ok"] = r["ids"] == want.get(cap) if r["ids"] is not None else ""
                got[arm] = r
                print(f"  {cap} {arm} rep {rep}: {r['s_tok']:.3f} s/token, {r['tokens_per_pass']:.2f} tokens/pass, "
                      f"{r['gb_tok']:.3f} GB/token, hit {r['hit_pct']:.0f}%, withheld {r.get('withheld', 0)}, "
                      f"ids ok {r['ok']}", file=sys.stderr)
            proj = {}
            if not a.no_project and "plain" in got:
                sr = got.get("spec-right") or {}
                acc = sr["accepted"] / sr["drafted"] if sr.get("drafted") else 0.7
                proj = project(a, flags, got["plain"]["available"], acc)
                if "error" in proj:
                    print(f"{cap} projection rep {rep}: {proj['error']}", file=sys.stderr)
                    proj = {}
            for arm, r in got.items():
                extra = {}
                if proj and arm in PROJECTED:
                    sc, gc = PROJECTED[arm]
                    ps = proj["row"][sc]
                    extra = {"proj_s_tok": ps, "proj_gb_tok": proj["row"][gc], "proj_acceptance": proj["acceptance"],
                             "proj_seq_gbps": proj["rates"]["sequential"] / 1e9,
                             "proj_random_gbps": proj["rates"]["random"] / 1e9,
                             "proj_vs_measured": ps / r["s_tok"] if ps and r["s_tok"] else ""}
                    r.update(extra)
                p_s = got["plain"]["s_tok"] if "plain" in got else None
                r["speed_vs_plain"] = p_s / r["s_tok"] if p_s and r["s_tok"] else ""
                tsv.add(cap=cap, ceiling_gb=ceiling, arm=arm, rep=rep, ids_ok=r["ok"], cpu=cpu,
                        **{k: v for k, v in r.items() if k in COLS and k not in ("flags", "ids_ok")},
                        flags=" ".join(r["flags"]))
                res.setdefault((cap, arm), []).append(r)
    rows = []
    for cap in caps:
        plain = res.get((cap, "plain"), [])
        if not plain:
            continue
        p_s = statistics.fmean(r["s_tok"] for r in plain)
        p_gb = statistics.fmean(r["gb_tok"] for r in plain)
        for arm in arms:
            rs = res.get((cap, arm), [])
            if not rs:
                continue
            m, sd, spr = mean_sd_spread([r["s_tok"] for r in rs])
            gb_tok = statistics.fmean(r["gb_tok"] for r in rs)
            allow = ""
            if arm == "batch8":  # what its bytes allow: plain's tok/s x plain's bytes per token / the batch's
                allow = f"{(1 / m) / ((1 / p_s) * p_gb / gb_tok):.2f}" if gb_tok else ""
            pr = [r["proj_s_tok"] for r in rs if r.get("proj_s_tok")]
            proj = (f"{statistics.fmean(pr):.3f} ({statistics.fmean(pr) / m - 1:+.0%})" if pr else "")
            rows.append([cap, arm, len(rs), f"{m:.3f}", f"{spr:.0%}", f"{p_s / m:.2f}x",
                         f"{statistics.fmean(r['tokens_per_pass'] for r in rs):.2f}",
                         f"{statistics.fmean(r['expert_gb_tok'] for r in rs):.3f}", f"{gb_tok:.3f}",
                         f"{statistics.fmean(r['plan_read_gb_tok'] for r in rs):.3f}", proj,
                         f"{statistics.fmean(r['hit_pct'] for r in rs):.0f}",
                         f"{sum(r.get('drafted', 0) for r in rs)}/{sum(r.get('accepted', 0) for r in rs)}/"
                         f"{sum(r.get('withheld', 0) for r in rs)}", allow,
                         all(r["ids"] == want.get(cap) for r in rs) if arm != "batch8" else "n/a"])
    print(table(rows, ["cap", "arm", "reps", "s/token", "spread", "speed vs plain", "tokens/pass",
                       "expert GB/token", "GB read/token", "plan's GB/token", "projected s/token (vs measured)",
                       "hit %", "drafted/accepted/withheld", "batch vs its bytes", "ids = plain"]))
    print(f"run {tsv.run} -> {tsv.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
