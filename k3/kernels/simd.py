"""LLVM-IR building blocks of the kernels: explicit vector loads, stores, fma and
prefetch, counted loops, the bf16 widening, the halving trees of the canonical order,
lane permutes, and the intrinsics numba code calls them through. Nothing here is
fast-math: a lane's sum is never reordered.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import LANES, _V

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
