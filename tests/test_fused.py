"""The grouped and fused paths of issue 15 against the plain per-expert / per-op paths,
bit for bit (torch.equal on the float bits), on random inputs: BF16 and MXFP4 weights,
one token and several, one thread and two.

The references are the code as it was before the fusion: ``linear`` per matrix,
``routed_experts_reference`` (one expert at a time), and the torch op chains written
out below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import k3
from k3.config import parse_config
from k3.model import kda, ops
from k3.model.moe import routed_experts
from k3.model.ops import glu_act, linear
from k3.model.weights import DictWeights, Mxfp4Weight
from k3.kernels import aten, attention, attn_res, kda as k_kda, kda_region, launch, mla_region, moe, norms, vml
from k3.kernels import bf16_grouped, get_num_threads, max_threads, mxfp4_grouped, set_num_threads
from k3.kernels.mxfp4 import encode_mxfp4
from k3.synth import build_config

THREADS = [1, 2] if max_threads() >= 2 else [1]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same float32 bits (so -0.0 != +0.0 and NaNs compare by payload)."""
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(params=THREADS, ids=lambda n: f"threads{n}")
def threads(request):
    before, tb = get_num_threads(), torch.get_num_threads()
    set_num_threads(request.param)
    torch.set_num_threads(request.param)
    yield request.param
    set_num_threads(before)
    torch.set_num_threads(tb)


def _bf16(g, n, k):
    return (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)


def _mxfp4(g, n, k):
    return Mxfp4Weight(*encode_mxfp4(torch.randn(n, k, generator=g) / k ** 0.5))


def _x(g, t, k):
    x = torch.randn(t, k, generator=g)
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-30])  # signed zeros and a tiny value ride along
    return x


# ------------------------------------------------------------------ grouped linears
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("T", [1, 3, 70])
def test_grouped_linear_equals_one_call_per_matrix(fmt, T, threads):
    g = torch.Generator().manual_seed(T)
    K = 64 * 6 + 32                      # a tail after the 64-lane steps
    make = _bf16 if fmt == "bf16" else _mxfp4
    ws = [make(g, n, K) for n in (5, 64, 33, 1, 1100)]  # 1100: enough work for two threads at T = 1
    x = _x(g, T, K)
    # every matrix on all rows, then each on its own row range (the MoE's layout)
    outs = ops.linears(x, ws)
    for w, y in zip(ws, outs):
        assert same(y, ops.linear(x, w))
    rows = [(0, T), (T // 2, T), (0, 1), (T - 1, T), (0, 0)]
    grouped = bf16_grouped if fmt == "bf16" else mxfp4_grouped
    flat = grouped(x, ws, rows)
    off = 0
    for w, (a, b) in zip(ws, rows):
        n = w.shape[0]
        got = flat[off:off + (b - a) * n].view(b - a, n)
        off += (b - a) * n
        assert same(got, ops.linear(x[a:b], w))
    assert off == flat.numel()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("K", [384, 416])
def test_decode_rows_equal_batch_rows_and_the_canonical_order(fmt, K, threads):
    """T = 1 takes the in-register row dot when K has no tail (K = 384), the memory
    accumulators otherwise; T > 1 the scratch tiles. All three give the canonical bits."""
    from test_bf16_matmul import _emulate_canonical
    g = torch.Generator().manual_seed(K)
    w = (_bf16 if fmt == "bf16" else _mxfp4)(g, 40, K)
    x = _x(g, 3, K)
    batch = ops.linear(x, w)
    for t in range(3):
        assert same(ops.linear(x[t:t + 1], w), batch[t:t + 1])
    if fmt == "bf16":
        emu = _emulate_canonical(x.numpy(), w.float().numpy())
        assert np.array_equal(batch.numpy().view(np.uint32), emu.view(np.uint32))


def test_grouped_linear_refuses_mismatched_inputs():
    w = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in-features"):
        bf16_grouped(torch.zeros(2, 32), [w])
    with pytest.raises(ValueError, match="outside"):
        bf16_grouped(torch.zeros(2, 64), [w], [(1, 3)])
    p, s = encode_mxfp4(torch.zeros(4, 64))
    with pytest.raises(ValueError, match="in-features"):
        mxfp4_grouped(torch.zeros(2, 32), [(p, s)])
    # weights that share no kernel format go one by one, with the same bits
    x = torch.randn(2, 64)
    f32 = torch.randn(3, 64)
    assert ops.grouped_linear(x, [w, f32]) is None
    a, b = ops.linears(x, [w, f32])
    assert same(a, ops.linear(x, w)) and same(b, ops.linear(x, f32))


# ------------------------------------------------------------------ routed experts
class GroupedWeights(DictWeights):
    """Hands the experts out in small groups, in a shuffled order (as a bounded cache may)."""

    def __init__(self, cfg, tensors, size):
        super().__init__(cfg, tensors)
        self.size = size

    def expert_groups(self, i, ids):
        ids = list(ids)
        np.random.default_rng(len(ids)).shuffle(ids)
        for a in range(0, len(ids), self.size):
            yield from super().expert_groups(i, ids[a:a + self.size])


def routed_experts_reference(cfg, z: torch.Tensor, ids: torch.Tensor, layer: int, provider) -> torch.Tensor:
    """contrib [T, k, d]: contrib[t, j] = expert ids[t, j] on z[t], one expert at a
    time (three linear calls each). The reference ``moe.routed_experts`` must equal."""
    T, k = ids.shape
    uniq = sorted(set(ids.flatten().tolist()))
    contrib = z.new_zeros(T, k, z.shape[1])
    for group in provider.expert_groups(layer, uniq):
        for e, ew in group.items():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = linear(glu_act(cfg, linear(z[tok], ew.w1), linear(z[tok], ew.w3)), ew.w2)
            contrib[tok, slot] = y
    return contrib


def _moe_case(arch, fmt, seed):
    cfg = parse_config(build_config("tiny", arch), "test")
    g = torch.Generator().manual_seed(seed)
    d = cfg.latent_size or cfg.hidden_size
    inter = cfg.moe_intermediate_size
    t = {}
    for e in range(cfg.num_experts):
        p = f"layers.1.block_sparse_moe.experts.{e}."
        for name, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            if fmt == "mxfp4":
                t[p + name + ".weight_packed"], t[p + name + ".weight_scale"] = encode_mxfp4(
                    torch.randn(*shape, generator=g) / shape[1] ** 0.5)
            else:
                t[p + name + ".weight"] = _bf16(g, *shape)
    return cfg, t, g, d


@pytest.mark.parametrize("arch,fmt", [("k3", "mxfp4"), ("kimi_linear", "bf16"), ("k3", "bf16")])
@pytest.mark.parametrize("T", [1, 6])
def test_routed_experts_grouped_equals_per_expert(arch, fmt, T, threads, math_form):
    cfg, tensors, g, d = _moe_case(arch, fmt, T)
    k = cfg.num_experts_per_token
    z = _x(g, T, d)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:k] for _ in range(T)])
    ref = routed_experts_reference(cfg, z, ids, 1, DictWeights(cfg, tensors))
    assert same(routed_experts(cfg, z, ids, 1, DictWeights(cfg, tensors)), ref)
    assert same(routed_experts(cfg, z, ids, 1, GroupedWeights(cfg, tensors, 3)), ref)
    # a token alone gets the bits it gets in the batch
    assert same(routed_experts(cfg, z[-1:], ids[-1:], 1, DictWeights(cfg, tensors)), ref[-1:])


@pytest.mark.parametrize("tile", [1, 4, 7])
def test_routed_experts_in_tiles_of_pairs_equal_per_expert(tile, monkeypatch):
    """A long prefill's pairs run in tiles of at most PAIR_TILE (an expert's run cut where
    a tile ends): the bits of the per-expert reference whatever the tile."""
    from k3.model import moe
    cfg, tensors, g, d = _moe_case("k3", "mxfp4", 9)
    k = cfg.num_experts_per_token
    z = _x(g, 9, d)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:k] for _ in range(9)])
    ref = routed_experts_reference(cfg, z, ids, 1, DictWeights(cfg, tensors))
    monkeypatch.setattr(moe, "PAIR_TILE", tile)
    assert same(moe.routed_experts(cfg, z, ids, 1, GroupedWeights(cfg, tensors, 3)), ref)


