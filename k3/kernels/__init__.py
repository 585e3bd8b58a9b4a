"""k3's compiled kernels (numba): the BF16 and MXFP4 matmuls, the fused per-token ops and
the one-token layer regions; model math calls them, never the other way round.

Public API::

    bf16_linear(x, w)              # x f32 [T, K], w bf16 [N, K] -> f32 [T, N]
    decode_mxfp4(packed, scale)    # -> f32 [R, C], bit-exact
    mxfp4_linear(x, packed, scale) # x f32 [T, C] -> f32 [T, R], fused decode + matmul
    bf16_grouped(x, ws, rows)      # several BF16 linears (each on its rows of x) in one call
    mxfp4_grouped(x, ws, rows)     # several MXFP4 linears in one call
    set_num_threads(n)             # numba threads for these kernels
    get_num_threads()

Every output element has one fixed summation order (see ``k3.kernels.bf16``), so the
results are bit-identical for any thread count, any number of tokens per call and any
grouping (a grouped call gives each product the bits its own linear call gives it).
"""

from __future__ import annotations

import numba


def _preload_tbb() -> str | None:
    """Load the oneTBB library the ``tbb`` wheel installs (``<prefix>/lib``, where numba's
    TBB pool does not look), so that numba's default layer order (tbb, then omp) can pick
    TBB. Its workers wake several times faster than sleeping OpenMP workers and yield to
    other processes instead of spinning (docs/PERFORMANCE.md, "Per-token overhead").
    Without it numba falls back to OpenMP; results are the same bits either way."""
    import ctypes
    import sys
    from importlib import metadata
    from pathlib import Path

    def candidates():
        yield Path(sys.prefix) / "lib" / "libtbb.so.12"  # where pip puts it in a venv
        try:  # elsewhere (a user or target install): ask the wheel's file list
            for f in metadata.files("tbb") or []:
                if f.name == "libtbb.so.12":
                    yield Path(f.locate())
        except metadata.PackageNotFoundError:
            pass

    for path in candidates():
        if path.is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                return str(path)
            except OSError:
                continue
    return None


TBB = _preload_tbb()

from .bf16 import bf16_grouped, bf16_linear  # noqa: E402
from .cpu import LANES  # noqa: E402
from .mxfp4 import decode_mxfp4, mxfp4_grouped, mxfp4_linear  # noqa: E402
from .mxfp4_ir import E2M1  # noqa: E402

__all__ = ["bf16_linear", "bf16_grouped", "decode_mxfp4", "mxfp4_linear", "mxfp4_grouped", "E2M1", "LANES",
           "set_num_threads", "get_num_threads", "max_threads"]


def max_threads() -> int:
    """Largest thread count numba allows in this process (NUMBA_NUM_THREADS, by default
    the number of CPUs at import time)."""
    return int(numba.config.NUMBA_NUM_THREADS)


def set_num_threads(n: int) -> None:
    """Set the number of numba threads the kernels use (safe to call repeatedly).

    ``n`` above the process maximum (``max_threads()``) is clamped to it; ``n < 1``
    raises ValueError. Like numba's own setting it applies to the calling Python
    thread (numba keeps it thread-local). Results do not depend on it, only speed."""
    n = int(n)
    if n < 1:
        raise ValueError(f"number of threads must be >= 1, got {n}")
    numba.set_num_threads(min(n, max_threads()))


def get_num_threads() -> int:
    """Thread count the kernels use in the calling Python thread."""
    return int(numba.get_num_threads())
