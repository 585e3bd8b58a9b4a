"""How kernels are launched and fed: job tables (a grouped call's matrices, their
addresses and the rows of x each multiplies), what a call checks about a weight kept
per live weight object, the scratch allocator (64-byte aligned, huge pages, per
thread), and the thread policy: below a work limit a parallel op runs as its serial
twin on the calling thread, since waking the pool costs more than a second core gives.
"""

from __future__ import annotations

import threading
import weakref
import numpy as np
import torch
import numba
from numba import njit

from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

# Columns of a grouped call's job table (int64 [G, 4 + addresses]): job g multiplies
# rows x0..x1-1 of x by its matrix W_g [n, K] (at the address(es) from column J_ADDR)
# and writes the [x1-x0, n] result row-major at out[off:].
J_N, J_X0, J_X1, J_OFF, J_ADDR = 0, 1, 2, 3, 4


@njit(cache=True, nogil=True)
def empty64(n):
    """An uninitialised float32 [n] whose data start on a 64-byte boundary (a cache line,
    one 512-bit register). numpy's and numba's allocators give 16 or 32 bytes, and then
    every 64-byte vector load from the array straddles two cache lines, which slowed the
    T > 1 tiles."""
    buf = np.empty(n + 16, np.float32)
    o = (-(buf.ctypes.data >> 2)) & 15
    return buf[o:o + n]


#: bytes of T > 1 scratch (``scratch_f32``) a Python thread keeps between kernel calls;
#: a call that needs more allocates its own
_SCRATCH_KEEP = 16 << 20
_SCRATCH = threading.local()


def scratch_f32(shape: tuple[int, int]) -> np.ndarray:
    """An uninitialised float32 array of ``shape`` on a 64-byte boundary, in transparent
    huge pages where the system gives them (``k3.checkpoint.io.aligned_empty``): the
    copy of x the T > 1 tiles read. Its token rows lie kilobytes apart, each on its
    own 4 KiB page, and a tile sweep over them misses the TLB on every row; in 2 MiB
    pages they share a few entries. One buffer of up to _SCRATCH_KEEP bytes per Python
    thread is kept and reused by the next call, so the caller must be done with the
    array before the same thread asks again (one kernel call at a time per thread)."""
    from ..buffers import HUGE, aligned_empty
    n = shape[0] * shape[1]
    if 4 * n > _SCRATCH_KEEP:
        return aligned_empty(4 * n, huge=True).view(np.float32).reshape(shape)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < n:
        # one whole huge page at least, else aligned_empty would not advise one
        buf = _SCRATCH.buf = aligned_empty(max(4 * n, HUGE), huge=True).view(np.float32)
    return buf[:n].reshape(shape)


