"""Decode speed of two trees of k3 in ONE process: this tree and another checkout (a
`git worktree` of an older commit), both engines loaded and resident, reps alternating
which goes first. On a noisy shared host the same code moves by 30-40 % between
processes a minute apart; within one process, rep by rep, the two trees see the same
machine.

The other tree is imported as a second package (``k3other``), so its numba kernels
compile into that tree's own cache. Each rep decodes ``--gen`` tokens after an 8-id
prompt on a fresh state and takes the mean s/token of the decode steps (prefill
excluded), the models and resident experts as in bench_overhead.py. Greedy tokens of
the two trees must agree (they are compared every rep). ``--prefill N`` times prompt
processing instead: each rep reads an N-id prompt into a fresh state and takes the
first token (wall time of the whole call; the engine's prefill chunks as configured),
reported as tokens/s of prompt.

    git worktree add /tmp/k3-old <rev>
    python benchmarks/bench_ab.py /tmp/k3-old [--arms small-k3,...] [--reps 6] [--gen 16] [--prefill 512]

One TSV row per (arm, tree, rep) in benchmarks/results/ab.tsv, with the CPU flags.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from bench_overhead import ARMS, ensure_model  # noqa: E402
from benchlib import Tsv, cpu_flags, loadavg  # noqa: E402


def load_tree(root: Path, name: str = "k3other"):
    init = root / "k3" / "__init__.py"
    if not init.is_file():
        sys.exit(f"bench_ab: {root} holds no k3 package (expected {init}); give a checkout of k3, "
                 "e.g. one made with `git worktree add`.")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(root / "k3")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def rev(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", help="the other checkout of k3 (its root folder)")
    ap.add_argument("--arms", default="realdims-kimi_linear,small-kimi_linear,small-k3,tiny-k3",
                    help=f"comma-separated, of: {', '.join(ARMS)}")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=0, help="time an N-id prompt's prefill instead of decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=None, help="where the synthetic models live (default ~/.cache/k3/overhead)")
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "ab.tsv"))
    args = ap.parse_args(argv)
    if args.prefill < 0:
        ap.error(f"--prefill takes a prompt length (0: time decode instead), not {args.prefill}")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            ap.error(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    other_root = Path(args.other).resolve()
    other = load_tree(other_root)
    trees = {"other": (other, rev(other_root)), "this": (k3, rev(ROOT))}
    from k3 import env
    cache = Path(args.cache) if args.cache else env.cache_dir() / "overhead"
    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    print(f"this {trees['this'][1]} against other {trees['other'][1]}; {flags}", file=sys.stderr)
    tsv = Tsv(Path(args.tsv), ["arm", "tree", "code", "rep", "first", "threads", "tokens", "s_per_token",
                               "load", "cpu"])
    for arm in arms:
        d = ensure_model(cache, arm)
        engs = {t: mod.load(d, threads=args.threads, max_context=max(args.gen, args.prefill) + 64,
                            log=lambda *a, **k: None)
                for t, (mod, _) in trees.items()}
        try:
            cfg = engs["this"].cfg
            for e in engs.values():  # every expert resident before timing
                for i in range(e.n_layers):
                    if cfg.is_moe(i):
                        for _ in e.provider.expert_groups(i, range(cfg.num_experts)):
                            pass
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, cfg.vocab_size - 256, (args.prefill or 8,), generator=g).tolist()
            for e in engs.values():  # warm-up: kernels, allocator
                list(e.decode(prompt, state=e.new_state(), max_tokens=3))
            res = {t: [] for t in trees}
            for rep in range(args.reps):
                order = ("other", "this") if rep % 2 == 0 else ("this", "other")
                toks = {}
                for t in order:
                    e = engs[t]
                    t0 = time.perf_counter()
                    steps = list(e.decode(prompt, state=e.new_state(), max_tokens=1 if args.prefill else args.gen + 1))
                    wall = time.perf_counter() - t0
                    toks[t] = [s.token for s in steps]
                    spt = wall / len(prompt) if args.prefill else statistics.mean(s.seconds for s in steps[1:])
                    res[t].append(spt)
                    tsv.add(arm=f"{arm}-prefill{args.prefill}" if args.prefill else arm, tree=t, code=trees[t][1],
                            rep=rep, first=order[0], threads=args.threads,
                            tokens=len(prompt) if args.prefill else len(steps) - 1, s_per_token=spt,
                            load=loadavg(), cpu=flags)
                if toks["this"] != toks["other"]:
                    print(f"{arm}: the trees' greedy tokens differ (rep {rep}): {toks}", file=sys.stderr)
                    return 1
            mo, mt = statistics.median(res["other"]), statistics.median(res["this"])
            if args.prefill:
                print(f"{arm:22} prefill {args.prefill}: other {' '.join(f'{1 / v:.1f}' for v in res['other'])} | this "
                      f"{' '.join(f'{1 / v:.1f}' for v in res['this'])} | medians {1 / mo:.1f} -> {1 / mt:.1f} "
                      f"tokens/s ({100 * (mo / mt - 1):+.0f} %)", file=sys.stderr)
                continue
            print(f"{arm:22} other {' '.join(f'{v * 1e3:.1f}' for v in res['other'])} | this "
                  f"{' '.join(f'{v * 1e3:.1f}' for v in res['this'])} | medians {mo * 1e3:.1f} -> {mt * 1e3:.1f} "
                  f"ms/token ({100 * (mt / mo - 1):+.0f} %)", file=sys.stderr)
        finally:
            for e in engs.values():
                e.close()
    print(f"wrote {args.tsv} (run {tsv.run})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
