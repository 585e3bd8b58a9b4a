"""Fused BF16 linear (k3.kernels.bf16): accuracy vs float64, the canonical summation order
(bit-exact emulation), thread-count and batch independence, odd shapes, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3.kernels import LANES, bf16_linear, get_num_threads, max_threads, set_num_threads


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.uint32)


def _case(seed, T, N, K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    return x, w


def _check_accuracy(x, w, y):
    ref = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T          # sum |x||w|
    err = (y.double() - ref).abs()
    assert torch.all(err <= 1e-6 * bound + 1e-30), (err / bound).max().item()
    nref = torch.linalg.norm(ref)
    if nref > 0:
        assert (torch.linalg.norm(y.double() - ref) / nref).item() < 1e-6


@pytest.mark.parametrize("T", [1, 2, 33, 65])
@pytest.mark.parametrize("N,K", [(1, 7), (1, 64), (5, 100), (17, 1000), (64, 4096 + 13), (3, 12288)])
def test_vs_float64(T, N, K):
    x, w = _case(T * 7919 + N * 31 + K, T, N, K)
    y = bf16_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (T, N)
    _check_accuracy(x, w, y)


def _emulate_canonical(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The documented order, with fma(a, b, c) = fp32(fp64(a) * fp64(b) + fp64(c)):
    the product is exact in fp64, so this differs from a true fma only on a double
    rounding (probability ~2^-29 per step; these small cases are fixed and pass)."""
    T, K = x.shape
    N = w.shape[0]
    km = K - K % LANES
    out = np.empty((T, N), np.float32)
    x64 = x.astype(np.float64)
    w64 = w.astype(np.float64)
    for t in range(T):
        for n in range(N):
            a = np.zeros(LANES, np.float32)
            for j in range(0, km, LANES):
                a = (x64[t, j:j + LANES] * w64[n, j:j + LANES] + a.astype(np.float64)).astype(np.float32)
            for i in range(K - km):
                a[i] = np.float32(x64[t, km + i] * w64[n, km + i] + np.float64(a[i]))
            h = LANES // 2
            while h >= 1:
                a[:h] = a[:h] + a[h:2 * h]
                h //= 2
            out[t, n] = a[0]
    return out


@pytest.mark.parametrize("T,N,K", [(1, 5, 200), (3, 5, 200), (4, 3, 64 * 5 + 33),
                                   (21, 7, 64 * 3 + 5), (18, 5, 40), (33, 4, 2048 + 128),  # super tiles, chunks
                                   (1, 9, 2304), (1, 9, 4096), (1, 21, 4096),  # T = 1: one row, many at a time
                                   (1, 17, 1536)])  # many at a time from K = 1536 (Intel AVX-512)
def test_canonical_order_bit_exact(T, N, K):
    x, w = _case(11 + T + K, T, N, K)
    y = bf16_linear(x, w)
    emu = _emulate_canonical(x.numpy(), w.float().numpy())
    assert np.array_equal(_bits(y), emu.view(np.uint32))


def test_thread_count_and_batch_independence():
    T, N, K = 33, 301, 1000 + 5
    x, w = _case(3, T, N, K)
    before = get_num_threads()
    try:
        set_num_threads(1)
        y1 = bf16_linear(x, w)
        rows = torch.stack([bf16_linear(x[t:t + 1], w)[0] for t in range(T)])
        set_num_threads(2)
        y2 = bf16_linear(x, w)
        y2_rows = torch.stack([bf16_linear(x[t:t + 1], w)[0] for t in (0, T - 1)])
    finally:
        set_num_threads(before)
    # a token's result does not depend on how many tokens share the call (decode == prefill)
    assert np.array_equal(_bits(y1), _bits(rows))
    assert np.array_equal(_bits(y1[[0, T - 1]]), _bits(y2_rows))
    # nor on an arbitrary split of the token batch (token blocks of 64 and pairs)
    x130 = torch.cat([x, x, x, x, x[:-2]])          # 130 tokens: crosses a token block
    assert np.array_equal(_bits(bf16_linear(x130, w)[:T]), _bits(y1))
    if max_threads() < 2:
        pytest.skip("only one numba thread available here")
    assert np.array_equal(_bits(y1), _bits(y2))


@pytest.mark.parametrize("serial_small", [False, True])
def test_small_calls_leave_the_thread_count_as_it_was(serial_small, monkeypatch):
    """Small work may run on one thread (outside numba's TBB layer): the caller's thread
    count is restored, also when the kernel raises, and the bits are those of a large call's rows."""
    from k3.kernels import launch as B
    get, put, _ = B._threads()
    monkeypatch.setattr(B, "_TH", (get, put, serial_small))
    x, w = _case(4, 3, 40, 64)
    before = get_num_threads()
    y = bf16_linear(x, w)
    assert get_num_threads() == before
    big = torch.cat([w] * 200)                              # above the small-work limit
    assert np.array_equal(_bits(bf16_linear(x, big)[:, :40]), _bits(y))

    def boom(*args):
        raise RuntimeError("kernel failed")
    with pytest.raises(RuntimeError, match="kernel failed"):
        B._launch(boom, 1)
    assert get_num_threads() == before


