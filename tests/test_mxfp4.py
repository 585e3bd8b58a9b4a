"""MXFP4 decode (bit-exact) and fused decode+matmul (k3.kernels.mxfp4).

References: compressed-tensors' MXFP4PackedCompressor (an independent decoder), the
frozen real-data vector of spec section 4, and the real checkpoint bytes of
tests/fixtures/k3-in-c-v1/mxfp4.json (which also records what a nibble-swapped
decoder would produce, so we can show the fixture catches that bug).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from k3.kernels import E2M1, decode_mxfp4, get_num_threads, max_threads, mxfp4_linear, set_num_threads

from k3fixtures import FIXTURES

FIXTURE = FIXTURES / "mxfp4.json"


def _bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _ref_decode_np(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Plain numpy decoder written from the spec (float64, then exact cast)."""
    lut = np.array(list(E2M1) + [-v for v in E2M1], dtype=np.float64)
    R, P = packed.shape
    w = np.empty((R, 2 * P), dtype=np.float64)
    w[:, 0::2] = lut[packed & 15]
    w[:, 1::2] = lut[packed >> 4]
    f = np.ldexp(1.0, scale.astype(np.int64) - 127)
    f[scale == 255] = 0.0
    w *= np.repeat(f, 32, axis=1)
    w[np.repeat(scale == 255, 32, axis=1)] = 0.0  # +0.0, also for negative nibbles
    with np.errstate(over="ignore"):               # scale 254: 2 * 2^127 overflows to inf, as in fp32
        return w.astype(np.float32)


def _ct_decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    ct = pytest.importorskip("compressed_tensors")
    del ct
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
        scale_dtype=torch.uint8))
    out = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)
    return out["weight"]


