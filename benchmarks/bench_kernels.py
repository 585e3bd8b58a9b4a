"""Throughput of the quantisation/matmul kernels (k3.kernels) beside unfused baselines.

Arms, for every shape and token count T:
  MXFP4 experts (w1/w3 [3072, 3584], w2 [3584, 3072]):
    mxfp4_linear           fused decode + matmul (the kernel; called as the model calls it,
                           mxfp4_grouped on an Mxfp4Weight), one expert a call
    mxfp4 top-16 (T = 1)   the same kernel on 16 experts in one call, each with the same
                           one-token x: how a K3 decode step calls its experts (top-16,
                           one parallel region), so the thread pool's wake-up (~0.1-0.2 ms
                           after an idle gap) is paid once per 16 experts, not per expert
    decode+torch           decode_mxfp4 to an fp32 matrix, then torch x @ W.T (unfused)
  BF16 trunk ([12288, 7168], [7168, 12288]):
    bf16_linear            fused widen + matmul (the kernel)
    upcast+torch           x @ w.float().T (upcast the whole matrix, then torch sgemm)
    torch-bf16             torch.nn.functional.linear(x.bfloat16(), w) (torch's own bf16
                           matmul; rounds x to bf16, so different numbers: reference only)

GB/s = weight bytes / seconds (MXFP4: packed + scale bytes; BF16: 2 bytes/element), the
same definition for every arm. GFMA/s = T * rows * cols / seconds.
MXFP4 arms cycle through a pool of distinct random experts at least twice the L3 the
system reports (at least 8; 2 x 32 MiB L3 -> 12 experts, 2 x 300 MiB -> 108; the pool's
size is printed), so each call reads weights that are not cache-hot, as in real decode
(runs before 2026-12-06T16 cycled 8 experts, 46 MB, even where L3 was larger); the BF16
matrices (176 MB) are never cache-resident on a 32 MB L3. Weights are random (MXFP4
scale bytes 112..122 as in K3),
held as the engine holds them (``k3.checkpoint.io.aligned_empty(..., huge=True)``: 2 MiB
aligned, transparent huge pages where the system allows them; MXFP4 as Mxfp4Weight
objects, whose checked descriptors are kept as in decode); ``--torch-weights`` holds
them in plain torch tensors instead (small pages: torch never advises huge ones; MXFP4
as bare tuples, checked every call). Runs before 2026-12-02 held the BF16 matrices that
way and the MXFP4 experts in numpy arrays (which numpy advises as huge pages, unaligned).

Method: threads pinned (numba and torch) to --threads (default 2); every arm is warmed
up first (numba compile / cache load excluded from timings and reported separately);
each arm's reps run back to back after its own warm-up call (so no arm is timed right
after another arm's memory traffic, e.g. the 44 MB fp32 matrix of decode+torch);
time.perf_counter per call. Every rep goes to benchmarks/results/kernels.tsv (appended,
with a run id). The machine's other core may be busy (other people's jobs): the load
average is recorded before and after; re-run when it is high.

    python benchmarks/bench_kernels.py [--quick] [--reps 5] [--threads 2] [--tsv PATH]
"""

from __future__ import annotations

import os

# Sleeping (not spinning) OpenMP workers; must precede `import torch` (see k3/kernels/__init__.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numba  # noqa: E402

from benchlib import cpu_flags  # noqa: E402
from k3.checkpoint.io import aligned_empty  # noqa: E402
from k3.model.weights import Mxfp4Weight  # noqa: E402
from k3.kernels import bf16_linear, decode_mxfp4, mxfp4_grouped, mxfp4_linear, set_num_threads  # noqa: E402

MX_SHAPES = [("w1/w3", 3072, 3584), ("w2", 3584, 3072)]
BF_SHAPES = [("q/kv-like", 12288, 7168), ("o/down-like", 7168, 12288)]
TOPK = 16       # experts per call of the top-16 arm (K3's experts_per_token)


