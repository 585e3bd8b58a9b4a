"""Fused BF16-weight linear: y = x @ fp32(w).T without materialising fp32(w).

Numeric contract
----------------
* The weight stays in memory as stored (``torch.bfloat16``); each element is widened
  on the fly (bf16 -> fp32 is exact: the 16 bits become the top half of a 32-bit word).
* Activations and accumulators are fp32; products are accumulated with fused
  multiply-adds (one rounding per step).
* The summation order of every output element is fixed by this source, never by the
  compiler, the thread count or the number of tokens in the call (the *canonical
  order* below). Results are therefore bit-identical for 1 or N threads, run to run,
  and for a token computed alone (decode, T=1) or with others (prefill).

Canonical order of ``y[t, n] = sum_k x[t, k] * w[n, k]`` (K = in-features)
--------------------------------------------------------------------------
``LANES`` = 64 fp32 accumulators ``a[0..63]`` start at +0.0; ``Km = K - K % 64``:

1. for j = 0 .. Km/64 - 1 (in order), for every lane l:
   ``a[l] = fma(x[64j + l], w[64j + l], a[l])``
2. tail: for l < K % 64: ``a[l] = fma(x[Km + l], w[Km + l], a[l])``
3. halving tree: for h = 32, 16, 8, 4, 2, 1: ``a[i] = a[i] + a[i + h]`` (i < h);
   the result is ``a[0]``.

How it is enforced: step 1 is hand-written LLVM vector code (lanes are explicit,
``llvm.fma`` on float vectors; no fast-math flag is ever set), so LLVM may map the 64
lanes onto any SIMD width but cannot reorder a lane's sum: the bits depend on nothing
but IEEE fp32 fma semantics. Steps 2-3 are scalar numba code or the same additions
on a register vector (``tree_sum_ir``).

Kernels are numba ``@njit(parallel=True, cache=True, nogil=True)`` functions with
``prange`` over fixed blocks of output rows, so every output element is produced by
exactly one thread.

* T = 1 (decode): each weight row is streamed once, its 64 lanes in registers (memory
  bound); several rows at a time where the rows are long (``_T1_MANY_K``; not on the
  generic path).
* T > 1 (batches, speculative checks, prefill): register tiles of ``_NT`` tokens x
  ``_NR`` rows (``make_tile``). The 64 lanes are 64 independent sums, so a tile works
  on one machine register of lanes at a time (16 with AVX-512, 8 with AVX2,
  ``kernel_isa``) and keeps nt x nr accumulators in registers, loading each weight
  vector once for nt tokens and each activation vector once for nr rows. A 32-bit load
  of two bf16 gives the even element by a shift and the odd one by a mask, so the
  tiles hold even and odd elements in separate registers: the activations are copied
  once per call into that lane order (``pair_split_x``) and the lanes put back in
  canonical order before the tree. Up to ``_ST`` tokens sweep K together in chunks of
  ``_KC``: each chunk of a row block's weights (in L2) serves every token tile in turn
  (each tile's activation chunk in L1, its accumulators in L2 between chunks); the last
  chunk trees the lanes straight into the output.
"""

from __future__ import annotations

import numpy as np
import torch
import numba
from numba import get_thread_id, njit, prange

from .cpu import LANES, PAIR_SPLIT, PF_ARG, _KC, _NR, _NT, _RB, _RB1, _ST, _T1_MANY_K, _T1_NR, _T1_PF, _T1_PF1, _TILE_LOC, _TILE_NEXT, _TILE_PF, _V
from .launch import J_ADDR, J_N, J_OFF, J_X0, J_X1, SERIAL_LIMITS, _as_f32_activations, _launch, _launch_t1, described, empty64, grouped_jobs, job_blocks, scratch_f32
from .simd import _bf16_to_f32, _fma, _i16_ptr, _pair_split_step, _tree_sum, _zero, make_unpermute, make_vdot
from .tiles import make_dotn_bf16, make_tile
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

_vdot_bf16 = make_vdot(1, 1, 1, "bf16")     # T = 1 with a tail
_tile_eo = make_tile(_NT, _NR, 1, "bf16eo", _V, pf=PF_ARG, pf_locality=_TILE_LOC)
_tile1_eo = make_tile(_NT, 1, 1, "bf16eo", _V, pf=PF_ARG, pf_locality=_TILE_LOC)     # a block's last rows
_unpermute = make_unpermute(PAIR_SPLIT)
_dotn_bf16 = make_dotn_bf16(_T1_NR, _T1_PF)
_dot_bf16 = make_dotn_bf16(1, _T1_PF1)


