"""MXFP4 decoding in LLVM IR: the E2M1 nibble and E8M0 scale decodes (lane permute on
AVX-512, byte shuffles on AVX2, plain vector arithmetic elsewhere) and the one-token
row dots built on them. See ``k3.kernels.mxfp4`` for the format and the canonical order.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import LANES, _ISA
from .simd import F32_ONLY, _data_ptr, _prefetch, _row_ptr, _vfma, _vload, _vstore, c_matrix, counted_loop, tree_sum_ir
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude table; bit 3 of the nibble = sign
GROUP = 32  # elements per scale byte

_RB1 = 16    # rows per prange iteration (decode, and T = 1)
_RB = 8      # rows decoded together and reused across tokens when T > 1
_JC = 16     # 64-byte steps per chunk of the T > 1 paths (the chunk of x for a token tile stays in L1)


# --------------------------------------------------------------------------- intrinsics
def _dec_nibble_ir(builder, n, vt):
    """E2M1 nibbles n (i32 or <L x i32>, values 0..15) -> float bits (same shape)."""
    def c(v):
        return ir.Constant(vt, [v] * vt.count) if isinstance(vt, ir.VectorType) else ir.Constant(vt, v)
    m = builder.and_(n, c(7))
    # m >= 2: exponent (m >> 1) + 126, mantissa bit (m & 1): (m << 22) + 0x3F000000
    big = builder.add(builder.shl(m, c(22)), c(0x3F000000))
    # m == 1 -> 0.5 = 0x3F000000; m == 0 -> 0
    small = builder.and_(builder.neg(m), c(0x3F000000))
    mag = builder.select(builder.icmp_unsigned("<", m, c(2)), small, big)
    sign = builder.shl(builder.and_(n, c(8)), c(28))
    return builder.or_(mag, sign)


def _scale_bits_ir(builder, s, vt):
    """E8M0 scale bytes s (zero-extended i32 / <n x i32>) -> fp32 bits of 2^(s-127);
    0 -> 2^-127 (subnormal 0x00400000); 255 -> +0.0 (zero group)."""
    def c(v):
        return ir.Constant(vt, [v] * vt.count) if isinstance(vt, ir.VectorType) else ir.Constant(vt, v)
    bits = builder.shl(s, c(23))
    bits = builder.select(builder.icmp_unsigned("==", s, c(0)), c(0x00400000), bits)
    return builder.select(builder.icmp_unsigned("==", s, c(255)), c(0), bits)


def _u8_to_f32(transform):
    """A numba intrinsic: uint8 byte -> the float32 whose bits ``transform`` builds from
    the zero-extended byte (``transform(builder, v, i32)``)."""

    @intrinsic
    def conv(typingctx, b):
        if not isinstance(b, types.Integer) or b.bitwidth != 8:
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            return builder.bitcast(transform(builder, builder.zext(args[0], i32), i32), ir.FloatType())

        return types.float32(b), codegen

    return conv


# Scalar: the E2M1 value of a byte's low / high nibble (unscaled), and a scale byte's
# fp32 factor (255 -> 0.0).
_dec_lo = _u8_to_f32(lambda bld, v, i32: _dec_nibble_ir(bld, bld.and_(v, i32(15)), i32))
_dec_hi = _u8_to_f32(lambda bld, v, i32: _dec_nibble_ir(bld, bld.and_(bld.lshr(v, i32(4)), i32(15)), i32))
_scale_f32 = _u8_to_f32(_scale_bits_ir)


_GPJ = LANES // 16  # scale groups per 64-byte step
_U8_ONLY = (types.uint8,)


def _half_scale_bits_ir(builder, s, vt):
    """E8M0 scale bytes s (zero-extended i32 vector) -> fp32 bits of 2^(s-128), the
    factor of the doubled E2M1 integers: 1 -> 2^-127 (0x00400000), 0 -> 2^-128
    (0x00200000), 255 -> +0.0 (zero group)."""
    def c(v):
        return ir.Constant(vt, [v] * vt.count)
    bits = builder.shl(builder.sub(s, c(1)), c(23))
    bits = builder.select(builder.icmp_unsigned("==", s, c(1)), c(0x00400000), bits)
    bits = builder.select(builder.icmp_unsigned("==", s, c(0)), c(0x00200000), bits)
    return builder.select(builder.icmp_unsigned("==", s, c(255)), c(0), bits)


def _concat_ir(builder, parts):
    """One vector of the 1, 2, 4, .. equally typed vectors ``parts``, in order."""
    while len(parts) > 1:
        m = parts[0].type.count
        idx = ir.Constant(ir.VectorType(ir.IntType(32), 2 * m), list(range(2 * m)))
        parts = [builder.shuffle_vector(parts[k], parts[k + 1], idx) for k in range(0, len(parts), 2)]
    return parts[0]


#: 2 x the E2M1 value of each nibble as a signed byte (nibble 8, -0, gives 0)
_DEC2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _dec2_nibble_ir(builder, n, vt):
    """E2M1 nibbles n (<L x i8>, 0..15) -> 2 x their value as signed i8 (_DEC2). With
    AVX2 / AVX-512BW a byte shuffle looks the 16-entry table up (pshufb: one instruction
    per 32 / 64 bytes); otherwise magnitude m = n & 7 -> 0 1 2 3 4 6 8 12
    (= m + max(m - 4, 0) + 2 [m == 7]), negated when bit 3 is set. The same bytes
    either way."""
    isa = _ISA
    width = 64 if isa == "avx512" else 32 if isa == "avx2" else 0
    if width and vt.count == 16:   # one scale group: SSSE3's 16-byte shuffle (AVX2 implies it)
        width = 16
    if width and vt.count % width == 0:
        bt = ir.VectorType(ir.IntType(8), width)
        name = {64: "llvm.x86.avx512.pshuf.b.512", 32: "llvm.x86.avx2.pshuf.b", 16: "llvm.x86.ssse3.pshuf.b.128"}[width]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(bt, [bt, bt]), name)
        table = ir.Constant(bt, [ir.IntType(8)(v) for v in _DEC2 * (width // 16)])
        parts = []
        for k in range(vt.count // width):
            piece = n if vt.count == width else builder.shuffle_vector(
                n, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                              list(range(k * width, (k + 1) * width))))
            parts.append(builder.call(fn, [table, piece]))
        return _concat_ir(builder, parts)

    def c(v):
        return ir.Constant(vt, [v] * vt.count)
    m = builder.and_(n, c(7))
    over = builder.select(builder.icmp_unsigned(">", m, c(4)), builder.sub(m, c(4)), c(0))
    seven = builder.select(builder.icmp_unsigned("==", m, c(7)), c(2), c(0))
    r = builder.add(builder.add(m, over), seven)
    neg = builder.icmp_unsigned("!=", builder.and_(n, c(8)), c(0))
    return builder.select(neg, builder.sub(c(0), r), r)


#: the signed E2M1 value of each nibble (nibble 8, -0, gives +0.0 like the byte-lane decode)
_E2M1_SIGNED = tuple(E2M1) + (0.0,) + tuple(-v for v in E2M1[1:])


def _splat_ir(builder, v, n: int):
    """<n x type(v)> with v in every lane."""
    vt = ir.VectorType(v.type, n)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.IntType(32)(0)),
                                  ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


def _scaled_e2m1_table() -> np.ndarray:
    """float32 [256, 16]: row s = the signed E2M1 values x 2^(s-127), the format's own
    definition, exact in fp32 (subnormal at s = 0; 254 x 2 and up overflow to inf as a
    multiply does); row 255, a zero group, is those values x +0.0."""
    e2m1 = np.array(_E2M1_SIGNED, np.float32)
    with np.errstate(over="ignore"):
        tab = np.ldexp(e2m1[None, :], (np.arange(256, dtype=np.int32) - 127)[:, None])
    tab[255] = e2m1 * np.float32(0.0)
    return tab


_SCALED_E2M1 = _scaled_e2m1_table()


def _scaled_table_ptr(builder):
    """float* to ``_SCALED_E2M1`` as a constant of the module being built (64-byte
    aligned: each scale's 16 values are one cache line, loaded whole)."""
    mod = builder.module
    name = "k3_mxfp4_scaled_e2m1"
    gv = mod.globals.get(name)
    if gv is None:
        at = ir.ArrayType(ir.FloatType(), _SCALED_E2M1.size)
        gv = ir.GlobalVariable(mod, at, name)
        gv.linkage = "internal"
        gv.global_constant = True
        gv.align = 64
        gv.initializer = ir.Constant(at, [float(v) for v in _SCALED_E2M1.ravel()])
    return builder.bitcast(gv, ir.FloatType().as_pointer())


def _table_row_ir(builder, sb):
    """<16 x float> row of ``_SCALED_E2M1`` for the scale byte sb (i8): one aligned load,
    no vector arithmetic."""
    I64 = ir.IntType(64)
    p = builder.gep(_scaled_table_ptr(builder), [builder.mul(builder.zext(sb, I64), I64(16))], inbounds=True)
    vt = ir.VectorType(ir.FloatType(), 16)
    return builder.load(builder.bitcast(p, vt.as_pointer()), align=64, typ=vt)


def _perm_lookup_ir(builder, d, tab):
    """The permute decode of 16 bytes d (<16 x i32>, zero-extended) with their scale
    group's row ``tab`` of ``_SCALED_E2M1``: (low nibbles' values, high nibbles' values)."""
    V16, VF16 = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.FloatType(), 16)
    perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF16, [VF16, V16]),
                                          "llvm.x86.avx512.permvar.sf.512")
    return builder.call(perm, [tab, d]), builder.call(perm, [tab, builder.lshr(d, ir.Constant(V16, [4] * 16))])


