"""`k3 cache-sim TRACE`: replay an expert trace under LRU and Belady, by cache size."""

from __future__ import annotations

import json
import os

from ..errors import UsageError

HELP = "replay an expert trace: LRU and Belady hit rates by cache size"


def add_arguments(p) -> None:
    p.add_argument("trace", help="expert_trace.bin (int32 pairs layer, expert), e.g. from `k3 run --dump-cache-trace`")
    p.add_argument("--capacity", type=int, nargs="+", default=[], metavar="N", help="cache sizes in slots")
    p.add_argument("--gb", type=float, nargs="+", default=[], metavar="X",
                   help="cache sizes in GB (default: the C engine's table, 8 16 32 64 128 192, when neither "
                        "--capacity nor --gb is given)")
    p.add_argument("--slot-mb", type=float, default=None,
                   help="bytes of one slot in MB, to convert GB <-> slots (default 17.56, K3's)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def run(args) -> int:
    from ..memory.cache_sim import DEFAULT_GB, DEFAULT_SLOT_MB, capacities, format_table, load_trace, table

    slot_mb = DEFAULT_SLOT_MB if args.slot_mb is None else args.slot_mb
    gb = args.gb if (args.gb or args.capacity) else DEFAULT_GB
    caps = capacities(args.capacity, gb, slot_mb)
    trace = load_trace(args.trace)
    if not len(trace):
        raise UsageError(f"the expert trace {args.trace} is empty: nothing to replay.")
    rows = table(trace, caps, slot_mb)
    if args.json:
        print(json.dumps({"trace": os.fspath(args.trace), "slot_mb": slot_mb, "rows": rows}, indent=1))
    else:
        print(format_table(args.trace, trace, rows, slot_mb))
    return 0