@pytest.mark.parametrize("arch,fmt", [("k3", "mxfp4"), ("kimi_linear", "bf16")])
@pytest.mark.parametrize("latent,shared", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("situ", [None, (4.0, 25.0)])
def test_moe_decode_equals_the_separate_calls(arch, fmt, latent, shared, situ, threads):
    """One token's experts, mix and projections in one parallel region (moe.moe_decode)
    against expert_ffn, moe_mix, the latent up-projection, the shared expert's down
    projection and their sum as separate calls, bit for bit; with and without the
    latent up-projection and the shared expert, SiLU- and SiTU-GLU, MXFP4 and BF16
    experts; on one thread the region's second iteration finds every piece done."""
    from k3.model.moe import group_format
    cfg, tensors, g, dz = _moe_case(arch, fmt, 11)
    k, inter_s = cfg.num_experts_per_token, 48
    n_out = 72 if latent else dz
    ids = torch.randperm(cfg.num_experts, generator=g)[:k].tolist()
    ews = list(next(iter(DictWeights(cfg, tensors).expert_groups(1, ids))).values())
    fmt_got, descs = group_format(ews)
    assert fmt_got == fmt
    z = _x(g, 1, dz) * 3.0
    wts = torch.rand(1, k, generator=g)
    norm_w = (1 + 0.1 * torch.randn(dz, generator=g)).to(torch.bfloat16) if latent else None
    shared_gu = (torch.randn(1, inter_s, generator=g), torch.randn(1, inter_s, generator=g)) if shared else None
    up_w = _bf16(g, n_out, dz) if latent else None
    down_w = _bf16(g, n_out, inter_s) if shared else None
    got = moe.moe_decode(z, descs, wts, norm_w, 1e-5, shared_gu, situ, up_w, down_w)
    contrib = torch.from_numpy(moe.expert_ffn(fmt, z, [e.w1 for e in ews], [e.w3 for e in ews],
                                                [e.w2 for e in ews], [(0, 1)] * k, situ)).view(1, k, dz)
    r, h = moe.moe_mix(contrib, wts, norm_w, 1e-5, shared_gu, situ)
    if latent:
        r = ops.linear(r, up_w)
    want = r + ops.linear(h, down_w) if shared else r
    if got is None:
        assert not vml.AVAILABLE
        return
    assert same(got, want)


def test_all_experts_descriptors_live_as_long_as_their_set():
    """The descriptors of a layer's held experts are made once per ExpertSet (the same
    array while the set lives) and dropped with it: they never keep a provider's experts
    alive. A plain tuple (no weak references) gets them made each call."""
    import gc
    import weakref

    from k3.model import compiled
    from k3.model.weights import ExpertSet
    cfg, tensors, g, dz = _moe_case("k3", "mxfp4", 4)
    ews = list(next(iter(DictWeights(cfg, tensors).expert_groups(1, range(cfg.num_experts)))).values())
    held = ExpertSet(ews)
    descs = compiled._all_experts(held)
    assert descs.shape[:2] == (cfg.num_experts, 3) and compiled._all_experts(held) is descs
    assert np.array_equal(compiled._all_experts(tuple(ews)), descs) and compiled._all_experts(tuple(ews)) is not descs
    gone = weakref.ref(held)
    del held
    gc.collect()
    assert gone() is None and all(k is not None for k in compiled._ALL_EXPERTS.keys())


def test_moe_decode_declines_what_it_does_not_take():
    """More than one token, experts that do not chain on the input, an F32 projection:
    None (the caller runs the separate calls)."""
    from k3.model.moe import group_format
    cfg, tensors, g, dz = _moe_case("k3", "mxfp4", 2)
    ews = list(next(iter(DictWeights(cfg, tensors).expert_groups(1, [0, 1]))).values())
    _, descs = group_format(ews)
    wts = torch.rand(1, 2, generator=g)
    assert moe.moe_decode(_x(g, 2, dz), descs, wts, None, 1e-5, None, None, None, None) is None
    assert moe.moe_decode(_x(g, 1, dz + 64), descs, wts, None, 1e-5, None, None, None, None) is None
    assert moe.moe_decode(_x(g, 1, dz), descs, wts, None, 1e-5, None, None, torch.randn(8, dz), None) is None


@pytest.mark.parametrize("linear_beta", [None, 0.5])
def test_routed_experts_situ_forms(linear_beta, math_form):
    """SiTU-GLU without the linear branch (and with a small one, so tanh saturates),
    large inputs: the one-call group (its GLU in place in its own buffers) against one
    expert at a time."""
    import dataclasses
    cfg, tensors, g, d = _moe_case("k3", "mxfp4", 5)
    cfg = dataclasses.replace(cfg, situ_linear_beta=linear_beta)
    for T in (1, 3):
        z = _x(g, T, d) * 40.0
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_token]
                           for _ in range(T)])
        ref = routed_experts_reference(cfg, z, ids, 1, DictWeights(cfg, tensors))
        assert same(routed_experts(cfg, z, ids, 1, DictWeights(cfg, tensors)), ref)


def test_routed_experts_f32_fixture_weights_fall_back():
    cfg, tensors, g, d = _moe_case("kimi_linear", "bf16", 0)
    tensors = {n: v.float() for n, v in tensors.items()}
    ids = torch.tensor([[0, 5, 2, 7], [7, 1, 0, 3]])
    z = _x(g, 2, d)
    ref = routed_experts_reference(cfg, z, ids, 1, DictWeights(cfg, tensors))
    assert same(routed_experts(cfg, z, ids, 1, DictWeights(cfg, tensors)), ref)
    # one token, its experts handed out in shuffled groups
    assert same(routed_experts(cfg, z[1:], ids[1:], 1, GroupedWeights(cfg, tensors, 3)), ref[1:])


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_expert_ffn_tables_are_grouped_jobs_tables(fmt):
    """expert_ffn builds its two job tables in one compiled pass: they must be the tables
    grouped_jobs makes for the gate | up call and the down call (rows of different
    sizes, an expert with no rows among them)."""
    from k3.kernels.bf16 import _bf16_matrix
    from k3.kernels.launch import described, grouped_jobs
    from k3.kernels.moe import _ffn_jobs
    from k3.kernels.mxfp4 import _mxfp4_weight
    cfg, tensors, g, d = _moe_case("k3", fmt, 3)
    prov = DictWeights(cfg, tensors)
    ews = list(next(iter(prov.expert_groups(1, [3, 0, 5, 1]))).values())
    w1s, w3s, w2s = [e.w1 for e in ews], [e.w3 for e in ews], [e.w2 for e in ews]
    rows = [(0, 2), (2, 2), (2, 5), (5, 6)]
    describe = _bf16_matrix if fmt == "bf16" else _mxfp4_weight
    dd = np.array([described(w, describe) for e in zip(w1s, w3s, w2s) for w in e], np.int64).reshape(4, 3, -1)
    j13 = np.empty((8, 2 + dd.shape[2]), np.int64)
    j2 = np.empty((4, j13.shape[1]), np.int64)
    n13, n2, n, tmax, bad, why = _ffn_jobs(dd, np.array(rows, np.int64), 6, d, j13, j2)
    ref13, total13, _, ref_tmax = grouped_jobs(6, d, w1s + w3s, describe, rows + rows)
    inter = cfg.moe_intermediate_size
    ref2, total2, _, _ = grouped_jobs(6, inter, w2s, describe, [(0, 2), (2, 2), (2, 5), (5, 6)])
    assert (bad, why, n, tmax) == (-1, 0, 6, ref_tmax) and total13 == 2 * n * inter and total2 == n * d
    assert np.array_equal(j13[:n13], ref13) and np.array_equal(j2[:n2], ref2)


def test_expert_ffn_refuses_shapes_that_do_not_chain():
    from k3.kernels.moe import expert_ffn
    cfg, tensors, g, d = _moe_case("kimi_linear", "bf16", 0)
    ew = next(iter(DictWeights(cfg, tensors).expert_groups(1, [0]))).get(0)
    z = _x(g, 1, d)
    with pytest.raises(ValueError, match="down matrix of expert 0"):
        expert_ffn("bf16", z, [ew.w1], [ew.w3], [ew.w1], [(0, 1)], None)
    with pytest.raises(ValueError, match="outside"):
        expert_ffn("bf16", z, [ew.w1], [ew.w3], [ew.w2], [(0, 2)], None)