@njit(cache=True, nogil=True, inline="always")
def _t1_rows(x, x0, w, out, off, r0, r1):
    """out[off + n] = x[x0] . fp32(w[n]) for rows r0 <= n < r1 (one token: each weight row
    streamed once, memory bound), in the canonical order: the T = 1 work of every
    kernel here."""
    K = x.shape[1]
    nj = K // LANES
    km = nj * LANES
    if km == K:                                       # no tail: the whole row in registers
        n = r0
        while K >= _T1_MANY_K and n + _T1_NR <= r1:   # _T1_NR rows at a time, _T1_NR streams
            ys = _dotn_bf16(x, x0, w, n, nj)
            for i in range(_T1_NR):
                out[off + n + i] = ys[i]
            n += _T1_NR
        while n < r1:
            out[off + n] = _dot_bf16(x, x0, w, n, nj)
            n += 1
        return
    acc = np.empty((1, LANES), np.float32)            # a tail (K % 64): lanes through memory
    a = acc[0]
    for n in range(r0, r1):
        _zero(a)
        _vdot_bf16(acc, (0,), x, x, (x0,), 0, w, w, (n,), 0, nj, 1, 0)
        for i in range(K - km):
            a[i] = _fma(x[x0, km + i], _bf16_to_f32(w[n, km + i]), a[i])
        out[off + n] = _tree_sum(a)


@njit(cache=True, nogil=True, inline="always")
def _t1_block(x, jobs, out, starts, b, rb1):
    """Row block b (``job_blocks``) of a job table whose jobs all have one token."""
    g = np.searchsorted(starts, b, side="right") - 1
    N = jobs[g, J_N]
    w = numba.carray(_i16_ptr(jobs[g, J_ADDR]), (N, x.shape[1]))
    r0 = (b - starts[g]) * rb1
    _t1_rows(x, jobs[g, J_X0], w, out, jobs[g, J_OFF], r0, min(N, r0 + rb1))


@njit(parallel=True, cache=True, nogil=True)
def _bf16_t1(x, jobs, out, rb1):
    """``_bf16_grouped`` for a table whose jobs all have one token (decode): the same
    rows in the same order, without the scratch and the code of the token tiles (a
    smaller call: less to set up and to fetch)."""
    starts = job_blocks(jobs, rb1, rb1)
    for b in prange(starts[-1]):
        _t1_block(x, jobs, out, starts, b, rb1)


@njit(cache=True, nogil=True)
def _bf16_t1_serial(x, jobs, out, rb1):
    """``_bf16_t1`` on the calling thread alone, for calls too small to pay for waking
    the pool."""
    for g in range(jobs.shape[0]):                    # whole jobs: no blocks to find
        N = jobs[g, J_N]
        w = numba.carray(_i16_ptr(jobs[g, J_ADDR]), (N, x.shape[1]))
        _t1_rows(x, jobs[g, J_X0], w, out, jobs[g, J_OFF], 0, N)


