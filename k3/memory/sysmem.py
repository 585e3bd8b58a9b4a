"""This machine's memory as a plan must see it: MemTotal / MemAvailable lowered to every
memory cgroup limit above the process, and this process's own measured footprint. (No
torch here.)"""

from __future__ import annotations

import os
import resource

from ..errors import UsageError

#: above the measured peak RSS: thread stacks, allocator arenas, the kernels' scratch
BASELINE_MARGIN = 300 * 1000 * 1000

CGROUP_ROOT = "/sys/fs/cgroup"
#: v1 writes "no limit" as a page-rounded 2^63 - 1; anything this large is no limit
UNLIMITED = 1 << 60


def meminfo(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str | None = None,
            proc_meminfo: str | None = None) -> dict:
    """MemTotal / MemAvailable in bytes, lowered to the memory cgroups' limits when any
    applies (a container, a systemd slice, a benchmark's ceiling), plus CgroupLimit (the
    lowest limit) then. MemAvailable is what a plan may use: the least of the machine's
    MemAvailable and, at every level of the cgroup tree, that level's limit less its
    usage. The texts of /proc/self/cgroup and /proc/meminfo, and the cgroup mount, can be
    given (tests); by default they are this machine's."""
    if proc_meminfo is None:
        proc_meminfo = _read("/proc/meminfo")
    out = {}
    for line in proc_meminfo.splitlines():
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    if "MemAvailable" not in out or "MemTotal" not in out:
        raise UsageError("/proc/meminfo is not readable here, so `auto` cannot size the budgets; "
                         "give --trunk-gb and --cache-gb (or a named --preset) instead.")
    res = {"MemTotal": out["MemTotal"], "MemAvailable": out["MemAvailable"]}
    lim = cgroup_limit(cgroup_root, proc_cgroup)
    if lim is not None:
        limit, headroom = lim
        res["CgroupLimit"] = limit
        res["MemTotal"] = min(res["MemTotal"], limit)
        res["MemAvailable"] = max(0, min(res["MemAvailable"], headroom))
    return res


def cgroup_limit(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str | None = None) -> tuple[int, int] | None:
    """(lowest limit, least headroom) over every memory cgroup level that limits this
    process, headroom being a level's limit less its usage (it may be negative); None
    when no level has a limit or none is visible. A limit on any ancestor binds the
    process as surely as its own group's (the OOM killer acts at the level whose limit is
    hit), so the tree is walked from the process's own group up to the mount's root.
    Unreadable, missing or garbage files count as "no limit at this level"."""
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup")
    levels = []  # (limit, usage) of each level that has a limit
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":  # cgroup v2: mounted at the root, or at unified/ beside v1 (hybrid)
            mount = cgroup_root
            if not os.path.isfile(os.path.join(mount, "cgroup.controllers")):
                mount = os.path.join(cgroup_root, "unified")
            for d in _up(mount, path):
                levels.append((_limit(_read(os.path.join(d, "memory.max"))), _v2_usage(d)))
        elif "memory" in ctrls.split(","):  # cgroup v1
            for i, d in enumerate(_up(os.path.join(cgroup_root, "memory"), path)):
                # (kernels before 5.11) a parent with use_hierarchy 0 is not charged for its children
                if i and _read(os.path.join(d, "memory.use_hierarchy")).strip() == "0":
                    break
                stat = _stat(os.path.join(d, "memory.stat"))
                # v1 usage counts page cache, which is reclaimable (MemAvailable counts it
                # available too), so only the anonymous memory is usage; total_rss, not
                # rss, because a limit is charged for the whole subtree under it (the
                # process's group and its siblings), while rss is the group's own alone.
                usage = _int(stat.get("total_rss", stat.get("rss", ""))) or 0
                levels.append((_limit(_read(os.path.join(d, "memory.limit_in_bytes"))), usage))
                if i == 0:  # the kernel's lowest limit up the tree, levels this mount hides
                    # included; their usage is not visible, so this group's stands in
                    levels.append((_limit(stat.get("hierarchical_memory_limit", "")), usage))
    levels = [(lim, use) for lim, use in levels if lim is not None]
    if not levels:
        return None
    return min(lim for lim, _ in levels), min(lim - use for lim, use in levels)


def _up(mount: str, path: str):
    """The folders of the cgroup at `path` and of each ancestor up to the mount's root.
    When the path is not under this mount (a cgroup namespace shows "/", a container's
    bind mount of its own group shows the host's path, an outside group shows "/.."),
    the mount's root is the process's own group and is all there is to see."""
    parts = [p for p in path.split("/") if p]
    if not path.startswith("/") or ".." in parts or not os.path.isdir(os.path.join(mount, *parts)):
        parts = []
    while True:
        yield os.path.join(mount, *parts)
        if not parts:
            return
        parts.pop()


def _v2_usage(d: str) -> int:
    """memory.current less the inactive page cache, which the kernel reclaims before it
    OOM-kills (the working set, as MemAvailable counts that cache available)."""
    current = _int(_read(os.path.join(d, "memory.current"))) or 0
    inactive = _int(_stat(os.path.join(d, "memory.stat")).get("inactive_file", "")) or 0
    return max(0, current - inactive)


def _read(path: str) -> str:
    try:
        # surrogateescape: a cgroup name in any bytes still maps back to its folder
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except (OSError, ValueError):  # missing, unreadable, a folder, a NUL in the path
        return ""


def _int(text: str) -> int | None:
    """A non-negative decimal integer, or None ("max", empty, garbage). The kernel's
    numbers have at most 20 digits; Python refuses to parse thousands of them."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else None


def _limit(text: str) -> int | None:
    v = _int(text)
    return v if v is not None and v < UNLIMITED else None


def _stat(path: str) -> dict[str, str]:
    """memory.stat: key -> value text."""
    out = {}
    for line in _read(path).splitlines():
        k, _, v = line.partition(" ")
        out[k] = v
    return out


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_large_blocks(threshold: int = 1 << 20) -> bool:
    """Make every allocation of ``threshold`` bytes or more its own mapping, handed back
    to the system when freed. glibc by default raises its mmap threshold each time such a
    block is freed (up to 32 MiB), after which a prefill's large temporaries come from
    the heap and its free lists keep them resident: the peak RSS of a long prompt then
    grows well past the activations the plan counts (docs/PERFORMANCE.md). A fixed
    threshold stops that. Returns False where the C library is not glibc."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def drive_read_bytes() -> int | None:
    """Bytes this process has had fetched from storage (/proc/self/io read_bytes): its
    reads less what the page cache served. None where the kernel does not say."""
    for line in _read("/proc/self/io").splitlines():
        if line.startswith("read_bytes:"):
            return _int(line.split(":", 1)[1])
    return None


def rss_bytes() -> int:
    """Current resident set size."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM, which belongs to the address space (an exec starts
    it afresh). getrusage's ru_maxrss, the fallback, survives exec on Linux: a k3 started
    by a large parent (a test runner, a server that forks) would report the parent's
    size as its own and plan for it."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def baseline_bytes() -> int:
    """This process's own footprint, measured: the peak RSS so far (compiling a kernel
    peaks above what it leaves resident) plus a margin for thread stacks and allocator
    slack. Call it after the kernels are loaded."""
    return max(rss_bytes(), peak_rss_bytes()) + BASELINE_MARGIN
