"""A prompt's prefill at K3's expert pool (issue 53): the plan's piece against 256-token
pieces, bytes beside the time.

The checkpoint: `k3 synth OUT --preset realdims --experts 896 --layers 2 --vocab 163840`
and its packed trunk (`k3 pack-trunk`), as for bench_k3scale.py. Caps (cgroup v1 ceilings
that count the page cache; the checkpoint is evicted from the page cache before each run):

  stream   5.5 GiB, --trunk-gb 2.4: the trunk streams through a ring
  pinned   12 GiB, --cache-gb 0.7: the trunk pinned, the expert cache fixed at 4.4% of
           the pool (the plan's slack, not the cache, pays for a longer piece)

Arms, interleaved within each rep: `plan` (the piece the plan chooses) and `chunk256`
(`--prefill-chunk 256`, today's default before the plan chose it); with `--one`, a run
without a ceiling at `--prefill-chunk` = the prompt (one pass: the bytes of one pass over
the trunk, the tables and each touched expert once, the denominator of the ratio).

Per run: passes, prefill seconds, GB read by the prefill (step 0), the plan's predicted
GB, the drive bound (GB / the run's own measured read rate) and the compute bound
(prefill seconds outside the reads), the ids (every arm's must be the same). One TSV row
per run (benchmarks/results/prefill.tsv) with the CPU flags.

    python benchmarks/bench_prefill.py --model /tmp/k3bench/pool896 --trunk /tmp/k3bench/pool896-trunk
                                       [--tokens 2048] [--reps 2] [--caps stream,pinned] [--one]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RESULTS, Tsv, cpu_flags, evict, pool_parser, run_k3, table  # noqa: E402

from k3.decode import prefill_pieces  # noqa: E402

CAPS = {"stream": (5.5, ["--trunk-gb", "2.4"]), "pinned": (12.0, ["--cache-gb", "0.7"])}
COLS = ["cap", "arm", "rep", "tokens", "piece", "passes", "prefill_s", "prefill_gb", "predicted_gb", "pred_vs_measured",
        "expert_reads", "trunk_gb", "io_s", "drive_bound_s", "compute_s", "peak_rss_gb", "plan_total_gb", "ids_ok",
        "load1", "flags"]


def measure(d: dict, cap: str, arm: str, rep: int, tokens: int, ids0) -> dict:
    s0 = d["steps"][0]
    pp = d.get("prefill_plan") or {}
    gb = s0["bytes_read"] / 1e9
    io_s = s0.get("io_seconds") or 0.0
    rate = d["expert_cache"].get("read_gbps") or 0.0
    return {"cap": cap, "arm": arm, "rep": rep, "tokens": tokens, "piece": pp.get("piece"),
            "passes": len(prefill_pieces(tokens, pp.get("piece") or tokens)),
            "prefill_s": d["prefill_seconds"], "prefill_gb": gb,
            "predicted_gb": (pp.get("read_bytes") or 0) / 1e9 if arm == "plan" else None,
            "pred_vs_measured": ((pp.get("read_bytes") or 0) / 1e9 / gb - 1) if arm == "plan" and gb else None,
            "expert_reads": d["expert_cache"].get("reads"), "trunk_gb": s0.get("trunk_bytes_read", 0) / 1e9,
            "io_s": io_s, "drive_bound_s": gb / rate if rate else None,
            "compute_s": d["prefill_seconds"] - io_s, "peak_rss_gb": d["peak_rss_bytes"] / 2**30,
            "plan_total_gb": d["memory_plan"]["total"] / 2**30,
            "ids_ok": ids0 is None or d["generated_ids"] == ids0, "load1": d.get("_load1")}


def main(argv=None) -> int:
    ap = pool_parser(__doc__, reps=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--one", action="store_true", help="also the one-pass run without a ceiling")
    a = ap.parse_args(argv)
    ids = ",".join(str(5000 + (7919 * i) % 150000) for i in range(a.tokens))  # distinct, no repeats to hit
    flags_cpu = cpu_flags()
    tsv = Tsv(RESULTS / "prefill.tsv", COLS)
    rows, ids0 = [], None
    runs = [(cap, arm) for cap in a.caps.split(",") for arm in ("plan", "chunk256")]
    if a.one:
        runs.append(("none", "one"))
    for rep in range(a.reps):
        for cap, arm in runs:
            ceiling, flags = CAPS.get(cap, (None, ["--trunk-gb", "2.4"]))
            flags = ["--trunk", a.trunk, *flags]
            if arm == "chunk256":
                flags += ["--prefill-chunk", "256"]
            elif arm == "one":
                flags += ["--prefill-chunk", str(-(-a.tokens // 256) * 256)]
            evict(a.model, a.trunk)
            d = run_k3(a.model, flags, ceiling_gb=ceiling, ids=ids, gen=1, tag=f"prefill-{cap}-{arm}")
            if "_error" in d:
                print(f"{cap} {arm} rep {rep}: FAILED {d['_error']}", flush=True)
                continue
            m = measure(d, cap, arm, rep, a.tokens, ids0)
            ids0 = ids0 or d["generated_ids"]
            m["flags"] = flags_cpu
            tsv.add(**m)
            rows.append(m)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()
                           if k != "flags"), flush=True)
    print(table([[r[c] for c in COLS[:-1]] for r in rows], COLS[:-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
