"""Where numba keeps k3's compiled kernels.

numba keys each cached function on its own source file only, but k3's kernels compile
in code from one another (``simd`` and ``tiles`` intrinsics in ``bf16`` and ``mxfp4``,
``vml`` in the fused ops): after a ``git pull`` that changed ``bf16.py`` alone,
the cached ``mxfp4`` and ``moe`` functions would keep the old code. So the kernel
modules are compiled into a folder named by a hash of every kernel source (and of
``K3_KERNEL_ISA``, the path a process compiles): any change to any of them starts a
fresh folder (~8 MB; old ones can be deleted at any time). Each kernel module calls
``enter()`` before its first ``@njit(cache=True)`` and ``leave()`` after its last, so
other code's numba functions keep numba's own cache location. An explicit
``NUMBA_CACHE_DIR`` wins; where the folder cannot be written numba falls back to its
usual places. k3.warmup leaves a marker in ``jobs/`` for each group of kernels it has
compiled there (:func:`missing`, :func:`mark`), so a run knows before it starts whether
it will compile, and what.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import config

from .. import env

#: every file of the kernel package (they compile in one another's code), relative to the k3 package
KERNEL_SOURCES = tuple(sorted(f"kernels/{f.name}" for f in Path(__file__).resolve().parent.glob("*.py")))

_PKG = Path(__file__).resolve().parent.parent
_DIR: str | None = None


def folder(sources: dict[str, bytes] | None = None, isa: str | None = None) -> Path:
    """The cache folder for these kernel sources (default: the installed files) and
    instruction-set choice (default: K3_KERNEL_ISA)."""
    if sources is None:
        sources = {rel: (_PKG / rel).read_bytes() for rel in KERNEL_SOURCES}
    h = hashlib.sha256()
    for rel in sorted(sources):
        h.update(rel.encode() + b"\0" + hashlib.sha256(sources[rel]).digest())
    h.update(b"isa=" + ((env.kernel_isa() or "") if isa is None else isa).encode())
    return env.cache_dir() / "numba" / h.hexdigest()[:16]


def enter() -> str | None:
    """Point numba's cache at ``folder()`` for the functions defined next; returns the
    setting to give ``leave`` (None: the user chose NUMBA_CACHE_DIR, left alone)."""
    global _DIR
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    if _DIR is None:
        try:
            _DIR = str(folder())
        except (OSError, RuntimeError):  # a source unreadable, no home folder: numba's usual places
            return None
    prev = config.CACHE_DIR
    config.CACHE_DIR = _DIR
    return prev


def leave(prev: str | None) -> None:
    if prev is not None:
        config.CACHE_DIR = prev


def where() -> str | None:
    """The kernel folder this process compiles into; None under a NUMBA_CACHE_DIR of the
    user's (or where no folder could be named)."""
    return _DIR


def _stamp() -> str:
    """What numba's cache index checks beside the code: the source files' place and their
    modification times and sizes. A fresh clone, another venv or a checkout that touched
    the files gets new markers, so the run knows it will compile (and says so)."""
    h = hashlib.sha256(str(_PKG).encode())
    for rel in KERNEL_SOURCES:
        try:
            st = (_PKG / rel).stat()
            h.update(f"|{rel}:{st.st_mtime_ns}:{st.st_size}".encode())
        except OSError:
            h.update(f"|{rel}:?".encode())
    return h.hexdigest()[:12]


def _marker(job: str) -> Path | None:
    if _DIR is None:
        return None
    import numba
    return Path(_DIR) / "jobs" / f"{job}.numba-{numba.__version__}.{_stamp()}"


def missing(jobs) -> list[str]:
    """The warm-up jobs (k3.warmup.JOBS) whose kernels this folder does not hold yet: no
    marker of a finished run of them. Empty under a NUMBA_CACHE_DIR of the user's (k3
    cannot tell; the kernels compile where they are first used)."""
    if _DIR is None:
        return []
    return [j for j in jobs if not _marker(j).is_file()]


def mark(job: str) -> None:
    """A warm-up job's kernels are all in the folder (best effort: an unwritable folder
    only means the next run checks again)."""
    m = _marker(job)
    if m is None:
        return
    try:
        m.parent.mkdir(parents=True, exist_ok=True)
        m.touch()
    except OSError:
        pass