@pytest.mark.parametrize("K", [64 * 5, 64 * 5 + 33, 7, 4096])
def test_one_token_kernels_give_the_general_kernels_bits(K, monkeypatch):
    """Decode's compact one-token kernels (parallel, and serial below a work limit) give
    the bits of the general kernel's one-token path (which a table holding a job of more
    tokens goes to): whole steps, several rows at a time, tails."""
    from k3.kernels import bf16_grouped, launch
    x, w = _case(K, 2, 70, K)
    ws = [w, w[:33]]
    want = bf16_grouped(x, ws + [w[:5]], [(1, 2), (0, 1), (0, 2)])[: 70 + 33]
    for limit in (0, 1 << 62):                        # the parallel kernel, the serial one
        monkeypatch.setitem(launch.SERIAL_LIMITS, "bf16", limit)
        got = bf16_grouped(x, ws, [(1, 2), (0, 1)])
        assert np.array_equal(_bits(got), _bits(want)), limit


def test_non_contiguous_input():
    x, w = _case(4, 6, 9, 130)
    xt = x.T.contiguous().T                         # same values, column-major strides
    assert not xt.is_contiguous()
    assert torch.equal(bf16_linear(xt, w), bf16_linear(x, w))
    xs = torch.randn(6, 260)[:, ::2]                # strided view
    assert torch.equal(bf16_linear(xs, w), bf16_linear(xs.contiguous(), w))
    with pytest.raises(ValueError, match="contiguous"):
        bf16_linear(x, w.T.contiguous().T)          # a weight is never copied per call


def test_numpy_bits_1d_and_empty():
    x, w = _case(5, 2, 4, 70)
    y = bf16_linear(x, w)
    wb = w.view(torch.int16).numpy()
    assert torch.equal(bf16_linear(x.numpy(), wb), y)
    assert torch.equal(bf16_linear(x, wb.view(np.uint16)), y)
    v = bf16_linear(x[1], w)
    assert v.shape == (4,) and torch.equal(v, y[1])
    assert bf16_linear(torch.zeros(0, 70), w).shape == (0, 4)
    assert torch.equal(bf16_linear(torch.zeros(3, 0), torch.zeros(4, 0, dtype=torch.bfloat16)),
                       torch.zeros(3, 4))


def test_special_values_propagate():
    x, w = _case(6, 2, 3, 100)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    y = bf16_linear(x, w)
    assert torch.isnan(y[0]).all()
    ref = x[1].double() @ w.double().T
    assert torch.equal(torch.isinf(y[1]), torch.isinf(ref)) and torch.equal(torch.sign(y[1]), torch.sign(ref).float())