# ------------------------------------------------------------------ fused small ops
@pytest.fixture(params=[True, False], ids=["vml", "torch-calls"])
def math_form(request, monkeypatch):
    """Both forms of the fused chains: torch's exp / tanh / log called from the compiled
    pass (k3.kernels.vml), and called by torch between two compiled passes."""
    if request.param and not vml.AVAILABLE:
        pytest.skip("torch's vector math is not callable from compiled code in this build")
    monkeypatch.setattr(vml, "AVAILABLE", request.param)
    return request.param


def test_vml_gives_torchs_bits_anywhere_in_an_array():
    """torch's exp / tanh / log from compiled code: every element torch's bits, at any
    offset and length (a chain's buffer holds several functions' arguments side by
    side) and in place. This x86 build of torch has MKL's vector math, so the fast form
    must be on: losing it would silently bring the torch calls back."""
    import platform
    if platform.machine() in ("x86_64", "AMD64"):
        assert vml.AVAILABLE
    if not vml.AVAILABLE:
        pytest.skip("no MKL vector math in this torch build")
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(200_000, generator=g) * 40, torch.randn(100_000, generator=g) * 3,
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.72284, -103.9721, 1e-45])])
    rng = np.random.default_rng(3)
    for fn, ref, arg in ((vml.vexp, torch.exp, x), (vml.vtanh, torch.tanh, x), (vml.vlog, torch.log, x.abs())):
        want = ref(arg).numpy()
        a = arg.numpy()
        got = np.empty_like(a)
        fn(a, got)
        assert np.array_equal(got.view(np.int32), want.view(np.int32))
        for _ in range(300):
            n = int(rng.integers(1, 300))
            o = int(rng.integers(0, a.size - n))
            piece = a[o:o + n].copy()
            fn(piece, piece)
            assert np.array_equal(piece.view(np.int32), want[o:o + n].view(np.int32))




def test_vml_calls_put_back_the_callers_mkl_thread_setting():
    """Each vexp / vtanh / vlog call sets MKL's per-thread count to 1 for itself (a short
    call threaded across MKL's sleeping OpenMP team cost ~50-100 us: measured in
    benchmarks, not here) and must put the caller's own setting back afterwards,
    whatever it was: torch's ops on that thread go by it."""
    if not vml.AVAILABLE:
        pytest.skip("no MKL vector math in this torch build")
    import ctypes
    local = ctypes.CDLL(vml._LIB).MKL_Set_Num_Threads_Local
    local.argtypes, local.restype = [ctypes.c_int], ctypes.c_int
    for n in (777, vml._OWN_THREAD + 5):        # a short call, and a long one left to MKL
        a = np.linspace(-3, 3, n, dtype=np.float32)
        out = np.empty_like(a)
        for mine in (3, 0):
            local(mine)
            for fn in (vml.vexp, vml.vtanh, vml.vlog):
                fn(a, out)
            assert local(mine) == mine    # what the calls left behind is the caller's setting
    local(0)
# The torch chains the fused ops replaced, verbatim.
def ref_silu(x):
    return x / (1.0 + torch.exp(-x))


def ref_sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def ref_situ_glu(g, u, beta, linear_beta):
    a = beta * torch.tanh(g / beta) * ref_sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return a * u


def test_in_place_activation_chains(threads, math_form):
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 7), (3, 1000), (70, 301)]:
        x = torch.randn(*shape, generator=g) * 30.0
        u = torch.randn(*shape, generator=g) * 40.0
        x.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
        assert same(ops.sigmoid(x), ref_sigmoid(x))
        assert same(ops.silu(x), ref_silu(x))
        for lb in (25.0, None):
            assert same(ops.situ_glu(x, u, 4.0, lb), ref_situ_glu(x, u, 4.0, lb))
        assert same(ops.silu_glu(x, u), ref_silu(x) * u)


def test_output_gate(threads, math_form):
    g = torch.Generator().manual_seed(4)
    o = torch.randn(3, 500, generator=g) * 5.0
    z = torch.randn(3, 500, generator=g) * 30.0
    z.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    assert same(ops.gate(o, z), o * ref_sigmoid(z))
    assert same(ops.gate(o[:, :7], z[:, 1:8]), o[:, :7] * ref_sigmoid(z[:, 1:8]))  # strided views


def ref_route(logits, bias, k, renorm, scale):
    """moe.route before the fusion, verbatim: a stable descending sort of the biased
    scores, a gather, torch's sum."""
    scores = ref_sigmoid(logits)
    biased = scores + bias.to(torch.float32).reshape(1, -1) if bias is not None else scores
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k]
    wts = torch.gather(scores, 1, ids)
    if renorm:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return ids, wts * scale


@pytest.mark.parametrize("E,k", [(32, 8), (100, 1), (896, 16), (16, 16), (40, 12)])
def test_route_topk_equals_the_sort(E, k, math_form):
    g = torch.Generator().manual_seed(E + k)
    for T in (1, 5):
        logits = torch.randn(T, E, generator=g) * 3.0
        logits[:, ::3] = torch.round(logits[:, ::3])       # ties: equal keys keep the lowest id first
        if T > 1:
            logits[1, :] = 0.5                             # a row of nothing but ties
            logits[2, 5] = float("nan")                    # NaN sorts above every number
        for bias in (None, torch.randn(E, generator=g) * 0.1, (torch.randn(E, generator=g) * 0.1).to(torch.bfloat16),
                     torch.zeros(E)):
            for renorm, scale in ((True, 2.5), (False, 1.0), (True, 1.0)):
                ids, wts = moe.route_topk(logits, bias, k, renorm, scale)
                rids, rwts = ref_route(logits, bias, k, renorm, scale)
                assert ids.dtype == torch.int64 and torch.equal(ids, rids), (T, bias, renorm)
                assert same(wts, rwts)


def test_online_softmax_tile_equals_the_torch_chain(math_form):
    """mla's online-softmax step before the fusion, verbatim, over several key tiles:
    masked keys (-inf), a NaN score, ties at the maximum, rows whose maximum moves."""
    g = torch.Generator().manual_seed(11)
    H, M, dv = 3, 5, 7
    m = torch.full((H, M, 1), float("-inf"))
    den, acc = torch.zeros(H, M, 1), torch.zeros(H, M, dv)
    rm, rden, racc = m.clone(), den.clone(), acc.clone()
    for n, shift in ((6, 0.0), (9, 4.0), (1, -3.0), (11, 8.0)):
        sc = torch.randn(H, M, n, generator=g) * 3.0 + shift
        sc[0, 1, -1] = float("-inf")
        sc[1, 2, 0] = sc[1, 2].max()
        if n == 9:
            sc[2, 4, 3] = float("nan")
        v = torch.randn(H, M, dv, generator=g)
        m_new = torch.maximum(rm, sc.amax(-1, keepdim=True))
        rp = torch.exp(sc - m_new)
        rcorr = torch.exp(rm - m_new)
        rden = rden * rcorr + rp.sum(-1, keepdim=True)
        racc = racc * rcorr + v
        rm = m_new
        p, m, corr = attention.softmax_tile(sc.clone(), m)
        attention.softmax_merge(den, acc, corr, p.sum(-1, keepdim=True), v)
        assert same(p, rp) and same(m, rm) and same(corr, rcorr)
        assert same(den, rden) and same(acc, racc)


# ------------------------------------------------------------------ Attention Residuals mix
def _aten_replicated() -> bool:
    """Whether torch runs the ATen kernels the compiled mix re-does (AVX2 or AVX512, with
    SLEEF's exp of that width exported)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return (cap == "AVX2" and vml.HAS_SLEEF8) or (cap == "AVX512" and vml.HAS_SLEEF16)


def ref_attn_mix(V, w, eps):
    """ops.attn_res before the fusion, verbatim: torch's norm, sum and softmax chain."""
    scaled = norms.norm_rows(V, eps, w)
    S, T = V.shape[0], V.shape[1]
    scores = scaled.sum(-1)
    scores = scores.view(1, S) if T == 1 else scores.T.contiguous()
    a = torch.softmax(scores, dim=-1)
    return norms.weighted_sum(V.permute(1, 0, 2), a)


