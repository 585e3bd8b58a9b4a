"""`k3 demo`: generate the built-in synthetic checkpoint once (cached), then run on it."""

from __future__ import annotations

from pathlib import Path

HELP = "generate a small synthetic checkpoint once and run on it"


def add_arguments(d) -> None:
    d.add_argument("--preset", default="small", help="synthetic preset (default small)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--prompt", default="The capital of France is")
    d.add_argument("--gen", type=int, default=16)
    d.add_argument("--out")
    d.add_argument("--cache-dir", help="where the synthetic checkpoint is kept (default ~/.cache/k3)")


def run(args) -> int:
    import argparse

    from .. import env
    from ..synth import synthesize
    from . import run as run_cmd
    from .common import err

    cache = Path(args.cache_dir) if args.cache_dir else env.cache_dir()
    model_dir = cache / f"synth-{args.preset}-seed{args.seed}"
    if not (model_dir / "model.safetensors.index.json").is_file():
        err(f"demo: generating the synthetic '{args.preset}' checkpoint into {model_dir} (once)")
        synthesize(model_dir, preset=args.preset, seed=args.seed)
    else:
        err(f"demo: using the cached synthetic checkpoint {model_dir}")
    p = argparse.ArgumentParser(prog="k3 run")
    run_cmd.add_arguments(p)
    run_args = p.parse_args([str(model_dir), "--prompt", args.prompt, "--gen", str(args.gen)]
                            + (["--out", args.out] if args.out else []))
    return run_cmd.run(run_args)