def l3_bytes() -> int:
    """The largest level-3 cache the kernel reports for cpu0 (32 MiB where it says none)."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (d / "level").read_text().strip() == "3":
                v = (d / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
                best = max(best, int(v.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 << 20


BARS = {"mxfp4_linear": 1.5, "bf16_linear": 8.0}   # GB/s at T = 1 (brief's bars)


def cpu_name() -> str:
    from k3.cpuinfo import cpuinfo
    return cpuinfo().model


def loadavg() -> str:
    try:
        return "%.2f" % os.getloadavg()[0]
    except OSError:
        return "?"


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(kernel, shape_name, R, C, T, arms, wbytes, reps, rows, tsv, run_id, mats=1):
    """arms: list of (name, fn(i)) where i is the call counter (to cycle weights); mats:
    [R, C] matrices a call multiplies (wbytes are all of theirs)."""
    calls = {name: 0 for name, _ in arms}

    def call(name, fn):
        i = calls[name]
        calls[name] += 1
        return timed(lambda: fn(i))

    times = {name: [] for name, _ in arms}
    la0 = loadavg()
    for name, fn in arms:
        call(name, fn)                          # warm-up (compile / first touch), not timed
        for rep in range(reps):                 # reps back to back, so no arm runs right
            s = call(name, fn)                  # after another arm's cache / memory traffic
            times[name].append(s)
            tsv.write("\t".join(map(str, [run_id, kernel, name, shape_name, f"{R}x{C}", T, rep,
                                          "%.6f" % s, wbytes, "%.3f" % (wbytes / s / 1e9),
                                          numba.get_num_threads(), loadavg()])) + "\n")
    tsv.flush()
    la1 = loadavg()
    for name, _ in arms:
        ts = times[name]
        mean = statistics.fmean(ts)
        sd = statistics.stdev(ts) if len(ts) > 1 else 0.0
        mn = min(ts)
        rows.append(dict(kernel=kernel, arm=name, shape=f"{shape_name} [{R}, {C}]", T=T,
                         mean_ms=mean * 1e3, sd_ms=sd * 1e3, min_ms=mn * 1e3,
                         gbs_mean=wbytes / mean / 1e9, gbs_best=wbytes / mn / 1e9,
                         gfma=mats * T * R * C / mean / 1e9, reps=len(ts), load=f"{la0}->{la1}"))


def fmt_table(rows) -> str:
    hdr = ("| kernel | arm | shape | T | reps | mean ms | sd ms | min ms | GB/s (mean) | GB/s (best) "
           "| GFMA/s | load |")
    sep = "|" + "---|" * 12
    out = [hdr, sep]
    for r in rows:
        out.append("| {kernel} | {arm} | {shape} | {T} | {reps} | {mean_ms:.2f} | {sd_ms:.2f} | {min_ms:.2f} "
                   "| {gbs_mean:.2f} | {gbs_best:.2f} | {gfma:.1f} | {load} |".format(**r))
    return "\n".join(out)


def fma_peak(threads: int, iters: int = 50_000_000, reps: int = 3) -> tuple[float, str]:
    """The machine's fp32 FMA peak, measured: every thread runs 12 independent chains of
    vector FMAs held in registers (16 lanes with AVX-512, 8 with AVX2: enough chains to
    cover the latency of two FMA units). Returns (best GFMA/s over the threads, what ran).
    The vectors are those of the path the kernels run (``kernel_isa``): with
    K3_KERNEL_ISA=avx2 on an AVX-512 machine, the 8-lane peak its AVX2 code can reach."""
    import llvmlite.binding as ll
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from k3.kernels.cpu import VECTOR_LANES, kernel_isa
    from k3.kernels.simd import counted_loop

    feats = ll.get_host_cpu_features()
    width = 16 if feats.get("avx512f") else 8 if feats.get("avx2") else 4
    width = min(width, VECTOR_LANES[kernel_isa()])
    chains = 12

    @intrinsic
    def _chains(typingctx, n, ab):
        sig = types.float32(n, ab)

        def codegen(context, builder, sig, args):
            vf = ir.VectorType(ir.FloatType(), width)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                f"llvm.fma.v{width}f32")
            # a, b and the starting values come from memory, so nothing can be folded
            p = context.make_array(sig.args[1])(context, builder, args[1]).data
            one = builder.load(builder.gep(p, [ir.IntType(64)(0)]))
            small = builder.load(builder.gep(p, [ir.IntType(64)(1)]))

            def splat(x):
                v = ir.Constant(vf, ir.Undefined)
                for i in range(width):
                    v = builder.insert_element(v, x, ir.IntType(32)(i))
                return v
            a, b = splat(one), splat(small)
            inits = [splat(builder.fadd(one, builder.fmul(small, ir.Constant(ir.FloatType(), float(i)))))
                     for i in range(chains)]
            n64 = context.cast(builder, args[0], sig.args[0], types.int64)
            fins = counted_loop(builder, n64, inits, lambda j, acc: [builder.call(fn, [v, a, b]) for v in acc],
                                "fmapeak")
            tot = fins[0]
            for v in fins[1:]:
                tot = builder.fadd(tot, v)
            return builder.extract_element(tot, ir.IntType(32)(0))
        return sig, codegen

    @njit(parallel=True)
    def run(n, nth, out, ab):
        for t in prange(nth):
            out[t] = _chains(n, ab)

    out = np.zeros(threads, np.float32)
    ab = np.array([0.9999999, 1e-7], np.float32)
    run(10, threads, out, ab)  # compile

    def best_of(n: int, tries: int) -> float:
        best = 0.0
        for _ in range(tries):
            t0 = time.perf_counter()
            run(iters, n, out, ab)
            best = max(best, n * iters * chains * width / (time.perf_counter() - t0) / 1e9)
        return best

    one = best_of(1, reps)
    best = best_of(threads, reps)
    # A shared VM can leave one of the threads without its core for the whole probe (one
    # run here read exactly one thread's peak for two): then measure again, a little later
    for _ in range(5):
        if threads == 1 or best >= 0.75 * threads * one:
            break
        time.sleep(0.5)
        best = max(best, best_of(threads, reps))
    how = f"{threads} threads x {chains} chains of {width}-lane FMAs; one thread {one:.1f}"
    if threads > 1 and best < 0.75 * threads * one:
        how += f"; WARNING: below {threads} x one thread, the other cores were busy"
    return best, how


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T in {1, 16}, 3 reps, one shape per kernel")
    ap.add_argument("--reps", type=int, default=None, help="reps per arm (default 5; 3 with --quick)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=str, default=None, help="comma list of T (default 1,4,16,64)")
    ap.add_argument("--only", choices=["mxfp4", "bf16"], default=None)
    ap.add_argument("--torch-weights", action="store_true",
                    help="weights in plain torch tensors (small pages), not where the engine holds them")
    ap.add_argument("--tsv", type=Path, default=ROOT / "benchmarks" / "results" / "kernels.tsv")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 5)
    if reps < 3:
        ap.error("--reps must be >= 3")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 16] if args.quick else [1, 4, 16, 64])
    mx_shapes = MX_SHAPES[:1] if args.quick else MX_SHAPES
    bf_shapes = BF_SHAPES[:1] if args.quick else BF_SHAPES

    set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    from k3.kernels.cpu import kernel_isa
    run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{kernel_isa()}"   # the kernel path is part of every row's run
    print(f"# run {run_id}: {cpu_name()}, {os.cpu_count()} CPUs, numba {numba.__version__} "
          f"threads={numba.get_num_threads()}, torch {torch.__version__} threads={torch.get_num_threads()}, "
          f"load {loadavg()}", flush=True)

    # first calls (compile or on-disk cache load), measured once per kernel specialisation
    x1 = torch.randn(1, 64)
    x2 = torch.randn(2, 64)
    p = np.zeros((4, 32), np.uint8)
    s = np.full((4, 2), 120, np.uint8)
    wb = torch.zeros(4, 64, dtype=torch.bfloat16)
    first = {
        "mxfp4_linear T=1": timed(lambda: mxfp4_linear(x1, p, s)),
        "mxfp4_linear T>1": timed(lambda: mxfp4_linear(x2, p, s)),
        "decode_mxfp4": timed(lambda: decode_mxfp4(p, s)),
        "bf16_linear T=1": timed(lambda: bf16_linear(x1, wb)),
        "bf16_linear T>1": timed(lambda: bf16_linear(x2, wb)),
    }
    print("# first call (numba compile, or load from the on-disk cache): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in first.items()), flush=True)
    print(f"# numba threading layer: {numba.threading_layer()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
          flush=True)

    from k3.probe import memory_bandwidth
    bw = memory_bandwidth()
    peak, how = fma_peak(args.threads)
    isa = kernel_isa()
    print(f"# CPU: {cpu_flags()}; MXFP4 decode path: {isa}", flush=True)
    print(f"# probes: memory read bandwidth {bw:.1f} GB/s (torch sum over 512 MiB, best of 5); fp32 FMA peak "
          f"{peak:.1f} GFMA/s ({how}, best of 3)", flush=True)

    def placed(a):
        """a (numpy or torch) copied to where the engine would hold it (module doc)."""
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        if args.torch_weights:
            return t.clone()
        buf = aligned_empty(t.numel() * t.element_size(), huge=True)
        out = torch.from_numpy(buf).view(t.dtype).reshape(t.shape)
        out.copy_(t)
        return out

    print(f"# weights: {'plain torch tensors' if args.torch_weights else 'as the engine holds them (huge pages)'}",
          flush=True)
    args.tsv.parent.mkdir(parents=True, exist_ok=True)
    new = not args.tsv.exists()
    rows = []
    rng = np.random.default_rng(0)
    with open(args.tsv, "a") as tsv:
        if new:
            tsv.write("run\tkernel\tarm\tshape\tRxC\tT\trep\tseconds\tweight_bytes\tGBps\tthreads\tload1\n")
        if args.only in (None, "mxfp4"):
            for name, R, C in mx_shapes:
                wbytes = R * C // 2 + R * C // 32
                l3 = l3_bytes()
                n_pool = max(8, -(-2 * l3 // wbytes))
                print(f"# {name}: a pool of {n_pool} experts ({n_pool * wbytes / 1e6:.0f} MB, twice the "
                      f"{l3 / 2**20:.0f} MiB L3 or more)", flush=True)
                experts = [(placed(rng.integers(0, 256, (R, C // 2), dtype=np.uint8)),
                            placed(rng.integers(112, 123, (R, C // 32), dtype=np.uint8)))
                           for _ in range(n_pool)]
                held = experts if args.torch_weights else [Mxfp4Weight(*e) for e in experts]
                for T in tokens:
                    x = torch.randn(T, C)
                    arms = [
                        ("mxfp4_linear", lambda i: mxfp4_grouped(x, [held[i % n_pool]]).view(T, R)),
                        ("decode+torch", lambda i: x @ decode_mxfp4(*experts[i % n_pool]).T),
                    ]
                    run_case("mxfp4", name, R, C, T, arms, wbytes, reps, rows, tsv, run_id)
                    print(fmt_table(rows[-len(arms):]).split("\n", 2)[2], flush=True)
                    if T == 1:   # 16 experts a call, consecutive in the pool, as a decode step calls them
                        top = [("mxfp4 top-16", lambda i: mxfp4_grouped(
                            x, [held[(TOPK * i + k) % n_pool] for k in range(TOPK)]))]
                        run_case("mxfp4", name, R, C, T, top, TOPK * wbytes, reps, rows, tsv, run_id, TOPK)
                        print(fmt_table(rows[-1:]).split("\n", 2)[2], flush=True)
                del experts, held
        if args.only in (None, "bf16"):
            for name, N, K in bf_shapes:
                w = placed((torch.randn(N, K) * 0.02).to(torch.bfloat16))
                wbytes = w.numel() * 2
                for T in tokens:
                    x = torch.randn(T, K)
                    arms = [
                        ("bf16_linear", lambda i: bf16_linear(x, w)),
                        ("upcast+torch", lambda i: x @ w.float().T),
                        ("torch-bf16", lambda i: torch.nn.functional.linear(x.to(torch.bfloat16), w)),
                    ]
                    run_case("bf16", name, N, K, T, arms, wbytes, reps, rows, tsv, run_id)
                    print(fmt_table(rows[-len(arms):]).split("\n", 2)[2], flush=True)
                del w

    print()
    print(fmt_table(rows))
    print()
    for r in rows:
        if r["T"] == 1 and r["arm"] in BARS:
            bar = BARS[r["arm"]]
            print(f"# bar {r['arm']} {r['shape']} T=1: mean {r['gbs_mean']:.2f} GB/s, best {r['gbs_best']:.2f} "
                  f"(bar {bar} GB/s: {'PASS' if r['gbs_mean'] >= bar else 'below (re-run if load was high)'})")
    mx_target = 12.0 if isa == "avx512" else 8.0
    for r in rows:
        if r["arm"] == "bf16_linear" and r["T"] == 1:
            print(f"# target bf16_linear T=1 >= 85% of the bandwidth probe: {r['gbs_mean']:.2f} GB/s = "
                  f"{100 * r['gbs_mean'] / bw:.0f}% ({r['shape']})")
        if r["arm"] in ("mxfp4_linear", "mxfp4 top-16") and r["T"] == 1:
            print(f"# target {r['arm']} T=1 >= {mx_target:g} GB/s ({isa}): {r['gbs_mean']:.2f} GB/s ({r['shape']})")
        if r["arm"] in ("bf16_linear", "mxfp4_linear") and r["T"] >= 4:
            print(f"# target {r['arm']} T={r['T']} >= 50% of the FMA peak: {r['gfma']:.1f} GFMA/s = "
                  f"{100 * r['gfma'] / peak:.0f}% ({r['shape']})")
    print(f"# every rep: {args.tsv} (run {run_id})")


if __name__ == "__main__":
    main()
