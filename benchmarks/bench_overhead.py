"""Per-token overhead: how close decode runs to the time its weight bytes need.

For each model (synthetic presets, generated once), everything resident and every
expert read in before timing:

  s/token      incremental decode, mean of the decode steps of a rep (the prefill
               step excluded)
  bytes/token  weight bytes one decode step reads: every trunk tensor of every layer,
               top-k routed experts per MoE layer, lm_head and the final norms (one
               embedding row is left out)
  bw           memory read bandwidth measured at the start: best of 5 reads of a 1 GiB
               fp32 buffer (torch.sum on the decode's threads); a copy (torch copy_, 2
               bytes counted per byte copied, as STREAM does) is reported beside it
  bound        bytes/token / bw: the memory-bound time of a step
  ratio        s/token / bound
  bw beside, ratio beside
               the same read probe (best of 3) taken right before and right after each
               rep, their mean, and the rep's ratio against the bound it gives: on a
               shared host whose bandwidth drifts by a third within minutes, a probe
               taken beside the rep measures the machine the rep ran on
  kernel, strict
               k3's own one-token BF16 kernel streaming a 1 GiB matrix, right before and
               right after each rep (best of 3 each; on some hosts it reads faster than
               torch's sum, which is then no bound), and the rep's ratio against the bound
               the faster of the two beside probes gives
  cold read    right after each rep: what one cache line read costs after a 128 MB
               stream, above its hot cost (k3.probe.cold_reads_after_stream, the
               doctor's probe; ns a line): the glue between a step's kernels reads its
               code and data cold, so this moves the glue's share of the step
  kernels/layer, torch ops/layer
               numba kernel launches and torch (aten) ops of one decode step, counted in
               a separate untimed step, divided by the layers

One TSV row per rep (benchmarks/results/overhead.tsv), with the CPU flags and the
1-minute load average before and after. The code measured is the tree this script
lives in (run a copy of it in another worktree to measure that tree).

    python benchmarks/bench_overhead.py [--arms tiny-k3,small-kimi_linear,...] [--reps 3] [--gen 16]
                                        [--threads 2] [--cache DIR] [--tsv FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (docs/PERFORMANCE.md)

import torch  # noqa: E402

import k3  # noqa: E402
from k3.probe import COLD_LINES, cold_reads_after_stream  # noqa: E402
from k3.kernels import bf16_linear  # noqa: E402
from benchlib import Tsv, cpu_flags, loadavg  # noqa: E402

#: arm -> (preset, arch, layers, experts); realdims-kimi_linear has Kimi-Linear-48B's
#: per-tensor shapes with 4 layers (dense KDA layer 0, KDA, KDA, MLA) and 16 experts
ARMS = {
    "tiny-k3": ("tiny", "k3", None, None),
    "tiny-kimi_linear": ("tiny", "kimi_linear", None, None),
    "small-k3": ("small", "k3", None, None),
    "small-kimi_linear": ("small", "kimi_linear", None, None),
    "realdims-kimi_linear": ("realdims", "kimi_linear", 4, 16),
    "realdims-k3": ("realdims", "k3", 4, 32),
}
DEFAULT_ARMS = "tiny-k3,tiny-kimi_linear,small-k3,small-kimi_linear,realdims-kimi_linear"
GIB = 1 << 30


def ensure_model(cache: Path, arm: str) -> Path:
    preset, arch, layers, experts = ARMS[arm]
    d = cache / arm
    if not (d / "model.safetensors.index.json").is_file():
        from k3 import synth
        print(f"generating {arm} into {d} ...", file=sys.stderr)
        synth.synthesize(d, preset=preset, arch=arch, seed=0, layers=layers, experts=experts)
    return d


def arm_models(ap: argparse.ArgumentParser, args) -> tuple[list[str], dict[str, Path]]:
    """The arms named by ``args.arms`` (checked against ARMS, ``ap.error`` otherwise) and
    their model folders under ``args.cache`` (default ~/.cache/k3/overhead), made when
    missing."""
    from k3 import env
    cache = Path(args.cache) if args.cache else env.cache_dir() / "overhead"
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            ap.error(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    return arms, {a: ensure_model(cache, a) for a in arms}


class Probe:
    """The memory probes over one pair of 1 GiB fp32 buffers and one 1 GiB bf16 matrix,
    made once."""

    def __init__(self):
        self.a = torch.ones(GIB // 4)
        self.b = torch.empty_like(self.a)
        self.w = torch.ones(GIB // 2 // 8192, 8192, dtype=torch.bfloat16)
        self.x = torch.ones(1, 8192)

    def kernel(self, reps: int) -> float:
        """Read GB/s of k3's own one-token BF16 kernel streaming the 1 GiB matrix: best of
        ``reps``. Where it reads faster than torch's sum, the sum is no bound on what the
        machine streams, and the strict ratio takes this one."""
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            bf16_linear(self.x, self.w)
            best = max(best, GIB / (time.perf_counter() - t0) / 1e9)
        return best

    def read(self, reps: int) -> float:
        """Read GB/s: best of ``reps`` sums over the buffer."""
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            float(self.a.sum())
            best = max(best, GIB / (time.perf_counter() - t0) / 1e9)
        return best

    def copy(self, reps: int) -> float:
        """Copy GB/s (two bytes counted per byte copied): best of ``reps``."""
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            self.b.copy_(self.a)
            best = max(best, 2 * GIB / (time.perf_counter() - t0) / 1e9)
        return best


def _nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if hasattr(w, "nbytes"):  # Mxfp4Weight
        return int(w.nbytes)
    return sum(_nbytes(c) for c in w.chunks())


def bytes_per_token(eng) -> int:
    """Weight bytes one decode step reads (see the module docstring)."""
    cfg, prov = eng.cfg, eng.provider
    total = 0
    for i in range(eng.n_layers):
        total += sum(_nbytes(t) for t in prov.layer(i).values())
        prov.release_layer(i)
        if cfg.is_moe(i):
            group = next(iter(prov.expert_groups(i, [0])))
            ew = group[0]
            total += cfg.num_experts_per_token * sum(_nbytes(w) for w in (ew.w1, ew.w2, ew.w3))
    for name in ("norm.weight", "lm_head.weight", "output_attn_res_norm.weight", "output_attn_res_proj.weight"):
        try:
            total += _nbytes(prov.global_weight(name))
        except KeyError:
            pass
    return total


class Counter:
    """Counts the matmul kernels' launches (k3.kernels' _launch and _launch_t1) and torch aten ops."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        import k3.kernels.bf16 as b
        import k3.kernels.mxfp4 as m
        self.kernels = 0
        # the general launcher and the one-token one (decode's projections and experts)
        self.hooks = [(mod, name) for mod in (b, m) for name in ("_launch", "_launch_t1") if hasattr(mod, name)]
        self.orig = [getattr(mod, name) for mod, name in self.hooks]
        counter = self

        class Ops(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Ops.n += 1
                return func(*args, **(kwargs or {}))

        self.Ops = Ops

        def launch(orig):
            def f(*a, **k):
                counter.kernels += 1
                return orig(*a, **k)
            return f

        self.patched = [launch(o) for o in self.orig]

    def count(self, fn) -> tuple[int, int]:
        self.kernels = 0
        self.Ops.n = 0
        for (mod, name), p in zip(self.hooks, self.patched):
            setattr(mod, name, p)
        try:
            with self.Ops():
                fn()
        finally:
            for (mod, name), o in zip(self.hooks, self.orig):
                setattr(mod, name, o)
        return self.kernels, self.Ops.n


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def measure(arm: str, d: Path, args, tsv: Tsv, probe: Probe, bw: tuple[float, float], flags: str,
            rev: str) -> list[tuple[float, float, float]]:
    eng = k3.load(d, threads=args.threads, max_context=args.prompt_len + args.gen + 16, log=lambda *a, **k: None)
    try:
        cfg, prov = eng.cfg, eng.provider
        n_experts = sum(cfg.num_experts for i in range(eng.n_layers) if cfg.is_moe(i))
        if prov.cache.n_slots < n_experts:
            print(f"{arm}: the plan cannot hold every expert; skipped (this measures resident decode)", file=sys.stderr)
            return []
        for i in range(eng.n_layers):  # every expert resident before timing
            if cfg.is_moe(i):
                for _ in prov.expert_groups(i, range(cfg.num_experts)):
                    pass
        nbytes = bytes_per_token(eng)
        bound = nbytes / (bw[0] * 1e9)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size - 256, (args.prompt_len,), generator=g).tolist()
        st = eng.new_state()  # warm-up: kernels, allocator
        steps = list(eng.decode(prompt, state=st, max_tokens=3))
        kern, ops = Counter().count(lambda: list(eng.decode([steps[-1].token], state=st, max_tokens=1)))
        out = []
        for rep in range(args.reps):
            l0 = loadavg()
            before, kbefore = probe.read(3), probe.kernel(3)
            steps = list(eng.decode(prompt, state=eng.new_state(), max_tokens=args.gen + 1))
            after, kafter = probe.read(3), probe.kernel(3)
            first, hot = cold_reads_after_stream(reps=5)
            cold_ns = max(0.0, first - hot) / COLD_LINES * 1e3
            l1 = loadavg()
            dec = [s.seconds for s in steps[1:]]
            spt = statistics.mean(dec)
            beside = (before + after) / 2
            ratio_beside = spt / (nbytes / (beside * 1e9))
            strict = max(beside, (kbefore + kafter) / 2)
            ratio_strict = spt / (nbytes / (strict * 1e9))
            out.append((spt, spt / bound, ratio_beside, ratio_strict))
            tsv.add(arm=arm, code=rev, layers=eng.n_layers, rep=rep, threads=args.threads, tokens=len(dec),
                    s_per_token=spt, s_median=statistics.median(dec), bytes_per_token=nbytes, bw_read_gbs=bw[0],
                    bw_copy_gbs=bw[1], bound_s=bound, ratio=spt / bound, kernels_per_layer=kern / eng.n_layers,
                    torch_ops_per_layer=ops / eng.n_layers, load_before=l0, load_after=l1, cpu=flags,
                    bw_before_gbs=before, bw_after_gbs=after, ratio_beside=ratio_beside,
                    cold_read_ns=cold_ns, bw_kernel_before_gbs=kbefore, bw_kernel_after_gbs=kafter,
                    ratio_strict=ratio_strict)
            print(f"{arm:22} rep {rep}: {spt * 1e3:8.2f} ms/token  bound {bound * 1e3:7.2f} ms  ratio {spt / bound:6.2f}  "
                  f"beside: probe {before:4.1f}/{after:4.1f} GB/s ratio {ratio_beside:5.2f} "
                  f"kernel {kbefore:4.1f}/{kafter:4.1f} GB/s strict {ratio_strict:5.2f} "
                  f"cold read {cold_ns:4.0f} ns  "
                  f"kernels/layer {kern / eng.n_layers:5.1f}  torch ops/layer {ops / eng.n_layers:6.1f}  "
                  f"load {l0:.1f}->{l1:.1f}", file=sys.stderr)
        return out
    finally:
        eng.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of: {', '.join(ARMS)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=16, help="decode steps timed per rep")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=None, help="where the synthetic models live (default ~/.cache/k3/overhead)")
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "overhead.tsv"))
    args = ap.parse_args(argv)
    arms, dirs = arm_models(ap, args)
    torch.set_num_threads(args.threads)
    probe = Probe()
    bw = probe.read(5), probe.copy(5)
    flags, rev = cpu_flags(), git_rev()
    print(f"code {rev}; memory read {bw[0]:.1f} GB/s, copy {bw[1]:.1f} GB/s; {flags}", file=sys.stderr)
    tsv = Tsv(Path(args.tsv), ["arm", "code", "layers", "rep", "threads", "tokens", "s_per_token", "s_median",
                               "bytes_per_token", "bw_read_gbs", "bw_copy_gbs", "bound_s", "ratio",
                               "kernels_per_layer", "torch_ops_per_layer", "load_before", "load_after", "cpu",
                               "bw_before_gbs", "bw_after_gbs", "ratio_beside", "cold_read_ns",
                               "bw_kernel_before_gbs", "bw_kernel_after_gbs", "ratio_strict"])
    summary = []
    for a in arms:
        reps = measure(a, dirs[a], args, tsv, probe, bw, flags, rev)
        if reps:
            summary.append((a, *([r[i] for r in reps] for i in range(4))))
    print("\narm                    mean ms/token   min     max   ratio (start probe)  ratio (probe beside)"
          "  ratio (strict)", file=sys.stderr)
    for a, spts, rs, rb, rk in summary:
        print(f"{a:22} {statistics.mean(spts) * 1e3:10.2f} {min(spts) * 1e3:8.2f} {max(spts) * 1e3:8.2f}   "
              f"{min(rs):6.2f} - {max(rs):5.2f}        {min(rb):6.2f} - {max(rb):5.2f}"
              f"        {min(rk):6.2f} - {max(rk):5.2f}", file=sys.stderr)
    print(f"wrote {args.tsv} (run {tsv.run})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
