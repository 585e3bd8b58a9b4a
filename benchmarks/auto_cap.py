"""Does pinning past `auto`'s cap pay? `--preset auto` against explicit trunk budgets, all
under one cgroup memory ceiling (docs/BENCHMARKS.md "Pinning past auto's cap").

`auto` keeps the reference engine's cap (trunk <= 0.55 x MemTotal - reserve - cache floor;
there, pinning to ~90 % of RAM measured slower because of reclaim). Each explicit arm gives
the trunk X GB and the cache --cache-gb, inside the same ceiling, so the page cache and
reclaim pressure are those of a box that size. Reps interleaved across arms; every rep goes
to the TSV; the summary prints mean / sd / spread per arm and whether the ids agree.

    python benchmarks/auto_cap.py --model /work/rd10 --trunk /work/rd10-trunk --ceiling 14 \\
        --trunk-gbs 7,9,11 [--cache-gb 0.3] [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

COLS = ["ceiling_gb", "arm", "rep", "model", "trunk_gb", "cache_gb", "pinned", "n_layers", "pinned_gb", "ring",
        "slots", "s_tok", "s_tok_warm", "prefill_s", "hit_pct", "trunk_gb_tok", "expert_gb_tok", "dec_gbps",
        "peak_rss_gb", "cg_max_gb", "failcnt", "io_share", "ids", "load1", "note"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/work/rd10")
    ap.add_argument("--trunk", default=None, help="packed trunk (default MODEL-trunk)")
    ap.add_argument("--ceiling", type=float, default=14.0, help="cgroup ceiling, GiB")
    ap.add_argument("--trunk-gbs", default="7,9,11", help="explicit trunk budgets to compare with auto, GB")
    ap.add_argument("--cache-gb", type=float, default=0.3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--tsv", default=str(bl.RESULTS / "auto-cap.tsv"))
    a = ap.parse_args(argv)
    if not bl.cgroup_available():
        print("auto_cap: needs a writable cgroup v1 memory controller (root); without a ceiling the "
              "comparison says nothing about a box of that size", file=sys.stderr)
        return 2
    trunk = a.trunk or a.model.rstrip("/") + "-trunk"
    arms = [("auto", ["--preset", "auto"])]
    arms += [(f"trunk{x}", ["--trunk-gb", x, "--cache-gb", str(a.cache_gb)]) for x in a.trunk_gbs.split(",")]
    tsv = bl.Tsv(Path(a.tsv), COLS)
    rows: dict[str, list[dict]] = {name: [] for name, _ in arms}
    for rep in range(a.reps):
        for name, flags in arms:
            d = bl.run_k3(a.model, ["--trunk", trunk, *flags], ceiling_gb=a.ceiling, gen=a.gen, tag=f"cap-{name}")
            m = bl.metrics(d)
            if not m["ok"]:
                print(f"  {name} rep {rep}: FAILED {m['error']}", file=sys.stderr)
                tsv.add(ceiling_gb=a.ceiling, arm=name, rep=rep, model=a.model, note=f"FAILED rc={m['rc']}")
                continue
            tsv.add(ceiling_gb=a.ceiling, arm=name, rep=rep, model=a.model, **m)
            rows[name].append(m)
            print(f"  {name:<8} rep {rep}: trunk {m['trunk_gb']:.2f} / cache {m['cache_gb']:.2f} GB, pinned "
                  f"{m['pinned']}/{m['n_layers']}, ring {m['ring']}, {m['s_tok']:.2f} s/tok, "
                  f"{m['trunk_gb_tok'] + m['expert_gb_tok']:.2f} GB read/tok, peak RSS {m['peak_rss_gb']:.2f} GB, "
                  f"cgroup max {m['cg_max_gb']:.2f} GB (load {m['load1']:.1f})", file=sys.stderr)
    out = []
    for name, _ in arms:
        ms = rows[name]
        if not ms:
            out.append([name, 0, "FAILED"] + [""] * 8)
            continue
        a_ = bl.arm_summary(ms)
        out.append([name, len(ms), a_["budgets"], a_["pinned"], a_["mean"], a_["sd"], a_["spread"], a_["gb_read"],
                    a_["rss_max"], max(m["cg_max_gb"] for m in ms), a_["every"]])
    print(bl.table(out, ["arm", "n", "trunk/cache GB", "pinned", "s/tok mean", "sd", "spread", "GB read/tok",
                         "peak RSS", "cgroup max", "every rep"]))
    ids = {m["ids"] for ms in rows.values() for m in ms}
    print(f"generated ids identical on every arm and rep: {len(ids) == 1}")
    return 0 if len(ids) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
