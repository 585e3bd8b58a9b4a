"""MXFP4 multi-token dots and their instantiation for this CPU: the AVX2 bf16-word path
(``_dot_mxfp4_w``, ``make_vdotn_w``), the decode-once-use-for-all-tokens dots
(``make_vdotn_mxfp4``), the group decode into scratch for the register tiles.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import LANES, _ISA, _V
from .mxfp4_ir import PREFETCH_BYTES, _GPJ, _RB, _U8_ONLY, _W16, _W_TH, _W_TL, _decode_group_ir, _decode_step_ir, _f32_array, _row_args, _row_ptrs, _u8_array
from .simd import F32_ONLY, _data_ptr, _prefetch, _row_ptr, _vfma, _vload, _vstore, address_intrinsic, c_matrix, counted_loop, for_each_nt, make_trees, tree_sum_ir
from .tiles import make_gtile

def _w_step_ir(builder, pp, sp, j, xep, xop, acc):
    """One 64-byte step of the AVX2 decode into the 8 accumulators (W_PERM order) of each
    token: pp / sp the row's packed / scale bytes, xep / xop lists of x pointers,
    acc[8 t + k] token t's register k. The step's four scale bytes give the subtrahends
    (252 - s) << 7 (0xFFFF for 255) in registers, each word spread over its group's
    eight; the row must hold no scale 0, 1, 253 or 254 (``_row_bad``)."""
    I64, I32, I16, I8, F32 = ir.IntType(64), ir.IntType(32), ir.IntType(16), ir.IntType(8), ir.FloatType()
    VB, VW, VD, VF = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8), ir.VectorType(F32, 8)
    shuf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VB, [VB, VB]), "llvm.x86.avx2.pshuf.b")
    sub = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VW, [VW, VW]), "llvm.usub.sat.v16i16")
    tl, th = (ir.Constant(VB, [I8(v) for v in t]) for t in (_W_TL, _W_TH))
    m15 = ir.Constant(VB, [15] * 32)
    off = builder.mul(j, I64(LANES))
    V4 = ir.VectorType(I16, 4)
    s4 = builder.zext(_vload(builder, sp, builder.mul(j, I64(_GPJ)), I8, _GPJ), V4)
    d4 = builder.select(builder.icmp_unsigned("==", s4, ir.Constant(V4, [255] * 4)), ir.Constant(V4, [0xFFFF] * 4),
                        builder.shl(builder.sub(ir.Constant(V4, [252] * 4), s4), ir.Constant(V4, [7] * 4)))
    new = list(acc)
    for c in range(2):
        b = _vload(builder, pp, builder.add(off, I64(32 * c)), I8, 32)
        d = builder.shuffle_vector(d4, ir.Constant(d4.type, ir.Undefined),
                                   ir.Constant(ir.VectorType(I32, 16), [2 * c] * 8 + [2 * c + 1] * 8))
        for h, nib in enumerate((builder.and_(b, m15), builder.and_(builder.lshr(b, ir.Constant(VB, [4] * 32)), m15))):
            lo, hi = builder.call(shuf, [tl, nib]), builder.call(shuf, [th, nib])
            xps = (xep, xop)[h]                        # low nibbles: even elements
            for u in range(2):                         # punpck{l,h}bw: bytes 8u.. of each 128-bit half
                mask = [k for hh in range(2) for i in range(8) for k in (16 * hh + 8 * u + i, 48 + 16 * hh + 8 * u + i - 16)]
                w = builder.bitcast(builder.call(sub, [builder.bitcast(builder.shuffle_vector(
                    lo, hi, ir.Constant(ir.VectorType(I32, 32), mask)), VW), d]), VD)
                for p, f in ((0, builder.shl(w, ir.Constant(VD, [16] * 8))),
                             (1, builder.and_(w, ir.Constant(VD, [-65536] * 8)))):
                    k = 4 * c + 2 * u + p
                    fv = builder.bitcast(f, VF)
                    for t, xp in enumerate(xps):
                        xv = _vload(builder, xp, builder.add(off, I64(8 * k)), F32, 8)
                        new[8 * t + k] = _vfma(builder, xv, fv, new[8 * t + k])
    return new


def _w_tree_ir(builder, parts):
    """The halving tree of one token's 8 accumulator registers (W_PERM order), on the
    registers as they are: register k = 4c + 2u + p holds canonical lanes 32c + 16hh +
    8u + 2i + p in its lane 4hh + i, so each level of the tree pairs whole registers
    (h = 32: c, h = 8: u), register halves (h = 16: hh, h = 4: i >> 1) or neighbours
    (h = 2: i & 1, h = 1: p): the additions of ``tree_sum_ir`` on the canonical lanes,
    in its order, without moving 64 lanes back first."""
    I32 = ir.IntType(32)

    def half(v, lo):
        n = v.type.count // 2
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(lo * n, lo * n + n))))

    r = [builder.fadd(parts[k], parts[k + 4]) for k in range(4)]          # h = 32: c
    r = [builder.fadd(half(v, 0), half(v, 1)) for v in r]                  # h = 16: hh
    r = [builder.fadd(r[p], r[2 + p]) for p in range(2)]                   # h = 8: u
    r = [builder.fadd(half(v, 0), half(v, 1)) for v in r]                  # h = 4: i >> 1
    r = [builder.fadd(builder.extract_element(v, I32(0)), builder.extract_element(v, I32(1))) for v in r]  # h = 2
    return builder.fadd(r[0], r[1])                                        # h = 1: p


def _w_bad_ir(builder, sp, j):
    """<4 x i16>, lane g nonzero when scale byte g of step j is 0, 1, 253 or 254 (what
    ``_row_bad`` finds, from the bytes the step loads anyway)."""
    I16, I8, I64 = ir.IntType(16), ir.IntType(8), ir.IntType(64)
    V4 = ir.VectorType(I16, _GPJ)
    s4 = builder.zext(_vload(builder, sp, builder.mul(j, I64(_GPJ)), I8, _GPJ), V4)

    def c(v):
        return ir.Constant(V4, [v] * _GPJ)
    big = builder.and_(builder.icmp_unsigned(">", s4, c(252)), builder.icmp_unsigned("!=", s4, c(255)))
    return builder.sext(builder.or_(builder.icmp_unsigned("<", s4, c(2)), big), V4)


@intrinsic
def _dot_mxfp4_w(typingctx, xe, xo, xr, pk, sc, r, nj):
    """(``_dot_mxfp4`` by the AVX2 decode, bad): xe / xo in the W_PERM order of each step.
    bad is nonzero when a scale byte of the row is 0, 1, 253 or 254, which this decode
    cannot scale: the value is then not the row's and the caller takes ``_dot_mxfp4``
    (the check rides on the steps' own scale loads, a few vector operations each, in
    place of a scalar pass over the row's scale bytes). Only on the AVX2 path
    (elsewhere it compiles to (0.0, 1) and is never called)."""
    if not _row_args(xe, xo, xr, pk, sc, r, nj):
        return None
    sig = types.Tuple((types.float32, types.int64))(xe, xo, xr, pk, sc, r, nj)

    def codegen(context, builder, sig, args):
        I64, F32 = ir.IntType(64), ir.FloatType()
        if not _W16:
            return context.make_tuple(builder, sig.return_type, [ir.Constant(F32, 0.0), I64(1)])
        xep, xop, pp, sp, n = _row_ptrs(context, builder, sig, args)

        def body(j, acc):
            _prefetch(builder, builder.gep(pp, [builder.add(builder.mul(j, I64(LANES)), I64(PREFETCH_BYTES))]))
            return _w_step_ir(builder, pp, sp, j, [xep], [xop], acc[:8]) + [builder.or_(acc[8], _w_bad_ir(builder, sp, j))]

        fins = counted_loop(builder, n, [ir.Constant(ir.VectorType(F32, 8), [0.0] * 8)] * 8
                            + [ir.Constant(ir.VectorType(ir.IntType(16), _GPJ), [0] * _GPJ)], body, "dmxw")
        bad = builder.bitcast(fins[8], I64)                # the four lanes' flags as one word
        return context.make_tuple(builder, sig.return_type, [_w_tree_ir(builder, fins[:8]), bad])

    return sig, codegen


def make_vdotn_w(max_nt):
    """``make_vdotn_mxfp4`` by the AVX2 decode (``_dot_mxfp4_w``): each step decoded
    once in registers for the nt tokens of the call::

        vdotn_w(nt, acc, a0, xe, xo, xr, pk, sc, r, j0, n, mode, out, obase, ostride)

    xe / xo in the W_PERM order (2-D, rows xr + t), a row r for which ``_row_bad`` is 0.
    The accumulators acc[a0 + t] hold the lanes in
    the W_PERM order between chunks; ``mode`` bit 0: they start at +0.0; bit 1: finish,
    out[obase + t * ostride] = the halving tree of the lanes put back in order. Only on
    the AVX2 path (elsewhere it compiles to nothing and is never called)."""
    def typer(typingctx, nt, acc, a0, xe, xo, xr, pk, sc, r, j0, n, mode, out, obase, ostride):
        if not (c_matrix(acc, F32_ONLY) and c_matrix(xe, F32_ONLY) and xo == xe and c_matrix(pk, _U8_ONLY)
                and sc == pk and _f32_array(out)):
            return None
        if not all(isinstance(t, types.Integer) for t in (nt, a0, xr, r, j0, n, mode, obase, ostride)):
            return None
        sig = types.void(nt, acc, a0, xe, xo, xr, pk, sc, r, j0, n, mode, out, obase, ostride)

        def codegen(context, builder, sig, args):
            if not _W16:
                return context.get_dummy_value()
            I64, F32 = ir.IntType(64), ir.FloatType()
            iv = [context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
                  for a, t in zip(args, sig.args)]
            nt_v, acc_v, a0, xe_v, xo_v, xr, pk_v, sc_v, r, j0, n, mode, out_v, obase, ostride = iv
            at, xt = sig.args[1], sig.args[3]
            first = builder.icmp_unsigned("!=", builder.and_(mode, I64(1)), I64(0))
            finish = builder.icmp_unsigned("!=", builder.and_(mode, I64(2)), I64(0))
            outp = _data_ptr(context, builder, sig.args[12], out_v)
            pp = _row_ptr(context, builder, sig.args[6], pk_v, r, builder.mul(j0, I64(LANES)))
            sp = _row_ptr(context, builder, sig.args[7], sc_v, r, builder.mul(j0, I64(_GPJ)))
            e0 = builder.mul(j0, I64(LANES))
            z = ir.Constant(ir.VectorType(F32, 8), [0.0] * 8)

            def emit(n_t):
                accp = [_row_ptr(context, builder, at, acc_v, builder.add(a0, I64(t)), I64(0)) for t in range(n_t)]
                xep = [_row_ptr(context, builder, xt, xe_v, builder.add(xr, I64(t)), e0) for t in range(n_t)]
                xop = [_row_ptr(context, builder, xt, xo_v, builder.add(xr, I64(t)), e0) for t in range(n_t)]
                init = [builder.select(first, z, _vload(builder, p, I64(8 * k), F32, 8)) for p in accp for k in range(8)]

                def body(j, acc):
                    _prefetch(builder, builder.gep(pp, [builder.add(builder.mul(j, I64(LANES)), I64(PREFETCH_BYTES))]))
                    return _w_step_ir(builder, pp, sp, j, xep, xop, acc)

                fins = counted_loop(builder, n, init, body, f"vdotnw{n_t}")
                with builder.if_else(finish) as (then, other):
                    with then:
                        for t in range(n_t):
                            o = builder.add(obase, builder.mul(I64(t), ostride))
                            builder.store(_w_tree_ir(builder, fins[8 * t: 8 * t + 8]),
                                          builder.gep(outp, [o], inbounds=True))
                    with other:
                        for t in range(n_t):
                            for k in range(8):
                                _vstore(builder, fins[8 * t + k], accp[t], I64(8 * k))

            for_each_nt(builder, nt_v, max_nt, "vdotnw", emit)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"vdotn{max_nt}_w"
    return intrinsic(typer)


def make_vdotn_mxfp4(max_nt):
    """An intrinsic for a few tokens sharing each decoded step of one row::

        vdotn(nt, acc, a0, xe, xo, xr, pk, sc, r, j0, n, mode, out, obase, ostride)

    for j in j0 .. j0+n-1: decode bytes [64j, 64j+64) of row r of pk / sc (2-D) in
    registers once, then for every token t < nt (a run-time value, 1 .. max_nt):
    acc[a0 + t] = fma(xo[xr + t], wo, fma(xe[xr + t], we, acc[a0 + t])) lane-wise (the
    canonical order). ``mode`` bit 0: the lanes start at +0.0; bit 1: finish,
    out[obase + t * ostride] = the halving tree of acc[a0 + t]. For T = 2 .. max_nt the
    decode (more work per byte than the multiply-adds of two tokens) is paid once per
    call instead of once per token, and no decoded copy goes through memory."""
    def codegen(context, builder, sig, args):
        I64 = ir.IntType(64)
        F32 = ir.FloatType()
        iv = [context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
              for a, t in zip(args, sig.args)]
        nt_v, acc_v, a0, xe_v, xo_v, xr, pk_v, sc_v, r, j0, n, mode, out_v, obase, ostride = iv
        at, xt, pt = sig.args[1], sig.args[3], sig.args[6]
        first = builder.icmp_unsigned("!=", builder.and_(mode, I64(1)), I64(0))
        finish = builder.icmp_unsigned("!=", builder.and_(mode, I64(2)), I64(0))
        outp = _data_ptr(context, builder, sig.args[-3], out_v)
        pp = _row_ptr(context, builder, pt, pk_v, r, builder.mul(j0, I64(LANES)))
        sp = _row_ptr(context, builder, pt, sc_v, r, builder.mul(j0, I64(_GPJ)))
        z = ir.Constant(ir.VectorType(F32, LANES), [0.0] * LANES)
        def emit(n_t):
            e0 = builder.mul(j0, I64(LANES))
            accp = [_row_ptr(context, builder, at, acc_v, builder.add(a0, I64(t)), I64(0)) for t in range(n_t)]
            xep = [_row_ptr(context, builder, xt, xe_v, builder.add(xr, I64(t)), e0) for t in range(n_t)]
            xop = [_row_ptr(context, builder, xt, xo_v, builder.add(xr, I64(t)), e0) for t in range(n_t)]
            init = [builder.select(first, z, _vload(builder, p, I64(0), F32, LANES)) for p in accp]

            def body(j, acc, xep=xep, xop=xop):
                off = builder.mul(j, I64(LANES))
                _prefetch(builder, builder.gep(pp, [builder.add(off, I64(PREFETCH_BYTES))]))
                we, wo = _decode_step_ir(builder, pp, sp, j)
                return [_vfma(builder, _vload(builder, xo_p, off, F32, LANES), wo,
                              _vfma(builder, _vload(builder, xe_p, off, F32, LANES), we, a))
                        for a, xe_p, xo_p in zip(acc, xep, xop)]

            fins = counted_loop(builder, n, init, body, f"vdotn{n_t}")
            with builder.if_else(finish) as (then, other):
                with then:
                    for t, f in enumerate(fins):
                        o = builder.add(obase, builder.mul(I64(t), ostride))
                        builder.store(tree_sum_ir(builder, f), builder.gep(outp, [o], inbounds=True))
                with other:
                    for p, f in zip(accp, fins):
                        _vstore(builder, f, p, I64(0))

        for_each_nt(builder, nt_v, max_nt, "vdotn", emit)
        return context.get_dummy_value()

    def check(nt, acc, a0, xe, xo, xr, pk, sc, ints, out):
        return (c_matrix(acc, F32_ONLY) and c_matrix(xe, F32_ONLY) and xo == xe and c_matrix(pk, _U8_ONLY)
                and sc == pk and _f32_array(out) and all(isinstance(t, types.Integer) for t in ints))

    def typer(typingctx, nt, acc, a0, xe, xo, xr, pk, sc, r, j0, n, mode, out, obase, ostride):
        if not check(nt, acc, a0, xe, xo, xr, pk, sc, (nt, a0, xr, r, j0, n, mode, obase, ostride), out):
            return None
        return types.void(nt, acc, a0, xe, xo, xr, pk, sc, r, j0, n, mode, out, obase, ostride), codegen

    typer.__name__ = f"vdotn{max_nt}_mxfp4"
    return intrinsic(typer)


@intrinsic
def _vdecode_group(typingctx, w, pk, sc, nj, q):
    """Scale group q of the first nj steps of a row, group-major: w[32j .. 32j + 15] =
    its even elements of step j, w[32j + 16 .. 32j + 31] the odd ones (``_decode_group_ir``)."""
    if not (_f32_array(w) and _u8_array(pk) and _u8_array(sc) and isinstance(nj, types.Integer)
            and isinstance(q, types.Integer)):
        return None
    sig = types.void(w, pk, sc, nj, q)

    def codegen(context, builder, sig, args):
        I64 = ir.IntType(64)
        wp, pp, sp = (_data_ptr(context, builder, t, v) for t, v in zip(sig.args[:3], args[:3]))
        n, qi = (context.cast(builder, a, t, types.int64) for a, t in zip(args[3:], sig.args[3:]))
        with cgutils.for_range(builder, n) as loop:
            e, o = _decode_group_ir(builder, pp, sp, loop.index, qi)
            off = builder.mul(loop.index, I64(32))
            _vstore(builder, e, wp, off)
            _vstore(builder, o, wp, builder.add(off, I64(16)))
        return context.get_dummy_value()

    return sig, codegen


_u8_ptr = address_intrinsic(types.uint8)
#: register tiles (tokens x rows) of the T > _NTF path per kernel_isa(): nt * nr
#: accumulators + 2 nr weight vectors (even, odd) + one activation vector
_NT2, _NR2 = {"avx512": (4, 4), "avx2": (4, 2), "generic": (2, 2)}[_ISA]
_gtile2 = make_gtile(_NT2, _NR2, 2, _V)
_gtile2_1 = make_gtile(_NT2, 1, 2, _V)            # a block's last rows
#: tokens of a T > _NTF job whose accumulators a block keeps at once (its rows are
#: decoded again for each such super tile)
_GST = 64
#: jobs of up to this many tokens decode each step in registers once for all of them: up
#: to here that beats the group-major tiles on both paths, from 7 it does not
#: (docs/PERFORMANCE.md, "Kernels")
_NTF = 6
_vdotn = make_vdotn_mxfp4(_NTF)
_vdotn_w = make_vdotn_w(_NTF)
_trees_rb = make_trees(_RB)              # a block's rows' trees side by side (_RB: a power of two)