def _byte_pair_ir(builder, b, sc):
    """The byte-lane decode of bytes b (<L x i8>) whose factors 2^(s-128) are sc
    (<L x float>, per byte): (low nibbles' values, high nibbles' values), each the
    doubled E2M1 integer (``_dec2_nibble_ir``) widened and scaled (exact)."""
    VB, VF = b.type, ir.VectorType(ir.FloatType(), b.type.count)
    lo = builder.and_(b, ir.Constant(VB, [15] * VB.count))
    hi = builder.lshr(b, ir.Constant(VB, [4] * VB.count))
    return (builder.fmul(builder.sitofp(_dec2_nibble_ir(builder, lo, VB), VF), sc),
            builder.fmul(builder.sitofp(_dec2_nibble_ir(builder, hi, VB), VF), sc))


def _decode_step_perm_ir(builder, pp, sp, j):
    """``_decode_step_ir`` on AVX-512: each group's 16 bytes widened to 32-bit lanes
    (one per byte, the lanes of we / wo) and looked up by a lane permute that reads only
    an index's low 4 bits (the byte itself for the low nibble, the byte shifted right by
    4 for the high one) in the group's 16-entry table E2M1 x 2^(s-127), one aligned load
    of ``_SCALED_E2M1``'s row s. The same values as the byte-lane decode, bit for bit
    (the table's products are exact; scale 255 gives a zero group the same way), in 4
    vector operations per scale group where the byte-lane decode needs about twice as
    many."""
    I64, I32, I8 = ir.IntType(64), ir.IntType(32), ir.IntType(8)
    V16 = ir.VectorType(I32, 16)
    off = builder.mul(j, I64(LANES))
    es, os_ = [], []
    for g in range(_GPJ):
        d = builder.zext(_vload(builder, pp, builder.add(off, I64(16 * g)), I8, 16), V16)
        sb = builder.load(builder.gep(sp, [builder.add(builder.mul(j, I64(_GPJ)), I64(g))], inbounds=True))
        e, o = _perm_lookup_ir(builder, d, _table_row_ir(builder, sb))
        es.append(e)
        os_.append(o)
    return _concat_ir(builder, es), _concat_ir(builder, os_)


