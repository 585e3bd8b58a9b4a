"""Decode seconds/token with everything resident, and where the time goes.

Loads a checkpoint fully into RAM (default: a `realdims` synthetic K3 with the real
per-tensor shapes, generated once into ~/.cache/k3), then for each rep prefills a
prompt and decodes incrementally, timing every step and splitting it into
  trunk    : BF16 trunk matmuls (fused BF16 x fp32 kernel)
  experts  : routed-expert matmuls (fused MXFP4 decode + matmul)
  attention: KDA recurrence / chunked form and MLA softmax attention
  other    : norms, conv, routing, AttnRes, Python overhead (= step - the above)
Also times full-recompute steps (the C engine's default mode) for comparison.
Every rep is written to benchmarks/results/decode.tsv; timings on this 2-core
machine are noisy, so read the spread.

    python benchmarks/bench_decode.py [--model DIR] [--reps 3] [--prompt-len 8] [--gen 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import k3.model.kda as kda_mod  # noqa: E402
import k3.model.mla as mla_mod  # noqa: E402
import k3.model.moe as moe_mod  # noqa: E402
import k3.model.ops as ops_mod  # noqa: E402
import k3.model.stack as stack_mod  # noqa: E402
import k3  # noqa: E402
from k3.decode import greedy  # noqa: E402
from k3.model.weights import Mxfp4Weight  # noqa: E402


class Breakdown:
    """Patches the leaf compute functions to accumulate seconds per category."""

    def __init__(self, provider):
        self.t = defaultdict(float)
        self.expert_ids: set[int] = set()
        orig_linear = ops_mod.linear
        orig_groups = provider.expert_groups

        def expert_groups(i, ids):
            for group in orig_groups(i, ids):
                for ew in group.values():
                    self.expert_ids.update(id(w) for w in (ew.w1, ew.w2, ew.w3))
                yield group

        def linear(x, w):
            t0 = time.perf_counter()
            y = orig_linear(x, w)
            cat = "experts" if (isinstance(w, Mxfp4Weight) or id(w) in self.expert_ids) else "trunk"
            self.t[cat] += time.perf_counter() - t0
            return y

        orig_grouped = ops_mod.grouped_linear

        def grouped_linear(x, ws, rows=None):
            t0 = time.perf_counter()
            y = orig_grouped(x, ws, rows)
            expert = any(isinstance(w, Mxfp4Weight) or id(w) in self.expert_ids for w in ws)
            self.t["experts" if expert else "trunk"] += time.perf_counter() - t0
            return y

        def timed(fn, cat):
            def f(*a, **k):
                t0 = time.perf_counter()
                r = fn(*a, **k)
                self.t[cat] += time.perf_counter() - t0
                return r
            return f

        provider.expert_groups = expert_groups
        for m in (ops_mod, kda_mod, mla_mod, moe_mod, stack_mod):
            m.linear = linear
        for m in (ops_mod, moe_mod):  # several matrices in one kernel call
            m.grouped_linear = grouped_linear
        kda_mod.kda_recurrent = timed(kda_mod.kda_recurrent, "attention")
        kda_mod.kda_chunked = timed(kda_mod.kda_chunked, "attention")
        mla_mod.attend = timed(mla_mod.attend, "attention")
        mla_mod.attend_latent = timed(mla_mod.attend_latent, "attention")

    def take(self) -> dict:
        d = dict(self.t)
        self.t.clear()
        return d


def ensure_model(args) -> Path:
    if args.model:
        return Path(args.model)
    from k3 import synth
    from k3 import env
    d = env.cache_dir() / f"synth-realdims-L{args.layers}-E{args.experts}"
    if not (d / "model.safetensors.index.json").is_file():
        print(f"generating realdims checkpoint into {d} ...", file=sys.stderr)
        synth.synthesize(d, preset="realdims", seed=0, layers=args.layers, experts=args.experts)
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--full-steps", type=int, default=2, help="full-recompute steps per rep")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "decode.tsv"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from k3.kernels import set_num_threads
    set_num_threads(args.threads)
    d = ensure_model(args)
    t0 = time.perf_counter()
    eng = k3.load(d, max_context=args.prompt_len + args.gen + args.full_steps + 1)
    model, cfg = eng.model, eng.cfg
    if eng.provider.cache.n_slots < sum(cfg.num_experts for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)):
        sys.exit("the plan cannot hold every expert in RAM; this benchmark measures resident decode")
    # every expert resident before timing (first touch reads them from disk)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe(i):
            for _ in model.provider.expert_groups(i, range(cfg.num_experts)):
                pass
    print(f"model {d}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts "
          f"top-{cfg.num_experts_per_token}; resident trunk {model.provider.resident_trunk_bytes / 1e9:.2f} GB, "
          f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    bd = Breakdown(model.provider)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size - 256, (args.prompt_len,), generator=g).tolist()

    # warm-up (numba compilation, allocator)
    st = model.new_state()
    greedy(model.forward(prompt, st))
    model.forward([1], st)
    bd.take()

    rows = []
    for rep in range(args.reps):
        st = model.new_state()
        t0 = time.perf_counter()
        tok = greedy(model.forward(prompt, st))
        rows.append(("prefill", rep, 0, time.perf_counter() - t0, bd.take()))
        for s in range(args.gen):
            t0 = time.perf_counter()
            tok = greedy(model.forward([tok], st))
            rows.append(("decode", rep, s, time.perf_counter() - t0, bd.take()))
        seq = list(prompt)
        for s in range(args.full_steps):
            t0 = time.perf_counter()
            tok = greedy(model.forward(seq))
            seq.append(tok)
            rows.append(("full", rep, s, time.perf_counter() - t0, bd.take()))

    Path(args.tsv).parent.mkdir(parents=True, exist_ok=True)
    cats = ["trunk", "experts", "attention"]
    with open(args.tsv, "w") as f:
        f.write("mode\trep\tstep\tseconds\t" + "\t".join(cats) + "\tother\n")
        for mode, rep, s, sec, t in rows:
            parts = [t.get(c, 0.0) for c in cats]
            f.write(f"{mode}\t{rep}\t{s}\t{sec:.4f}\t" + "\t".join(f"{p:.4f}" for p in parts)
                    + f"\t{sec - sum(parts):.4f}\n")
    print(f"\n{'mode':8} {'n':>3} {'s/step mean':>11} {'sd':>7} {'min':>7} {'max':>7} | "
          f"{'trunk':>6} {'experts':>7} {'attn':>6} {'other':>6}  (mean seconds)")
    for mode in ("prefill", "decode", "full"):
        rs = [r for r in rows if r[0] == mode]
        if not rs:
            continue
        secs = [r[3] for r in rs]
        parts = {c: statistics.mean(r[4].get(c, 0.0) for r in rs) for c in cats}
        other = statistics.mean(secs) - sum(parts.values())
        sd = statistics.stdev(secs) if len(secs) > 1 else 0.0
        print(f"{mode:8} {len(rs):>3} {statistics.mean(secs):>11.3f} {sd:>7.3f} {min(secs):>7.3f} {max(secs):>7.3f} | "
              f"{parts['trunk']:>6.3f} {parts['experts']:>7.3f} {parts['attention']:>6.3f} {other:>6.3f}")
    print(f"\nwrote {args.tsv}")


if __name__ == "__main__":
    main()
