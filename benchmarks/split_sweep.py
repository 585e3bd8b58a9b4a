"""Fixed-budget split: the same trunk + cache total, different trunk shares (docs/BENCHMARKS.md).

For a fixed TOTAL (GB), each arm gives the trunk f*TOTAL (--trunk-gb) and the expert cache
the rest (--cache-gb). Arms whose trunk share is under k3's ring floor (the largest layer)
or whose cache is under the cache floor (top-k + 1 slots) are moved to the floor and
flagged, because k3 refuses them. Same greedy incremental prompt and --gen per rep; reps
interleaved across arms. Every rep goes to benchmarks/results/split.tsv; the summary prints
mean / sd / spread per arm and Spearman rho of decode s/token vs trunk share over all reps
(direction claims rest on rho; magnitude only where the arm means differ by more than the
spread), and a PNG if matplotlib is installed.

    python benchmarks/split_sweep.py [--model /work/rd4] [--trunk DIR] [--total 5]
                                     [--fractions 0.5,0.7,0.86,0.94] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

COLS = ["total_gb", "frac", "rep", "model", "trunk_gb", "cache_gb", "pinned", "n_layers", "pinned_gb", "ring",
        "slots", "s_tok", "s_tok_warm", "prefill_s", "hit_pct", "trunk_gb_tok", "expert_gb_tok", "dec_gbps",
        "peak_rss_gb", "io_share", "ids", "load1", "note"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/work/rd4")
    ap.add_argument("--trunk", default=None, help="packed trunk (default MODEL-trunk)")
    ap.add_argument("--total", type=float, default=5.0, help="trunk + cache budget, GB")
    ap.add_argument("--fractions", default="0.5,0.7,0.86,0.94")
    ap.add_argument("--trunk-floor", type=float, default=2.35, help="k3's ring floor for this model, GB")
    ap.add_argument("--cache-floor", type=float, default=0.30, help="k3's cache floor (17 slots), GB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--ceiling", type=float, default=None, help="optional cgroup ceiling, GiB")
    ap.add_argument("--quick", action="store_true", help="1 rep, the two end arms")
    ap.add_argument("--tsv", default=str(bl.RESULTS / "split.tsv"))
    ap.add_argument("--png", default=str(bl.RESULTS / "split.png"))
    a = ap.parse_args(argv)
    trunk = a.trunk or a.model.rstrip("/") + "-trunk"
    fr = [float(x) for x in a.fractions.split(",")]
    if a.quick:
        fr = [fr[0], fr[-1]]
    reps = 1 if a.quick else a.reps
    arms = []
    for f in fr:
        t, c, note = round(f * a.total, 3), round(a.total - f * a.total, 3), ""
        if t < a.trunk_floor:
            t, c, note = a.trunk_floor, round(a.total - a.trunk_floor, 3), f"trunk raised to the floor {a.trunk_floor}"
        if c < a.cache_floor:
            c, t, note = a.cache_floor, round(a.total - a.cache_floor, 3), f"cache raised to the floor {a.cache_floor}"
        arms.append((f, t, c, note))
    tsv = bl.Tsv(Path(a.tsv), COLS)
    rows: dict[float, list[dict]] = {f: [] for f, *_ in arms}
    for rep in range(reps):
        for f, t, c, note in arms:
            d = bl.run_k3(a.model, ["--trunk", trunk, "--trunk-gb", str(t), "--cache-gb", str(c)],
                          ceiling_gb=a.ceiling, gen=a.gen, tag=f"split{f:g}")
            m = bl.metrics(d)
            if not m["ok"]:
                print(f"  f={f:g} rep {rep}: FAILED {m['error']}", file=sys.stderr)
                tsv.add(total_gb=a.total, frac=f, rep=rep, model=a.model, trunk_gb=t, cache_gb=c,
                        note=f"FAILED rc={m['rc']} {note}")
                continue
            tsv.add(total_gb=a.total, frac=f, rep=rep, model=a.model, note=note, **m)
            rows[f].append(m)
            print(f"  f={f:4.2f} rep {rep}: trunk {t} / cache {c} GB, pinned {m['pinned']}/{m['n_layers']}, "
                  f"ring {m['ring']}, {m['slots']} slots, {m['s_tok']:.2f} s/tok, hit {m['hit_pct']:.1f}%, "
                  f"{m['trunk_gb_tok'] + m['expert_gb_tok']:.2f} GB read/tok (load {m['load1']:.1f})",
                  file=sys.stderr)
    out, xs, ys, means = [], [], [], []
    for f, t, c, note in arms:
        ms = rows[f]
        if not ms:
            out.append([f, t, c, 0, "FAILED"] + [""] * 9)
            continue
        a_, k = bl.arm_summary(ms), ms[0]
        mean = a_["mean"]
        out.append([f, t, c, len(ms), a_["pinned"], k["ring"], k["slots"], mean, a_["sd"], a_["spread"],
                    bl.statistics.fmean(m["hit_pct"] for m in ms), a_["gb_read"], a_["rss_max"], a_["every"]])
        xs += [f] * len(ms)
        ys += [m["s_tok"] for m in ms]
        means.append((f, mean))
    print(bl.table(out, ["trunk share", "trunk GB", "cache GB", "n", "pinned", "ring", "slots", "s/tok mean",
                         "sd", "spread", "hit %", "GB read/tok", "peak RSS", "every rep"]))
    rho = bl.spearman(xs, ys)
    print(f"\nSpearman rho (decode s/token vs trunk share, {len(xs)} reps): {rho:+.3f}")
    if len(means) >= 2:
        lo, hi = means[0][1], means[-1][1]
        print(f"end arms: {lo:.2f} -> {hi:.2f} s/token ({lo / hi:.2f}x)")
    ids = {m["ids"] for ms in rows.values() for m in ms}
    print(f"generated ids identical on every arm and rep: {len(ids) == 1}")
    bl.plot(Path(a.png), xs, ys, xlabel=f"trunk share of {a.total:g} GB", ylabel="decode s/token",
            title=f"fixed-budget split, {a.model} (rho {rho:+.2f})", means=means)
    return 0 if len(ids) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