@njit(parallel=True, cache=True, nogil=True)
def _bf16_grouped(x, xs, jobs, out, rb1, rb, kc, nth):
    """For every job g (``jobs``: the J_* columns): out[off + t * n + r] = x[x0 + t] . fp32(W_g[r])
    for t < x1 - x0, r < n, with W_g the bf16 bits [n, K] at address jobs[g, J_ADDR].
    x float32 [M, K]; xs: x with each 64-element step in the ``pair_split`` order (only
    read by jobs of more than one token); out float32 (flat). One prange over the row
    blocks of all jobs, so every output element is computed by one thread, in the
    canonical order.

    A job with one token streams each weight row once (memory bound). A job with more
    takes its tokens _ST at a time and sweeps K in chunks; per chunk, each tile of _NT
    of those tokens (whose activation chunk stays in L1) runs over the block's rows _NR
    at a time, the bf16 weights widened in registers (the chunk's weights stay in L2 for
    the next tile); the accumulator lanes persist across chunks, so the order is the same."""
    K = x.shape[1]
    nj = K // LANES
    km = nj * LANES
    starts = job_blocks(jobs, rb1, rb)
    # per-thread scratch, allocated once per call (nth = numba threads of the caller;
    # numba.get_num_threads() inside a cached function would defeat the cache)
    acc_all = empty64(nth * rb * _ST * LANES).reshape((nth, rb * _ST, LANES))
    for b in prange(starts[-1]):
        g = np.searchsorted(starts, b, side="right") - 1
        N = jobs[g, J_N]
        x0 = jobs[g, J_X0]
        T = jobs[g, J_X1] - x0
        off = jobs[g, J_OFF]
        w = numba.carray(_i16_ptr(jobs[g, J_ADDR]), (N, K))
        tid = get_thread_id()
        if T == 1:
            _t1_rows(x, x0, w, out, off, (b - starts[g]) * rb1, min(N, (b - starts[g] + 1) * rb1))
            continue
        r0 = (b - starts[g]) * rb
        nrb = min(N, r0 + rb) - r0
        acc = acc_all[tid]                                # token t, row r of a super tile at r * _ST + t
        for T0 in range(0, T, _ST):                       # super tiles of _ST tokens: each chunk
            ntt = min(_ST, T - T0)                        # of the block's weights serves all their
            if km == 0:                                   # token tiles while it is in L2
                for r in range(nrb):
                    for t in range(ntt):
                        _zero(acc[r * _ST + t])
            for c0 in range(0, km, kc):
                njc = (min(km, c0 + kc) - c0) // LANES
                mode = (1 if c0 == 0 else 0) | (2 if c0 + kc >= km and km == K else 0)
                for t0 in range(T0, T0 + ntt, _NT):       # a token tile: its activation chunk in L1
                    nt = min(_NT, T0 + ntt - t0)
                    xt = x0 + t0
                    ob = off + t0 * N + r0
                    a0 = t0 - T0
                    r = 0
                    while r < nrb:
                        nr = _NR if r + _NR <= nrb else 1
                        # prefetch what this thread reads next: the next rows' same
                        # columns, then the block's first rows' next chunk, then the
                        # next block (its next prange item), else nothing
                        if not _TILE_NEXT:
                            pfo = _TILE_PF
                        elif r + nr < nrb:
                            pfo = nr * K
                        elif c0 + kc < km:
                            pfo = -r * K + kc
                        elif r0 + rb < N:
                            pfo = (rb - r) * K - c0
                        else:
                            pfo = 0
                        if nr == _NR:
                            _tile_eo(nt, acc, a0 + r * _ST, _ST, xs, xs, xt, c0, w, w, r0 + r, c0, njc, mode, out, ob + r, N,
                                     pfo)
                        else:
                            _tile1_eo(nt, acc, a0 + r * _ST, _ST, xs, xs, xt, c0, w, w, r0 + r, c0, njc, mode, out, ob + r, N,
                                      pfo)
                        r += nr
            if km < K:                                    # the tail, then the tree
                for t in range(ntt):
                    xt = x0 + T0 + t
                    for r in range(nrb):
                        a = acc[r * _ST + t]
                        _unpermute(a)
                        for i in range(K - km):
                            a[i] = _fma(x[xt, km + i], _bf16_to_f32(w[r0 + r, km + i]), a[i])
                        out[off + (T0 + t) * N + r0 + r] = _tree_sum(a)


def _bf16_matrix(w) -> tuple[int, int, int]:
    """w: torch.bfloat16 [N, K] (or numpy uint16/int16 bit patterns), contiguous ->
    (N, address, K). Nothing is converted: a weight's bytes are read where they lie."""
    if isinstance(w, torch.Tensor):
        if w.device.type != "cpu":
            raise ValueError(f"w must be a CPU tensor, got device {w.device}")
        if w.dtype != torch.bfloat16:
            raise ValueError(f"w must be torch.bfloat16, got {w.dtype}")
        if w.dim() != 2:
            raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
        if not w.is_contiguous():
            raise ValueError("w must be contiguous (make it contiguous once at load time; "
                             "bf16_linear never copies a weight matrix)")
        return w.shape[0], w.data_ptr(), w.shape[1]
    if isinstance(w, np.ndarray):
        if w.dtype not in (np.uint16, np.int16):
            raise ValueError(f"numpy w must hold bf16 bit patterns as uint16/int16, got {w.dtype}")
        if w.ndim != 2:
            raise ValueError(f"w must be 2-D [N, K], got shape {w.shape}")
        if not w.flags.c_contiguous:
            raise ValueError("w must be C-contiguous")
        return w.shape[0], w.ctypes.data, w.shape[1]
    raise ValueError(f"w must be a torch.bfloat16 tensor, got {type(w).__name__}")


