"""torch's own exp, tanh and log, callable from compiled (numba) code.

Also the exp of ATen's AVX2 vector type (SLEEF's ``Sleef_expf8_u10``, exported from the
same library), which torch's softmax uses: see ``sexp8``.

On x86 torch's CPU build runs its unary exp / tanh / log on contiguous float32 through
MKL's vector math library (VML, linked into libtorch_cpu), per element and whatever
the position in the array. Calling the same exported entry points (``vmsExp_64``,
``vmsTanh_64``, ``vmsLn_64``) from a compiled pass gives the same bits as torch, without
leaving the compiled code: a chain such as sigmoid or SiTU-GLU becomes one call instead
of compiled pass + torch op + compiled pass (k3.kernels).

The library is found beside torch and bound by name (``llvmlite.binding``), so compiled
functions that use it can be cached across processes. ``AVAILABLE`` is True only when
the symbols resolve AND a self-check gives torch's bits for every element of a vector of
random and special values (infinities, NaN, signed zeros, subnormals, the overflow and
underflow edges) at several lengths and offsets; otherwise the fused ops keep calling
torch between two compiled passes (a torch build without MKL, another architecture).
"""

from __future__ import annotations

import ctypes
import os
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

#: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: ATen's mode for its VML calls
_MODE = 0x2 | 0x140000 | 0x100
_NAMES = {"exp": "vmsExp_64", "tanh": "vmsTanh_64", "log": "vmsLn_64"}
#: SLEEF's 8-lane float exp, 1-ulp (what ATen's AVX2 Vectorized<float>::exp calls)
_SLEEF_EXP8 = "Sleef_expf8_u10"
#: its 16-lane form (what ATen's AVX512 Vectorized<float>::exp calls)
_SLEEF_EXP16 = "Sleef_expf16_u10"


def _library() -> str | None:
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(lib):
        return None
    try:
        handle = ctypes.CDLL(lib)
        if not all(hasattr(handle, n) for n in (*_NAMES.values(), "MKL_Set_Num_Threads_Local")):
            return None
        global HAS_SLEEF8, HAS_SLEEF16
        HAS_SLEEF8 = hasattr(handle, _SLEEF_EXP8)
        HAS_SLEEF16 = hasattr(handle, _SLEEF_EXP16)
        import llvmlite.binding as llb
        llb.load_library_permanently(lib)
    except (OSError, RuntimeError):
        return None
    return lib


#: whether libtorch_cpu exports Sleef_expf8_u10 / Sleef_expf16_u10 (set by _library)
HAS_SLEEF8 = False
HAS_SLEEF16 = False
_LIB = _library()

_SIG = types.void(types.int64, types.CPointer(types.float32), types.CPointer(types.float32), types.int64)
_vms_exp = types.ExternalFunction(_NAMES["exp"], _SIG)
_vms_tanh = types.ExternalFunction(_NAMES["tanh"], _SIG)
_vms_log = types.ExternalFunction(_NAMES["log"], _SIG)
#: MKL's per-thread thread count (by value; the lower-case symbol is the Fortran form,
#: by pointer); returns the previous one (0: the global setting).
#: VML threads a call of a few hundred elements across MKL's OpenMP team, which with
#: OMP_WAIT_POLICY=PASSIVE (k3/__init__.py) sleeps between calls: waking it costs far
#: more than the call (docs/PERFORMANCE.md). Each call here runs on its calling thread,
#: with the same bits (every element is computed on its own).
_mkl_local = types.ExternalFunction("MKL_Set_Num_Threads_Local", types.intc(types.intc))
#: calls of fewer elements than this run on the calling thread; longer ones (prefill's)
#: keep MKL's own threading, where the team's wake-up is small beside the work
_OWN_THREAD = 1 << 16


@njit(cache=True, nogil=True, inline="always")
def _own_thread(n):
    """MKL's count 1 for a call of n elements under _OWN_THREAD; the caller's setting
    to put back (-1: nothing was changed)."""
    return _mkl_local(1) if n < _OWN_THREAD else -1


@njit(cache=True, nogil=True, inline="always")
def _back(prev):
    if prev >= 0:
        _mkl_local(prev)


@njit(cache=True, nogil=True)
def vexp(a, out):
    """out[i] = exp(a[i]) for 1-D C-contiguous float32 a, out of one size (out may be a);
    short calls on the calling thread (``_OWN_THREAD``)."""
    prev = _own_thread(a.size)
    _vms_exp(a.size, a.ctypes, out.ctypes, _MODE)
    _back(prev)


