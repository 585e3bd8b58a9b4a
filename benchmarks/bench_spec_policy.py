"""The speculation policy with its own clock, at K3's ratio on the small-dims pool
(issue 52): `k3 synth --preset pool` (896 routed experts per MoE layer, top-16), an
expert cache of ~2.5 % of the pool (`--cache-gb 0.0008`), a prompt, N greedy tokens.
Each run is a fresh `k3 run` process, so the policy starts cold every time, as a user's
run does.

Arms, interleaved within each rep (plain first: its tokens give the corpora):

  plain        no --spec
  right        --spec 4, a corpus holding plain's continuation (the policy decides)
  right-every  the same with every draft read (K3_SPEC_EVERY_DRAFT=1): what drafts buy
  half         --spec 4, each context's first 2 drafted tokens right, the next 2 wrong
  wrong        --spec 4, the same n-grams with wrong continuations

Per run: decode s/token, tokens per weight pass, drafted / accepted / withheld, and
whether the ids are plain's. One TSV row per run (benchmarks/results/spec-policy.tsv)
with the CPU flags.

    python benchmarks/bench_spec_policy.py [--model DIR] [--gen 32] [--reps 3] [--seed 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import K3, RESULTS, Tsv, cpu_flags, mean_sd_spread, metrics, run_k3, table  # noqa: E402

ARMS = ("plain", "right", "right-every", "half", "wrong")
COLS = ["arm", "rep", "s_tok", "tokens", "passes", "tokens_per_pass", "drafted", "accepted", "withheld",
        "speed_vs_plain", "ids_ok", "load1", "cpu"]
PROMPT = [5, 17, 99, 300, 42, 7, 1000, 12] * 3


def corpora(full: list[int], prompt: int, tmp: Path) -> dict[str, Path]:
    right = full
    half = [t for i in range(prompt, len(full) - 4) for t in full[i - 4:i + 2] + [full[i + 2] + 1, full[i + 3] + 1]]
    wrong = [t for i in range(prompt, len(full)) for t in full[i - 4:i] + [full[i] + 1]]
    out = {}
    for name, ids in (("right", right), ("half", half), ("wrong", wrong)):
        out[name] = tmp / f"{name}.ids"
        out[name].write_text(" ".join(map(str, ids)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/k3bench/pool-small")
    ap.add_argument("--seed", type=int, default=3, help="the synthetic pool's seed, when --model is generated")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-gb", default="0.0008")
    ap.add_argument("--tsv", default=str(RESULTS / "spec-policy.tsv"))
    a = ap.parse_args(argv)
    if not (Path(a.model) / "config.json").exists():
        import subprocess
        subprocess.run([K3, "synth", a.model, "--preset", "pool", "--seed", str(a.seed)], check=True)
    tsv = Tsv(Path(a.tsv), COLS)
    cpu = cpu_flags()
    print(f"cpu: {cpu}; run {tsv.run}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="k3spec-"))
    ids = ",".join(map(str, PROMPT))
    base = ["--cache-gb", a.cache_gb]
    want, paths, res = None, {}, {}
    for rep in range(a.reps):
        plain_s = None
        for arm in ARMS:
            flags = list(base)
            if arm != "plain":
                flags += ["--spec", "4", "--spec-corpus", str(paths[arm.split("-")[0]])]
            if arm == "right-every":
                os.environ["K3_SPEC_EVERY_DRAFT"] = "1"
            try:
                d = run_k3(a.model, flags, ids=ids, gen=a.gen, tag=f"spec-{arm}", timeout=1800)
            finally:
                os.environ.pop("K3_SPEC_EVERY_DRAFT", None)
            if "_error" in d:
                print(f"{arm} rep {rep}: {d['_error'][-400:]}", file=sys.stderr)
                continue
            m = metrics(d)
            n = len(d["generated_ids"])
            passes = len({s.get("pass", i) for i, s in enumerate(d["steps"])})
            if want is None:
                want = d["generated_ids"]
                paths = corpora(PROMPT + want, len(PROMPT), tmp)
            sp = d.get("spec") or {}
            plain_s = m["s_tok"] if arm == "plain" else plain_s
            r = {"s_tok": m["s_tok"], "tokens": n, "passes": passes, "tokens_per_pass": n / max(1, passes),
                 "drafted": sp.get("drafted", 0), "accepted": sp.get("accepted", 0), "withheld": sp.get("withheld", 0),
                 "speed_vs_plain": plain_s / m["s_tok"] if plain_s and m["s_tok"] else "",
                 "ids_ok": d["generated_ids"] == want, "load1": m["load1"]}
            tsv.add(arm=arm, rep=rep, cpu=cpu, **r)
            res.setdefault(arm, []).append(r)
            print(f"  {arm} rep {rep}: {r['s_tok']:.4f} s/token, {r['tokens_per_pass']:.2f} tokens/pass, "
                  f"{r['drafted']}/{r['accepted']}/{r['withheld']}, ids ok {r['ids_ok']}", file=sys.stderr)
    rows = []
    for arm in ARMS:
        rs = res.get(arm, [])
        if not rs:
            continue
        m, _, spr = mean_sd_spread([r["s_tok"] for r in rs])
        vs = [r["speed_vs_plain"] for r in rs if r["speed_vs_plain"] != ""]
        rows.append([arm, len(rs), f"{m:.4f}", f"{spr:.0%}", f"{min(vs):.2f}-{max(vs):.2f}x" if vs else "",
                     f"{statistics.fmean(r['tokens_per_pass'] for r in rs):.2f}",
                     f"{sum(r['drafted'] for r in rs)}/{sum(r['accepted'] for r in rs)}/{sum(r['withheld'] for r in rs)}",
                     all(r["ids_ok"] for r in rs)])
    print(table(rows, ["arm", "reps", "s/token", "spread", "speed vs plain (per rep)", "tokens/pass",
                       "drafted/accepted/withheld", "ids = plain"]))
    print(f"run {tsv.run} -> {tsv.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