def pair_split_x(x: np.ndarray) -> np.ndarray:
    """A copy of activations x float32 [T, K] with each whole 64-element step in the
    PAIR_SPLIT order (the tail, K % 64, as it is): the x the even/odd tiles read, on a
    64-byte boundary, in per-thread huge-page scratch (``scratch_f32``)."""
    xs = scratch_f32(x.shape)
    _pair_split_into(x, xs)
    return xs


@njit(cache=True, nogil=True)
def _pair_split_into(x, xs):
    T, K = x.shape
    nj = K // LANES
    for t in range(T):
        _pair_split_step(x[t], xs[t], nj)
        for k in range(nj * LANES, K):
            xs[t, k] = x[t, k]


def run_bf16_jobs(xn: np.ndarray, jobs: np.ndarray, out: np.ndarray, work: int, tmax: int) -> None:
    """The kernel call of a job table (``grouped_jobs``: jobs, total, work, tmax) on
    activations xn (C-contiguous float32 [M, K]) into out (flat float32 of the table's
    total), as ``bf16_grouped`` makes it; for callers that keep the tables and outputs
    themselves (k3.kernels.moe.expert_ffn)."""
    if out.size == 0:
        return
    if xn.shape[1] == 0:
        out[:] = 0.0
        return
    if tmax == 1:
        _launch_t1(_bf16_t1, _bf16_t1_serial, work, SERIAL_LIMITS["bf16"], xn, jobs, out, _RB1)
        return
    _launch(_bf16_grouped, work, xn, pair_split_x(xn) if tmax > 1 else xn, jobs, out, _RB1, _RB, _KC)


def bf16_grouped(x, ws, rows=None) -> torch.Tensor:
    """Several BF16 linears in one kernel call. x float32 [M, K]; ws: bf16 matrices
    [N_g, K] (contiguous); ``rows``: per matrix the rows (x0, x1) of x it multiplies
    (None: all of them). Returns one flat float32 tensor holding x[x0:x1] @ fp32(W_g).T
    for g = 0, 1, ... one after another, each row-major [x1 - x0, N_g].

    Each output element has the canonical order (module docstring): the same bits as
    ``bf16_linear(x[x0:x1], W_g)``, whatever the grouping, tokens or thread count."""
    return torch.from_numpy(_bf16_grouped_np(x, ws, rows))


def _bf16_grouped_np(x, ws, rows=None) -> np.ndarray:
    """bf16_grouped's result as the numpy array it fills."""
    xn, _ = _as_f32_activations(x)
    M, K = xn.shape
    jobs, total, work, tmax = grouped_jobs(M, K, ws, _bf16_matrix, rows)
    out = np.empty(total, dtype=np.float32)
    run_bf16_jobs(xn, jobs, out, work, tmax)
    return out


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: float32 [T, K] (T = 1..~4096 tokens), w: torch.bfloat16 [N, K] (contiguous).

    Returns float32 [T, N] = x @ fp32(w).T, fused: the bf16 weight is widened on the fly,
    never materialising fp32(w). A 1-D x [K] gives a 1-D result [N]. A non-contiguous x
    is copied (activations only); a non-contiguous w is refused with ValueError.
    Summation order: the canonical order of the module docstring, so the result is
    bit-identical for any thread count and any number of tokens sharing the call."""
    xn, was_1d = _as_f32_activations(x)
    M, K = xn.shape
    jobs, total, work, tmax = grouped_jobs(M, K, (w,), _bf16_matrix)  # checks w against x
    out = np.empty(total, dtype=np.float32)
    run_bf16_jobs(xn, jobs, out, work, tmax)
    if was_1d:
        return torch.from_numpy(out)
    return torch.from_numpy(out.reshape(M, total // M if M else described(w, _bf16_matrix)[0]))


_cache_leave(_CACHE_PREV)
