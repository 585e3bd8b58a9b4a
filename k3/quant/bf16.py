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

import threading
import weakref

import numpy as np
import torch
import numba
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.quant.kcache.folder(), until the end

__all__ = ["bf16_linear", "bf16_grouped", "LANES"]

#: fp32 accumulator lanes of the canonical dot-product order. Part of the numeric
#: contract: changing it changes the bits every caller gets.
LANES = 64

# Blocking (performance only; none of these changes a single output bit).
_RB1 = 32    # rows per prange iteration, T = 1
_RB = 24     # weight rows per block (one prange iteration), T > 1 (a multiple of every _NR)
_KC = 2048   # K-chunk (elements, multiple of LANES) of the T > 1 tiles
_ST = 16     # tokens whose tiles take each K-chunk of a row block in turn, T > 1 (a multiple of every _NT)
#: ``make_tile``'s prefetch distance given at run time (its last argument)
PF_ARG = -2


# =========================================================================== SIMD blocks
_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F32, LANES)


def _vfma(builder, a, b, c):
    """Lane-wise a*b + c, one rounding (llvm.fma.v<n>f32 for <n x float> operands)."""
    vt = a.type
    fnty = ir.FunctionType(vt, [vt, vt, vt])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{vt.count}f32")
    return builder.call(fn, [a, b, c])


def _data_ptr(context, builder, aryty, val):
    return context.make_array(aryty)(context, builder, val).data


