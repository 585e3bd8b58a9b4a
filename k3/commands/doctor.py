"""`k3 doctor [MODEL]`: what this machine can run, with which preset, how fast, what next.

Exit status: 0 unless a problem blocks running at all (a required package missing, a
shard missing or truncated, the config unreadable): then 1. Works without a model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import EXIT_OK, EXIT_RUNTIME, UsageError

HELP = "check this machine (and a model folder): what runs, with which preset, how fast, and what to do next"
DESCRIPTION = __doc__.split("\n\n")[0]


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", help="model folder to check (optional)")
    p.add_argument("--project", action="store_true",
                   help="project bytes and seconds per token for the released K3 (or MODEL) at several memory sizes, "
                        "plain, batch 8 and --spec 4, from this machine's measured storage and kernels")
    p.add_argument("--ram", default=None, metavar="GB,...",
                   help="memory sizes for --project (default 8,16,32,64,128,224)")
    p.add_argument("--disk-gbps", type=float, default=None, metavar="X",
                   help="--project with this storage rate (GB/s, sequential and random) instead of the probe's")
    p.add_argument("--acceptance", type=float, default=None,
                   help="--project: the chance a draft is right, per drafted token (default 0.7)")
    p.add_argument("--trunk-gb", type=float, default=None, help="--project: fix the trunk budget, as k3 run does")
    p.add_argument("--cache-gb", type=float, default=None, help="--project: fix the expert cache, as k3 run does")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="--project: positions the projected plans hold (default 4096)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="--project: prompt tokens a projected pass reads per sequence (default 64)")
    p.add_argument("--prompt-tokens", default=None, metavar="N,...",
                   help="--project: also the time to first token of prompts of these sizes (e.g. 1024,8192,32768), "
                        "from the one-drive bound and this machine's measured prefill compute")
    p.add_argument("--model-dirs", nargs="+", metavar="DIR", default=[],
                   help="more folders holding the checkpoint's shards (one per drive); each is probed")
    p.add_argument("--trunk", help="packed trunk folder (default MODEL/trunk)")
    p.add_argument("--no-probe", action="store_true", help="skip the storage probe")
    p.add_argument("--probe-seconds", type=float, default=8.0, help="time for the storage probe (default 8)")
    p.add_argument("--probe-dir", help="probe this folder's drive instead of the model's (a scratch file is "
                   "written there and removed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from ..doctor import run_doctor

    if not args.probe_seconds > 0:
        raise UsageError(f"--probe-seconds must be > 0, got {args.probe_seconds}.")
    for d in args.model_dirs:
        if not Path(d).is_dir():
            raise UsageError(f"--model-dirs {d}: not a folder. Give the folders that hold the checkpoint's shards.")
    if args.probe_dir and not Path(args.probe_dir).is_dir():
        raise UsageError(f"--probe-dir {args.probe_dir}: not a folder.")
    project = None
    if args.project:
        from ..projection import DEFAULT_ACCEPTANCE, DEFAULT_RAM_GB
        try:
            ram = [float(x) for x in args.ram.split(",")] if args.ram else list(DEFAULT_RAM_GB)
        except ValueError:
            raise UsageError(f"--ram takes memory sizes in GB separated by commas, got {args.ram!r}.") from None
        if not ram or not all(0 < x < 1e5 for x in ram):
            raise UsageError(f"--ram sizes must be positive GB figures, got {args.ram!r}.")
        acc = DEFAULT_ACCEPTANCE if args.acceptance is None else args.acceptance
        if not 0 <= acc <= 1:
            raise UsageError(f"--acceptance is a chance between 0 and 1, got {acc}.")
        if args.disk_gbps is not None and not args.disk_gbps > 0:
            raise UsageError(f"--disk-gbps must be > 0, got {args.disk_gbps}.")
        for flag, v in (("--max-context", args.max_context), ("--prefill-chunk", args.prefill_chunk)):
            if v is not None and not v >= 1:
                raise UsageError(f"{flag} must be a whole number >= 1, got {v}.")
        project = {"ram": ram, "acceptance": acc, "disk_gbps": args.disk_gbps, "trunk_gb": args.trunk_gb,
                   "cache_gb": args.cache_gb, "context": args.max_context, "piece": args.prefill_chunk,
                   "prompt_tokens": _prompt_tokens(args.prompt_tokens)}
    elif any(v is not None for v in (args.ram, args.disk_gbps, args.acceptance, args.trunk_gb, args.cache_gb,
                                     args.max_context, args.prefill_chunk, args.prompt_tokens)):
        raise UsageError("--ram, --disk-gbps, --acceptance, --trunk-gb, --cache-gb, --max-context, "
                         "--prefill-chunk and --prompt-tokens shape --project; add --project.")
    rep = run_doctor(args.model, args.trunk, probe=not args.no_probe, probe_seconds=args.probe_seconds,
                     probe_dir=args.probe_dir, model_dirs=args.model_dirs, project=project)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=1, default=str))
    else:
        print(rep.render())
    sys.stdout.flush()
    return EXIT_RUNTIME if rep.blocking else EXIT_OK


def _prompt_tokens(text: str | None) -> list[int]:
    """--prompt-tokens' prompt sizes (none without it)."""
    if text is None:
        return []
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(0 < n <= 10_000_000 for n in sizes):
        raise UsageError(f"--prompt-tokens takes prompt sizes in tokens (whole numbers >= 1) separated by commas, "
                         f"e.g. 1024,8192,32768; got {text!r}.")
    return sizes
