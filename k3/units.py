"""Sizes: one formatter for every message, plan and report, and the O_DIRECT alignment.

GB and MB are decimal (1e9 / 1e6 bytes), as in the C engine's tables and the README.
"""

from __future__ import annotations

import math

GB = 1e9
MB = 1e6
#: O_DIRECT alignment: file offsets, read sizes and buffers are multiples of it
ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return n + (-n) % align


def human(n: float) -> str:
    """``n`` bytes with a unit: 512 B, 4.27 MB, 1.04 GB (2 decimals above bytes)."""
    n = float(n)
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000.0
        if abs(n) < 1000:
            return f"{n:.2f} {unit}"
    return f"{n / 1000.0:.2f} TB"


def _decimals(n: float) -> int:
    """Decimals that show ``n`` bytes in GB to ~1% (never fewer than 2)."""
    return max(2, 9 - math.floor(math.log10(max(abs(n), 1) / 100)))


def gb(n: float) -> str:
    """``n`` bytes as a number of GB: 2 decimals, more for small sizes (0.00042)."""
    return f"{n / GB:.{_decimals(n)}f}"


def gb_up(n: float) -> str:
    """Like :func:`gb`, rounded UP: a threshold quoted to the user must suffice."""
    d = _decimals(n)
    return f"{math.ceil(n / 10 ** (9 - d) - 1e-9) / 10 ** d:.{d}f}"
