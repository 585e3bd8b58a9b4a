"""What /proc/cpuinfo says about this CPU, read in one place: the doctor reports it, the
kernels pick a few tuning choices (never results) by vendor, the benchmarks label every
row with it. Nothing here imports torch or numba."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

#: /proc/cpuinfo's vendor_id -> the short name the tuning choices use
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


@dataclass(frozen=True)
class CpuInfo:
    model: str                # "model name" (or the platform's name for the processor)
    vendor: str               # "intel", "amd" or "" (unknown, or not x86)
    flags: frozenset          # the feature flags of the first processor listed
    physical: int | None      # distinct (physical id, core id) pairs, None if not listed


def parse(text: str) -> CpuInfo:
    """A CpuInfo from the text of /proc/cpuinfo (x86's "flags", ARM's "Features")."""
    model = vendor = ""
    flags: set = set()
    cores = set()
    phys = core = None
    for line in text.splitlines() + [""]:
        if ":" not in line:                       # a blank line ends one processor's block
            if phys is not None or core is not None:
                cores.add((phys, core))
            phys = core = None
            continue
        k, v = (x.strip() for x in line.split(":", 1))
        if k in ("model name", "Model", "cpu model") and not model:
            model = v
        elif k == "vendor_id" and not vendor:
            vendor = VENDORS.get(v, "")
        elif k in ("flags", "Features") and not flags:
            flags = set(v.split())
        elif k == "physical id":
            phys = v
        elif k == "core id":
            core = v
    return CpuInfo(model or platform.processor() or platform.machine() or "unknown", vendor, frozenset(flags),
                   len(cores) or None)


@functools.lru_cache(maxsize=1)
def cpuinfo() -> CpuInfo:
    """This machine's CpuInfo (read once; an unreadable /proc/cpuinfo gives an empty one)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return parse(f.read())
    except OSError:
        return parse("")