def test_torch_row_sum_and_softmax_replicas_give_torchs_bits():
    """The compiled mix's row sum and softmax are ATen's AVX2 / AVX512 ones re-done:
    against torch.sum over rows of 1..40,000 (every cascade level, vector and scalar
    tails) and torch.softmax over 1..100 scores (masked -inf scores, a tie at the
    maximum, large spreads). This torch runs one of those paths here, so they must
    match: the row sum with 8 lanes (on both paths of this torch), the softmax with 8
    (AVX2) or 16 (AVX512)."""
    if not _aten_replicated():
        pytest.skip("torch runs neither its AVX2 nor its AVX512 kernels here (the mix keeps torch's chain)")
    assert aten._rowsum_ok()  # the router's one-call form is on
    g = torch.Generator().manual_seed(5)
    acc = np.empty((4, 4, 8), np.float32)
    for d in (1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 127, 128, 129, 500, 1024, 2304, 4097, 7168, 16384, 40000):
        x = torch.randn(40, d, generator=g) * torch.rand(40, 1, generator=g) * 10
        got = np.array([aten._torch_row_sum(r, acc) for r in x.numpy()], np.float32)
        assert np.array_equal(got.view(np.int32), x.sum(-1).numpy().view(np.int32)), d
    L = aten._VL
    assert L == (16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8)
    v = np.empty(2 * L, np.float32)
    for n in list(range(1, 41)) + [63, 64, 65, 100]:
        x = torch.randn(300, n, generator=g) * torch.rand(300, 1, generator=g) * 30
        if n > 3:
            x[::5, 1] = float("-inf")
            x[1::5, 2] = x[1::5].max(-1).values
        got = x.clone().numpy()
        buf = np.empty(-(-n // L) * L, np.float32)
        for r in got:
            aten._softmax_row(r, n, buf, v)
        assert np.array_equal(got.view(np.int32), torch.softmax(x, -1).numpy().view(np.int32)), n


@pytest.mark.parametrize("S,T,d", [(1, 1, 64), (2, 1, 1024), (6, 1, 1000), (9, 4, 257), (17, 2, 2304),
                                   (33, 1, 100), (3, 5, 7)])
def test_attn_mix_equals_the_torch_chain(S, T, d, threads):
    """The mix (one compiled call where torch runs its AVX2 or AVX512 kernels, else the
    chain) has the chain's bits; a source far larger than the others, rows shorter than
    a vector (d = 7 takes the chain), and where torch runs those kernels the compiled
    form must be the one running."""
    if _aten_replicated():
        assert attn_res._mix_ok()
    g = torch.Generator().manual_seed(S * 100 + T)
    V = torch.randn(S, T, d, generator=g) * torch.rand(S, T, 1, generator=g) * 20
    V[-1, 0] *= 1e4
    w = torch.randn(d, generator=g) * 2
    assert same(attn_res.attn_mix(V, w, 1e-6), ref_attn_mix(V, w, 1e-6))
    nw = (1.0 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)   # the next pre-norm, same call
    assert same(attn_res.attn_mix(V, w, 1e-6, (nw, 1e-5)), ref_rms_norm(ref_attn_mix(V, w, 1e-6), nw, 1e-5))
    assert same(attn_res.attn_mix(V.bfloat16().float(), w, 1e-6), ref_attn_mix(V.bfloat16().float(), w, 1e-6))
    # a non-finite source gives NaN where the chain does (the layer's finite check then stops the pass)
    V[0, -1, 3] = float("inf")
    got, want = attn_res.attn_mix(V, w, 1e-6), ref_attn_mix(V, w, 1e-6)
    assert torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.parametrize("past", [0, 1, 6, 7, 8, 40, 300])
def test_attend_latent_one_tile_decode_equals_the_tiles(past, threads, math_form, monkeypatch):
    """A decode step's attention over one key tile in one pass (scores, softmax and its
    torch row sum in one compiled call, no running maximum) against the general tiled
    online softmax, at cache lengths below, at and past a vector of 8 keys; and the one
    pass against torch's chain written out."""
    from k3.model import mla
    g = torch.Generator().manual_seed(past + 3)
    H, L, R = 4, 64, 16
    q_lat, q_pe = torch.randn(1, H, L, generator=g) * 2, torch.randn(1, H, R, generator=g)
    c, kpe = torch.randn(past + 1, L, generator=g), torch.randn(past + 1, R, generator=g) * 3
    scale = (48 + R) ** -0.5
    fast = mla.attend_latent(q_lat, q_pe, c, kpe, past, scale)
    with monkeypatch.context() as m:
        m.setattr(mla, "scores_softmax", lambda *a: None)
        tiles = mla.attend_latent(q_lat, q_pe, c, kpe, past, scale)
    assert same(fast, tiles)
    a, b = torch.randn(H * (past + 1), generator=g) * 5, torch.randn(H * (past + 1), generator=g)
    one = attention.scores_softmax(a, b, scale, H, past + 1)
    if one is None:
        assert not vml.AVAILABLE or not aten._rowsum_ok()
        return
    sc = (a + b).view(H, past + 1) * scale
    rp = torch.exp(sc - sc.amax(-1, keepdim=True))
    assert same(one[0], rp) and same(one[1], rp.sum(-1))


def ref_kda_decay(u, a_log, dt_bias, n_heads, lower_bound):
    """kda.kda_decay before the fusion, verbatim (its softplus with log1p(y) as
    log(1 + y) * y / ((1 + y) - 1))."""
    T = u.shape[0]
    a = a_log.to(torch.float32).reshape(-1)[:n_heads]
    x = (u + dt_bias.to(torch.float32).reshape(-1)).reshape(T, n_heads, -1)
    A = torch.exp(a).reshape(1, n_heads, 1)
    if lower_bound is not None:
        return lower_bound * ref_sigmoid(A * x)
    y = torch.exp(torch.clamp(x, max=20.0))
    v = 1.0 + y
    lp = torch.where(v == 1.0, y, torch.log(v) * y / (v - 1.0))
    return -A * torch.where(x > 20.0, x, lp)


@pytest.mark.parametrize("T", [1, 4])
def test_fused_kda_decay(T, threads, math_form):
    g = torch.Generator().manual_seed(T)
    H, dk = 3, 40
    u = torch.randn(T, H * dk, generator=g) * 8.0
    u[0, :10] = torch.tensor([-60.0, -25.0, -5.0, 0.0, 5.0, 19.9, 20.0, 20.1, 60.0, float("inf")])
    for a_log in (torch.randn(H, generator=g), torch.randn(128, generator=g).to(torch.bfloat16)):  # K3 pads A_log
        for dt_bias in (torch.randn(H * dk, generator=g), torch.randn(H * dk, generator=g).to(torch.bfloat16)):
            for lb in (-5.0, None):
                ref = ref_kda_decay(u, a_log, dt_bias, H, lb)
                assert same(kda.kda_decay(u, a_log, dt_bias, H, lb), ref)
                g2, eg = k_kda.kda_decay(u, a_log, dt_bias, H, lb, with_exp=True)  # the recurrence's exp(g)
                assert same(g2, ref) and same(eg, torch.exp(ref))


def ref_sumsq(x):
    """fp64 sum of squares over the last dim in norm_rows' documented order: eight
    lanes (lane l: elements i = l mod 8, ascending, from +0.0), then a fixed tree."""
    sq = x.double().square()
    d = sq.shape[-1]
    sq = torch.nn.functional.pad(sq, (0, -d % 8))  # + 0.0 leaves a lane's sum as it is
    lanes = torch.zeros(*sq.shape[:-1], 8, dtype=torch.float64)
    for c in sq.split(8, dim=-1):
        lanes = lanes + c
    l = lanes.unbind(-1)
    return (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))).unsqueeze(-1)


def ref_rms_norm(x, w, eps):
    ms = ref_sumsq(x) / x.shape[-1]
    inv = torch.rsqrt(ms + eps).to(torch.float32)
    y = x * inv
    return y if w is None else y * w.to(torch.float32)


def ref_l2_norm(x, eps):
    return x * torch.rsqrt(ref_sumsq(x) + eps).to(torch.float32)


def ref_short_conv(x, w, state):
    T, C = x.shape
    wk = w.to(torch.float32).reshape(C, -1)
    K = wk.shape[1]
    if state is None:
        state = x.new_zeros(K - 1, C)
    z = torch.cat([state, x], 0)
    acc = torch.zeros_like(x)
    for j in range(K):
        acc = acc + z[j:j + T] * wk[:, j]
    return ref_silu(acc), z[T:].clone() if K > 1 else state