def _decode_step_ir(builder, pp, sp, j):
    """Decode bytes [64j, 64j+64) of a row: (we, wo) <64 x float> = even / odd elements,
    scaled (exact). pp: i8* packed row, sp: i8* scale row.

    The nibbles are decoded in byte lanes to 2 x their E2M1 value (small integers),
    widened to fp32 and multiplied by 2^(s-128): the same value as E2M1 * 2^(s-127),
    exactly (both factors are exact, the product needs at most 4 significant bits),
    except that nibble 8 (-0) gives +0.0, which no accumulator starting at +0.0 can
    tell apart (module docstring)."""
    I64 = ir.IntType(64)
    if _ISA == "avx512":
        return _decode_step_perm_ir(builder, pp, sp, j)
    v = _vload(builder, pp, builder.mul(j, I64(LANES)), ir.IntType(8), LANES)
    VS = ir.VectorType(ir.IntType(32), _GPJ)
    s4 = builder.zext(_vload(builder, sp, builder.mul(j, I64(_GPJ)), ir.IntType(8), _GPJ), VS)
    sc4 = builder.bitcast(_half_scale_bits_ir(builder, s4, VS), ir.VectorType(ir.FloatType(), _GPJ))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [i // 16 for i in range(LANES)])
    return _byte_pair_ir(builder, v, builder.shuffle_vector(sc4, ir.Constant(sc4.type, ir.Undefined), mask))


def _decode_group_ir(builder, pp, sp, j, q):
    """Scale group q (bytes [64j + 16q, 64j + 16q + 16), scale byte 4j + q) of a row:
    (even, odd) <16 x float> elements, the values of ``_decode_step_ir``'s lanes 16q ..
    16q + 15 bit for bit (AVX-512: the permute table; else the byte-lane decode)."""
    I64, I32, I8, F32 = ir.IntType(64), ir.IntType(32), ir.IntType(8), ir.FloatType()
    V16 = ir.VectorType(I32, 16)
    b = _vload(builder, pp, builder.add(builder.mul(j, I64(LANES)), builder.mul(q, I64(16))), I8, 16)
    sb = builder.load(builder.gep(sp, [builder.add(builder.mul(j, I64(_GPJ)), q)], inbounds=True))
    if _ISA == "avx512":
        return _perm_lookup_ir(builder, builder.zext(b, V16), _table_row_ir(builder, sb))
    s = builder.zext(sb, I32)
    sc = builder.bitcast(_half_scale_bits_ir(builder, _splat_ir(builder, s, 16), V16), ir.VectorType(F32, 16))
    return _byte_pair_ir(builder, b, sc)


def _u8_array(t):
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.uint8


def _f32_array(t):
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32


#: how far ahead of the T = 1 decode the packed bytes are prefetched (a hint: x86
#: prefetches never fault, so running past a matrix's end is harmless). One thread's
#: sequential stream alone does not keep the memory busy (docs/PERFORMANCE.md, "Kernels");
#: the BF16 kernel gains nothing from it.
PREFETCH_BYTES = 4096


def _dot_steps_ir(builder, xep, xop, pp, sp, n, a0, name):
    """Step 1 of the canonical order in registers: for j < n, decode bytes [64j, 64j+64)
    and acc = fma(xo, wo, fma(xe, we, acc)) lane-wise, from the <64 x float> a0."""
    I64 = ir.IntType(64)

    def body(j, acc):
        off = builder.mul(j, I64(LANES))
        _prefetch(builder, builder.gep(pp, [builder.add(off, I64(PREFETCH_BYTES))]))
        we, wo = _decode_step_ir(builder, pp, sp, j)
        a1 = _vfma(builder, _vload(builder, xep, off, ir.FloatType(), LANES), we, acc[0])
        return [_vfma(builder, _vload(builder, xop, off, ir.FloatType(), LANES), wo, a1)]

    fin, = counted_loop(builder, n, [a0], body, name)
    return fin


@intrinsic
def _vdot_mxfp4(typingctx, acc, xe, xo, pk, sc, nj):
    """Fused step 1 for one row and one token: for j < nj, decode bytes [64j, 64j+64)
    in registers and acc = fma(xo, wo, fma(xe, we, acc)) lane-wise (64 lanes)."""
    if not (_f32_array(acc) and _f32_array(xe) and _f32_array(xo) and _u8_array(pk)
            and _u8_array(sc) and isinstance(nj, types.Integer)):
        return None
    sig = types.void(acc, xe, xo, pk, sc, nj)

    def codegen(context, builder, sig, args):
        I64 = ir.IntType(64)
        ap, xep, xop, pp, sp = (_data_ptr(context, builder, t, v) for t, v in zip(sig.args[:5], args[:5]))
        n = context.cast(builder, args[5], sig.args[5], types.int64)
        zero = I64(0)
        fin = _dot_steps_ir(builder, xep, xop, pp, sp, n, _vload(builder, ap, zero, ir.FloatType(), LANES), "vmx")
        _vstore(builder, fin, ap, zero)
        return context.get_dummy_value()

    return sig, codegen


def _row_args(xe, xo, xr, pk, sc, r, nj):
    """The argument types of the one-row dots: x's even / odd rows xr of 2-D float32 C
    arrays, row r of 2-D uint8 C arrays of packed / scale bytes, nj steps. Row indices,
    not row views: a view made per row costs reference counting calls per row."""
    return (c_matrix(xe, F32_ONLY) and xo == xe and c_matrix(pk, _U8_ONLY) and sc == pk
            and all(isinstance(t, types.Integer) for t in (xr, r, nj)))


def _row_ptrs(context, builder, sig, args):
    """(xe, xo, packed, scale pointers at their rows, nj as i64) for ``_row_args``."""
    i64 = [context.cast(builder, args[k], sig.args[k], types.int64) for k in (2, 5, 6)]
    xr, r, n = i64
    zero = ir.IntType(64)(0)
    return (_row_ptr(context, builder, sig.args[0], args[0], xr, zero),
            _row_ptr(context, builder, sig.args[1], args[1], xr, zero),
            _row_ptr(context, builder, sig.args[3], args[3], r, zero),
            _row_ptr(context, builder, sig.args[4], args[4], r, zero), n)


@intrinsic
def _dot_mxfp4(typingctx, xe, xo, xr, pk, sc, r, nj):
    """x[xr] . W[r] for one row of 64 * nj bytes (no tail), the whole canonical order in
    registers: lanes from +0.0, the fused decode + 2 fma per step, the halving tree.
    The same bits as ``_zero`` + ``_vdot_mxfp4`` + ``_tree_sum``."""
    if not _row_args(xe, xo, xr, pk, sc, r, nj):
        return None
    sig = types.float32(xe, xo, xr, pk, sc, r, nj)

    def codegen(context, builder, sig, args):
        xep, xop, pp, sp, n = _row_ptrs(context, builder, sig, args)
        zero = ir.Constant(ir.VectorType(ir.FloatType(), LANES), [0.0] * LANES)
        return tree_sum_ir(builder, _dot_steps_ir(builder, xep, xop, pp, sp, n, zero, "dmx"))

    return sig, codegen


# ---- T = 1 on AVX2: the decode as bf16 words, the scale as an exponent subtraction
#
# The byte-lane decode above spends four instructions per eight weights (sign-extend,
# convert, scale, and the shuffles that cut 32 decoded bytes into eights) on the two
# floating-point ports an AVX2 core also multiplies on. This one spends about half of
# that, mostly on integer ports: two byte shuffles look up the low and high bytes of
# the bf16 pattern of 2 x E2M1(n) x 2^_W_BIAS, an unpack pairs them into words, one
# saturating subtraction of (252 - s) << 7 moves the exponent to 2 x E2M1(n) x
# 2^(s - 128) (the value the byte-lane decode makes; a zero word stays zero, and
# 0xFFFF zeroes a whole group of scale 255; the step's four scale bytes become these
# words in registers, no pass of its own over the row), and a shift / mask of each
# 32-bit pair widens the words to fp32 (exact). Scales 0, 1 (subnormal results), 253 and 254 (an
# overflow to inf) cannot be reached that way: a row holding one takes the byte-lane
# path. The unpacks and the even / odd split leave the lanes in the fixed order
# ``W_PERM`` (x is permuted to match, once per call, and the lanes put back before
# the tree), so each lane still sees its own fma sequence: the same bits.
_W16 = _ISA == "avx2"
_W_BIAS = 124


def _w_tables():
    import struct
    words = [0 if d == 0 else struct.unpack("<I", struct.pack("<f", d * 2.0 ** _W_BIAS))[0] >> 16 for d in _DEC2]
    return [w & 0xFF for w in words] * 2, [w >> 8 for w in words] * 2


_W_TL, _W_TH = _w_tables()


def _w_perm() -> list[int]:
    """position -> canonical lane of the 64 lanes of a step: 32-byte half c, unpack
    low / high u, even / odd word p; the two 128-bit halves of a register hold bytes
    8u + 2i + p and 16 + 8u + 2i + p (i < 4) of the half."""
    return [32 * c + 16 * hh + 8 * u + 2 * i + p for c in range(2) for u in range(2) for p in range(2)
            for hh in range(2) for i in range(4)]


W_PERM = _w_perm()


@njit(cache=True, nogil=True, inline="always")
def _row_bad(scale, r):
    """Nonzero when a scale byte of row r is 0, 1, 253 or 254 (the row needs the
    byte-lane decode)."""
    bad = 0
    for i in range(scale.shape[1]):
        s = scale[r, i]
        bad |= (s < 2) | ((s > 252) & (s != 255))
    return bad


_cache_leave(_CACHE_PREV)