# ---------------------------------------------------------------------------- decoder
def test_decode_matches_compressed_tensors_bit_exact():
    rng = np.random.default_rng(1)
    R, C = 96, 1024
    packed = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    scale = rng.integers(1, 255, (R, C // 32), dtype=np.uint8)   # 1..254
    scale.flat[:254] = np.arange(1, 255, dtype=np.uint8)          # every normal byte occurs
    scale[-1, :] = 0                                               # 2^-127 (subnormal) row
    ct = _ct_decompress(torch.from_numpy(packed), torch.from_numpy(scale))
    assert ct.shape == (R, C)
    ours = decode_mxfp4(packed, scale)
    assert ours.dtype == torch.float32 and ours.shape == (R, C)
    # compressed-tensors returns bf16; every MXFP4 value is exact in bf16, so widening
    # it to fp32 must reproduce our fp32 bits (inf at scale 254 included)
    assert np.array_equal(_bits(ours), _bits(ct.float()))
    assert np.array_equal(_bits(ours), _bits(_ref_decode_np(packed, scale)))
    assert np.isinf(ours.numpy()).any()              # 2 * 2^127 overflows, like ct
    sub = ours[-1].numpy()
    assert np.abs(sub[sub != 0]).min() == np.float32(2.0 ** -128)   # 0.5 * 2^-127, exact


def test_scale_255_is_a_zero_group_unlike_compressed_tensors():
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    scale = np.full((4, 4), 120, dtype=np.uint8)
    scale[1, 2] = 255
    scale[3, :] = 255
    ours = decode_mxfp4(torch.from_numpy(packed), torch.from_numpy(scale)).numpy()
    # intended difference: the whole group decodes to +0.0 (the C engine's rule) ...
    assert np.array_equal(_bits(ours[1, 64:96]), np.zeros(32, np.uint32))
    assert np.array_equal(_bits(ours[3]), np.zeros(128, np.uint32))
    # ... while compressed-tensors gives +-inf (and NaN where the nibble is a zero)
    ct = _ct_decompress(torch.from_numpy(packed), torch.from_numpy(scale)).float().numpy()
    grp = ct[1, 64:96]
    assert np.all(np.isinf(grp) | np.isnan(grp)) and np.isinf(grp).any()
    # everything else agrees bit for bit
    mask = np.ones_like(ours, dtype=bool)
    mask[1, 64:96] = False
    mask[3] = False
    assert np.array_equal(_bits(ours)[mask], _bits(ct)[mask])


def test_spec_frozen_real_vector():
    packed = bytes.fromhex("AB 4C 18 65 2C 91 04 39 48 94 58 33 94 B5 5B 30")
    bf16_bits = ("BCC0 BC80 BD00 3D00 8000 3C00 3D40 3D80 BD00 3C80 3C00 BC00 3D00 0000 BC00 3CC0 "
                 "8000 3D00 3D00 BC00 8000 3D40 3CC0 3CC0 3D00 BC00 3D40 BCC0 BCC0 3D40 0000 3CC0").split()
    p = np.frombuffer(packed, dtype=np.uint8).reshape(1, 16)
    s = np.array([[0x79]], dtype=np.uint8)
    w = decode_mxfp4(p, s)
    want = np.array([int(b, 16) << 16 for b in bf16_bits], dtype=np.uint32)
    assert np.array_equal(_bits(w)[0], want)
    assert w[0, :5].tolist() == [-0.0234375, -0.015625, -0.03125, 0.03125, -0.0]
    assert str(w[0, 4].item()) == "-0.0"


@pytest.fixture(scope="module")
def fixture_mxfp4():
    return json.loads(FIXTURE.read_text())


def _fixture_arrays(fx):
    packed = np.array(fx["packed"]["data"], dtype=np.uint8).reshape(fx["packed"]["shape"])
    scale = np.array(fx["scales"]["data"], dtype=np.uint8).reshape(fx["scales"]["shape"])
    expected = np.array(fx["expected"]["data"], dtype=np.float32).reshape(fx["expected"]["shape"])
    return packed, scale, expected


def test_fixture_real_checkpoint_bytes(fixture_mxfp4):
    fx = fixture_mxfp4
    packed, scale, expected = _fixture_arrays(fx)
    assert packed.shape == (fx["rows"], fx["packed_cols"]) and scale.shape == (fx["rows"], fx["scale_cols"])
    assert list(fx["e2m1_lut"][:8]) == list(E2M1)
    w = decode_mxfp4(torch.from_numpy(packed), torch.from_numpy(scale))
    assert w.shape == (fx["rows"], fx["logical_width"])
    assert np.array_equal(_bits(w), _bits(expected))          # signed zeros included

    # The fixture can catch a nibble-swapped decoder: swapping the two nibbles of every
    # byte reproduces the fixture's `expected_swapped_nibbles` and NOT `expected`.
    swapped_packed = ((packed & 15) << 4) | (packed >> 4)
    w_swapped = decode_mxfp4(swapped_packed.astype(np.uint8), scale).numpy()
    first64_swapped = np.array(fx["expected_swapped_nibbles"]["first64"], dtype=np.float32)
    assert np.array_equal(_bits(w_swapped.reshape(-1)[:64]), _bits(first64_swapped))
    assert not np.array_equal(_bits(w_swapped), _bits(expected))
    assert not np.array_equal(_bits(first64_swapped), _bits(expected.reshape(-1)[:64]))
    # same multiset of values (statistics identical), different positions
    assert np.array_equal(np.sort(w_swapped.reshape(-1)), np.sort(expected.reshape(-1)))


def test_fixture_fused_linear(fixture_mxfp4):
    packed, scale, expected = _fixture_arrays(fixture_mxfp4)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((5, packed.shape[1] * 2)).astype(np.float32))
    y = mxfp4_linear(x, torch.from_numpy(packed), torch.from_numpy(scale))
    ref = x.double() @ torch.from_numpy(expected).double().T
    bound = x.double().abs() @ torch.from_numpy(expected).double().abs().T
    assert torch.all((y.double() - ref).abs() <= 1e-5 * bound)


# ---------------------------------------------------------------------------- fused linear
def _random_weight(rng, R, C, lo=112, hi=123):
    packed = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    scale = rng.integers(lo, hi, (R, C // 32), dtype=np.uint8)
    return packed, scale


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("R,C", [(3, 32), (37, 96), (130, 3584 + 32), (64, 3584)])
def test_fused_linear_vs_float64(T, R, C):
    rng = np.random.default_rng(T * 1000 + R)
    packed, scale = _random_weight(rng, R, C)
    x = torch.from_numpy(rng.standard_normal((T, C)).astype(np.float32))
    y = mxfp4_linear(x, packed, scale)
    assert y.dtype == torch.float32 and y.shape == (T, R)
    W = torch.from_numpy(_ref_decode_np(packed, scale)).double()
    ref = x.double() @ W.T
    bound = x.double().abs() @ W.abs().T              # sum |x||w|: the scale of rounding
    err = (y.double() - ref).abs()
    assert torch.all(err <= 1e-5 * bound), (err / bound).max().item()
    assert (torch.linalg.norm(y.double() - ref) / torch.linalg.norm(ref)).item() < 1e-6


def test_fused_decoder_equals_decode_bit_exact():
    """x = identity rows: each output is one product fma(1, w, 0), so mxfp4_linear exposes
    the decoder of both fused paths (T = 1 in registers, T > 1 via the row scratch)."""
    rng = np.random.default_rng(4)
    for C in (128, 160):                               # 160: a 16-byte tail after one 64-byte step
        R = 24
        packed = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
        scale = rng.integers(0, 253, (R, C // 32), dtype=np.uint8)   # 0..252: no overflow
        scale[0, :] = 0
        scale[1, :] = np.resize(np.array([1, 2, 252, 128, 126], np.uint8), C // 32)  # the factor's edge cases
        scale[2, 1] = 255
        # fma(1, -0.0, +0.0) = +0.0: the sum cannot carry a weight's zero sign
        W = decode_mxfp4(packed, scale).numpy() + np.float32(0.0)
        eye = torch.eye(C, dtype=torch.float32)
        y = mxfp4_linear(eye, packed, scale).numpy()  # [C, R] = W.T
        assert np.array_equal(_bits(y), _bits(W.T))
        for c in (0, 1, 63, 64, C - 1):                # T = 1 path
            y1 = mxfp4_linear(eye[c:c + 1], packed, scale).numpy()[0]
            assert np.array_equal(_bits(y1), _bits(W[:, c]))


def test_decode_path_gives_the_same_bits_for_every_scale_byte():
    """T = 1 .. _NTF decode rows in registers by a path of their own where the CPU allows
    (AVX2: bf16 words and an exponent subtraction, for rows whose scales are all in
    2..252 or 255; any other row falls back). Every scale byte, alone in a row or
    mixed, gives the bits of the many-token path (which decodes into a scratch),
    infinities and NaNs of scales 253 / 254 included, and the exact decoded
    weight (identity rows)."""
    rng = np.random.default_rng(11)
    C = 256                                            # 2 steps of 64 bytes: no tail
    R = 256 + 64
    packed = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    scale = np.empty((R, C // 32), np.uint8)
    scale[:256] = np.arange(256, dtype=np.uint8)[:, None]          # row s: every group scale s
    scale[256:] = rng.integers(0, 256, (64, C // 32), dtype=np.uint8)
    scale[256:288] = rng.integers(100, 140, (32, C // 32), dtype=np.uint8)
    scale[260, 3] = 255
    from k3.kernels.mxfp4_tiles import _NTF
    n = _NTF + 2                                       # the many-token path
    x = torch.from_numpy(rng.standard_normal((n, C)).astype(np.float32))
    yn = mxfp4_linear(x, packed, scale)
    for t in range(n):
        y1 = mxfp4_linear(x[t], packed, scale)
        assert np.array_equal(_bits(y1), _bits(yn[t])), t
    for a, b in ((0, 2), (1, 4), (2, 6), (1, 1 + _NTF)):
        assert np.array_equal(_bits(mxfp4_linear(x[a:b], packed, scale)), _bits(yn[a:b])), (a, b)
    W = decode_mxfp4(packed, scale).numpy() + np.float32(0.0)
    fin = np.isfinite(W).all(1)                        # rows of 253 / 254: 0 x inf is NaN in a dot
    assert fin.sum() > 250
    for c in (0, 1, 2, 63, 64, 65, 127, 128, C - 1):
        e = torch.zeros(C)
        e[c] = 1.0
        assert np.array_equal(_bits(mxfp4_linear(e, packed, scale))[fin], _bits(W[fin, c])), c


def test_batch_invariance_and_thread_count_independence():
    rng = np.random.default_rng(5)
    R, C, T = 200, 3584, 9
    packed, scale = _random_weight(rng, R, C)
    x = torch.from_numpy(rng.standard_normal((T, C)).astype(np.float32))
    before = get_num_threads()
    try:
        set_num_threads(1)
        y1 = mxfp4_linear(x, packed, scale)
        single = torch.stack([mxfp4_linear(x[t:t + 1], packed, scale)[0] for t in range(T)])
        set_num_threads(2)
        y2 = mxfp4_linear(x, packed, scale)
        y2b = mxfp4_linear(x[:1], packed, scale)
    finally:
        set_num_threads(before)
    assert torch.equal(y1.view(torch.int32), single.view(torch.int32))   # decode == prefill
    assert torch.equal(y1[:1].view(torch.int32), y2b.view(torch.int32))
    if max_threads() < 2:
        pytest.skip("only one numba thread available here")
    assert torch.equal(y1.view(torch.int32), y2.view(torch.int32))


@pytest.mark.parametrize("C", [64 * 4, 64 * 3 + 32, 96])
def test_many_token_jobs_give_one_token_bits(C):
    """Jobs of more than _NTF tokens (the group-major scratch and tiles): tokens taken
    from inside x (x0 > 0), more tokens than one super tile (_GST), row blocks cut short,
    tails and rows of nothing but tail, zero groups and the subnormal factor: every
    output has the bits of its token computed alone."""
    from k3.kernels import mxfp4_grouped
    from k3.kernels import mxfp4_tiles as MX
    rng = np.random.default_rng(C + 1)
    R = 8 * 3 + 5
    packed, scale = _random_weight(rng, R, C)
    scale[0, 0], scale[5, -1], scale[11, 1] = 255, 0, 1
    T = MX._GST + 9
    x = torch.from_numpy(rng.standard_normal((T + 3, C)).astype(np.float32))
    ws = [(packed, scale), (packed[:13], scale[:13]), (packed[2:], scale[2:])]
    rows = [(3, T + 3), (1, 8), (0, MX._NTF + 1)]
    got = mxfp4_grouped(x, ws, rows)
    want = []
    for (p, s), (a, b) in zip(ws, rows):
        want.append(torch.stack([mxfp4_linear(x[t], p, s) for t in range(a, b)]).reshape(-1))
    assert torch.equal(got.view(torch.int32), torch.cat(want).view(torch.int32))


@pytest.mark.parametrize("C", [64 * 6, 64 * 7 + 32, 32])
def test_one_token_kernels_give_the_general_kernels_bits(C, monkeypatch):
    """Decode's compact one-token kernels (parallel, and serial below a work limit) give
    the bits of the general kernel's one-token path (which a table holding a job of more
    tokens goes to): whole steps, tails, rows for the byte-lane decode."""
    from k3.kernels import launch, mxfp4_grouped
    rng = np.random.default_rng(C)
    R = 70
    packed, scale = _random_weight(rng, R, C)
    scale[3, 0], scale[9, -1], scale[20, 0] = 1, 254, 255   # byte-lane rows, a zero group
    x = torch.from_numpy(rng.standard_normal((2, C)).astype(np.float32))
    ws = [(packed, scale), (packed[:33], scale[:33])]
    want = mxfp4_grouped(x, ws + [(packed[:5], scale[:5])], [(1, 2), (0, 1), (0, 2)])[: R + 33]
    for limit in (0, 1 << 62):                        # the parallel kernel, the serial one
        monkeypatch.setitem(launch.SERIAL_LIMITS, "mxfp4", limit)
        got = mxfp4_grouped(x, ws, [(1, 2), (0, 1)])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), limit


def test_inputs_torch_numpy_and_edge_shapes():
    rng = np.random.default_rng(6)
    packed, scale = _random_weight(rng, 10, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    a = mxfp4_linear(torch.from_numpy(x), torch.from_numpy(packed), torch.from_numpy(scale))
    b = mxfp4_linear(x, packed, scale)
    assert torch.equal(a, b)
    v = mxfp4_linear(torch.from_numpy(x[0]), packed, scale)          # 1-D x -> 1-D y
    assert v.shape == (10,) and torch.equal(v, a[0])
    assert mxfp4_linear(torch.zeros(0, 64), packed, scale).shape == (0, 10)
    xt = torch.from_numpy(np.ascontiguousarray(x.T)).T               # non-contiguous x: copied
    assert torch.equal(mxfp4_linear(xt, packed, scale), a)


def test_validation_errors():
    p = np.zeros((4, 16), np.uint8)
    s = np.zeros((4, 1), np.uint8)
    x = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        decode_mxfp4(np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8))
    with pytest.raises(ValueError, match="scale shape"):
        decode_mxfp4(p, np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="scale shape"):
        mxfp4_linear(x, p, np.zeros((3, 1), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        decode_mxfp4(p.astype(np.int8), s)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_linear(x, torch.zeros(4, 16, dtype=torch.int32), s)
    with pytest.raises(ValueError, match="float32"):
        mxfp4_linear(x.double(), p, s)
    with pytest.raises(ValueError, match="in-features"):
        mxfp4_linear(torch.zeros(1, 64), p, s)
    with pytest.raises(ValueError, match="contiguous"):
        decode_mxfp4(np.zeros((16, 4), np.uint8).T, s)
    with pytest.raises(ValueError, match="2-D"):
        decode_mxfp4(np.zeros(16, np.uint8), s)


_ISA_SCRIPT = r"""
import sys, torch, warnings
from numba.core.errors import NumbaPerformanceWarning
warnings.simplefilter("error", NumbaPerformanceWarning)   # a prange loop compiled serial fails
from k3.kernels import mxfp4_grouped, mxfp4_linear
from k3.kernels.cpu import kernel_isa   # the one path both kernels compiled
g = torch.Generator().manual_seed(7)
outs = [kernel_isa()]
for R, C, T in ((40, 64 * 7 + 32, 1), (96, 1024, 1), (17, 4096, 3), (23, 2048, 6), (64, 2048, 16),
                 (21, 64 * 5 + 32, 70)):
    p = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(100, 140, (R, C // 32), dtype=torch.uint8, generator=g)
    s[0, 0], s[1, 1] = 255, 0  # a zero group, the subnormal factor
    s[2, 0], s[3, 1], s[4, 0] = 1, 253, 254  # 2^-126, and 2^126 / 2^127 (x 6: inf)
    x = torch.randn(T, C, generator=g)
    outs.append(mxfp4_linear(x, p, s))
    outs.append(mxfp4_grouped(x, [(p, s), (p[: R // 2], s[: R // 2])], [(0, T), (T - 1, T)]))
# the BF16 tiles too (their register width and lane order follow the path)
from k3.kernels import bf16_grouped, bf16_linear
for N, K, T in ((29, 64 * 9 + 5, 1), (37, 4096, 1), (50, 2048 + 64, 2), (31, 4096, 5), (25, 640, 9)):
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(T, K, generator=g)
    outs.append(bf16_linear(x, w))
    outs.append(bf16_grouped(x, [w, w[: N // 2]], [(0, T), (T - 1, T)]))
torch.save(outs, sys.argv[1])
"""


def _isa_paths() -> tuple[list[str], str]:
    """(every kernel path this CPU can run, the path this process compiled)."""
    import llvmlite.binding as ll
    feats = ll.get_host_cpu_features()
    paths = ["generic"] + (["avx2"] if feats.get("avx2") else []) + \
        (["avx512"] if feats.get("avx2") and feats.get("avx512bw") else [])
    from k3.kernels.cpu import _ISA as native_isa
    return paths, native_isa


def start_other_paths(folder: Path) -> dict:
    """Start one fresh process per path other than this process's own, each compiling the
    kernels for its path into a cache of its own under ``folder`` and writing its
    results there. conftest.py calls this once the session's tests are collected, so the
    compiles (a minute or more each) run on the other core while the first tests run;
    the test starts them itself when it runs alone."""
    import os
    import subprocess
    import sys

    paths, native_isa = _isa_paths()
    procs = {}
    for isa in paths:
        if isa == native_isa:     # no second compile of the path this process already has
            continue
        env = dict(os.environ, K3_KERNEL_ISA=isa, NUMBA_CACHE_DIR=str(folder / f"cache-{isa}"))
        procs[isa] = subprocess.Popen([sys.executable, "-c", _ISA_SCRIPT, str(folder / f"{isa}.pt")], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return procs


#: (folder, processes) started by conftest.py after collection; None: not started
EARLY_PATHS = None


def test_every_instruction_set_path_gives_the_same_bits(tmp_path):
    """The kernels compile per path: MXFP4 nibbles decoded by byte shuffles (AVX-512BW,
    AVX2) or plain vector arithmetic, register tiles of 16, 8 or 4 lanes (the BF16 tiles
    in a lane order of their own): each path forced in a fresh process (its own numba
    cache: compiled code is cached per CPU, not per path) gives the same bits."""
    import sys

    paths, native_isa = _isa_paths()
    if EARLY_PATHS is not None:
        folder, procs = EARLY_PATHS
    else:
        folder, procs = tmp_path, start_other_paths(tmp_path)
    try:
        # this process's kernels (the native path, from the shared cache)
        native = tmp_path / "native.pt"
        saved = sys.argv
        try:
            sys.argv = ["-", str(native)]
            with warnings.catch_warnings():           # the script's warning filter stays in it
                exec(_ISA_SCRIPT, {})
        finally:
            sys.argv = saved
        got = {}
        mine = torch.load(native)
        assert mine[0] == native_isa
        if mine[0] in paths:
            got[mine[0]] = mine
        for isa, p in procs.items():
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-2000:]
            got[isa] = torch.load(folder / f"{isa}.pt")
            assert got[isa][0] == isa
    finally:                      # nothing left running if this process fails or times out
        for q in procs.values():
            if q.poll() is None:
                q.kill()
    ref = got["generic"]
    assert len(got) == len(paths)

    def same(a, b):  # bit for bit: the rows with scale 254 hold inf and NaN
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    for isa, outs in got.items():
        assert all(same(a, b) for a, b in zip(outs[1:], ref[1:])), isa
    assert all(same(a, b) for a, b in zip(mine[1:], ref[1:]))


def test_scaled_table_is_e2m1_times_the_scale_for_every_byte():
    """The AVX-512 decode's constant: row s, nibble n = E2M1(n) x 2^(s-127), in float64
    and rounded once (every value is exact in fp32); row 255 zero (a zero group: the
    values x +0.0, so the negative nibbles give -0.0, as a multiply by the factor does).
    Compared bit for bit, zeros' signs included."""
    from k3.kernels.mxfp4_ir import _SCALED_E2M1
    mag = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    val = np.concatenate([mag, -mag])                   # nibble 8 is -0: +0.0 in registers
    val[8] = 0.0
    want = val[None, :] * np.exp2(np.arange(256) - 127.0)[:, None]
    want[255] = val * 0.0
    with np.errstate(over="ignore"):
        want32 = want.astype(np.float32)
    got = np.asarray(_SCALED_E2M1)
    assert got.shape == (256, 16) and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want32.view(np.uint32))   # bits: -0.0 is not +0.0
    assert np.isinf(got[254, [4, 5, 6, 7, 12, 13, 14, 15]]).all()
    assert (got[0, 1] == np.float32(2.0 ** -128)) and got[0, 1] > 0  # subnormal, exact
