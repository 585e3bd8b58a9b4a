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
    if args.probe_dir and not Path(args.probe_dir).is_dir():
        raise UsageError(f"--probe-dir {args.probe_dir}: not a folder.")
    rep = run_doctor(args.model, args.trunk, probe=not args.no_probe, probe_seconds=args.probe_seconds,
                     probe_dir=args.probe_dir, model_dirs=args.model_dirs)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=1, default=str))
    else:
        print(rep.render())
    sys.stdout.flush()
    return EXIT_RUNTIME if rep.blocking else EXIT_OK