@njit(cache=True, nogil=True)
def job_blocks(jobs, rb1, rb, long_t=0, st=1):
    """Prefix sums of the jobs' row blocks (rb1 rows when a job has one token, rb
    otherwise): job g owns blocks starts[g] .. starts[g+1]-1. A job of more than
    ``long_t`` tokens (0: none) has one block per (super tile of ``st`` tokens, row
    block), super tile major: block i is super tile i // n, row block i % n of its n."""
    G = jobs.shape[0]
    starts = np.empty(G + 1, np.int64)
    starts[0] = 0
    for g in range(G):
        T = jobs[g, J_X1] - jobs[g, J_X0]
        b = rb1 if T == 1 else rb
        n = (jobs[g, J_N] + b - 1) // b
        starts[g + 1] = starts[g] + (n * ((T + st - 1) // st) if 0 < long_t < T else n)
    return starts


# =========================================================================== wrappers
#: below this many multiply-adds one thread beats waking the pool (under OpenMP with
#: OMP_WAIT_POLICY=PASSIVE, whose sleeping workers are slow to wake); results do not
#: depend on it
_SERIAL_WORK = 1 << 18

#: (get, set, small calls on one thread) once numba's threading layer is up: see _threads
_TH: tuple | None = None


def _threads() -> tuple:
    """(get, set, serial_small): numba's C functions for the calling thread's count (the
    public numba.get_num_threads / set_num_threads add Python checks to every call), and
    whether small work is run on one thread: not under the TBB layer, whose idle workers
    join a parallel region quickly, where OpenMP's passive ones are slow to wake
    (docs/PERFORMANCE.md, "Per-token overhead")."""
    global _TH
    if _TH is None:
        numba.get_num_threads()  # starts the threading layer
        from numba.np.ufunc import parallel as _par
        get, put = getattr(_par, "_get_num_threads", None), getattr(_par, "_set_num_threads", None)
        if not (callable(get) and callable(put)):  # another numba's layout: the public ones
            get, put = numba.get_num_threads, numba.set_num_threads
        _TH = (get, put, numba.threading_layer() != "tbb")
    return _TH


def _launch(kernel, work, *args):
    """kernel(*args, nth) on the caller's numba threads, or on one thread for small work
    (outside TBB)."""
    get, put, serial_small = _TH or _threads()
    nth = get()
    if serial_small and nth > 1 and work < _SERIAL_WORK:
        put(1)
        try:
            kernel(*args, 1)
        finally:
            put(nth)
    else:
        kernel(*args, nth)


#: below this much work (multiply-adds; state elements for KDA) a parallel kernel runs as
#: its serial twin on the calling thread (``_launch_t1``): waking the pool costs more than
#: the second core gives (docs/PERFORMANCE.md, "Per-token overhead"). Per family: the
#: one-token BF16 and MXFP4 kernels and the fused ops (``_run``). Read at each call, so a
#: test or the warm-up can change them; results never depend on them.
SERIAL_LIMITS = {"bf16": 1 << 18, "mxfp4": 1 << 18, "ops": 1 << 18}


def _launch_t1(kernel, serial, work, limit, *args):
    """A parallel kernel with a serial twin (the one-token kernels here, the fused ops'
    ``_run``): ``serial(*args)`` on the calling thread when work < limit or the caller
    has one numba thread, else ``kernel(*args)``."""
    if work < limit or (_TH or _threads())[0]() == 1:
        serial(*args)
    else:
        kernel(*args)


def as_cpu_array(a, name: str, torch_dtype, np_dtype) -> np.ndarray:
    """A CPU torch tensor or numpy array of the given dtype -> numpy (no copy); ValueError
    naming ``name`` for anything else."""
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {a.device}")
        if a.dtype != torch_dtype:
            raise ValueError(f"{name} must be {str(torch_dtype).replace('torch.', '')}, got {a.dtype}")
        return a.detach().numpy() if a.requires_grad else a.numpy()  # (detach is a dispatched op)
    if isinstance(a, np.ndarray):
        if a.dtype != np_dtype:
            raise ValueError(f"{name} must be {np.dtype(np_dtype).name}, got numpy {a.dtype}")
        return a
    raise ValueError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def _as_f32_activations(x, name="x"):
    """x (torch or numpy, float32, 1-D or 2-D) -> (C-contiguous float32 numpy [T, K], was_1d)."""
    if type(x) is torch.Tensor and x.dim() == 2 and x.dtype is torch.float32 and x.is_cpu \
            and not x.requires_grad and x.is_contiguous():
        return x.numpy(), False   # the decode path: the checks below, in their cheapest form
    if type(x) is np.ndarray and x.ndim == 2 and x.dtype == np.float32 and x.flags.c_contiguous:
        return x, False
    xn = as_cpu_array(x, name, torch.float32, np.float32)
    if xn.ndim not in (1, 2):
        raise ValueError(f"{name} must be 2-D [T, K] (or 1-D [K]), got shape {tuple(xn.shape)}")
    was_1d = xn.ndim == 1
    if was_1d:
        xn = xn.reshape(1, -1)
    # activations are small: a contiguous copy (only when needed) keeps the kernels simple
    return np.ascontiguousarray(xn), was_1d


@njit(cache=True, nogil=True)
def _fill_jobs(d, rows, M, K, jobs):
    """job_table's arithmetic and checks: the jobs with rows, in order; returns (their
    number, total, most tokens, the first bad matrix or -1, why: 1 its in-features are
    not K, 2 its rows lie outside the activation)."""
    off = tmax = j = 0
    na = d.shape[1] - 1                               # d[g] = (n, addresses..., in-features)
    for g in range(d.shape[0]):
        if d[g, na] != K:
            return j, off, tmax, g, 1
        x0, x1 = (0, M) if rows.shape[0] == 0 else (rows[g, 0], rows[g, 1])
        if not 0 <= x0 <= x1 <= M:
            return j, off, tmax, g, 2
        if x1 == x0 or d[g, 0] == 0:
            continue
        jobs[j, J_N] = d[g, 0]
        jobs[j, J_X0] = x0
        jobs[j, J_X1] = x1
        jobs[j, J_OFF] = off
        for a in range(1, na):
            jobs[j, J_ADDR + a - 1] = d[g, a]
        off += (x1 - x0) * d[g, 0]
        tmax = max(tmax, x1 - x0)
        j += 1
    return j, off, tmax, -1, 0


_ALL_ROWS = np.empty((0, 2), np.int64)


def job_table(M: int, K: int, mats, rows=None) -> tuple[np.ndarray, int, int, int]:
    """The job table (J_* columns) of a grouped call: matrix g, described by mats[g] =
    (n, address, ..., in-features) ([n, K] with its leading column at address; formats
    with more arrays give more addresses), multiplies rows ``rows[g]`` = (x0, x1) of an
    activation [M, K] (all of them when ``rows`` is None); the results lie one after
    another, each row-major [x1 - x0, n]. Returns (jobs, total output floats,
    multiply-adds, most tokens of one job); jobs with no rows or no outputs are left out
    of the table (their results are empty). ValueError for a matrix whose in-features
    are not K or whose rows lie outside the activation. Rebuilt for every call at
    decode: one array conversion and one compiled loop."""
    G = len(mats)
    d = np.array(mats, dtype=np.int64).reshape(G, -1)
    r = _ALL_ROWS if rows is None else np.array(rows, dtype=np.int64).reshape(G, 2)
    jobs = np.empty((G, J_ADDR + d.shape[1] - 2), np.int64)
    n, total, tmax, bad, why = _fill_jobs(d, r, M, K, jobs)
    if why == 1:
        raise ValueError(f"shape mismatch: x is [{M}, {K}] but weight {bad} is [{d[bad, 0]}, {d[bad, -1]}] "
                         "(in-features differ)")
    if why == 2:
        raise ValueError(f"job {bad}: rows [{r[bad, 0]}, {r[bad, 1]}) outside the activation's {M} rows")
    return jobs[:n], total, total * K, tmax


#: (describe, M, id(w_0), id(w_1), ...) -> (weakrefs, table); see ``grouped_jobs``
_TABLES: dict[tuple, tuple] = {}


def grouped_jobs(M: int, K: int, ws, describe, rows=None) -> tuple[np.ndarray, int, int, int]:
    """``job_table`` for weights ``ws`` described by ``describe`` (-> (n, address, ...,
    in-features)), each checked against x's K. Without ``rows`` (a layer's projections
    of one input, the same weight objects every step) the table of those objects at
    this M is kept and reused while they live."""
    if rows is None:
        key = (describe, M, *map(id, ws))
        e = _TABLES.get(key)
        if e is not None:
            for r, w in zip(e[0], ws):  # (a loop: a generator in all() costs more than the check)
                if r() is not w:
                    break
            else:
                return e[1]
    table = job_table(M, K, [described(w, describe) for w in ws], rows)
    if rows is None:
        try:
            refs = [weakref.ref(w, lambda _r, k=key, tables=_TABLES: tables.pop(k, None)) for w in ws]
        except TypeError:
            return table
        _TABLES[key] = (refs, table)
    return table


#: (weight object id, describe) -> (weakref, its checked descriptor); see ``described``
_DESC: dict[tuple, tuple] = {}


def described(w, describe, partner=None):
    """``describe(w)`` (a weight's checked address and shape, or another value derived
    from the weight alone), computed once per live weight object: the type, dtype and
    layout checks cost more than a small decode kernel, and a weight object's bytes
    never move. With ``partner``, ``describe(w, partner)``, kept per live pair. The
    entry goes with the object(s)."""
    if partner is None:
        k = (id(w), describe)  # one weight may be read two ways (a matrix, a vector)
    else:
        k = (id(w), describe, id(partner))
    e = _DESC.get(k)
    if e is not None and e[0]() is w and (partner is None or e[2]() is partner):
        return e[1]
    d = describe(w) if partner is None else describe(w, partner)
    try:
        # the dict bound now: at interpreter exit the module's globals may already be None
        drop = lambda _r, k=k, desc=_DESC: desc.pop(k, None)  # noqa: E731
        _DESC[k] = (weakref.ref(w, drop), d, None if partner is None else weakref.ref(partner, drop))
    except TypeError:  # an object without weak references: checked on every call
        pass
    return d

def _run(kernel, serial, n, *args):
    """kernel(*args) on the kernels' threads, or its serial twin (the same compiled
    block code) for work below ``SERIAL_LIMITS["ops"]``: ``_launch_t1``'s choice."""
    _launch_t1(kernel, serial, n, SERIAL_LIMITS["ops"], *args)


_cache_leave(_CACHE_PREV)