@njit(cache=True, nogil=True)
def vtanh(a, out):
    """out[i] = tanh(a[i]), as vexp."""
    prev = _own_thread(a.size)
    _vms_tanh(a.size, a.ctypes, out.ctypes, _MODE)
    _back(prev)


@njit(cache=True, nogil=True)
def vlog(a, out):
    """out[i] = log(a[i]), as vexp."""
    prev = _own_thread(a.size)
    _vms_log(a.size, a.ctypes, out.ctypes, _MODE)
    _back(prev)


def _sleef_exp_intrinsic(lanes: int, symbol: str, have: bool):
    """An intrinsic ``(a, out, i)``: out[i : i + lanes] = symbol(a[i : i + lanes]) (1-D
    float32 arrays), one call of SLEEF's vector function on one register, the <lanes x
    float> argument and result in a ymm / zmm register as the x86-64 ABI passes __m256 /
    __m512. Where libtorch lacks the symbol (``have`` false) it copies instead, so the
    users' checks against torch fail and they stay off."""
    vt = ir.VectorType(ir.FloatType(), lanes)

    def typer(typingctx, a, out, i):
        if not (isinstance(a, types.Array) and isinstance(out, types.Array) and a.dtype == types.float32
                and out.dtype == types.float32 and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            src = context.make_array(sig.args[0])(context, builder, args[0]).data
            dst = context.make_array(sig.args[1])(context, builder, args[1]).data
            k = context.cast(builder, args[2], sig.args[2], types.int64)
            v = builder.load(builder.bitcast(builder.gep(src, [k]), vt.as_pointer()), align=4)
            if have:
                v = builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt]), symbol), [v])
            builder.store(v, builder.bitcast(builder.gep(dst, [k]), vt.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(a, out, i), codegen

    typer.__name__ = f"sleef_exp{lanes}_at"
    return intrinsic(typer)


_sleef_exp8_at = _sleef_exp_intrinsic(8, _SLEEF_EXP8, HAS_SLEEF8)
_sleef_exp16_at = _sleef_exp_intrinsic(16, _SLEEF_EXP16, HAS_SLEEF16)


@njit(cache=True, nogil=True)
def sexp8(a, out):
    """out[i] = exp(a[i]) as ATen's AVX2 vector exp computes it (SLEEF, 1 ulp; not the
    bits of torch.exp, which is MKL's), for 1-D C-contiguous float32 a, out whose size is
    a multiple of 8. Only with HAS_SLEEF8; its users check their results against torch
    before they switch themselves on (k3.kernels.attn_res.attn_mix)."""
    for i in range(0, a.size - 7, 8):
        _sleef_exp8_at(a, out, i)


@njit(cache=True, nogil=True)
def sexp16(a, out):
    """``sexp8`` with ATen's AVX512 vector exp (SLEEF's 16-lane form, only called where
    AVX-512 runs), for sizes that are a multiple of 16."""
    for i in range(0, a.size - 15, 16):
        _sleef_exp16_at(a, out, i)


def _probe_values() -> np.ndarray:
    f = np.float32
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 88.72283, 88.72284, 89.0, -87.33655,
                        -103.97208, -104.0, -150.0, 1e-45, -1e-45, 1.17549435e-38, 3.4028235e38, -3.4028235e38,
                        0.5, 2.0, 1e-8, -1e-8, 9.0, -9.0, 20.0, 1e-30], f)
    rng = np.random.default_rng(20261202)
    rand = np.concatenate([rng.standard_normal(3000) * 4, rng.standard_normal(1000) * 60,
                           rng.uniform(-1e-3, 1e-3, 500), np.exp(rng.uniform(-80, 80, 500))]).astype(f)
    return np.concatenate([special, rand, -rand[:500]])


def _self_check() -> bool:
    if _LIB is None:
        return False
    x = _probe_values()
    for fn, ref in ((vexp, torch.exp), (vtanh, torch.tanh), (vlog, torch.log)):
        want = ref(torch.from_numpy(x)).numpy().view(np.int32)
        for start, stop in ((0, x.size), (1, x.size), (3, 20), (7, 8), (5, 1029)):
            got = np.empty(stop - start, np.float32)
            fn(np.ascontiguousarray(x[start:stop]), got)
            if not np.array_equal(got.view(np.int32), want[start:stop]):
                return False
        inplace = x.copy()
        fn(inplace, inplace)
        if not np.array_equal(inplace.view(np.int32), want):
            return False
    return True


#: whether vexp / vtanh / vlog give torch's bits in this process (checked at import)
AVAILABLE = _self_check()


_cache_leave(_CACHE_PREV)