def test_validation_errors():
    x, w = _case(7, 2, 3, 16)
    with pytest.raises(ValueError, match="in-features"):
        bf16_linear(x, torch.zeros(3, 17, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_linear(x, w.float())
    with pytest.raises(ValueError, match="float32"):
        bf16_linear(x.double(), w)
    with pytest.raises(ValueError, match="float32"):
        bf16_linear(x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="2-D"):
        bf16_linear(x.reshape(1, 2, 16), w)
    with pytest.raises(ValueError, match="2-D"):
        bf16_linear(x, w.reshape(3, 4, 4))
    with pytest.raises(ValueError, match="uint16"):
        bf16_linear(x, np.zeros((3, 16), np.float32))
    with pytest.raises(ValueError):
        set_num_threads(0)


def test_derived_values_follow_their_pair_of_objects():
    """``described(w, f, partner)`` keeps f(w, partner) per live pair: another partner
    (even one created where a dead one was) gets its own value, and the entry goes
    when either object does."""
    import gc

    from k3.kernels import launch as b

    def prod(a, c):
        return a * c

    a = torch.full((4,), 2.0)
    for n in range(1, 30):  # partners freed and allocated in turn: ids get reused
        c = torch.full((4,), float(n))
        assert torch.equal(b.described(a, prod, c), torch.full((4,), 2.0 * n))
        assert b.described(a, prod, c) is b.described(a, prod, c)
    key = (id(a), prod, id(c))
    assert key in b._DESC
    del c
    gc.collect()
    assert key not in b._DESC


def test_kept_tables_follow_their_weight_objects():
    """A weight's descriptor and a projection group's job table are kept per live weight
    object: a weight created where a dead one was (often the same id) gets its own,
    and the entries go with the objects."""
    import gc

    from k3.kernels import bf16_grouped
    from k3.kernels import launch as b
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, generator=g)
    for n in range(1, 41):  # freed and allocated in turn: ids get reused
        w = torch.randn(n, 64, generator=g).to(torch.bfloat16)
        ref = torch.from_numpy(x.double().numpy() @ w.double().numpy().T).float()
        y = bf16_linear(x, w)
        assert y.shape == (1, n) and torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
        y2 = bf16_grouped(x, [w, w])
        assert torch.equal(y2[:n], y[0]) and torch.equal(y2[n:], y[0])
    k = id(w)
    assert any(key[0] == k for key in b._DESC) and any(k in key[2:] for key in b._TABLES)
    del w
    gc.collect()
    assert not any(key[0] == k for key in b._DESC) and not any(k in key[2:] for key in b._TABLES)


def test_activation_scratch_is_per_thread_reused_and_bounded(monkeypatch):
    # the T > 1 copies of x live in per-thread huge-page scratch: reused by the next call
    # on the same thread (no page faults per call), never shared with another thread
    # (two engines' threads may call kernels at once), not kept when large
    import threading
    from k3.checkpoint.io import HUGE
    from k3.kernels import launch as bf16
    a = bf16.scratch_f32((16, 7168))
    assert a.shape == (16, 7168) and a.dtype == np.float32 and a.flags.c_contiguous
    from k3 import env
    assert a.ctypes.data % (HUGE if env.hugepages() else 64) == 0   # on a whole huge page
    b = bf16.scratch_f32((3, 100))
    assert b.ctypes.data == a.ctypes.data      # reused
    other = []
    t = threading.Thread(target=lambda: other.append(bf16.scratch_f32((16, 7168)).ctypes.data))
    t.start()
    t.join()
    assert other[0] != a.ctypes.data
    monkeypatch.setattr(bf16, "_SCRATCH_KEEP", 1 << 20)
    big1, big2 = bf16.scratch_f32((512, 1024)), bf16.scratch_f32((512, 1024))
    assert big1.ctypes.data != big2.ctypes.data and big1.ctypes.data % 64 == 0
    assert bf16.scratch_f32((1, 16)).ctypes.data == a.ctypes.data  # the kept one is still there
    # a T > 1 call through the scratch twice in a row gives the same bits as T = 1 rows
    w = torch.randn(40, 7168).bfloat16()
    x = torch.randn(16, 7168)
    y1 = bf16_linear(x, w)
    y2 = bf16_linear(x[:5], w)
    assert torch.equal(y1[:5], y2) and torch.equal(y1[7], bf16_linear(x[7], w))


def test_kernel_scratch_and_activation_copies_start_on_a_cache_line():
    # the T > 1 tiles load 64 bytes at a time from these; a misaligned start makes every
    # load straddle two cache lines (slower, same bits)
    from k3.kernels.bf16 import pair_split_x
    from k3.kernels.launch import empty64
    for n in (1, 15, 16, 17, 1000, 4096, 100_003, 1 << 20):
        a = empty64(n)
        assert a.shape == (n,) and a.dtype == np.float32 and a.ctypes.data % 64 == 0
    for T, K in ((2, 64), (3, 100), (16, 7168), (5, 3584)):
        x = torch.randn(T, K).numpy()
        xs = pair_split_x(x)
        assert xs.ctypes.data % 64 == 0 and xs.shape == (T, K) and xs.flags.c_contiguous
        assert np.array_equal(np.sort(xs, axis=1), np.sort(x, axis=1))   # a permutation of each row


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_shared_trees_give_each_rows_halving_tree(n):
    """make_trees(n): n rows' canonical trees side by side in registers, the bits of the
    halving tree in float32 (numpy, one row at a time), signed zeros, infinities and NaN
    included."""
    from numba import njit
    from k3.kernels.simd import make_trees
    trees = make_trees(n)

    @njit
    def run(acc, a0, stride, out, o0):
        trees(acc, a0, stride, out, o0)

    rng = np.random.default_rng(n)
    stride = 3
    rows = 2 + max(n, 3) * stride
    acc = (rng.standard_normal((rows, LANES)) * 10.0 ** rng.integers(-30, 30, (rows, 1))).astype(np.float32)
    acc[2 + stride, 5] = np.inf
    acc[2, 7] = -0.0
    if n > 2:
        acc[2 + 2 * stride, 9], acc[2 + 2 * stride, 41] = np.inf, -np.inf        # inf - inf: NaN
    out = np.full(n + 4, 7.0, np.float32)
    run(acc, 2, stride, out, 1)
    for k in range(n):
        a = acc[2 + k * stride].copy()
        h = LANES // 2
        with np.errstate(invalid="ignore"):                 # inf - inf
            while h >= 1:
                a[:h] = a[:h] + a[h:2 * h]
                h //= 2
        assert out[1 + k].tobytes() == a[0].tobytes(), k
    assert out[0] == 7.0 and (out[n + 1:] == 7.0).all()     # nothing outside its n lanes written
