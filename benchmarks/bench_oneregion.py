"""A decode step's one-token BF16 calls: one kernel launch each, or one parallel region.

Each kernel launch of a decode step pays a fixed cost beside its stream: numba's
dispatch of the arguments, waking the pool's worker, the join at the end, the
prefetchers' ramp. Small models make ~80-130 launches a step, so that cost is a large
part of the gap to the memory-bound time (docs/PERFORMANCE.md, "Per-token overhead").
This script measures what the launches cost against the same work with the two
threads kept in one parallel region, a spin barrier after each call:

  capture    one decode step of the arm's model (everything resident) with
             ``k3.kernels.bf16.run_bf16_jobs`` hooked: every one-token BF16 call's
             activations and job table (the engine's own weights, in place)
  launches   those calls replayed through ``run_bf16_jobs`` one after another: the
             engine's launch path (serial below ``launch.SERIAL_LIMITS["bf16"]``, else the pool),
             without its Python wrappers (job tables built, outputs wrapped in torch),
             so the saving measured is a lower bound
  region     the same calls inside ONE ``prange(2)`` with k3.kernels.region's pieces (as
             the engine's fused decode ops use them): each call's rows in two halves,
             each claimed by whichever thread comes first, both threads waiting for
             both halves before the next call, as the next call's input would need; the
             rows go through the kernels' own ``_t1_rows``, so each output has the
             launches' bits (checked first)

Before each timed pass a 256 MB buffer is streamed, so that a pass does not find the
last one's weights in the caches. Arms are bench_overhead.py's models (generated once
into the same cache). One TSV row per rep (benchmarks/results/oneregion.tsv) with the
CPU flags and the 1-minute load.

    python benchmarks/bench_oneregion.py [--arms small-k3,...] [--reps 15] [--cache DIR] [--tsv FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit, prange  # noqa: E402

import k3  # noqa: E402
import k3.kernels.bf16 as kb  # noqa: E402
from k3.kernels import region  # noqa: E402
from bench_overhead import ARMS, arm_models, git_rev  # noqa: E402
from benchlib import Tsv, cpu_flags, loadavg  # noqa: E402

DEFAULT_ARMS = "small-k3,small-kimi_linear,realdims-kimi_linear"


@njit(parallel=True, nogil=True)
def region_pass(tab, bounds, work, y):
    """Every captured call (table rows bounds[i] .. bounds[i+1]-1) as one step of ONE
    region (k3.kernels.region's claimable halves and waits, as the engine's fused decode
    ops use them)."""
    n = bounds.shape[0] - 1
    fl = region.flags(2 * n)
    for i in prange(2):
        c = np.int64(i)
        for j in range(n):
            region.bf16_step(tab, bounds[j], bounds[j + 1], work, work, y, fl, 2 * j, c)


class Capture:
    """The one-token BF16 calls of a decode step, as ``run_bf16_jobs`` received them."""

    def __init__(self):
        self.calls = []          # (x copy [1, K], jobs copy, total outputs, work)
        self.orig = kb.run_bf16_jobs

    def __enter__(self):
        def hook(xn, jobs, out, work, tmax):
            if xn.shape[0] == 1:
                self.calls.append((xn.copy(), jobs.copy(), out.size, work))
            return self.orig(xn, jobs, out, work, tmax)
        kb.run_bf16_jobs = hook
        return self

    def __exit__(self, *exc):
        kb.run_bf16_jobs = self.orig


def capture(eng, prompt_len: int = 8) -> list:
    cfg, prov = eng.cfg, eng.provider
    for i in range(eng.n_layers):       # every expert resident, as bench_overhead times decode
        if cfg.is_moe(i):
            for _ in prov.expert_groups(i, range(cfg.num_experts)):
                pass
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size - 256, (prompt_len,), generator=g).tolist()
    st = eng.new_state()
    steps = list(eng.decode(prompt, state=st, max_tokens=3))
    with Capture() as cap:
        list(eng.decode([steps[-1].token], state=st, max_tokens=1))
    return cap.calls


def call_table(calls):
    """The region's inputs: (table [matrices, 7] in k3.kernels.region's columns, bounds
    [calls + 1] of each call's rows, workspace holding every call's activations, the
    outputs' length, each call's offset in them)."""
    rows, bounds, xs, xo, oo, offs = [], [0], [], 0, 0, []
    for x, jobs, total, _ in calls:
        offs.append(oo)
        for g in range(jobs.shape[0]):
            rows.append((x.shape[1], int(jobs[g, kb.J_N]), int(jobs[g, kb.J_ADDR]), 1,
                         xo + x.shape[1] * int(jobs[g, kb.J_X0]), 2, oo + int(jobs[g, kb.J_OFF])))
        bounds.append(len(rows))
        xs.append(x.reshape(-1))
        xo += x.size
        oo += total
    return np.array(rows, np.int64), np.array(bounds, np.int64), np.concatenate(xs), oo, offs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of: {', '.join(ARMS)}")
    ap.add_argument("--reps", type=int, default=15, help="timed passes of each way, alternating")
    ap.add_argument("--cache", default=None, help="where the synthetic models live (default ~/.cache/k3/overhead)")
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "oneregion.tsv"))
    args = ap.parse_args(argv)
    arms, dirs = arm_models(ap, args)
    flags, rev = cpu_flags(), git_rev()
    tsv = Tsv(Path(args.tsv), ["arm", "code", "rep", "calls", "matrices", "mb", "launches_ms", "region_ms",
                               "region_over_launches", "load", "cpu"])
    junk = np.ones(256 << 20, np.uint8)
    print(f"code {rev}; {flags}", file=sys.stderr)
    for a in arms:
        eng = k3.load(dirs[a], threads=2, max_context=64, log=lambda *x, **k: None)
        try:
            numba.set_num_threads(2)
            calls = capture(eng)
            mb = sum(w * 2 for *_, w in calls) / 1e6
            outs_l = [np.empty(n, np.float32) for _, _, n, _ in calls]
            table, bounds, work, total, offs = call_table(calls)
            y = np.full(total, np.nan, np.float32)

            def launches():
                for (x, jobs, _, work), out in zip(calls, outs_l):
                    kb.run_bf16_jobs(x, jobs, out, work, 1)

            def one_region():
                region_pass(table, bounds, work, y)

            launches()
            one_region()
            same = all(np.array_equal(p, y[o:o + p.size]) for p, o in zip(outs_l, offs))
            print(f"{a}: {len(calls)} calls, {len(table)} matrices, {mb:.1f} MB; region bit-identical: {same}",
                  file=sys.stderr)
            if not same:
                print(f"{a}: results differ, not timed", file=sys.stderr)
                continue
            ts = {"launches": [], "region": []}
            for rep in range(args.reps):
                order = (("launches", launches), ("region", one_region))
                for name, fn in (order if rep % 2 == 0 else order[::-1]):
                    junk[::64] += 1          # stream 256 MB: the last pass's weights out of the caches
                    t0 = time.perf_counter()
                    fn()
                    ts[name].append(time.perf_counter() - t0)
                lm, rm = ts["launches"][-1], ts["region"][-1]
                tsv.add(arm=a, code=rev, rep=rep, calls=len(calls), matrices=len(table), mb=mb, launches_ms=lm * 1e3,
                        region_ms=rm * 1e3, region_over_launches=rm / lm, load=loadavg(), cpu=flags)
            lm, rm = statistics.median(ts["launches"]), statistics.median(ts["region"])
            print(f"{a:22} launches {lm * 1e3:7.2f} ms ({mb / lm / 1e3:5.1f} GB/s)  one region {rm * 1e3:7.2f} ms "
                  f"({mb / rm / 1e3:5.1f} GB/s)  region/launches {rm / lm:5.2f} (medians of {args.reps})",
                  file=sys.stderr)
        finally:
            eng.close()
    print(f"wrote {args.tsv} (run {tsv.run})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
