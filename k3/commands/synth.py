"""`k3 synth OUT`: write a synthetic checkpoint in the exact release format."""

from __future__ import annotations

import sys

HELP = "write a synthetic checkpoint in the exact release format"
PRESETS = ("tiny", "pool", "small", "realdims")
ARCHS = ("k3", "kimi_linear")


def add_arguments(parser) -> None:
    parser.add_argument("out", help="output model folder (created; must be empty or a previous synth output)")
    parser.add_argument("--preset", default="tiny", choices=PRESETS,
                        help="tiny (a few MB), pool (tiny dims with K3's 896 experts, top-16; ~17 MB), "
                             "small (~200 MB), realdims (K3's real tensor shapes, several GB)")
    parser.add_argument("--arch", default="k3", choices=ARCHS,
                        help="k3 (nested config, MXFP4 experts, AttnRes) or kimi_linear (flat config, BF16)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a pure function of the seed (default 0)")
    parser.add_argument("--layers", type=int, default=None,
                        help="number of layers (>= 2; layer 0 dense, every 4th and the last MLA)")
    parser.add_argument("--experts", type=int, default=None,
                        help="routed experts per MoE layer (>= the preset's top-k)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary size, specials included (K3's release: 163840); learned BPE ranks, "
                             "then filler ranks no text reaches")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes drawing the weights (default: one per core from 1 GB up)")
    parser.add_argument("--force", action="store_true", help="write into a folder that holds other files")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (shards, sizes) and write nothing")


def _printer():
    from rich.console import Console

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    return lambda msg: console.print(msg, markup=False)


def run(args) -> int:
    from ..synth import describe_plan, synthesize

    say = _printer() if sys.stderr.isatty() else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.dry_run:
        for line in describe_plan(args.preset, args.arch, args.seed, args.layers, args.experts, args.vocab):
            say(line)
        return 0
    synthesize(args.out, preset=args.preset, arch=args.arch, seed=args.seed, layers=args.layers,
               experts=args.experts, vocab=args.vocab, workers=args.workers, force=args.force, progress=say)
    return 0
