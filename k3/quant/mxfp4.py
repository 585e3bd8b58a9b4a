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
``k3.quant.bf16.make_gtile`` (even and odd elements as two streams), up to ``_GST``
tokens per decode. All paths compute the same canonical order
of one output y[t, r] (P = C/2 bytes per row, ``LANES`` = 64 fp32 accumulators
starting at +0.0, Pm = P - P % 64):

1. for j = 0 .. Pm/64 - 1, for every lane l, with p = 64j + l (a byte index):
   ``a[l] = fma(x[2p], W[2p], a[l]); a[l] = fma(x[2p+1], W[2p+1], a[l])``
2. the tail bytes p = Pm + l (l < P % 64) the same way into lane l;
3. the halving tree of ``k3.quant.bf16`` (h = 32 .. 1), result a[0].

(A zero group, scale 255, and nibble 8 (-0, decoded as +0.0 in registers) contribute
signed zeros to the sum, which cannot change it: the accumulators start at +0.0 and a
sum that starts there is never -0.0, so the result equals decode-then-matmul bit for
bit.)

No fast-math reassociation, so the bits do not depend on the thread count, the number
of tokens in the call (decode == prefill) or the machine's SIMD width.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16 import (F32_ONLY, J_ADDR, J_N, J_OFF, J_X0, J_X1, LANES, _as_f32_activations, _data_ptr, _fma, _launch,
                   _launch_t1,
                   _prefetch, _tree_sum, _vfma, _vload, _vstore, _zero, address_intrinsic, as_cpu_array, c_matrix,
                   counted_loop, empty64, job_blocks, tree_sum_ir, grouped_jobs, make_gtile, make_trees, for_each_nt,
                   _ISA, _V, _row_ptr, scratch_f32)
from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.quant.kcache.folder(), until the end

__all__ = ["E2M1", "decode_mxfp4", "mxfp4_linear", "mxfp4_grouped", "encode_mxfp4", "GROUP"]

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude table; bit 3 of the nibble = sign
GROUP = 32  # elements per scale byte

_RB1 = 16    # rows per prange iteration (decode, and T = 1)
_RB = 8      # rows decoded together and reused across tokens when T > 1
_JC = 16     # 64-byte steps per chunk of the T > 1 paths (the chunk of x for a token tile stays in L1)
#: one-token calls of fewer multiply-adds than this run on the calling thread alone
#: (``k3.quant.bf16._launch_t1``; the decode costs more per byte than bf16's)
_T1_SERIAL_WORK = 1 << 18


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
#: sequential stream alone did not keep the memory busy (docs/PERFORMANCE.md, "Kernels");
#: the BF16 kernel measured no faster with it.
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
#: jobs of up to this many tokens decode each step in registers once for all of them
#: (at 5 and 6 tokens, against the group-major tiles: 0.77x the time on AVX-512, 0.70 / 0.92x
#: on the AVX2 path; at 7, 1.07x, docs/PERFORMANCE.md)
_NTF = 6
_vdotn = make_vdotn_mxfp4(_NTF)
_vdotn_w = make_vdotn_w(_NTF)
_trees_rb = make_trees(_RB)              # a block's rows' trees side by side (_RB: a power of two)


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


@njit(cache=True, nogil=True, inline="always")
def _tail_tree(packed, scale, xe, xo, acc, tb, xt, nt, out, ob, R, r0, nrb, sc3):
    """Steps 2-3 of the canonical order for rows r0 .. r0 + nrb - 1 and tokens t < nt
    whose step-1 lanes are in acc[r * tb + t] (+0.0 when there are no whole steps): the
    tail bytes [Pm, P) of each row (decoded into sc3's rows 1 / 2) with x rows xt + t,
    then out[ob + t * R + r0 + r] = the halving tree (a whole block's rows' trees of a
    token at once, ``_trees_rb``)."""
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
    """For every job g (the J_* columns of ``k3.quant.bf16``; packed bytes [n, P] at
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
                _tail_tree(packed, scale, xe, xo, acc, _NTF, x0, T, out, off, R, r0, nrb, gv_all[tid])
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
        _tail_tree(packed, scale, xe, xo, acc, _GST, x0 + s0, ns, out, off + s0 * R, R, r0, nrb, gv_all[tid])


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
    makes it (``k3.quant.bf16.run_bf16_jobs``; tmax: most tokens of one job, 1 for the
    one-token kernels, 0 when unknown)."""
    if out.size == 0:
        return
    if xn.shape[1] == 0:
        out[:] = 0.0
        return
    if tmax == 1:
        _launch_t1(_mxfp4_t1, _mxfp4_t1_serial, work, _T1_SERIAL_WORK, xn, jobs, out, _RB1)
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