def ref_weighted_sum(c, wts):
    r = c[:, 0] * wts[:, :1]
    for j in range(1, c.shape[1]):
        r = r + c[:, j] * wts[:, j:j + 1]
    return r


def ref_attn_res(sources, norm_w, proj_w, eps):
    w = norm_w.to(torch.float32).reshape(-1) * proj_w.to(torch.float32).reshape(-1)
    V = torch.stack(sources, 0)
    normed = ref_rms_norm(V, None, eps)
    a = torch.softmax((normed * w).sum(-1).T.contiguous(), dim=-1)
    out = sources[0] * a[:, :1]
    for j in range(1, len(sources)):
        out = out + sources[j] * a[:, j:j + 1]
    return out


def ref_kda_recurrent(q, k, v, g, beta, state, dtype=torch.float32):
    """The recurrence in torch, its two contractions written out in k3's documented
    order (each product rounded, then added over rows a = 0, 1, ... from +0.0; torch's
    elementwise ops are position-independent), so the fused kernel must match it bit for
    bit; with dtype float64, a reference to measure the error of that order."""
    q, k, v, g, beta = (a.to(dtype) for a in (q, k, v, g, beta))
    T, H, dk = k.shape
    dv = v.shape[-1]
    S = q.new_zeros(H, dk, dv) if state is None else state.to(dtype).clone()
    out = q.new_empty(T, H, dv)
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)
        kt, qt = k[t], q[t]
        u = q.new_zeros(H, dv)
        for a in range(dk):
            u = u + S[:, a, :] * kt[:, a:a + 1]
        S = S + kt.unsqueeze(-1) * (beta[t].unsqueeze(-1) * (v[t] - u)).unsqueeze(1)
        o = q.new_zeros(H, dv)
        for a in range(dk):
            o = o + S[:, a, :] * qt[:, a:a + 1]
        out[t] = o
    return out, S


@pytest.mark.parametrize("T", [1, 5])
def test_fused_norms_and_sums(T, threads):
    g = torch.Generator().manual_seed(T)
    d = 300
    x = _x(g, T, d) * 3.0
    w = 1.0 + 0.02 * torch.randn(d, generator=g)
    for eps in (1e-5, 1e-6):
        assert same(ops.rms_norm(x, w, eps), ref_rms_norm(x, w, eps))
        assert same(ops.rms_norm(x, w.to(torch.bfloat16), eps), ref_rms_norm(x, w.to(torch.bfloat16), eps))
        assert same(ops.rms_norm(x, None, eps), ref_rms_norm(x, None, eps))
        x3 = x.reshape(T, 3, 100)
        assert same(ops.l2_norm(x3, eps), ref_l2_norm(x3, eps))
        for scale in (x3.shape[-1] ** -0.5, 0.1, 3.0):   # KDA's query scale, fused
            assert same(ops.l2_norm(x3, eps, scale), ref_l2_norm(x3, eps) * scale)
        for n in (7, 263):  # shorter than one lane round; a tail of seven
            assert same(ops.rms_norm(x[:, :n], w[:n], eps), ref_rms_norm(x[:, :n], w[:n], eps))
    c = torch.randn(T, 8, d, generator=g)
    wts = torch.rand(T, 8, generator=g)
    assert same(norms.weighted_sum(c, wts), ref_weighted_sum(c, wts))
    srcs = [torch.randn(T, d, generator=g) for _ in range(4)]
    nw, pw = 1.0 + 0.02 * torch.randn(d, generator=g), torch.randn(1, d, generator=g) / d ** 0.5
    assert same(ops.attn_res(srcs, nw, pw, 1e-5), ref_attn_res(srcs, nw, pw, 1e-5))


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("K", [1, 4])
def test_fused_short_conv(T, K, threads, math_form):
    g = torch.Generator().manual_seed(T * 10 + K)
    C = 96
    ws = [torch.randn(C, 1, K, generator=g) for _ in range(3)]
    ws[1] = ws[1].to(torch.bfloat16)  # Kimi-Linear stores the taps in BF16
    xs = [_x(g, T, C) for _ in range(3)]
    for states in ([None] * 3, [torch.randn(K - 1, C, generator=g) for _ in range(3)]):
        outs, news = ops.short_convs(xs, ws, states)
        for x, w, s, y, ns in zip(xs, ws, states, outs, news):
            ry, rs = ref_short_conv(x, w, s)
            assert same(y, ry) and same(ns, rs)
    # the strided column views the grouped projections hand over
    wide = _x(g, T, 3 * C)
    y, s = ops.short_conv(wide[:, C:2 * C], ws[0], None)
    ry, rs = ref_short_conv(wide[:, C:2 * C].contiguous(), ws[0], None)
    assert same(y, ry) and same(s, rs)


@pytest.mark.parametrize("T", [1, 5])
def test_kda_inputs_equal_the_ops_one_by_one(T, threads, math_form):
    """KDA's one-call input step (convs + SiLU, per-head L2 norms with q's scale, beta)
    against the ops it replaces, from zero and from carried conv states, on the strided
    column views the grouped projections hand over; and the gated output norm against
    rms_norm then gate."""
    g = torch.Generator().manual_seed(T + 40)
    H, D, dv, K = 4, 32, 24, 4
    ws = [torch.randn(c, 1, K, generator=g) for c in (H * D, H * D, H * dv)]
    ws[2] = ws[2].to(torch.bfloat16)
    wide = _x(g, T, 2 * H * D + H * dv + H) * 3.0
    xs = [wide[:, :H * D], wide[:, H * D:2 * H * D], wide[:, 2 * H * D:2 * H * D + H * dv]]
    b = wide[:, 2 * H * D + H * dv:]
    for states in ([None] * 3, [torch.randn(K - 1, x.shape[1], generator=g) for x in xs]):
        q, k, v, news, beta = k_kda.kda_inputs(xs, ws, states, b, H, 1e-6, D ** -0.5)
        outs, rnews = ops.short_convs([x.contiguous() for x in xs], ws, states)
        assert same(q, ops.l2_norm(outs[0].reshape(T, H, D), 1e-6, D ** -0.5))
        assert same(q, ref_l2_norm(outs[0].reshape(T, H, D), 1e-6) * D ** -0.5)
        assert same(k, ref_l2_norm(outs[1].reshape(T, H, D), 1e-6))
        assert same(v, outs[2].reshape(T, H, dv))
        assert same(beta, ops.sigmoid(b)) and all(same(a, r) for a, r in zip(news, rnews))
    o = torch.randn(T, H, dv, generator=g) * 5.0
    z = _x(g, T, H * dv) * 4.0
    w = (1.0 + 0.1 * torch.randn(dv, generator=g)).to(torch.bfloat16)
    assert same(k_kda.norm_gate(o, w, 1e-5, z), ops.gate(ref_rms_norm(o, w, 1e-5).reshape(T, -1), z))


@pytest.mark.parametrize("T", [1, 4])
def test_add_norm_is_the_add_then_the_norm(T):
    g = torch.Generator().manual_seed(T)
    h, a = torch.randn(T, 200, generator=g) * 3, torch.randn(T, 200, generator=g) * 1e3
    w = (1.0 + 0.1 * torch.randn(200, generator=g)).to(torch.bfloat16)
    s, y = norms.add_norm(h, a, w, 1e-6)
    assert same(s, h + a) and same(y, ref_rms_norm(h + a, w, 1e-6))
    with pytest.raises(ValueError, match="differ"):
        norms.add_norm(h, a[:, :100], w, 1e-6)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("situ", [None, (4.0, None), (4.0, 0.5)])
