"""Kernel speed of two trees of k3 in ONE process: ``k3.kernels``' mxfp4_linear and
bf16_linear of this tree against another checkout's (a `git worktree` of an older
commit), on the same weights and activations, reps alternating which tree goes first.

On a shared host the same kernel moves by a third between processes a minute apart
(docs/PERFORMANCE.md); within one process, rep by rep, both trees see the same machine.
The other tree is imported as a second package (``k3other``, as bench_ab.py does), so
its kernels compile into that tree's own cache folder. The two trees' outputs are
compared bit for bit before any timing.

Each rep: one warm call (the pool's threads awake), then ``--calls`` timed calls, the
mean per call. MXFP4 cycles through ``--experts`` distinct random experts (scale bytes
112..122, as in K3), one per rep, as a model's calls do; BF16 uses one matrix. Those
weights are warm (the warm call has just read them; a [12288, 7168] BF16 matrix, 176
MB, is then partly in an L3 of 300 MiB). ``--cold``: a pool of experts or BF16 matrices
at least twice the L3 the system reports (as bench_kernels.py), the warm call on one
and every timed call on the next ones, so the timed calls read their weights from
memory as a model's do (the trunk's BF16 matrices are streamed every token).

    git worktree add /tmp/k3-old <rev>
    python benchmarks/bench_kernels_ab.py /tmp/k3-old [--kernel mxfp4] [--tokens 8,16,64]
        [--shape 3072x3584] [--reps 11] [--threads 2]

One TSV row per (kernel, shape, T, tree, rep) in benchmarks/results/kernels_ab.tsv, with
the CPU flags; a summary line per (shape, T): medians and this / other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numba  # noqa: E402
import torch  # noqa: E402

import k3.kernels as this_quant  # noqa: E402
from bench_ab import load_tree, rev  # noqa: E402
from benchlib import Tsv, cpu_flags, loadavg  # noqa: E402

SHAPES = {"mxfp4": "3072x3584", "bf16": "12288x7168"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", help="the other checkout of k3 (its root folder)")
    ap.add_argument("--kernel", choices=("mxfp4", "bf16"), default="mxfp4")
    ap.add_argument("--tokens", default="8,16,64", help="comma-separated token counts T")
    ap.add_argument("--shape", default=None, help="RxC of the weight (default: mxfp4 3072x3584, bf16 12288x7168)")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--calls", type=int, default=3, help="timed calls per rep")
    ap.add_argument("--experts", type=int, default=4, help="MXFP4: distinct experts cycled")
    ap.add_argument("--cold", action="store_true", help="timed calls on weights not in cache (a pool of experts or matrices)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "kernels_ab.tsv"))
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        R, C = (int(v) for v in (args.shape or SHAPES[args.kernel]).lower().split("x"))
    except ValueError:
        ap.error("--tokens takes integers (8,16,64), --shape RxC (3072x3584)")
    if min(tokens or [0]) < 1 or min(R, C) < 1 or min(args.reps, args.calls, args.experts, args.threads) < 1:
        ap.error("--tokens, --shape, --reps, --calls, --experts and --threads take positive numbers")
    if args.kernel == "mxfp4" and C % 32:
        ap.error(f"an MXFP4 weight's width must be a multiple of 32, not {C}")
    other_root = Path(args.other).resolve()
    other = load_tree(other_root)
    import importlib
    try:  # the package load_tree just made; older trees kept the kernels in k3.quant
        other_quant = importlib.import_module("k3other.kernels")
    except ModuleNotFoundError:
        other_quant = importlib.import_module("k3other.quant")
    quants = {"other": other_quant, "this": this_quant}
    codes = {"other": rev(other_root), "this": rev(ROOT)}
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    print(f"this {codes['this']} against other {codes['other']} ({other.__file__}); {flags}", file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    npool = 1
    if args.cold:
        from bench_kernels import l3_bytes  # noqa: E402
        if args.kernel == "mxfp4":
            args.experts = npool = max(args.experts, -(-2 * l3_bytes() // (R * C * 17 // 32)))
        else:
            npool = max(2, -(-2 * l3_bytes() // (R * C * 2)))
        print(f"cold: a pool of {npool} {'experts' if args.kernel == 'mxfp4' else 'matrices'}", file=sys.stderr)
    if args.kernel == "mxfp4":
        ws = [(torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g),
               torch.randint(112, 123, (R, C // 32), dtype=torch.uint8, generator=g)) for _ in range(args.experts)]

        def call(q, x, w):
            return q.mxfp4_linear(x, *w)
    else:
        ws = [(torch.randn(R, C, generator=g) * 0.05).to(torch.bfloat16) for _ in range(npool)]

        def call(q, x, w):
            return q.bf16_linear(x, w)
    tsv = Tsv(Path(args.tsv), ["kernel", "shape", "tokens", "tree", "code", "rep", "first", "threads", "ms",
                               "gfma_s", "load", "cpu", "weights"])
    shape = f"{R}x{C}"
    for T in tokens:
        x = torch.randn(T, C, generator=g)
        a, b = call(quants["other"], x, ws[0]), call(quants["this"], x, ws[0])
        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
            print(f"{args.kernel} {shape} T={T}: the trees' outputs differ; nothing timed", file=sys.stderr)
            return 1
        res = {t: [] for t in quants}
        nxt = 0
        for rep in range(args.reps):
            order = ("other", "this") if rep % 2 == 0 else ("this", "other")
            w = ws[rep % len(ws)]
            for t in order:
                if args.cold:   # the pool's next calls + 1 experts or matrices, in turn
                    cw = [ws[(nxt + i) % len(ws)] for i in range(args.calls + 1)]
                    nxt += args.calls + 1
                else:
                    cw = [w] * (args.calls + 1)
                call(quants[t], x, cw[0])
                t0 = time.perf_counter()
                for i in range(args.calls):
                    call(quants[t], x, cw[1 + i])
                s = (time.perf_counter() - t0) / args.calls
                res[t].append(s)
                tsv.add(kernel=args.kernel, shape=shape, tokens=T, tree=t, code=codes[t], rep=rep, first=order[0],
                        threads=args.threads, ms=s * 1e3, gfma_s=T * R * C / s / 1e9, load=loadavg(), cpu=flags,
                        weights=(f"cold, {len(ws)} {'experts' if args.kernel == 'mxfp4' else 'matrices'}"
                                 if args.cold else "warm"))
        mo, mt = statistics.median(res["other"]), statistics.median(res["this"])
        fl = T * R * C / 1e9
        print(f"{args.kernel} {shape} T={T}: other {mo * 1e3:.2f} ms ({fl / mo:.0f} GFMA/s), this {mt * 1e3:.2f} ms "
              f"({fl / mt:.0f} GFMA/s): this / other {mt / mo:.3f} (medians of {args.reps} reps)", file=sys.stderr)
    print(f"wrote {args.tsv} (run {tsv.run})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
