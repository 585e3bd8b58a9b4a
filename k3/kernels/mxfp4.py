"""MXFP4 ("mxfp4-pack-quantized", compressed-tensors) decode and fused decode+matmul.

Format (docs/MODEL.md §4): a logical weight W [R, C] is stored as ``packed`` uint8 [R, C/2]
and ``scale`` uint8 [R, C/32]. Byte j of a row holds element 2j in its low nibble and
element 2j+1 in its high nibble. Nibble n: sign = bit 3, magnitude = E2M1[n & 7].
W[r, c] = E2M1(n) * 2^(scale[r, c // 32] - 127).

* Every such value is exactly representable in fp32 (including scale byte 0, which
  gives 2^-127, a subnormal; 0.5 * 2^-127 = 2^-128 is still exact), so decoding is
  bit-exact and the decoded weight the matmul sees equals the dequantised weight.
* Scale byte 255 (E8M0 NaN in the OCP spec) decodes the whole group of 32 to +0.0,
  like the C engine kimi-k3-in-c. compressed-tensors gives +inf there (and NaN for the
  zero nibbles). Neither 0x00 nor 0xFF occurs in the K3 experts that were checked.
* Scale byte 254 with magnitude >= 2 overflows fp32 and gives +-inf, exactly like
  compressed-tensors' bf16 result.

``mxfp4_linear`` never builds the dequantised matrix. For T = 1 (decode) each 64-byte
step of a row is decoded in SIMD registers (on AVX-512 by a lane permute in the
scale byte's 16-entry fp32 table, one aligned load from 256 made beforehand,
``_decode_step_perm_ir``;
elsewhere in byte lanes: nibble -> 2 x its E2M1
value as a small signed integer, by a byte-shuffle table lookup where the CPU has one
(AVX2, AVX-512BW; ``kernel_isa``), else by vector arithmetic; widened to fp32 and
multiplied by the exact factor 2^(s-128); on AVX2 as bf16 words whose exponent a
saturating subtraction scales, ``_dot_mxfp4_w``) and consumed at once; the packed bytes are
read exactly once, prefetched ``PREFETCH_BYTES`` ahead (one thread's sequential stream
alone did not keep the memory busy). For T = 2 .. ``_NTF`` each decoded step is used
for all the tokens before the next is decoded (``make_vdotn_mxfp4``; on AVX2
``make_vdotn_w``). For more tokens a block of ``_RB`` rows is decoded once per scale
group (16 lanes of a step) into a per-thread fp32 scratch (exact values, group-major:
each lane group's steps contiguous) and swept whole by the register tiles of
``k3.kernels.tiles.make_gtile`` (even and odd elements as two streams), up to ``_GST``
tokens per decode. All paths compute the same canonical order
of one output y[t, r] (P = C/2 bytes per row, ``LANES`` = 64 fp32 accumulators
starting at +0.0, Pm = P - P % 64):

1. for j = 0 .. Pm/64 - 1, for every lane l, with p = 64j + l (a byte index):
   ``a[l] = fma(x[2p], W[2p], a[l]); a[l] = fma(x[2p+1], W[2p+1], a[l])``
2. the tail bytes p = Pm + l (l < P % 64) the same way into lane l;
3. the halving tree of ``k3.kernels.bf16`` (h = 32 .. 1), result a[0].

(A zero group, scale 255, and nibble 8 (-0, decoded as +0.0 in registers) contribute
signed zeros to the sum, which cannot change it: the accumulators start at +0.0 and a
sum that starts there is never -0.0, so the result equals decode-then-matmul bit for
bit.)

No fast-math reassociation, so the bits do not depend on the thread count, the number
of tokens in the call (decode == prefill) or the machine's SIMD width.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
import torch
from numba import get_thread_id, njit, prange

from .cpu import LANES, _V
from .launch import J_ADDR, J_N, J_OFF, J_X0, J_X1, SERIAL_LIMITS, _as_f32_activations, _launch, _launch_t1, as_cpu_array, empty64, grouped_jobs, job_blocks, scratch_f32
from .mxfp4_ir import GROUP, W_PERM, _GPJ, _JC, _RB, _RB1, _W16, _dec_hi, _dec_lo, _dot_mxfp4, _row_bad, _scale_f32, _vdot_mxfp4
from .mxfp4_tiles import _GST, _NR2, _NT2, _NTF, _dot_mxfp4_w, _gtile2, _gtile2_1, _trees_rb, _u8_ptr, _vdecode_group, _vdotn, _vdotn_w
from .simd import _fma, _tree_sum, _zero
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

# --------------------------------------------------------------------------- kernels
@njit(cache=True, nogil=True, inline="always")
def _decode_tail(pk, sc, we, wo, p0, P):
    """Scalar decode of bytes [p0, P) (whole 16-byte groups) into we/wo[0 : P-p0]."""
    for p in range(p0, P):
        f = _scale_f32(sc[p // 16])
        b = pk[p]
        we[p - p0] = _dec_lo(b) * f
        wo[p - p0] = _dec_hi(b) * f


@njit(parallel=True, cache=True, nogil=True)
def _decode_kernel(packed, scale, out, rb, nth):
    """out float32 [R, G, 32] <- packed uint8 [R, G, 16], scale uint8 [R, G] (nth unused)."""
    R, G = scale.shape
    nblk = (R + rb - 1) // rb
    for b in prange(nblk):
        for r in range(b * rb, min(R, (b + 1) * rb)):
            for g in range(G):
                s = scale[r, g]
                o = out[r, g]
                if s == 255:
                    for i in range(32):
                        o[i] = np.float32(0.0)
                else:
                    f = _scale_f32(s)
                    pk = packed[r, g]
                    for i in range(16):
                        o[2 * i] = _dec_lo(pk[i]) * f
                        o[2 * i + 1] = _dec_hi(pk[i]) * f


_W_PERM_ARR = np.array(W_PERM, np.int64)


@njit(cache=True, nogil=True)
def _split_x(x, jobs):
    """x float32 [M, 2P] -> (xe, xo, xep, xop): x's even / odd elements [M, P], and
    those in the W_PERM order of each 64-lane step when the AVX2 decode will read them
    (a job of at most _NTF tokens, P a multiple of 64; else xep / xop are xe / xo).
    One compiled pass: as numpy slicing and fancy indexing it cost more than a small
    MXFP4 kernel."""
    M, C = x.shape
    P = C // 2
    xe = empty64(M * P).reshape((M, P))
    xo = empty64(M * P).reshape((M, P))
    split_evens_odds(x, xe, xo)
    few = False
    if _W16 and P % LANES == 0:
        for g in range(jobs.shape[0]):
            if jobs[g, J_X1] - jobs[g, J_X0] <= _NTF:
                few = True
    if not few:
        return xe, xo, xe, xo
    xep = empty64(M * P).reshape((M, P))
    xop = empty64(M * P).reshape((M, P))
    perm_steps(xe, xo, xep, xop)
    return xe, xo, xep, xop


def _group_x(x: np.ndarray, jobs: np.ndarray) -> np.ndarray:
    """x float32 [M, 2P] -> xg [M, 2 Pm] (Pm = P - P % 64) in the group-major order
    that ``_gtile2`` reads for the jobs of more than _NTF tokens (``_vdecode_group``'s
    layout), in per-thread huge-page scratch (``scratch_f32``); [M, 0] when no job has
    more than _NTF tokens."""
    M, C = x.shape
    nj = C // (2 * LANES)
    if nj == 0 or (jobs[:, J_X1] - jobs[:, J_X0]).max(initial=0) <= _NTF:
        return np.empty((M, 0), np.float32)
    xg = scratch_f32((M, nj * LANES * 2))
    _group_x_into(x, xg)
    return xg


@njit(cache=True, nogil=True)
def _group_x_into(x, xg):
    """xg[t, 32 (nj q + j) + 16 s + i] = x[t, 2 (64 j + 16 q + i) + s], nj = Pm / 64."""
    M = x.shape[0]
    nj = xg.shape[1] // (LANES * 2)
    for t in range(M):
        for q in range(_GPJ):
            for j in range(nj):
                d = 32 * (nj * q + j)
                c = 2 * (LANES * j + 16 * q)
                for i in range(16):
                    xg[t, d + i] = x[t, c + 2 * i]
                    xg[t, d + 16 + i] = x[t, c + 2 * i + 1]


@njit(cache=True, nogil=True, inline="always")
def split_evens_odds(x, xe, xo):
    """xe / xo [M, P] = the even / odd elements of x [M, 2P]."""
    for t in range(x.shape[0]):
        for p in range(xe.shape[1]):
            xe[t, p] = x[t, 2 * p]
            xo[t, p] = x[t, 2 * p + 1]


@njit(cache=True, nogil=True, inline="always")
def perm_steps(xe, xo, xep, xop):
    """xep / xop = xe / xo in the W_PERM order of each 64-lane step (what the AVX2
    decode of one to _NTF tokens reads)."""
    for t in range(xe.shape[0]):
        for j in range(0, xe.shape[1], LANES):
            for i in range(LANES):
                xep[t, j + i] = xe[t, j + _W_PERM_ARR[i]]
                xop[t, j + i] = xo[t, j + _W_PERM_ARR[i]]


@njit(cache=True, nogil=True, inline="always")
def t1_perm(P):
    """Whether the one-token decode of rows of P bytes reads x in the W_PERM order too."""
    return _W16 and P % LANES == 0


@njit(cache=True, nogil=True, inline="always")
def _t1_rows(xe, xo, xep, xop, x0, packed, scale, out, off, r0, r1):
    """out[off + r] = x[x0] . W[r] for rows r0 <= r < r1 of one token: each row decoded
    in registers and consumed at once (the packed bytes read exactly once; on AVX2 by
    ``_dot_mxfp4_w`` from x in the W_PERM order, xep / xop, unless a scale of the row
    needs the byte-lane decode), in the canonical order: the T = 1 work of every
    kernel here."""
    P = xe.shape[1]
    nj = P // LANES
    pm = nj * LANES
    if pm == P:                                       # no tail: the whole row in registers
        for r in range(r0, r1):
            if _W16:
                y, bad = _dot_mxfp4_w(xep, xop, x0, packed, scale, r, nj)
                out[off + r] = _dot_mxfp4(xe, xo, x0, packed, scale, r, nj) if bad else y
            else:
                out[off + r] = _dot_mxfp4(xe, xo, x0, packed, scale, r, nj)
        return
    sc3 = np.empty((3, LANES), np.float32)            # a tail: the row's bytes after its last whole step
    acc = sc3[0]
    te = sc3[1]
    to = sc3[2]
    xe0 = xe[x0]
    xo0 = xo[x0]
    for r in range(r0, r1):
        _zero(acc)
        pk = packed[r]
        sc = scale[r]
        _vdot_mxfp4(acc, xe0, xo0, pk, sc, nj)
        _decode_tail(pk, sc, te, to, pm, P)
        for i in range(P - pm):
            acc[i] = _fma(xo0[pm + i], to[i], _fma(xe0[pm + i], te[i], acc[i]))
        out[off + r] = _tree_sum(acc)


@njit(cache=True, nogil=True, inline="always")
def _t1_block(xe, xo, xep, xop, jobs, out, starts, b, rb1):
    """Row block b (``job_blocks``) of a job table whose jobs all have one token."""
    P = xe.shape[1]
    g = np.searchsorted(starts, b, side="right") - 1
    R = jobs[g, J_N]
    packed = numba.carray(_u8_ptr(jobs[g, J_ADDR]), (R, P))
    scale = numba.carray(_u8_ptr(jobs[g, J_ADDR + 1]), (R, P // 16))
    r0 = (b - starts[g]) * rb1
    _t1_rows(xe, xo, xep, xop, jobs[g, J_X0], packed, scale, out, jobs[g, J_OFF], r0, min(R, r0 + rb1))


@njit(parallel=True, cache=True, nogil=True)
def _mxfp4_t1(x, jobs, out, rb1):
    """``_mxfp4_grouped`` for a table whose jobs all have one token (decode), x float32
    [M, 2P] as it is (split here, ``_split_x``): the same rows in the same order,
    without the scratch and the code of the multi-token paths (a smaller call: less to
    set up and to fetch)."""
    xe, xo, xep, xop = _split_x(x, jobs)
    starts = job_blocks(jobs, rb1, rb1)
    for b in prange(starts[-1]):
        _t1_block(xe, xo, xep, xop, jobs, out, starts, b, rb1)


@njit(cache=True, nogil=True)
def _mxfp4_t1_serial(x, jobs, out, rb1):
    """``_mxfp4_t1`` on the calling thread alone, for calls too small to pay for waking
    the pool."""
    xe, xo, xep, xop = _split_x(x, jobs)
    P = xe.shape[1]
    for g in range(jobs.shape[0]):                    # whole jobs: no blocks to find
        R = jobs[g, J_N]
        packed = numba.carray(_u8_ptr(jobs[g, J_ADDR]), (R, P))
        scale = numba.carray(_u8_ptr(jobs[g, J_ADDR + 1]), (R, P // 16))
        _t1_rows(xe, xo, xep, xop, jobs[g, J_X0], packed, scale, out, jobs[g, J_OFF], 0, R)


#: a row block of one job's weight: rows r0 .. r0 + nrb - 1 of its packed and scale bytes
TailRows = namedtuple("TailRows", "packed scale r0 nrb")
#: a block's tokens: rows xt .. xt + nt - 1 of x's even (xe) and odd (xo) elements
TailTokens = namedtuple("TailTokens", "xe xo xt nt")
#: a job's results: token t, row r at out[ob + t * R + r] (R rows per token)
TailOut = namedtuple("TailOut", "out ob R")


@njit(cache=True, nogil=True, inline="always")
def _tail_tree(rows, toks, acc, tb, dst, sc3):
    """Steps 2-3 of the canonical order for rows r0 .. r0 + nrb - 1 (``rows``) and tokens
    t < nt (``toks``) whose step-1 lanes are in acc[r * tb + t] (+0.0 when there are no
    whole steps): the tail bytes [Pm, P) of each row (decoded into sc3's rows 1 / 2) with
    x rows xt + t, then out[ob + t * R + r0 + r] = the halving tree (a whole block's
    rows' trees of a token at once, ``_trees_rb``)."""
    # (by attribute: unpacking a tuple of 2-D arrays built in a prange body, as the
    # callers' are, trips numba's parfor array analysis)
    packed, scale, r0, nrb = rows.packed, rows.scale, rows.r0, rows.nrb
    xe, xo, xt, nt = toks.xe, toks.xo, toks.xt, toks.nt
    out, ob, R = dst.out, dst.ob, dst.R
    P = xe.shape[1]
    nj = P // LANES
    pm = nj * LANES
    te = sc3[1]
    to = sc3[2]
    if pm < P or nj == 0:
        for r in range(nrb):
            if pm < P:
                _decode_tail(packed[r0 + r], scale[r0 + r], te, to, pm, P)
            for t in range(nt):
                a = acc[r * tb + t]
                if nj == 0:
                    _zero(a)
                for i in range(P - pm):
                    a[i] = _fma(xo[xt + t, pm + i], to[i], _fma(xe[xt + t, pm + i], te[i], a[i]))
    if nrb == _RB:
        for t in range(nt):
            _trees_rb(acc, t, tb, out, ob + t * R + r0)
        return
    for r in range(nrb):
        for t in range(nt):
            out[ob + t * R + r0 + r] = _tree_sum(acc[r * tb + t])


@njit(parallel=True, cache=True, nogil=True)
def _mxfp4_grouped(xe, xo, xep, xop, xg, jobs, out, rb1, rb, jc, nth):
    """For every job g (the J_* columns of ``k3.kernels.bf16``; packed bytes [n, P] at
    jobs[g, J_ADDR], scale bytes [n, P/16] at jobs[g, J_ADDR + 1]):
    out[off + t * n + r] = x[x0 + t] . W_g[r] for t < x1 - x0, r < n. xe/xo float32
    [M, P] (the even / odd elements of x). One prange over the row blocks of all jobs.

    A job with one token decodes each row in registers and consumes it at once (the
    packed bytes are read exactly once; on AVX2 by ``_dot_mxfp4_w`` from x in the
    W_PERM order, xep / xop, unless a scale of the row needs the byte-lane decode); one of up to _NTF tokens does the same for all
    its tokens, in chunks of jc 64-byte steps. A job with more takes its tokens _GST at
    a time: for each scale group q of a 64-byte step (16 lanes) a block of rb rows is
    decoded once into an exact fp32 scratch laid out group-major (``_vdecode_group``),
    which the register tiles (``_gtile2``, _NT2 tokens x _NR2 rows, x from xg in the
    same layout, ``_group_x``) sweep whole, each lane's sum finished in registers and
    stored once; such a job's prange items are (super tile, row block) pairs, super
    tile major (``job_blocks``: the threads work through one super tile's x at a time;
    a block that took all of a long job's super tiles read the whole of x again, from
    L3 once it outgrew L2: half the speed at 256 tokens). All have the canonical order
    of the module docstring."""
    P = xe.shape[1]
    nj = P // LANES
    pm = nj * LANES
    starts = job_blocks(jobs, rb1, rb, _NTF, _GST)
    # per-thread scratch, allocated once; no cache line holds two threads' rows (their
    # writes every block made the line bounce between the cores: docs/PERFORMANCE.md)
    gv_all = empty64(nth * 3 * LANES).reshape((nth, 3, LANES))
    wok = np.zeros((nth, (rb + 7) // 8 * 8 + 8), np.int64)
    ws_all = empty64(nth * rb * nj * 32).reshape((nth, rb, nj * 32))   # one scale group of rb rows
    acc_all = empty64(nth * rb * max(_GST, _NTF) * LANES).reshape((nth, rb * max(_GST, _NTF), LANES))
    for b in prange(starts[-1]):
        g = np.searchsorted(starts, b, side="right") - 1
        R = jobs[g, J_N]
        x0 = jobs[g, J_X0]
        T = jobs[g, J_X1] - x0
        off = jobs[g, J_OFF]
        packed = numba.carray(_u8_ptr(jobs[g, J_ADDR]), (R, P))
        scale = numba.carray(_u8_ptr(jobs[g, J_ADDR + 1]), (R, P // 16))
        tid = get_thread_id()
        if T == 1:
            _t1_rows(xe, xo, xep, xop, x0, packed, scale, out, off, (b - starts[g]) * rb1,
                     min(R, (b - starts[g] + 1) * rb1))
            continue
        nbr = (R + rb - 1) // rb                          # row blocks of the job
        r0 = (b - starts[g]) % nbr * rb
        nrb = min(R, r0 + rb) - r0
        acc = acc_all[tid]
        if T <= _NTF:                                     # a few tokens: decode in registers
            for r in range(nrb):                          # 1: this row by the AVX2 decode
                wok[tid, r] = 1 if _W16 and pm == P and _row_bad(scale, r0 + r) == 0 else 0
            for c0 in range(0, nj, jc):
                n = min(nj, c0 + jc) - c0
                mode = (1 if c0 == 0 else 0) | (2 if c0 + jc >= nj and pm == P else 0)
                for r in range(nrb):
                    if wok[tid, r]:
                        _vdotn_w(T, acc, r * _NTF, xep, xop, x0, packed, scale, r0 + r, c0, n, mode, out,
                                 off + r0 + r, R)
                    else:
                        _vdotn(T, acc, r * _NTF, xe, xo, x0, packed, scale, r0 + r, c0, n, mode, out, off + r0 + r, R)
            if pm < P or nj == 0:
                _tail_tree(TailRows(packed, scale, r0, nrb), TailTokens(xe, xo, x0, T), acc, _NTF,
                           TailOut(out, off, R), gv_all[tid])
            continue
        ws = ws_all[tid]
        s0 = (b - starts[g]) // nbr * _GST                # this item's super tile: its (token, row) sums in acc
        ns = min(_GST, T - s0)
        for q in range(_GPJ):
            for r in range(nrb):
                _vdecode_group(ws[r], packed[r0 + r], scale[r0 + r], nj, q)
            for h in range(16 // _V):             # the group's registers of lanes
                for t0 in range(0, ns, _NT2):
                    nt = min(_NT2, ns - t0)
                    r = 0
                    while r < nrb:
                        if r + _NR2 <= nrb:
                            _gtile2(nt, acc, r * _GST + t0, _GST, 16 * q + _V * h, xg, x0 + s0 + t0,
                                    32 * nj * q + _V * h, ws, r, _V * h, nj)
                            r += _NR2
                        else:
                            _gtile2_1(nt, acc, r * _GST + t0, _GST, 16 * q + _V * h, xg, x0 + s0 + t0,
                                      32 * nj * q + _V * h, ws, r, _V * h, nj)
                            r += 1
        _tail_tree(TailRows(packed, scale, r0, nrb), TailTokens(xe, xo, x0 + s0, ns), acc, _GST,
                   TailOut(out, off + s0 * R, R), gv_all[tid])


# --------------------------------------------------------------------------- wrappers
def _as_u8(a, name):
    a = as_cpu_array(a, name, torch.uint8, np.uint8)
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (packed weights are never copied per call)")
    return a


def _check_packed_scale(packed, scale):
    p = _as_u8(packed, "packed")
    s = _as_u8(scale, "scale")
    R, P = p.shape
    if (2 * P) % GROUP != 0:
        raise ValueError(f"logical width C = 2 * {P} = {2 * P} is not a multiple of {GROUP} "
                         f"(packed is [{R}, {P}])")
    if s.shape != (R, (2 * P) // GROUP):
        raise ValueError(f"scale shape {tuple(s.shape)} inconsistent with packed [{R}, {P}]: "
                         f"expected [{R}, {(2 * P) // GROUP}] (one byte per {GROUP} elements)")
    return p, s


def _u8_matrix(a, name) -> tuple[int, tuple]:
    """(address, shape) of a C-contiguous 2-D uint8 CPU tensor or numpy array, without
    converting it (the checks of ``_as_u8``)."""
    if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dtype == torch.uint8:
        if a.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(a.shape)}")
        if not a.is_contiguous():
            raise ValueError(f"{name} must be C-contiguous (packed weights are never copied per call)")
        return a.data_ptr(), tuple(a.shape)
    a = _as_u8(a, name)
    return a.ctypes.data, a.shape


def _mxfp4_matrix(packed, scale) -> tuple[int, int, int, int]:
    """(R, packed address, scale address, P) of a packed weight [R, 2P], checked as
    ``_check_packed_scale`` checks it."""
    pa, (R, P) = _u8_matrix(packed, "packed")
    sa, sshape = _u8_matrix(scale, "scale")
    if (2 * P) % GROUP != 0:
        raise ValueError(f"logical width C = 2 * {P} = {2 * P} is not a multiple of {GROUP} "
                         f"(packed is [{R}, {P}])")
    if sshape != (R, (2 * P) // GROUP):
        raise ValueError(f"scale shape {tuple(sshape)} inconsistent with packed [{R}, {P}]: "
                         f"expected [{R}, {(2 * P) // GROUP}] (one byte per {GROUP} elements)")
    return R, pa, sa, P


def _mxfp4_weight(w) -> tuple[int, int, int, int]:
    """(R, packed address, scale address, logical in-features 2P) of an Mxfp4Weight
    or a (packed, scale) pair."""
    R, pa, sa, P = _mxfp4_matrix(*((w.packed, w.scale) if hasattr(w, "packed") else w))
    return R, pa, sa, 2 * P


def decode_mxfp4(packed, scale) -> torch.Tensor:
    """packed uint8 [R, C/2] (torch or numpy), scale uint8 [R, C/32] -> float32 [R, C], bit-exact.

    Low nibble of byte j = element 2j, high nibble = element 2j+1;
    value = E2M1[n & 7] * (-1 if n & 8) * 2^(s-127). Scale byte 255: the group of 32
    decodes to +0.0 (compressed-tensors gives +inf). Scale 0 gives 2^-127 (exact).
    Materialises the whole matrix: for tests, tools and small tensors, not the hot path."""
    p, s = _check_packed_scale(packed, scale)
    R, P = p.shape
    G = s.shape[1]
    out = np.empty((R, 2 * P), dtype=np.float32)
    if R and P:
        _launch(_decode_kernel, R * P * 2, p.reshape(R, G, 16), s, out.reshape(R, G, 32), _RB1)
    return torch.from_numpy(out)


def run_mxfp4_jobs(xn: np.ndarray, jobs: np.ndarray, out: np.ndarray, work: int, tmax: int = 0) -> None:
    """The kernel call of a job table on activations xn into out, as ``mxfp4_grouped``
    makes it (``k3.kernels.bf16.run_bf16_jobs``; tmax: most tokens of one job, 1 for the
    one-token kernels, 0 when unknown)."""
    if out.size == 0:
        return
    if xn.shape[1] == 0:
        out[:] = 0.0
        return
    if tmax == 1:
        _launch_t1(_mxfp4_t1, _mxfp4_t1_serial, work, SERIAL_LIMITS["mxfp4"], xn, jobs, out, _RB1)
        return
    _launch(_mxfp4_grouped, work, *_split_x(xn, jobs), _group_x(xn, jobs), jobs, out, _RB1, _RB, _JC)


def mxfp4_grouped(x, ws, rows=None) -> torch.Tensor:
    """Several fused MXFP4 linears in one kernel call. x float32 [M, C]; ws: (packed,
    scale) pairs (or objects with ``.packed`` / ``.scale``, e.g. Mxfp4Weight) of logical
    weights [R_g, C]; ``rows``: per weight the rows (x0, x1) of x it multiplies (None:
    all of them). Returns one flat float32 tensor holding x[x0:x1] @ W_g.T for g = 0,
    1, ... one after another, each row-major [x1 - x0, R_g]: the same bits as
    ``mxfp4_linear(x[x0:x1], packed_g, scale_g)`` (canonical order)."""
    xn, _ = _as_f32_activations(x)
    M, C = xn.shape
    jobs, total, work, tmax = grouped_jobs(M, C, ws, _mxfp4_weight, rows)
    out = np.empty(total, dtype=np.float32)
    run_mxfp4_jobs(xn, jobs, out, work, tmax)
    return torch.from_numpy(out)


def mxfp4_linear(x: torch.Tensor, packed, scale) -> torch.Tensor:
    """x float32 [T, C] (any T >= 0), packed/scale as in ``decode_mxfp4`` for a logical
    weight [R, C]. Returns float32 [T, R] = x @ decode(packed, scale).T, fused: rows are
    decoded a few at a time into a small scratch, never the full matrix. A 1-D x [C]
    gives a 1-D result [R]. Bit-identical for any thread count and any T (module doc)."""
    xn, was_1d = _as_f32_activations(x)
    res = mxfp4_grouped(xn, [(packed, scale)])  # checks the weight against x
    return res if was_1d else res.view(xn.shape[0], _mxfp4_matrix(packed, scale)[0])


# ---------------------------------------------------------------- encoder (for writers, not the hot path)
def _e2m1_codes(x) -> np.ndarray:
    """Nearest E2M1 code (0..15 uint8, sign in bit 3) of values already divided by their
    group scale; |x| > 6 saturates to 6. Ties go to the even code (round half to even
    of the mantissa): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    Works on the three binades of E2M1 with np.round (half to even): steps of 0.5 below
    2, of 1 in [2, 4), of 2 in [4, 6]. (numpy, single-threaded: torch's threaded unary
    ops stall on a busy 2-core machine.)"""
    x = np.asarray(x.numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float32)
    a = np.minimum(np.abs(x), np.float32(6.0))
    v2 = np.where(a < 2, np.round(a * 2),  # twice the rounded magnitude, 0..12
                  np.where(a < 4, np.round(a) * 2, np.round(a * 0.5) * 4))
    code = np.where(v2 <= 4, v2, np.where(v2 <= 8, v2 * 0.5 + 2, 7)).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def encode_mxfp4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ("mxfp4-pack-quantized") encoding of a [rows, cols] float matrix.

    Per group of 32 columns the E8M0 scale byte s is the smallest with
    max|w| <= 6 * 2^(s - 127) (an all-zero group gets 127; s is clamped to 0..254);
    each element is rounded to the nearest E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6} x
    2^(s - 127) (ties to even), sign in bit 3 (so -0.0 and tiny negatives give code 8).
    Returns (packed uint8 [rows, cols/2] with element 2j in the low nibble of byte j,
    scale uint8 [rows, cols/32])."""
    if w.dim() != 2 or w.shape[1] % group_size or w.shape[1] % 2:
        raise ValueError(f"encode_mxfp4 needs [rows, cols] with cols a multiple of {group_size}, got {tuple(w.shape)}")
    r, c = w.shape
    g = w.detach().to(torch.float32).numpy().reshape(r, c // group_size, group_size)
    amax = np.abs(g).max(-1)
    nz = amax > 0
    with np.errstate(divide="ignore", over="ignore"):
        e = np.where(nz, np.ceil(np.log2(np.where(nz, amax, 1.0) / 6.0)), 0.0)
        e = np.where(nz & (amax > 6.0 * np.exp2(e)), e + 1, e)  # fix log2 rounding (exact compares)
        e = np.where(nz & (amax <= 3.0 * np.exp2(e)), e - 1, e)
    e = np.clip(e, -127, 127)
    codes = _e2m1_codes(g / np.exp2(e)[..., None].astype(np.float32)).reshape(r, c)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy((e + 127).astype(np.uint8))


_cache_leave(_CACHE_PREV)