def test_moe_mix_equals_the_ops_one_by_one(T, situ, math_form):
    """The MoE block's one compiled step between kernels (weighted sum of the routed
    contributions, latent norm, shared GLU) against weighted_sum, rms_norm and the GLU
    one by one; without the norm, and without a shared expert; the shared gate and up
    as the side-by-side views of one grouped projection."""
    g = torch.Generator().manual_seed(T * 7 + (0 if situ is None else 1 + (situ[1] is not None)))
    k, d, inter = 8, 96, 40
    contrib = torch.randn(T, k, d, generator=g) * 3.0
    wts = torch.rand(T, k, generator=g)
    nw = (1.0 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
    flat = torch.randn(T, 2 * inter, generator=g) * 6.0
    gu = (flat[:, :inter], flat[:, inter:])
    glu = (lambda a, b: norms.situ_glu(a, b, *situ)) if situ is not None else norms.silu_glu
    r, h = moe.moe_mix(contrib, wts, nw, 1e-5, gu, situ)
    assert same(r, ref_rms_norm(norms.weighted_sum(contrib, wts), nw, 1e-5))
    assert same(r, ops.rms_norm(ref_weighted_sum(contrib, wts), nw, 1e-5))
    assert same(h, glu(gu[0].contiguous(), gu[1].contiguous()))
    r2, h2 = moe.moe_mix(contrib, wts, None, 1e-5, None, situ)
    assert h2 is None and same(r2, ref_weighted_sum(contrib, wts))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("T", [1, 3])
def test_kda_decode_equals_the_calls_one_by_one(lower_bound, T, threads):
    """KDA's one-call decode step (convs + SiLU, L2 norms, beta, decay + exp, recurrence,
    gated norm) against kda_inputs, kda_decay, kda_recurrent_steps and norm_gate one by
    one, from zero and from carried conv and recurrent states (never written), on the
    strided column views the grouped projections hand over, into a pooled buffer."""
    g = torch.Generator().manual_seed(T + (0 if lower_bound is None else 9))
    H, dk, dv, K = 3, 32, 24, 4
    wide = _x(g, T, 2 * H * dk + H * dv + H) * 3.0
    xs = [wide[:, :H * dk], wide[:, H * dk:2 * H * dk], wide[:, 2 * H * dk:2 * H * dk + H * dv]]
    b = wide[:, 2 * H * dk + H * dv:]
    ws = [torch.randn(c, 1, K, generator=g) for c in (H * dk, H * dk, H * dv)]
    ws[1] = ws[1].to(torch.bfloat16)
    u = torch.randn(T, H * dk, generator=g) * 2
    a_log, dtb = torch.randn(H, generator=g) * 0.5, torch.randn(H * dk, generator=g)
    z, ow = torch.randn(T, H * dv, generator=g) * 3, (1 + 0.1 * torch.randn(dv, generator=g)).to(torch.bfloat16)
    for S0, states in ((None, [None] * 3),
                       (torch.randn(H, dk, dv, generator=g), [torch.randn(K - 1, x.shape[1], generator=g) for x in xs])):
        keep = None if S0 is None else S0.clone()
        got = k_kda.kda_decode(xs, b, u, z, states, S0, torch.empty(H, dk, dv), k_kda.KdaWeights(ws, a_log, dtb, ow),
                               k_kda.KdaConsts(H, 1e-6, dk ** -0.5, lower_bound, 1e-5))
        q, k, v, news, beta = k_kda.kda_inputs(xs, ws, states, b, H, 1e-6, dk ** -0.5)
        gl, eg = k_kda.kda_decay(u, a_log, dtb, H, lower_bound, with_exp=True)
        o, S = k_kda.kda_recurrent_steps(torch.zeros(H, dk, dv) if S0 is None else S0, eg, k, beta, v, q)
        want = k_kda.norm_gate(o, ow, 1e-5, z)
        if got is None:  # the one-call form is off here (no fused math)
            assert not vml.AVAILABLE
            continue
        assert same(got[0], want) and same(got[1], S)
        assert len(got[2]) == 3 and all(same(a, r) for a, r in zip(got[2], news))
        assert S0 is None or same(S0, keep)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("low_rank_gate", [False, True])
def test_kda_decode_layer_equals_the_separate_calls(lower_bound, low_rank_gate, threads):
    """The whole one-token KDA step in one parallel region (projections, the gate's
    second projections, kda_decode, the output projection) against the same steps as
    separate calls, bit for bit: from zero and from carried states, with K3's low-rank
    gate and Kimi-Linear's full-rank one; on one thread the region's second iteration
    runs after the first, which then has claimed every piece (no wait, no deadlock)."""
    g = torch.Generator().manual_seed(3 + low_rank_gate + (0 if lower_bound is None else 5))
    H, dk, dv, d, r, K = 4, 32, 24, 200, 40, 4
    x = _x(g, 1, d) * 2.0
    gate_rows = r if low_rank_gate else H * dv
    ws = [_bf16(g, n, d) for n in (H * dk, H * dk, H * dv, r, H, gate_rows)]
    f_b = _bf16(g, H * dk, r)
    g_b = _bf16(g, H * dv, r) if low_rank_gate else None
    o_w = _bf16(g, d, H * dv)
    conv = [torch.randn(c, 1, K, generator=g) for c in (H * dk, H * dk, H * dv)]
    a_log, dtb = torch.randn(H, generator=g) * 0.5, torch.randn(H * dk, generator=g)
    ow = (1 + 0.1 * torch.randn(dv, generator=g)).to(torch.bfloat16)
    for S0, states in ((None, [None] * 3),
                       (torch.randn(H, dk, dv, generator=g), [torch.randn(K - 1, c.shape[0], generator=g) for c in conv])):
        keep = None if S0 is None else S0.clone()
        wts, consts = k_kda.KdaWeights(conv, a_log, dtb, ow), k_kda.KdaConsts(H, 1e-6, dk ** -0.5, lower_bound, 1e-5)
        got = kda_region.kda_decode_layer(x, kda_region.KdaProj(ws, f_b, g_b, o_w), wts, consts, states, S0,
                                          torch.empty(H, dk, dv))
        q_in, k_in, v_in, f_a, b, z = ops.linears(x, ws)
        u = ops.linear(f_a, f_b)
        if g_b is not None:
            z = ops.linear(z, g_b)
        o, S, news = k_kda.kda_decode([q_in, k_in, v_in], b, u, z, states, S0, torch.empty(H, dk, dv), wts, consts)
        want = ops.linear(o, o_w)
        if got is None:
            assert not vml.AVAILABLE
            continue
        assert same(got[0], want) and same(got[1], S)
        assert len(got[2]) == 3 and all(same(a, n) for a, n in zip(got[2], news))
        assert S0 is None or same(S0, keep)


def test_kda_decode_layer_declines_what_it_does_not_take():
    """Not one token, or a weight that is not a contiguous bf16 matrix: None (the caller
    runs the separate calls)."""
    g = torch.Generator().manual_seed(1)
    H, dk, dv, d = 2, 8, 8, 16
    ws = [_bf16(g, n, d) for n in (H * dk, H * dk, H * dv, 8, H, H * dv)]
    args = (k_kda.KdaWeights([torch.randn(c, 1, 4) for c in (H * dk, H * dk, H * dv)], torch.zeros(H),
                             torch.zeros(H * dk), torch.ones(dv)), k_kda.KdaConsts(H, 1e-6, 0.5, None, 1e-5),
            [None] * 3, None, None)

    def proj(ws):
        return kda_region.KdaProj(ws, _bf16(g, H * dk, 8), None, _bf16(g, d, H * dv))
    assert kda_region.kda_decode_layer(_x(g, 2, d), proj(ws), *args) is None
    assert kda_region.kda_decode_layer(_x(g, 1, d), proj(ws[:5] + [ws[5].float()]), *args) is None
    assert kda_region.kda_decode_layer(_x(g, 1, d), proj(ws[:5] + [ws[5].t().contiguous().t()]), *args) is None


@pytest.mark.parametrize("T", [1, 4])
def test_fused_kda_recurrent(T, threads):
    g = torch.Generator().manual_seed(T)
    H, dk, dv = 3, 64, 48
    q = ops.l2_norm(torch.randn(T, H, dk, generator=g), 1e-6) * dk ** -0.5
    k = ops.l2_norm(torch.randn(T, H, dk, generator=g), 1e-6)
    v = torch.randn(T, H, dv, generator=g)
    gl = -torch.rand(T, H, dk, generator=g) * 2.0
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, dk, dv, generator=g)
    keep = S0.clone()
    for st in (None, S0):
        o, S = kda.kda_recurrent(q, k, v, gl, beta, st)
        ro, rS = ref_kda_recurrent(q, k, v, gl, beta, st)
        assert same(o, ro) and same(S, rS)
        do, dS = ref_kda_recurrent(q, k, v, gl, beta, st, torch.float64)
        assert torch.allclose(o.double(), do, rtol=1e-4, atol=1e-5) and torch.allclose(S.double(), dS, rtol=1e-4, atol=1e-5)
        s1 = st
        for t in range(T):                    # token by token: the same bits as all at once
            o1, s1 = kda.kda_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], gl[t:t + 1], beta[t:t + 1], s1)
            assert same(o1[0], o[t])
        assert same(s1, S)
    assert same(S0, keep)  # the carried state is never written (snapshots hold references to it)


