"""This machine's memory as a plan must see it: MemTotal / MemAvailable lowered to the
memory cgroup's limit, and this process's own measured footprint. (No torch here.)"""

from __future__ import annotations

import os
import resource

from ..errors import UsageError

#: above the measured peak RSS: thread stacks, allocator arenas, the kernels' scratch
BASELINE_MARGIN = 300 * 1000 * 1000


def meminfo() -> dict:
    """MemTotal / MemAvailable in bytes, lowered to the memory cgroup's limit when one
    applies (a container or a benchmark's ceiling)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                parts = v.split()
                if parts and parts[0].isdigit():
                    out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    if "MemAvailable" not in out or "MemTotal" not in out:
        raise UsageError("/proc/meminfo is not readable here, so `auto` cannot size the budgets; "
                         "give --trunk-gb and --cache-gb (or a named --preset) instead.")
    res = {"MemTotal": out["MemTotal"], "MemAvailable": out["MemAvailable"]}
    lim = cgroup_limit()
    if lim is not None:
        limit, usage = lim
        res["CgroupLimit"] = limit
        res["MemTotal"] = min(res["MemTotal"], limit)
        res["MemAvailable"] = max(0, min(res["MemAvailable"], limit - usage))
    return res


def cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup (v2 memory.max or v1
    memory.limit_in_bytes), or None when unlimited / not visible. v1 usage counts
    page cache, which is reclaimable, so only the anonymous part (rss) is used."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrl, path = parts
        try:
            if ctrl == "" and os.path.exists("/sys/fs/cgroup/unified" + path + "/memory.max"):
                base = "/sys/fs/cgroup/unified" + path
            elif ctrl == "" and os.path.exists("/sys/fs/cgroup" + path + "/memory.max"):
                base = "/sys/fs/cgroup" + path
            else:
                base = None
            if base is not None:
                raw = open(base + "/memory.max").read().strip()
                if raw != "max":
                    usage = int(open(base + "/memory.current").read())
                    return int(raw), usage
            if "memory" in ctrl.split(","):
                base = "/sys/fs/cgroup/memory" + path
                limit = int(open(base + "/memory.limit_in_bytes").read())
                if limit < (1 << 60):
                    usage = 0
                    for ln in open(base + "/memory.stat"):
                        k, v = ln.split()
                        if k == "rss":
                            usage = int(v)
                    return limit, usage
        except (OSError, ValueError):
            continue
    return None


def rss_bytes() -> int:
    """Current resident set size."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def baseline_bytes() -> int:
    """This process's own footprint, measured: the peak RSS so far (compiling a kernel
    peaks above what it leaves resident) plus a margin for thread stacks and allocator
    slack. Call it after the kernels are loaded."""
    return max(rss_bytes(), peak_rss_bytes()) + BASELINE_MARGIN