def _vload(builder, base, elem_index, ety, nelem):
    """Load <nelem x ety> from base (pointer to ety) + elem_index, unaligned."""
    p = builder.gep(base, [elem_index], inbounds=True)
    vty = ir.VectorType(ety, nelem)
    p = builder.bitcast(p, vty.as_pointer())
    return builder.load(p, align=max(1, ety.width // 8) if isinstance(ety, ir.IntType) else 4, typ=vty)


def _vstore(builder, val, base, elem_index):
    p = builder.gep(base, [elem_index], inbounds=True)
    p = builder.bitcast(p, val.type.as_pointer())
    builder.store(val, p, align=4)


def _prefetch(builder, ptr, locality=3):
    """llvm.prefetch(ptr, read, locality, data): 3 keeps the line in every level (L1),
    2 in L2 and below."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), _I32(0), _I32(locality), _I32(1)])


def counted_loop(builder, n, inits: list, body, name: str) -> list:
    """IR for ``for j in range(n): values = body(j, values)``, the values carried in
    registers (phi nodes) so LLVM never spills them to memory between iterations.
    Returns the final values (``inits`` when n == 0). ``n`` is an i64."""
    zero = _I64(0)
    pre = builder.block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", n, zero), loop, done)
    builder.position_at_end(loop)
    j = builder.phi(_I64)
    cur = [builder.phi(v.type) for v in inits]
    j.add_incoming(zero, pre)
    for c, v in zip(cur, inits):
        c.add_incoming(v, pre)
    new = body(j, cur)
    jn = builder.add(j, _I64(1))
    tail = builder.block
    j.add_incoming(jn, tail)
    for c, v in zip(cur, new):
        c.add_incoming(v, tail)
    builder.cbranch(builder.icmp_signed("<", jn, n), loop, done)
    builder.position_at_end(done)
    fins = []
    for v0, v1 in zip(inits, new):  # all phis first (LLVM requires them at the block's top)
        fin = builder.phi(v0.type)
        fin.add_incoming(v0, pre)
        fin.add_incoming(v1, tail)
        fins.append(fin)
    return fins


F32_ONLY = (types.float32,)
#: numba dtypes a weight operand may have, per ``wkind`` of the tile intrinsics
W_DTYPES = {"f32": F32_ONLY, "bf16": (types.int16, types.uint16), "bf16eo": (types.int16, types.uint16),
            "any": (types.float32, types.int16, types.uint16)}


def c_matrix(t, dts) -> bool:
    """Whether numba type t is a C-contiguous 2-D array of one of the dtypes dts."""
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C" and t.dtype in dts


def for_each_nt(builder, nt, max_nt: int, name: str, emit) -> None:
    """IR for ``switch nt: case n in 1 .. max_nt: emit(n)``: one body per run-time
    token count, each with its register tile sized when it compiles (any other nt does
    nothing). The builder is left after the switch."""
    done = builder.append_basic_block(f"{name}.done")
    sw = builder.switch(nt, done)
    for n in range(1, max_nt + 1):
        blk = builder.append_basic_block(f"{name}.nt{n}")
        sw.add_case(ir.Constant(nt.type, n), blk)
        builder.position_at_end(blk)
        emit(n)
        builder.branch(done)
    builder.position_at_end(done)


def widen_bf16_vec(builder, v16):
    """<n x i16> bf16 bit patterns -> <n x float> (exact)."""
    n = v16.type.count
    v = builder.zext(v16, ir.VectorType(_I32, n))
    v = builder.shl(v, ir.Constant(ir.VectorType(_I32, n), [16] * n))
    return builder.bitcast(v, ir.VectorType(_F32, n))


def _row_ptr(context, builder, aryty, val, idx, off):
    """Pointer to element [idx, off] of a C-contiguous 2-D array."""
    ary = context.make_array(aryty)(context, builder, val)
    ncol = cgutils.unpack_tuple(builder, ary.shape, 2)[1]
    e = builder.add(builder.mul(idx, ncol), off)
    return builder.gep(ary.data, [e], inbounds=True)


def make_vdot(nt, nr, streams, wkind):
    """Build a numba intrinsic doing step 1 of the canonical order for register tiles
    of ``nt`` tokens x ``nr`` weight rows::

        vdot(acc, ai, x0, x1, xi, xoff, w0, w1, wi, woff, nj, reps, step)

    * acc: float32 C array [*, >= 64]; ai: UniTuple of nt*nr row indices (tile (t, r) at
      position t*nr + r); each acc row is loaded once per tile, updated in registers,
      stored back;
    * x0, x1: float32 C arrays [*, *] for stream 0 / 1 (x1 ignored when streams == 1);
      xi: UniTuple of nt row indices; xoff: element offset inside those rows;
    * w0, w1: C arrays [*, *] of float32 (``wkind='f32'``) or bf16 bits int16/uint16
      (``wkind='bf16'``); wi: UniTuple of nr row indices; woff: element offset;
    * for p in 0..reps-1 (tile p uses x rows xi[t] + p*step and acc rows ai[k] + p*step,
      the same weight rows), for j in 0..nj-1, for s < streams, every (t, r), lane l < 64:
      acc[t, r][l] = fma(x_s[xi[t], xoff + 64j + l], w_s[wi[r], woff + 64j + l], acc[t, r][l]).

    Index-based (no array views are built per call). No bounds checks: the callers
    guarantee the extents."""

    def typer(typingctx, acc, ai, x0, x1, xi, xoff, w0, w1, wi, woff, nj, reps, step):
        if not (c_matrix(acc, F32_ONLY) and c_matrix(x0, F32_ONLY) and x1 == x0
                and c_matrix(w0, W_DTYPES[wkind]) and w1 == w0):
            return None
        for tup, n in ((ai, nt * nr), (xi, nt), (wi, nr)):
            if not (isinstance(tup, types.UniTuple) and tup.count == n and isinstance(tup.dtype, types.Integer)):
                return None
        if not all(isinstance(v, types.Integer) for v in (xoff, woff, nj, reps, step)):
            return None
        sig = types.void(acc, ai, x0, x1, xi, xoff, w0, w1, wi, woff, nj, reps, step)

        def codegen(context, builder, sig, args):
            (acc_t, ai_t, x0_t, x1_t, xi_t, xoff_t, w0_t, w1_t, wi_t, woff_t, nj_t,
             reps_t, step_t) = sig.args
            (acc_v, ai_v, x0_v, x1_v, xi_v, xoff_v, w0_v, w1_v, wi_v, woff_v, nj_v,
             reps_v, step_v) = args

            def i64(v, t):
                return context.cast(builder, v, t, types.int64)

            zero = _I64(0)
            ai0 = [i64(v, ai_t.dtype) for v in cgutils.unpack_tuple(builder, ai_v, ai_t.count)]
            xi0 = [i64(v, xi_t.dtype) for v in cgutils.unpack_tuple(builder, xi_v, xi_t.count)]
            wi = [i64(v, wi_t.dtype) for v in cgutils.unpack_tuple(builder, wi_v, wi_t.count)]
            xoff, woff, n = i64(xoff_v, xoff_t), i64(woff_v, woff_t), i64(nj_v, nj_t)
            reps, step = i64(reps_v, reps_t), i64(step_v, step_t)
            warr = [(w0_t, w0_v), (w1_t, w1_v)][:streams]
            xarr = [(x0_t, x0_v), (x1_t, x1_v)][:streams]
            # weight pointers, indexed [r * streams + s] (fixed over the tiles)
            wp = [_row_ptr(context, builder, ty, v, r, woff) for r in wi for (ty, v) in warr]
            with cgutils.for_range(builder, reps) as tile:
                shift = builder.mul(tile.index, step)
                ai = [builder.add(a, shift) for a in ai0]
                xi = [builder.add(t, shift) for t in xi0]
                accp = [_row_ptr(context, builder, acc_t, acc_v, a, zero) for a in ai]
                xp = [_row_ptr(context, builder, ty, v, t, xoff) for t in xi for (ty, v) in xarr]
                a0 = [_vload(builder, p, zero, _F32, LANES) for p in accp]

                def body(j, acc):
                    off = builder.mul(j, _I64(LANES))
                    xv = [_vload(builder, p, off, _F32, LANES) for p in xp]
                    if wkind == "f32":
                        wv = [_vload(builder, p, off, _F32, LANES) for p in wp]
                    else:
                        wv = [widen_bf16_vec(builder, _vload(builder, p, off, _I16, LANES)) for p in wp]
                    new = list(acc)
                    for s in range(streams):
                        for t in range(nt):
                            for r in range(nr):
                                k = t * nr + r
                                new[k] = _vfma(builder, xv[t * streams + s], wv[r * streams + s], new[k])
                    return new

                fins = counted_loop(builder, n, a0, body, "vdot")
                for p, fin in zip(accp, fins):
                    _vstore(builder, fin, p, zero)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"vdot_{nt}x{nr}_s{streams}_{wkind}"
    return intrinsic(typer)


def kernel_isa() -> str:
    """The instruction set the kernels are compiled for: "avx512" (AVX-512F/BW: 16-lane
    tiles, 64-byte shuffles), "avx2" (AVX2 + FMA: 8-lane tiles, 32-byte shuffles) or
    "generic" (4-lane tiles, plain vector arithmetic), from the CPU features numba
    compiles for (NUMBA_CPU_FEATURES when set, else the host's). K3_KERNEL_ISA forces a
    path those features allow (tests compare them; every path gives the same bits)."""
    from llvmlite import binding

    from .. import env
    if numba.config.CPU_FEATURES:
        feats = {f[1:]: f[0] == "+" for f in numba.config.CPU_FEATURES.split(",") if f[:1] in "+-" and f[1:]}
    else:
        feats = binding.get_host_cpu_features()
    have = ["generic"] + (["avx2"] if feats.get("avx2") and feats.get("fma") else [])
    have += ["avx512"] if len(have) == 2 and feats.get("avx512f") and feats.get("avx512bw") else []
    want = env.kernel_isa()
    if want is None:
        return have[-1]
    if want not in have:
        raise ValueError(f"K3_KERNEL_ISA={want}: the CPU features numba compiles for offer {', '.join(have)}")
    return want


def cpu_vendor() -> str:
    """"intel", "amd" or "" (unknown): the CPU's maker (k3.cpuinfo), for the few tuning
    choices (never results) where their memory systems differ."""
    from ..cpuinfo import cpuinfo
    return cpuinfo().vendor


def kernel_path() -> dict:
    """What the BF16 kernels run here, for ``k3 doctor``: the instruction-set path, the
    token x row tile of T > 1, the rows one token streams at once and from which K,
    the vendor tuning in force."""
    pf = [f"{'one row' if n == 1 else f'{n} rows'} at a time prefetch{'es' if n == 1 else ''} "
          + (f"the next {n} rows" if d == NEXT_ROWS else f"{d * 2} bytes ahead")
          for n, d in ((_T1_NR, _T1_PF), (1, _T1_PF1)) if d]
    if _TILE_NEXT:
        pf.append("the T > 1 tiles prefetch the rows they read next")
    return {"isa": _ISA, "lanes": _V, "tile": f"{_NT}x{_NR}", "t1_rows": _T1_NR,
            "t1_rows_from_k": _T1_MANY_K if _T1_MANY_K < 1 << 62 else None,
            "vendor": cpu_vendor(), "vendor_tuning": pf}


#: fp32 lanes of one register for each kernel_isa() path
VECTOR_LANES = {"avx512": 16, "avx2": 8, "generic": 4}


def pair_split(v: int) -> list[int]:
    """The lane permutation of the even/odd BF16 tiles with ``v``-lane registers:
    position ``2v*q + v*p + i`` holds canonical lane / element ``2v*q + 2i + p`` of each
    64-element step (a 32-bit load of two bf16 gives the even element by a shift and the
    odd one by a mask, so the tiles keep even and odd elements in separate registers).
    Returned as the list perm with perm[position] = canonical lane."""
    return [2 * v * q + 2 * i + p for q in range(LANES // (2 * v)) for p in range(2) for i in range(v)]


def make_tile(max_nt, nr, streams, wkind, v, pf=0, pf_locality=3):
    """A numba intrinsic doing step 1 of the canonical order for a register tile of
    ``nt`` tokens (a run-time value, 1 .. max_nt) x ``nr`` weight rows::

        tile(nt, acc, a0, tb, x0, x1, xr, xoff, w0, w1, wr, woff, nj, mode, out, obase, ostride)

    (``pf`` = PF_ARG: with a last argument ``pfo``, below)

    for t < nt, r < nr, s < streams, j < nj, lane l < 64 (in that order for each lane):
    ``acc[a0 + r*tb + t][l] = fma(x_s[xr + t, xoff + 64j + l], w_s[wr + r, woff + 64j + l], ...)``.
    ``mode`` bit 0: the accumulators start at +0.0 (the first chunk: acc is not read);
    bit 1: finish (the last chunk, no tail): steps 3 of the canonical order for every
    (t, r), ``out[obase + t*ostride + r]`` = the halving tree of the 64 lanes (acc then
    holds them in lane order).

    The 64 lanes of the canonical order are 64 independent sums, so they are done in
    groups of ``v`` lanes (one machine register: v = 16 with AVX-512, 8 with AVX2): each
    group keeps its nt x nr accumulators in registers over all nj steps, the weight
    vectors loaded once per step for every token, the activation vectors once for every
    row. Every lane still sees its own fma sequence in the canonical order, so the bits
    are those of a 64-lane loop. x_s / acc float32 C arrays [*, *].

    ``wkind='f32'``: w_s float32; ``'any'``: float32, or bf16 bits (int16 / uint16)
    widened in registers, the lanes in canonical order. ``wkind='bf16eo'`` (one
    stream): w holds bf16 bits (int16 / uint16) in the canonical element order, widened in registers two at a
    time (shift / mask of a 32-bit load), and x and acc are in the ``pair_split(v)``
    order (positions instead of lanes above; the caller permutes x once per call and
    the accumulators back before the tail and the tree). No bounds checks: the callers
    guarantee the extents.

    ``pf`` (bf16eo only; a hint, never faults): > 0, each step prefetches both cache lines
    of the step ``pf`` elements ahead in every row (into the cache levels
    ``pf_locality`` names, as llvm.prefetch); PF_ARG, ``pfo`` elements from each
    row's step instead, a run-time value: the caller points it at the rows its next tile
    reads (nr * K: the next rows' same columns), so that the weights stream in ahead of
    the tiles, one step of every row at a time, however the caller walks them."""
    eo = wkind == "bf16eo"
    assert not eo or streams == 1
    pf_arg = pf == PF_ARG

    def typer_pfo(typingctx, nt, acc, a0, tb, x0, x1, xr, xoff, w0, w1, wr, woff, nj, mode, out, obase, ostride,
                  pfo):
        if not isinstance(pfo, types.Integer):
            return None
        return _typer(typingctx, nt, acc, a0, tb, x0, x1, xr, xoff, w0, w1, wr, woff, nj, mode, out, obase, ostride,
                      (pfo,))

    def typer(typingctx, nt, acc, a0, tb, x0, x1, xr, xoff, w0, w1, wr, woff, nj, mode, out, obase, ostride):
        return _typer(typingctx, nt, acc, a0, tb, x0, x1, xr, xoff, w0, w1, wr, woff, nj, mode, out, obase, ostride, ())

    def _typer(typingctx, nt, acc, a0, tb, x0, x1, xr, xoff, w0, w1, wr, woff, nj, mode, out, obase, ostride, rest):
        if not (c_matrix(acc, F32_ONLY) and c_matrix(x0, F32_ONLY) and x1 == x0
                and c_matrix(w0, W_DTYPES[wkind]) and w1 == w0):
            return None
        if not (isinstance(out, types.Array) and out.ndim == 1 and out.dtype == types.float32):
            return None
        if not all(isinstance(t, types.Integer) for t in (nt, a0, tb, xr, xoff, wr, woff, nj, mode, obase, ostride)):
            return None
        sig = types.void(nt, acc, a0, tb, x0, x1, xr, xoff, w0, w1, wr, woff, nj, mode, out, obase, ostride, *rest)

        def codegen(context, builder, sig, args):
            iv = [context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
                  for a, t in zip(args, sig.args)]
            nt_v, acc_v, a0, tb, x0_v, x1_v, xr, xoff, w0_v, w1_v, wr, woff, nj, mode, out_v, obase, ostride = iv[:17]
            ahead = iv[17] if pf_arg else _I64(pf)
            first = builder.icmp_unsigned("!=", builder.and_(mode, _I64(1)), _I64(0))
            finish = builder.icmp_unsigned("!=", builder.and_(mode, _I64(2)), _I64(0))
            outp = _data_ptr(context, builder, sig.args[14], out_v)
            zv = ir.Constant(ir.VectorType(_F32, v), [0.0] * v)
            at, xt, wt = sig.args[1], sig.args[4], sig.args[8]
            wf32 = wt.dtype == types.float32
            xarr, warr = [x0_v, x1_v][:streams], [w0_v, w1_v][:streams]
            # per register group: (w element offset, [(x / acc position, stream, half)])
            if eo:
                groups = [(2 * v * q, [(2 * v * q + v * p, 0, p) for p in range(2)]) for q in range(LANES // (2 * v))]
            else:
                groups = [(v * q, [(v * q, s, None) for s in range(streams)]) for q in range(LANES // v)]
            vi32 = ir.VectorType(_I32, v)
            def emit(n_t):
                for gi, (wo, parts) in enumerate(groups):
                    npart = len(parts) if eo else 1          # accumulators per (t, r)
                    apos = [parts[k][0] for k in range(npart)]
                    accp = [_row_ptr(context, builder, at, acc_v, builder.add(a0, builder.add(
                        builder.mul(_I64(r), tb), _I64(t))), _I64(apos[k]))
                        for t in range(n_t) for r in range(nr) for k in range(npart)]
                    xp = [[_row_ptr(context, builder, xt, xarr[s], builder.add(xr, _I64(t)), builder.add(xoff, _I64(pos)))
                           for pos, s, _ in parts] for t in range(n_t)]
                    wp = [[_row_ptr(context, builder, wt, wa, builder.add(wr, _I64(r)), builder.add(woff, _I64(wo)))
                           for wa in warr] for r in range(nr)]
                    init = [builder.select(first, zv, _vload(builder, p, _I64(0), _F32, v)) for p in accp]

                    def body(j, acc, xp=xp, wp=wp, n_t=n_t, parts=parts, npart=npart, gi=gi):
                        off = builder.mul(j, _I64(LANES))
                        if eo:   # [r][half]: even elements by shift, odd by mask
                            wv = []
                            for row in wp:
                                if pf and gi == 0:   # both lines of the step `ahead` elements on
                                    for h in (0, LANES // 2):
                                        _prefetch(builder, builder.gep(row[0], [builder.add(off, builder.add(ahead, _I64(h)))]),
                                                  locality=pf_locality)
                                p = builder.bitcast(builder.gep(row[0], [off], inbounds=True), vi32.as_pointer())
                                u = builder.load(p, align=2, typ=vi32)
                                wv.append([builder.bitcast(builder.shl(u, ir.Constant(vi32, [16] * v)), ir.VectorType(_F32, v)),
                                           builder.bitcast(builder.and_(u, ir.Constant(vi32, [-65536] * v)),
                                                           ir.VectorType(_F32, v))])
                        else:    # [r][stream]
                            wv = [[_vload(builder, p, off, _F32, v) if wf32 else
                                   widen_bf16_vec(builder, _vload(builder, p, off, _I16, v)) for p in row] for row in wp]
                        new = list(acc)
                        for t in range(n_t):
                            for k, (_, s, half) in enumerate(parts):
                                xv = _vload(builder, xp[t][k], off, _F32, v)
                                for r in range(nr):
                                    i = (t * nr + r) * npart + (half if eo else 0)
                                    new[i] = _vfma(builder, xv, wv[r][half if eo else s], new[i])
                        return new

                    fins = counted_loop(builder, nj, init, body, f"tile{n_t}g{gi}")
                    for p, f in zip(accp, fins):
                        _vstore(builder, f, p, _I64(0))
                with builder.if_then(finish):     # the lanes are in L1: tree them into out now
                    for t in range(n_t):
                        for r in range(nr):
                            p = _row_ptr(context, builder, at, acc_v, builder.add(a0, builder.add(
                                builder.mul(_I64(r), tb), _I64(t))), _I64(0))
                            lanes = _vload(builder, p, _I64(0), _F32, LANES)
                            if eo:
                                lanes = builder.shuffle_vector(lanes, lanes, ir.Constant(
                                    ir.VectorType(_I32, LANES), _inverse(pair_split(v))))
                            o = builder.add(obase, builder.add(builder.mul(_I64(t), ostride), _I64(r)))
                            builder.store(tree_sum_ir(builder, lanes), builder.gep(outp, [o], inbounds=True))

            for_each_nt(builder, nt_v, max_nt, "tile", emit)
            return context.get_dummy_value()

        return sig, codegen

    name = (f"tile{max_nt}x{nr}_s{streams}_{wkind}_v{v}" + ("_pfarg" if pf_arg else f"_pf{pf}" if pf else "")
            + (f"_l{pf_locality}" if pf else ""))
    if pf_arg:
        typer_pfo.__name__ = name
        return intrinsic(typer_pfo)
    typer.__name__ = name
    return intrinsic(typer)


def make_gtile(max_nt, nr, streams, v, width=16):
    """A numba intrinsic doing step 1 of the canonical order for one register group of
    ``v`` lanes of a register tile, ``nt`` tokens (run time, 1 .. max_nt) x ``nr`` rows,
    over operands laid out *group-major* (each group's steps contiguous, so a tile
    streams whole cache lines in order and a pass over a scratch stays in L1)::

        gtile(nt, acc, a0, tb, apos, x, xr, xoff, w, wr, woff, nj)

    for t < nt, r < nr, i < v: from +0.0, for j < nj, s < streams (in that order):
    ``a = fma(x[xr + t, xoff + j*S + width*s + i], w[wr + r, woff + j*S + width*s + i], a)``
    with S = width * streams, and ``acc[a0 + r*tb + t, apos + i] = a``. A canonical lane
    (with its streams: MXFP4's even then odd element) thus keeps its fma sequence; the
    caller packs x and w so that (xoff, woff) + j*S + width*s + i is that lane's j-th
    step. float32 C arrays; no bounds checks."""

    def typer(typingctx, nt, acc, a0, tb, apos, x, xr, xoff, w, wr, woff, nj):
        if not (c_matrix(acc, F32_ONLY) and c_matrix(x, F32_ONLY) and c_matrix(w, F32_ONLY)):
            return None
        if not all(isinstance(t, types.Integer) for t in (nt, a0, tb, apos, xr, xoff, wr, woff, nj)):
            return None
        sig = types.void(nt, acc, a0, tb, apos, x, xr, xoff, w, wr, woff, nj)

        def codegen(context, builder, sig, args):
            iv = [context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
                  for a, t in zip(args, sig.args)]
            nt_v, acc_v, a0, tb, apos, x_v, xr, xoff, w_v, wr, woff, nj = iv
            at, xt, wt = sig.args[1], sig.args[5], sig.args[8]
            zv = ir.Constant(ir.VectorType(_F32, v), [0.0] * v)

            def emit(n_t):
                xp = [_row_ptr(context, builder, xt, x_v, builder.add(xr, _I64(t)), xoff) for t in range(n_t)]
                wp = [_row_ptr(context, builder, wt, w_v, builder.add(wr, _I64(r)), woff) for r in range(nr)]

                def body(j, acc):
                    off = builder.mul(j, _I64(width * streams))
                    wv = [[_vload(builder, p, builder.add(off, _I64(width * s)), _F32, v) for s in range(streams)]
                          for p in wp]
                    new = list(acc)
                    for t in range(n_t):
                        for s in range(streams):
                            xv = _vload(builder, xp[t], builder.add(off, _I64(width * s)), _F32, v)
                            for r in range(nr):
                                new[t * nr + r] = _vfma(builder, xv, wv[r][s], new[t * nr + r])
                    return new

                fins = counted_loop(builder, nj, [zv] * (n_t * nr), body, f"gtile{n_t}")
                for t in range(n_t):
                    for r in range(nr):
                        p = _row_ptr(context, builder, at, acc_v,
                                     builder.add(a0, builder.add(builder.mul(_I64(r), tb), _I64(t))), apos)
                        _vstore(builder, fins[t * nr + r], p, _I64(0))

            for_each_nt(builder, nt_v, max_nt, "gtile", emit)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"gtile{max_nt}x{nr}_s{streams}_v{v}_w{width}"
    return intrinsic(typer)


def _inverse(perm):
    """inv with inv[perm[i]] = i: as a shuffle mask, the lanes back in canonical order."""
    inv = [0] * len(perm)
    for pos, lane in enumerate(perm):
        inv[lane] = pos
    return inv


def make_unpermute(perm):
    """An intrinsic ``unperm(a)``: a[perm[i]] = a[i] for i < 64 (a float32 1-D array),
    in registers: the accumulators of a permuted tile back in the canonical lane order."""
    inv = _inverse(perm)

    @intrinsic
    def unperm(typingctx, a):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            p = _data_ptr(context, builder, sig.args[0], args[0])
            vec = _vload(builder, p, _I64(0), _F32, LANES)
            _vstore(builder, builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, LANES), inv)), p, _I64(0))
            return context.get_dummy_value()

        return types.void(a), codegen

    return unperm


def tree_sum_ir(builder, v):
    """Step 3 of the canonical order on a <64 x float> held in registers: for h = 32 ..
    1, lanes i < h become lane i + lane i + h (the same additions as ``_tree_sum``).
    Returns lane 0."""
    n = LANES
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, _I32(0))


def trees_ir(builder, vecs):
    """``tree_sum_ir`` of each <64 x float> of ``vecs`` (a power of two of them, <= 64):
    <n x float>, lane k the tree of vecs[k]. The same additions, lane i + lane i + h,
    but the trees share their registers: each stage puts the first and the last h lanes
    of every tree's part side by side and adds once, two vectors' trees into one vector
    while there are several, so 8 trees take ~6 vector operations each where one tree
    alone takes a chain of 6 dependent additions and its shuffles."""
    n = len(vecs)
    assert n and n & (n - 1) == 0 and n <= LANES and all(v.type.count == LANES for v in vecs)
    k, w = 1, LANES                      # trees per vector, lanes per tree

    def halves(L, off):                  # lanes [0, h) and [h, w) of each tree's part
        h = w // 2
        return ([off + j * w + i for j in range(L // w) for i in range(h)],
                [off + j * w + h + i for j in range(L // w) for i in range(h)])

    while w > 1:
        L = k * w
        if len(vecs) > 1:                # two vectors' trees side by side, then one addition
            lo_a, hi_a = halves(L, 0)
            lo_b, hi_b = halves(L, L)
            m = ir.VectorType(_I32, L)
            vecs = [builder.fadd(builder.shuffle_vector(a, b, ir.Constant(m, lo_a + lo_b)),
                                 builder.shuffle_vector(a, b, ir.Constant(m, hi_a + hi_b)))
                    for a, b in zip(vecs[0::2], vecs[1::2])]
            k *= 2
        else:
            lo, hi = halves(L, 0)
            m = ir.VectorType(_I32, L // 2)
            a = vecs[0]
            vecs = [builder.fadd(builder.shuffle_vector(a, a, ir.Constant(m, lo)),
                                 builder.shuffle_vector(a, a, ir.Constant(m, hi)))]
        w //= 2
    return vecs[0]


def make_trees(n):
    """An intrinsic ``trees(acc, a0, stride, out, o0)``: out[o0 + k] = the halving tree
    of acc[a0 + k * stride] for k < n (acc float32 [rows, 64], out float32 1-D), by
    ``trees_ir``: the bits of ``_tree_sum`` on each row."""
    def typer(typingctx, acc, a0, stride, out, o0):
        if not (c_matrix(acc, F32_ONLY) and isinstance(out, types.Array) and out.ndim == 1
                and out.dtype == types.float32 and all(isinstance(t, types.Integer) for t in (a0, stride, o0))):
            return None

        def codegen(context, builder, sig, args):
            a0_, st, o0_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4))
            vecs = [_vload(builder, _row_ptr(context, builder, sig.args[0], args[0],
                                             builder.add(a0_, builder.mul(_I64(k), st)), _I64(0)), _I64(0), _F32, LANES)
                    for k in range(n)]
            _vstore(builder, trees_ir(builder, vecs), _data_ptr(context, builder, sig.args[3], args[3]), o0_)
            return context.get_dummy_value()

        return types.void(acc, a0, stride, out, o0), codegen

    typer.__name__ = f"trees{n}"
    return intrinsic(typer)


_vdot_bf16 = make_vdot(1, 1, 1, "bf16")     # T = 1 with a tail

#: register tiles (tokens x rows) per path: nt * nr accumulators + nr weight vectors +
#: one activation vector fit the register file (32 zmm with AVX-512, 16 ymm with AVX2)
_ISA = kernel_isa()
_NT, _NR = {"avx512": (4, 3), "avx2": (2, 2), "generic": (2, 1)}[_ISA]
_V = VECTOR_LANES[_ISA]
PAIR_SPLIT = pair_split(_V)
#: how far ahead (elements) the T > 1 tiles prefetch the weight rows they read, passed
#: at run time (``_bf16_grouped``). On Intel (_TILE_NEXT) the weights the thread reads
#: next: the next rows' same columns, the block's next K-chunk, the next block. A fixed
#: distance in the same row left the start of every row's chunk (4 KiB, in a page of its
#: own: Intel's hardware streamer stops at each page) unfetched, and the next K-chunk
#: (AVX2's distance) the first chunk: docs/PERFORMANCE.md. Elsewhere the fixed
#: distances: on AVX-512 (Zen 4) a short one in the same row beat the next K-chunk by
#: 4-16 % at T = 4; AVX2 the chunk.
_TILE_NEXT = cpu_vendor() == "intel"
_TILE_PF = {"avx512": 256}.get(_ISA, _KC)
#: the next rows are read after the tile's whole chunk: into L2 (the chunk of x stays in L1)
_TILE_LOC = 2 if _TILE_NEXT else 3
_tile_eo = make_tile(_NT, _NR, 1, "bf16eo", _V, pf=PF_ARG, pf_locality=_TILE_LOC)
_tile1_eo = make_tile(_NT, 1, 1, "bf16eo", _V, pf=PF_ARG, pf_locality=_TILE_LOC)     # a block's last rows
_unpermute = make_unpermute(PAIR_SPLIT)


#: ``make_dotn_bf16``'s prefetch of the next rows' same columns
NEXT_ROWS = -1


def make_dotn_bf16(nr: int, pf: int = 0):
    """An intrinsic ``dot(x, xi, w, wi, nj)``: x[xi] . fp32(w[wi + k]) for k < nr over K =
    64 * nj elements (no tail), each row's whole canonical order in registers (lanes from
    +0.0, nj fma steps, the halving tree): the same bits as ``_zero`` + ``_vdot_bf16`` +
    ``_tree_sum``, without a trip through memory per row (which dominates short rows).
    nr > 1 rows at once keep nr weight streams in flight and share the x loads; the
    result is then a tuple. ``pf`` > 0: each step prefetches both cache lines of every
    row pf elements ahead; ``pf`` = NEXT_ROWS: the same column of the next nr rows (nr *
    K elements ahead: the rows the caller's loop reads next, so the prefetches make one
    sequential stream). A hint either way: it never faults past a row's or the matrix's
    end."""
    def typer(typingctx, x, xi, w, wi, nj):
        if not (isinstance(x, types.Array) and x.ndim == 2 and x.layout == "C" and x.dtype == types.float32
                and isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C"
                and w.dtype in (types.int16, types.uint16)
                and all(isinstance(v, types.Integer) for v in (xi, wi, nj))):
            return None
        ret = types.float32 if nr == 1 else types.UniTuple(types.float32, nr)
        sig = ret(x, xi, w, wi, nj)

        def codegen(context, builder, sig, args):
            def i64(k):
                return context.cast(builder, args[k], sig.args[k], types.int64)

            zero = _I64(0)
            xp = _row_ptr(context, builder, sig.args[0], args[0], i64(1), zero)
            wp = [_row_ptr(context, builder, sig.args[2], args[2], builder.add(i64(3), _I64(k)), zero)
                  for k in range(nr)]

            ahead = builder.mul(i64(4), _I64(LANES * nr)) if pf == NEXT_ROWS else _I64(pf)

            def body(j, acc):
                off = builder.add(builder.mul(j, _I64(LANES)), ahead)
                for p in wp if pf else ():
                    for h in (0, LANES // 2):
                        _prefetch(builder, builder.gep(p, [builder.add(off, _I64(h))]))
                off = builder.mul(j, _I64(LANES))
                xv = _vload(builder, xp, off, _F32, LANES)
                return [_vfma(builder, xv, widen_bf16_vec(builder, _vload(builder, p, off, _I16, LANES)), a)
                        for p, a in zip(wp, acc)]

            z = ir.Constant(_VF, [0.0] * LANES)
            sums = [tree_sum_ir(builder, f) for f in counted_loop(builder, i64(4), [z] * nr, body, f"dot{nr}")]
            return sums[0] if nr == 1 else context.make_tuple(builder, sig.return_type, sums)

        return sig, codegen

    typer.__name__ = f"dot{nr}_bf16" + ("_next" if pf == NEXT_ROWS else f"_pf{pf}" if pf else "")
    return intrinsic(typer)


#: T = 1 streams several rows at once when K is at least _T1_MANY_K (more streams in
#: flight keep the memory busier, and each activation load serves more rows), on AVX-512
#: and AVX2 alike; never on the generic path. Short rows go one at a time: on AVX2 one
#: row's 64 lanes already take 8 of its 16 registers and four rows spill accumulators
#: every step (on Zen 3 one row at a time was faster for K <= 2304, four for K >= 4096);
#: on AVX-512 (Zen 4) four short rows (four streams of 1.5 KB each, too short for the
#: hardware prefetcher) streamed cold [N, 768] at 14-17 GB/s, one at a time at 26-29.
#: AVX-512 takes eight rows (32 accumulators: a few spill to L1, which costs less than
#: the activation lines each step re-reads from L2 for every four rows); AVX2 four.
#: Measured in docs/PERFORMANCE.md.
_T1_NR = {"avx512": 8, "avx2": 4}.get(_ISA, 4)
#: On Intel's AVX-512 cores the eight rows start at K = 1024 and prefetch: there the
#: hardware streamer, which stops at every 4 KiB page, leaves unprefetched streams short,
#: one row's stream most of all; on Zen 4 a prefetch in the four-row dot was slower
#: (docs/PERFORMANCE.md, thirteenth and fourteenth sessions). They prefetch the next
#: eight rows' same columns (NEXT_ROWS: one sequential stream ahead of the eight they
#: read), which streamed [*, 2304] matrices from memory 8-12 % faster than 512
#: elements ahead in each row, and [2304, 1024] 10 % faster than one row at a time; at
#: K = 768 a small model's decode (its weights partly in the L3) kept one row at a time
#: faster (eighteenth session).
_T1_INTEL = _ISA == "avx512" and cpu_vendor() == "intel"
_T1_PF = NEXT_ROWS if _T1_INTEL else 0
_dotn_bf16 = make_dotn_bf16(_T1_NR, _T1_PF)
#: ... and the one-row dot (short rows, which stream one after another: one stream per
#: thread) prefetches 1024 elements (2 KiB) ahead on Intel, into the next rows: with the
#: weights partly in the shared L3, as in a small model's decode, +26-33 % on [*, 768]
#: calls; from memory about even (docs/PERFORMANCE.md, fifteenth session)
_T1_PF1 = 1024 if _T1_INTEL else 0
_dot_bf16 = make_dotn_bf16(1, _T1_PF1)
_T1_MANY_K = 1024 if _T1_INTEL else {"avx512": 4096, "avx2": 4096}.get(_ISA, 1 << 62)


@intrinsic
def _bf16_to_f32(typingctx, v):
    """16-bit pattern (int16/uint16) of a bf16 -> the float32 it denotes (exact)."""
    if not isinstance(v, types.Integer) or v.bitwidth != 16:
        return None
    sig = types.float32(v)

    def codegen(context, builder, sig, args):
        x = builder.zext(args[0], _I32)
        x = builder.shl(x, _I32(16))
        return builder.bitcast(x, _F32)

    return sig, codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c in float32 with a single rounding (llvm.fma.f32)."""
    if not all(isinstance(t, types.Float) and t.bitwidth == 32 for t in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def _zero(typingctx, a):
    """a[0:64] = +0.0 (one vector store; ``a`` is a float32 1-D array of >= 64)."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        _vstore(builder, ir.Constant(_VF, [0.0] * LANES), _data_ptr(context, builder, sig.args[0], args[0]), _I64(0))
        return context.get_dummy_value()

    return types.void(a), codegen


@intrinsic
def _tree_sum(typingctx, a):
    """Step 3 of the canonical order over a[0:64] (float32 1-D array), in registers."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return tree_sum_ir(builder, _vload(builder, _data_ptr(context, builder, sig.args[0], args[0]), _I64(0), _F32,
                                           LANES))

    return types.float32(a), codegen


# =========================================================================== kernels
def address_intrinsic(ty):
    """A numba intrinsic turning an integer address into a ``CPointer(ty)``, so that a
    kernel can view (``numba.carray``) many weight matrices whose addresses a table
    holds: one call multiplies any number of matrices wherever they live."""

    @intrinsic
    def ptr(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return types.CPointer(ty)(addr), codegen

    return ptr


_i16_ptr = address_intrinsic(types.int16)

# Columns of a grouped call's job table (int64 [G, 4 + addresses]): job g multiplies
# rows x0..x1-1 of x by its matrix W_g [n, K] (at the address(es) from column J_ADDR)
# and writes the [x1-x0, n] result row-major at out[off:].
J_N, J_X0, J_X1, J_OFF, J_ADDR = 0, 1, 2, 3, 4


@njit(cache=True, nogil=True)
def empty64(n):
    """An uninitialised float32 [n] whose data start on a 64-byte boundary (a cache line,
    one 512-bit register). numpy's and numba's allocators give 16 or 32 bytes, and then
    every 64-byte vector load from the array straddles two cache lines, which slowed the
    T > 1 tiles measurably (docs/PERFORMANCE.md, fourteenth session)."""
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
    own 4 KiB page, and a tile sweep over them missed the TLB often enough to take
    1.25x the time (docs/PERFORMANCE.md, twenty-first session); in 2 MiB pages they
    share a few entries. One buffer of up to _SCRATCH_KEEP bytes per Python
    thread is kept and reused by the next call, so the caller must be done with the
    array before the same thread asks again (one kernel call at a time per thread)."""
    from ..checkpoint.io import HUGE, aligned_empty
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


# =========================================================================== wrappers
#: below this many multiply-adds one thread beats waking the pool (~55 us per parallel
#: region on the 2-vCPU box with OMP_WAIT_POLICY=PASSIVE); results do not depend on it
_SERIAL_WORK = 1 << 18

#: (get, set, small calls on one thread) once numba's threading layer is up: see _threads
_TH: tuple | None = None


def _threads() -> tuple:
    """(get, set, serial_small): numba's C functions for the calling thread's count (the
    public numba.get_num_threads / set_num_threads add ~1.5 us of Python checks each, and
    a small call paid three of them), and whether small work is run on one thread: not
    under the TBB layer, whose idle workers cost a parallel region about a microsecond
    (OpenMP's passive ones ~55 us, docs/PERFORMANCE.md)."""
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


#: one-token calls of fewer multiply-adds than this run on the calling thread alone
#: (``_launch_t1``): waking the pool for them cost more than the second core gave
#: (docs/PERFORMANCE.md, "Per-token overhead"); results do not depend on it
_T1_SERIAL_WORK = 1 << 18


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
            for r, w in zip(e[0], ws):  # (a loop: a generator in all() costs a microsecond)
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


@intrinsic
def _pair_split_step(typingctx, src, dst, n):
    """dst[64j : 64j+64] = src[64j : 64j+64] in the PAIR_SPLIT order, j < n (float32
    1-D arrays): a register load, two lane shuffles (evens, odds) per 2 * _V elements."""
    if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32 for a in (src, dst))
            and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        sp = _data_ptr(context, builder, sig.args[0], args[0])
        dp = _data_ptr(context, builder, sig.args[1], args[1])
        cnt = context.cast(builder, args[2], sig.args[2], types.int64)
        v = _V
        ev = ir.Constant(ir.VectorType(_I32, v), list(range(0, 2 * v, 2)))
        od = ir.Constant(ir.VectorType(_I32, v), list(range(1, 2 * v, 2)))
        with cgutils.for_range(builder, cnt) as loop:
            base = builder.mul(loop.index, _I64(LANES))
            for g in range(0, LANES, 2 * v):
                e = builder.add(base, _I64(g))
                u = _vload(builder, sp, e, _F32, 2 * v)
                _vstore(builder, builder.shuffle_vector(u, u, ev), dp, e)
                _vstore(builder, builder.shuffle_vector(u, u, od), dp, builder.add(e, _I64(v)))
        return context.get_dummy_value()

    return types.void(src, dst, n), codegen


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
    themselves (k3.model.fused.expert_ffn)."""
    if out.size == 0:
        return
    if xn.shape[1] == 0:
        out[:] = 0.0
        return
    if tmax == 1:
        _launch_t1(_bf16_t1, _bf16_t1_serial, work, _T1_SERIAL_WORK, xn, jobs, out, _RB1)
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
