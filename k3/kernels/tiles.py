"""Kernel factories: the register tiles and row dots (``make_vdot``, ``make_tile``,
``make_gtile``, ``make_dotn_bf16``) that ``bf16`` and ``mxfp4`` instantiate for the
CPU's path. Each builds an intrinsic keeping the canonical per-lane fma order.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .cpu import LANES, NEXT_ROWS, PF_ARG, pair_split
from .simd import F32_ONLY, W_DTYPES, _F32, _I16, _I32, _I64, _VF, _data_ptr, _inverse, _prefetch, _row_ptr, _vfma, _vload, _vstore, c_matrix, counted_loop, for_each_nt, tree_sum_ir, widen_bf16_vec

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