def test_fixed_order_matmuls_do_not_depend_on_the_shapes_around_an_element(threads):
    """Attention's matmuls (k3.model.attention.dots / prods): close to a float64 einsum, and
    each element's bits the same whether it is computed alone, in a block of rows, or
    with masked (zero-weight) keys after it - which BLAS does not promise (MKL on AVX2
    AMD rounds a 256-key sum differently once 344 zeros follow it)."""
    g = torch.Generator().manual_seed(3)
    H, T, S, d, dv = 3, 40, 70, 80, 48             # d: one 64-lane step and a tail
    q = torch.randn(T, H, d, generator=g)
    k = torch.randn(S, H, d, generator=g)
    v = torch.randn(S, H, dv, generator=g)
    q2, k2, v2 = q.view(T, -1), k.view(S, -1), v.view(S, -1)

    def scores(t0, t1, s1, causal=None):
        return attention.dots(q2, k2, H, t1 - t0, s1, d, x_at=(t0, 0, 0, d), w_at=(0, 0, 0, d),
                          causal=causal).view(H, t1 - t0, s1)

    sc = scores(0, T, S)
    torch.testing.assert_close(sc.double(), torch.einsum("thd,shd->hts", q.double(), k.double()), rtol=1e-5, atol=1e-5)
    for t0, t1, s1 in ((7, 8, 33), (0, 40, 5), (5, 17, 70), (39, 40, 70)):
        assert same(scores(t0, t1, s1), sc[:, t0:t1, :s1])
    c = scores(3, 20, S, causal=3 + 30)            # query i needs keys j <= 33 + i only
    for i in range(17):
        assert same(c[:, i, :34 + i], sc[:, 3 + i, :34 + i])

    p = torch.rand(H, T, S, generator=g).tril(30)  # causal: zeros after each query's keys

    def values(t0, t1, s1, causal=None):
        pp = p[:, t0:t1, :s1].contiguous()
        return attention.prods(pp.view(-1, s1), v2, H, t1 - t0, dv, s1, x_at=(0, t1 - t0, 0, 0),
                           w_at=(0, 0, 0, dv), causal=causal).view(H, t1 - t0, dv)

    pv = values(0, T, S)
    torch.testing.assert_close(pv.double(), torch.einsum("hts,shd->htd", p.double(), v.double()), rtol=1e-5, atol=1e-5)
    for t0, t1 in ((0, 1), (0, 16), (16, 40), (39, 40), (5, 9)):   # a query block sees only its keys
        s1 = min(S, t1 + 30)
        assert same(values(t0, t1, s1), pv[:, t0:t1])
        assert same(values(t0, t1, s1, causal=30 + t0), pv[:, t0:t1])
    # a shared right side (MLA's latents, the same for every head) and a caller's layout
    lat = torch.randn(S, 64, generator=g)
    shared = attention.prods(p.reshape(-1, S), lat, H, T, 64, S, x_at=(0, T, 0, 0), out_at=(64, H * 64)).view(T, H, 64)
    for h in range(H):
        assert same(shared[:, h], attention.prods(p[h], lat, 1, T, 64, S).view(T, 64))
    # one row (decode) streams w's rows whole: the bits of the register tiles, bf16 w too
    wb = (torch.randn(H * 37, 100, generator=g) * 0.5).to(torch.bfloat16)
    xq = torch.randn(4, H * 37, generator=g)
    block = attention.prods(xq, wb, H, 4, 100, 37, x_at=(0, 0, 0, 37), w_at=(0, 37, 0, 0)).view(H, 4, 100)
    for t in range(4):
        one = attention.prods(xq[t:t + 1], wb, H, 1, 100, 37, x_at=(0, 0, 0, 37), w_at=(0, 37, 0, 0)).view(H, 100)
        assert same(one, block[:, t])


def test_all_finite_matches_isfinite():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 70, generator=g) * 1e38
    assert norms.all_finite(x) and norms.all_finite(x[:, ::3]) and norms.all_finite(torch.empty(0, 4))
    for bad in (float("inf"), -float("inf"), float("nan")):
        for pos in (0, 69, 131, 209):
            y = x.clone()
            y.view(-1)[pos] = bad
            assert not norms.all_finite(y) and norms.all_finite(y) == bool(torch.isfinite(y).all())
    assert not norms.all_finite((x * 1e38))  # overflowed to inf


@pytest.mark.parametrize("what", ["kda_decode", "dots", "dots_causal", "prods", "prods_one_row"])
def test_serial_twins_give_the_parallel_kernels_bits(what, monkeypatch):
    """Small work runs as a serial twin on the calling thread (``launch._run``): the same
    block code, so the same bits as the parallel kernel."""
    g = torch.Generator().manual_seed(len(what))
    G, M, N, K = 3, 5, 70, 130
    x = torch.randn(G * M, K, generator=g)
    if what == "kda_decode":
        T, H, dk, dv = 2, 4, 64, 48
        u = torch.randn(T, H * dk, generator=g)
        xs = [torch.randn(T, c, generator=g) for c in (H * dk, H * dk, H * dv)]
        ws = [torch.randn(c, 1, 4, generator=g) for c in (H * dk, H * dk, H * dv)]
        b, z = torch.randn(T, H, generator=g), torch.randn(T, H * dv, generator=g)
        S0, ow = torch.randn(H, dk, dv, generator=g), torch.ones(dv).to(torch.bfloat16)
        run = lambda: torch.cat([r.reshape(-1) for r in k_kda.kda_decode(  # noqa: E731
            xs, b, u, z, [None] * 3, S0, torch.empty(H, dk, dv),
            k_kda.KdaWeights(ws, torch.zeros(H), torch.zeros(H * dk), ow), k_kda.KdaConsts(H, 1e-6, 0.125, -5.0, 1e-5))[:2]])
    elif what.startswith("dots"):
        w = torch.randn(G * N, K, generator=g).to(torch.bfloat16)
        causal = 3 if what == "dots_causal" else None
        run = lambda: attention.dots(x, w, G, M, N, K, x_at=(0, M, 0, 0), w_at=(0, N, 0, 0), causal=causal)  # noqa: E731
    else:
        m = 1 if what == "prods_one_row" else M
        w = torch.randn(G * K, 4 * N, generator=g)
        run = lambda: attention.prods(x, w, G, m, 4 * N, K, x_at=(0, M, 0, 0), w_at=(0, K, 0, 0))  # noqa: E731
    outs = []
    for limit in (0, 1 << 62):                       # the parallel kernel, then its twin
        monkeypatch.setitem(launch.SERIAL_LIMITS, "ops", limit)
        outs.append(run())
    assert same(outs[0], outs[1])


class _SplitGroups:
    """A provider handing its experts out in groups of ``size`` in a shuffled order (a
    bounded expert cache's groups), everything else from ``inner``."""

    def __init__(self, inner, size):
        self.inner, self.size = inner, size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def expert_groups(self, i, ids):
        ids = list(ids)
        np.random.default_rng(len(ids)).shuffle(ids)
        for a in range(0, len(ids), self.size):
            yield from self.inner.expert_groups(i, ids[a:a + self.size])


@pytest.mark.parametrize("arch", ["k3", "kimi_linear"])
def test_moe_block_one_token_whatever_the_expert_groups(arch, tmp_path, threads):
    """moe_block on one token takes the one-region path when one group holds every
    expert in top-k order, and the separate calls when a bounded cache hands them out
    in smaller, shuffled groups (its first group already read): the same bits."""
    from k3 import synth
    from k3.model.moe import moe_block
    d = synth.synthesize(tmp_path / "m", preset="tiny", arch=arch, seed=4)
    with k3.load(d, threads=1, log=lambda *a, **k: None) as eng:
        cfg, prov = eng.cfg, eng.provider
        i = next(j for j in range(eng.n_layers) if cfg.is_moe(j))
        w = prov.layer(i)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            x = _x(g, 1, cfg.hidden_size) * 2.0
            one = moe_block(cfg, w, x, i, prov)
            assert same(moe_block(cfg, w, x, i, _SplitGroups(prov, 3)), one)
        prov.release_layer(i)


