"""Memory ladder: `k3 run --preset auto` under hard cgroup ceilings (docs/BENCHMARKS.md).

Each rung runs the same greedy, incremental prompt (benchlib.DEFAULT_IDS, --gen 4) inside a
fresh cgroup-v1 memory group whose limit is the rung (GiB; page cache counts). `auto` reads
the cgroup limit and sizes trunk and expert cache from it, so the rungs differ only in
what `auto` chose. Per rep: decode s/token (mean of the steps after the prefill step),
pinned layers, ring slots, cache slots, expert hit % (decode steps), GB read/token (trunk
+ experts, decode steps), peak RSS, cgroup max usage, I/O share, generated ids. The ids
must be identical on every rung and rep: the script asserts it (exit 1 otherwise).

    python benchmarks/memory_ladder.py [--model /work/rd4] [--trunk DIR] [--rungs 4,6,9,14]
                                       [--reps 3] [--quick] [--tsv PATH] [--png PATH]

Every rep is appended to benchmarks/results/ladder.tsv (with a run id). The summary
prints mean / sd / spread = (max-min)/mean per rung and Spearman rho of s/token vs rung
over every rep. Reps are interleaved across rungs (rung order per pass) so slow drift in
the machine's load does not line up with one rung.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

COLS = ["rung_gb", "rep", "model", "preset", "trunk_gb", "cache_gb", "pinned", "n_layers", "pinned_gb",
        "ring", "slots", "s_tok", "s_tok_warm", "prefill_s", "hit_pct", "trunk_gb_tok", "expert_gb_tok",
        "dec_gbps", "peak_rss_gb", "cg_max_gb", "failcnt", "io_share", "ids", "load1", "note"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/work/rd4")
    ap.add_argument("--trunk", default=None, help="packed trunk (default MODEL-trunk)")
    ap.add_argument("--rungs", default="4,6,9,14", help="cgroup ceilings in GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="1 rep, rungs 4,9")
    ap.add_argument("--tsv", default=str(bl.RESULTS / "ladder.tsv"))
    ap.add_argument("--png", default=str(bl.RESULTS / "ladder.png"))
    a = ap.parse_args(argv)
    trunk = a.trunk or a.model.rstrip("/") + "-trunk"
    rungs = [4.0, 9.0] if a.quick else [float(x) for x in a.rungs.split(",")]
    reps = 1 if a.quick else a.reps
    tsv = bl.Tsv(Path(a.tsv), COLS)
    rows: dict[float, list[dict]] = {r: [] for r in rungs}
    for rep in range(reps):
        for rung in rungs:
            d = bl.run_k3(a.model, ["--trunk", trunk, "--preset", "auto"], ceiling_gb=rung, gen=a.gen,
                          tag=f"ladder{rung:g}")
            m = bl.metrics(d)
            if not m["ok"]:
                print(f"  rung {rung:g} rep {rep}: FAILED {m['error']}", file=sys.stderr)
                tsv.add(rung_gb=rung, rep=rep, model=a.model, note=f"FAILED rc={m['rc']}")
                continue
            tsv.add(rung_gb=rung, rep=rep, model=a.model, **m)
            rows[rung].append(m)
            print(f"  rung {rung:4g} GiB rep {rep}: trunk {m['trunk_gb']:.2f} / cache {m['cache_gb']:.2f} GB, "
                  f"pinned {m['pinned']}/{m['n_layers']}, ring {m['ring']}, {m['slots']} slots, "
                  f"{m['s_tok']:.2f} s/tok, hit {m['hit_pct']:.1f}%, peak RSS {m['peak_rss_gb']:.2f} GB, "
                  f"ids {m['ids']} (load {m['load1']:.1f})", file=sys.stderr)
    out, xs, ys, means = [], [], [], []
    for rung, ms in rows.items():
        if not ms:
            out.append([rung, 0, "FAILED"] + [""] * 11)
            continue
        a_, f = bl.arm_summary(ms), ms[0]
        mean = a_["mean"]
        out.append([rung, len(ms), a_["budgets"], a_["pinned"], f["ring"], f["slots"], mean, a_["sd"], a_["spread"],
                    bl.statistics.fmean(m["hit_pct"] for m in ms), a_["gb_read"], a_["rss_max"],
                    bl.statistics.fmean(m["io_share"] for m in ms), f["ids"]])
        xs += [rung] * len(ms)
        ys += [m["s_tok"] for m in ms]
        means.append((rung, mean))
    print(bl.table(out, ["GiB", "n", "trunk/cache GB", "pinned", "ring", "slots", "s/tok mean", "sd", "spread",
                         "hit %", "GB read/tok", "peak RSS max", "I/O %", "ids"]))
    rho = bl.spearman(xs, ys)
    print(f"\nSpearman rho (s/token vs ceiling, {len(xs)} reps): {rho:+.3f}")
    ids = {m["ids"] for ms in rows.values() for m in ms}
    print(f"generated ids identical on every rung and rep: {len(ids) == 1} ({' | '.join(sorted(ids))})")
    bl.plot(Path(a.png), xs, ys, xlabel="cgroup ceiling (GiB), --preset auto", ylabel="decode s/token",
            title=f"memory ladder, {a.model} (rho {rho:+.2f})", means=means)
    return 0 if len(ids) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