# ------------------------------------------------------------------ MLA's one-token region
def _mla_case(arch, lora, gated, seed):
    import dataclasses
    cfg = parse_config(build_config("tiny", arch), "test")
    cfg = dataclasses.replace(cfg, q_lora_rank=(cfg.q_lora_rank or 48) if lora else None,
                              mla_use_output_gate=gated)
    g = torch.Generator().manual_seed(seed)
    H, nope, rope, vd = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    d, L, a = cfg.hidden_size, cfg.kv_lora_rank, "self_attn."
    gain = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)  # noqa: E731
    w = {a + "kv_a_proj_with_mqa.weight": _bf16(g, L + rope, d), a + "kv_a_layernorm.weight": gain(L),
         a + "kv_b_proj.weight": _bf16(g, H * (nope + vd), L), a + "o_proj.weight": _bf16(g, d, H * vd)}
    if lora:
        qr = cfg.q_lora_rank
        w.update({a + "q_a_proj.weight": _bf16(g, qr, d), a + "q_a_layernorm.weight": gain(qr),
                  a + "q_b_proj.weight": _bf16(g, H * (nope + rope), qr)})
    else:
        w[a + "q_proj.weight"] = _bf16(g, H * (nope + rope), d)
    if gated:
        w[a + "g_proj.weight"] = _bf16(g, H * vd, d)
    return cfg, w, g


@pytest.mark.parametrize("arch,lora,gated", [("k3", True, True), ("k3", False, True), ("kimi_linear", True, False),
                                             ("kimi_linear", False, False)])
def test_mla_decode_layer_equals_the_separate_calls(arch, lora, gated, threads, monkeypatch):
    """Latent MLA's one-token step in one parallel region (mla_region.mla_decode_layer, as
    the compiled path runs it) against the plain mla_layer, bit for bit, from an empty
    cache on over several positions: the outputs and the cache rows it writes; with and
    without q LoRA and the output gate. A cache past one key tile takes the plain
    forward (the region's softmax is one tile's)."""
    from k3.model import compiled, mla
    cfg, w, g = _mla_case(arch, lora, gated, 7 + 2 * lora + gated)
    took = []

    def counted(*a):
        y = mla_region.mla_decode_layer(*a)
        took.append(y is not None)
        return y
    monkeypatch.setattr(compiled, "mla_decode_layer", counted)
    fast = compiled.Compiled(cfg, None, None)

    def step(x, st, region):
        y = fast._mla(w, x, st, None) if region else None
        return mla.mla_layer(cfg, w, x, st) if y is None else y
    xs = [_x(g, 1, cfg.hidden_size) * 2.0 for _ in range(5)]
    runs = []
    for region in (True, False):
        st = mla.MLAState(latent=True)
        ys = [mla.mla_layer(cfg, w, torch.cat(xs[:2]), st)] + [step(x, st, region) for x in xs[2:]]
        runs.append((ys, st.k.clone(), st.v.clone()))
    assert took == [vml.AVAILABLE] * 3
    (a, ka, va), (b, kb, vb) = runs
    assert all(same(p, q) for p, q in zip(a, b)) and same(ka, kb) and same(va, vb)
    # past a key tile: not the region's (one softmax tile), the plain forward's bits
    took.clear()
    st = mla.MLAState(latent=True)
    st.append(torch.randn(mla.K_TILE, cfg.kv_lora_rank, generator=g), torch.randn(mla.K_TILE, cfg.qk_rope_head_dim,
                                                                                  generator=g))
    step(xs[0], st, True)
    assert took == [] and st.length == mla.K_TILE + 1


def test_mla_decode_layer_declines_what_it_does_not_take():
    """Not one token, an F32 or non-contiguous weight, a cache buffer of the wrong
    width or without room for the row: None, nothing written."""
    cfg, w, g = _mla_case("k3", True, True, 1)
    H, nope, rope, vd = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    L, a = cfg.kv_lora_rank, "self_attn."
    names = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
             "o_proj"]
    ws = [w[a + n + ".weight"] for n in names]

    def call(x, ws, kb, vb, past=0):
        return mla_region.mla_decode_layer(x, mla_region.MlaWeights(*ws), mla_region.MlaShape(H, nope, rope, vd, 1e-6, 0.1),
                                           kb, vb, past)
    kb, vb = np.zeros((4, L), np.float32), np.zeros((4, rope), np.float32)
    x = _x(g, 1, cfg.hidden_size)
    if not vml.AVAILABLE:
        assert call(x, ws, kb, vb) is None
        return
    assert call(x, ws, kb, vb) is not None and kb[0].any()
    kb[:], vb[:] = 0, 0
    assert call(_x(g, 2, cfg.hidden_size), ws, kb, vb) is None
    assert call(x, ws[:7] + [ws[7].float()], kb, vb) is None
    assert call(x, ws[:2] + [ws[2].t().contiguous().t()] + ws[3:], kb, vb) is None
    assert call(x, ws, np.zeros((4, L + 1), np.float32), vb) is None
    assert call(x, ws, kb, vb, past=4) is None
    assert not kb.any() and not vb.any()


# ------------------------------------------------------------------ a layer's first half in its mixer's region
@pytest.mark.parametrize("arch", ["k3", "kimi_linear"])
def test_layer_ends_in_the_mixer_region_give_the_separate_calls_bits(arch, tmp_path, threads, monkeypatch):
    """Decode steps whose mixer regions also do the residual step (Kimi-Linear's add and
    norm, K3's partial sum and Attention Residuals mix), the router and its top-k, and,
    with every routed expert of the layer held, the whole MoE block: logits bit-identical
    to the same steps with the region ending at its output (the separate calls), and to
    regions that stop after the router (experts not all held). The expert cache counts
    the experts used from a held layer as it counts fetched ones."""
    from k3 import synth
    from k3.model import compiled
    d = synth.synthesize(tmp_path / "m", preset="small", arch=arch, seed=5, layers=3)  # (tiny: top-4, no top-k here)
    prompt = [5, 17, 99, 300, 42, 7]
    with k3.load(d, threads=threads, log=lambda *a, **k: None) as eng:
        prov, cfg = eng.provider, eng.cfg
        for i in range(eng.n_layers):   # every expert in the cache: the whole-block path is open
            if cfg.is_moe(i):
                for _ in prov.expert_groups(i, range(cfg.num_experts)):
                    pass
        made = []
        real_plain, real_mix = compiled.plain_end, compiled.mix_end

        def keep(f):
            def g(*a):
                e = f(*a)
                made.append(e)
                return e
            return g

        counts = []

        def run():
            made.clear()
            before = prov.cache.stats()
            st = eng.new_state()
            out = [eng.model.forward(prompt, st, last_only=True)]
            for _ in range(4):
                out.append(eng.model.forward([int(out[-1].argmax())], st, last_only=True))
            after = prov.cache.stats()
            counts.append(tuple(after[k] - before[k] for k in ("requests", "hits", "misses")))
            return torch.cat(out)

        monkeypatch.setattr(compiled, "plain_end", keep(real_plain))
        monkeypatch.setattr(compiled, "mix_end", keep(real_mix))
        whole = run()
        if vml.AVAILABLE:
            ends = [e for e in made if e is not None]
            assert ends and all(e.done for e in ends)
            assert sum(e.out is not None for e in ends) == 4 * sum(cfg.is_moe(i) for i in range(eng.n_layers))
        monkeypatch.setattr(eng.model.fast, "resident", lambda i: None)
        routed = run()
        if vml.AVAILABLE:
            assert any(e is not None and e.ids is not None for e in made)
            assert all(e.done and e.out is None for e in made if e is not None)
        monkeypatch.setattr(compiled, "plain_end", lambda *a: None)
        monkeypatch.setattr(compiled, "mix_end", lambda *a: None)
        separate = run()
    assert counts[0] == counts[1] == counts[2] and counts[0][2] == 0
    assert same(whole, separate) and same(routed, separate)
