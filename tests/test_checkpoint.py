"""Checkpoint access: strict headers, index, buffered/O_DIRECT reads, writer, failures.

The independent reference for every byte is the `safetensors` library's own loader.
"""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.checkpoint import (
    ALIGN,
    INDEX_NAME,
    CheckpointIndex,
    FaultHook,
    ShardFiles,
    TensorInfo,
    aligned_empty,
    direct_span,
    load_tensor,
    read_header,
    read_shard_header,
    write_checkpoint,
    write_safetensors,
)
from k3.checkpoint import writer as writer_mod
from k3.errors import EXIT_CHECKPOINT, EXIT_READ, CheckpointError, ReadError

from k3fixtures import FIXTURES as FIX

ST_DIR = FIX / "st"
CACHE_SHARD = FIX / "cache" / "model-00001-of-00001.safetensors"
K3_NAME_FMT = "model-{i:05d}-of-{n:06d}.safetensors"


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensor(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype
    assert tuple(ours.shape) == tuple(ref.shape)
    assert bits(ours) == bits(ref)


def raw_st(path: Path, header, data: bytes = b"", *, hlen: int | None = None) -> Path:
    """Write a safetensors-like file by hand (header dict or raw JSON text/bytes)."""
    if isinstance(header, dict):
        raw = json.dumps(header).encode()
    elif isinstance(header, str):
        raw = header.encode()
    else:
        raw = header
    n = len(raw) if hlen is None else hlen
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
    return path


def direct_works(path) -> bool:
    """Independent probe: does a correctly aligned O_DIRECT read work on this file?"""
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    try:
        os.preadv(fd, [memoryview(aligned_empty(ALIGN))], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# --------------------------------------------------------------------------------------
# the st/ fixture: two shards of awkward tensors
# --------------------------------------------------------------------------------------


def test_st_fixture_matches_safetensors_library():
    ix = CheckpointIndex.open(ST_DIR)
    shards = sorted(ST_DIR.glob("*.safetensors"))
    assert ix.shards() == [str(p) for p in shards]
    ref_names = set()
    with ShardFiles() as r:
        for shard in shards:
            ref = safetensors.torch.load_file(str(shard))
            hdr = read_header(shard)
            assert set(hdr) == set(ref)
            ref_names |= set(ref)
            for name, ref_t in ref.items():
                info = ix.get(name)
                assert info == hdr[name]
                assert info.file == str(shard)
                assert_same_tensor(load_tensor(info, r), ref_t)
                # the other read paths give the same bytes
                assert r.read_bytes(info).tobytes() == bits(ref_t)
                assert r.read_direct(info).tobytes() == bits(ref_t)
                assert r.read_direct(info.file, info.offset, info.nbytes).tobytes() == bits(ref_t)
    assert set(ix.names()) == ref_names
    assert len(ix) == len(ref_names)
    assert ix.total_bytes == sum(ix.get(n).nbytes for n in ix.names())


def test_load_tensors_into_one_buffer_match_the_library():
    """Several tensors read into one huge-page buffer (a resident layer's matrices): each
    the library's bytes, dtype and shape, at whatever offset phase it lies in its shard,
    with O_DIRECT and buffered reads alike."""
    from k3.checkpoint.io import load_tensors
    ix = CheckpointIndex.open(ST_DIR)
    for shard in sorted(ST_DIR.glob("*.safetensors")):
        ref = safetensors.torch.load_file(str(shard))
        names = sorted(ref)
        for use_direct in (True, False):
            with ShardFiles(use_direct=use_direct) as r:
                for name, t in zip(names, load_tensors([ix.get(n) for n in names], r)):
                    assert_same_tensor(t, ref[name])


def test_st_fixture_awkward_tensors_are_covered():
    ix = CheckpointIndex.open(ST_DIR)
    with ShardFiles() as r:
        scalar = load_tensor(ix.get("scalar.f32"), r)
        assert scalar.shape == () and scalar.item() == 3.5
        empty = load_tensor(ix.get("empty.f32"), r)
        assert empty.shape == (0, 8) and empty.dtype == torch.float32
        bf = load_tensor(ix.get("plain.bf16.1d"), r)
        assert bf.dtype == torch.bfloat16 and bf.dim() == 1
        assert torch.isinf(bf).any() and torch.isnan(bf).any()  # non-finite bit patterns survive
        f16 = load_tensor(ix.get("tricky.f16.1d"), r)
        assert f16.dtype == torch.float16 and torch.isnan(f16).any()
        assert load_tensor(ix.get("packed.u8.2d"), r).shape == (7, 32)
        assert load_tensor(ix.get("rank4.u8"), r).shape == (2, 2, 2, 2)
    second = ix.get("second.shard.f32")
    assert second.file.endswith("model-00002-of-00002.safetensors")
    assert 'weird\\name."with"quotes' in ix  # JSON-escaped name
    assert "__metadata__" not in ix
    hdr = ix.shard_header(str(ST_DIR / "model-00001-of-00002.safetensors"))
    assert hdr.metadata["format"] == "pt"


def test_loaded_tensor_owns_its_memory():
    ix = CheckpointIndex.open(ST_DIR)
    t = load_tensor(ix.get("plain.f32.2d"), ShardFiles())
    assert t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    t += 1  # writable, and ours
    assert load_tensor(ix.get("plain.f32.2d")).ne(t).all()


def test_offsets_are_absolute_file_offsets():
    path = ST_DIR / "model-00002-of-00002.safetensors"
    blob = path.read_bytes()
    ref = safetensors.numpy.load_file(str(path))
    for name, info in read_header(path).items():
        assert blob[info.offset : info.end] == ref[name].tobytes()


# --------------------------------------------------------------------------------------
# the cache/ fixture: expert size not a multiple of 4096 -> alignment bugs must show
# --------------------------------------------------------------------------------------

EXPERT_PARTS = ("w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale", "w3.weight_packed", "w3.weight_scale")


def _expert_name(e: int, part: str) -> str:
    return f"language_model.model.layers.0.block_sparse_moe.experts.{e}.{part}"


def test_cache_fixture_buffered_and_direct_reads_agree():
    ref = safetensors.numpy.load_file(str(CACHE_SHARD))
    ix = CheckpointIndex.open(CACHE_SHARD.parent)
    assert set(ix.names()) == set(ref)
    n_exp = len(ref) // 6
    first = ix.get(_expert_name(0, EXPERT_PARTS[0]))
    last = ix.get(_expert_name(0, EXPERT_PARTS[-1]))
    expert_bytes = last.end - first.offset
    assert expert_bytes % ALIGN != 0 and first.offset % ALIGN != 0  # the point of this fixture
    hdr = ix.shard_header(str(CACHE_SHARD))
    assert hdr.file_size % ALIGN != 0  # widened reads of the last expert run past EOF

    # one reused "slot" like the expert cache: expert bytes + 2*4096, rounded to 4096
    slot_len = -(-(expert_bytes + 2 * ALIGN) // ALIGN) * ALIGN
    slot = aligned_empty(slot_len)
    runs = {}
    with ShardFiles() as direct, ShardFiles(use_direct=False) as buffered:
        for e in range(n_exp):
            infos = [ix.get(_expert_name(e, p)) for p in EXPERT_PARTS]
            for a, b in zip(infos, infos[1:]):  # six tensors form one contiguous run
                assert b.offset == a.end
            start, nbytes = infos[0].offset, infos[-1].end - infos[0].offset
            slot.fill(0xEE)
            run = direct.read_direct(infos[0].file, start, nbytes, out=slot)
            assert run.ctypes.data - slot.ctypes.data == direct_span(start, nbytes)[2]
            run_buf = buffered.read_bytes((infos[0].file, start, nbytes))
            assert run.tobytes() == run_buf.tobytes()
            for info in infos:
                want = ref[info.name].tobytes()
                assert buffered.read_bytes(info).tobytes() == want
                assert direct.read_direct(info).tobytes() == want
                lo = info.offset - start
                assert run[lo : lo + info.nbytes].tobytes() == want
                assert bits(load_tensor(info, direct)) == want
            runs[e] = run.tobytes()
        # where O_DIRECT works, it must have stayed in use: an alignment bug must not
        # hide behind the silent buffered fallback
        if direct_works(CACHE_SHARD):
            assert direct.direct_active(str(CACHE_SHARD)) and direct.direct_fallbacks == {}
    # bytes derive from the expert index: no two experts alias
    assert len(set(runs.values())) == n_exp


def test_direct_read_at_every_alignment_phase(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * ALIGN + 123, dtype=np.uint8)
    p = tmp_path / "blob.bin"
    p.write_bytes(data.tobytes())
    with ShardFiles() as r:
        for off in (0, 1, 511, 4095, 4096, 4097, 8191, 3 * ALIGN):
            for n in (0, 1, 100, 4095, 4096, 4097, len(data) - off):
                n = min(n, len(data) - off)
                got = r.read_direct(str(p), off, n)
                assert got.tobytes() == data[off : off + n].tobytes(), (off, n)
                assert r.read_bytes((str(p), off, n)).tobytes() == data[off : off + n].tobytes()
        if direct_works(p):
            assert r.direct_active(str(p)) and r.direct_fallbacks == {}


def test_direct_read_rejects_misaligned_or_small_target(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(bytes(10000))
    buf = aligned_empty(3 * ALIGN)
    with ShardFiles() as r:
        with pytest.raises(ValueError, match="aligned"):
            r.read_direct(str(p), 0, 100, out=buf[1:])
        with pytest.raises(ValueError, match="needs"):
            r.read_direct(str(p), 4000, 200, out=aligned_empty(ALIGN))


def test_direct_einval_falls_back_to_buffered(tmp_path):
    """A file system that takes the O_DIRECT flag but refuses the I/O: silent fallback, recorded."""
    data = bytes(range(256)) * 40
    p = tmp_path / "blob.bin"
    p.write_bytes(data)

    def hook(path, offset, nbytes, direct):
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return None

    with ShardFiles(hook=hook) as r:
        if not r.direct_active(str(p)):
            pytest.skip("O_DIRECT not available here at all")
        assert r.read_direct(str(p), 5, 5000).tobytes() == data[5:5005]
        assert not r.direct_active(str(p))
        assert "refused" in r.direct_fallbacks[str(p)]
        assert r.read_direct(str(p), 100, 10).tobytes() == data[100:110]


def test_use_direct_false_never_opens_direct(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(b"abcdefgh" * 1000)
    with ShardFiles(use_direct=False) as r:
        assert r.read_direct(str(p), 3, 7).tobytes() == b"defghab"
        assert not r.direct_active(str(p))


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 1 << 20])
def test_aligned_empty(nbytes):
    for align in (64, 4096, 1 << 21):
        a = aligned_empty(nbytes, align)
        assert a.dtype == np.uint8 and a.shape == (nbytes,) and a.ctypes.data % align == 0
        a[:] = 7  # writable, whole extent


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 24))
def test_direct_span(offset, nbytes):
    start, length, lead = direct_span(offset, nbytes)
    assert start % ALIGN == 0 and length % ALIGN == 0
    assert start <= offset and offset + nbytes <= start + length
    assert lead == offset - start and length < nbytes + 2 * ALIGN


# --------------------------------------------------------------------------------------
# writer
# --------------------------------------------------------------------------------------


def _layout_tensors():
    g = torch.Generator().manual_seed(1)
    experts = []
    for e in (3, 0, 2, 1):  # out of id order, like the release
        for part, shape in zip(EXPERT_PARTS, [(4, 16), (4, 1), (8, 8), (8, 1), (4, 16), (4, 1)]):
            experts.append((_expert_name(e, part), torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)))
    trunk = [
        ("language_model.model.norm.weight", torch.randn(33, generator=g).to(torch.bfloat16)),
        ("zz.first.but.sorted.last", torch.randn(3, 5, generator=g)),
        ("a.f16.odd", torch.randn(7, generator=g).half()),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 4)),
        ("i64", torch.arange(-5, 6)),
        ("flags", torch.tensor([True, False, True])),
        ("nonfinite.bf16", torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0]).to(torch.bfloat16)),
        ("numpy.i32", np.arange(12, dtype=np.int32).reshape(3, 4)),
        ("numpy.f64.bigendian", np.arange(5, dtype=">f8")),
        ("noncontig", torch.arange(12, dtype=torch.float32).reshape(3, 4).t()),
    ]
    return [trunk, experts]


def _ref_bits(t) -> bytes:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t.astype(t.dtype.newbyteorder("<"))).tobytes()
    return bits(t)


def test_writer_round_trip_exact_layout(tmp_path):
    shards = _layout_tensors()
    paths = write_checkpoint(tmp_path, shards, name_fmt=K3_NAME_FMT, fsync=False)
    assert [p.name for p in paths] == ["model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors"]
    assert sorted(os.listdir(tmp_path)) == sorted([p.name for p in paths] + [INDEX_NAME])

    for path, given_ in zip(paths, shards):
        sh = read_shard_header(path)
        infos = list(sh.tensors.values())
        assert [i.name for i in infos] == [n for n, _ in given_]  # header order = given order
        assert (sh.data_start - 8) % 8 == 0  # header padded to 8 bytes
        pos = sh.data_start
        for info in infos:  # gap-free, strictly in the given order
            assert info.offset == pos
            pos = info.end
        assert pos == sh.file_size
        offs = [i.offset for i in infos if i.nbytes]
        assert offs == sorted(set(offs))
        ref = safetensors.torch.load_file(str(path))
        assert list(ref) and set(ref) == {n for n, _ in given_}
        with safetensors.safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}
        with ShardFiles() as r:
            for name, t in given_:
                ours = load_tensor(sh.tensors[name], r)
                assert bits(ours) == _ref_bits(t) == bits(ref[name])
                assert tuple(ours.shape) == tuple(t.shape) == tuple(ref[name].shape)
                assert ours.dtype == ref[name].dtype

    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    ix = CheckpointIndex.open(tmp_path)
    assert idx["metadata"]["total_size"] == ix.total_bytes
    assert idx["weight_map"] == {n: p.name for p, s in zip(paths, shards) for n, _ in s}
    assert set(ix.names()) == set(idx["weight_map"])


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 3),
    st.randoms(use_true_random=False),
)
def test_writer_random_layouts(tmp_path_factory, specs, nshards, rnd):
    out = tmp_path_factory.mktemp("ck")
    tensors = []
    for i, (dt, shape) in enumerate(specs):
        raw = torch.randint(0, 256, (int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size(),), dtype=torch.uint8)
        t = raw.view(dt).reshape(shape) if dt is not torch.bool else (raw & 1).view(torch.bool).reshape(shape)
        tensors.append((f"t{rnd.randrange(1 << 30)}.{i}", t))
    rnd.shuffle(tensors)
    shards = [tensors[i::nshards] for i in range(nshards)]
    paths = write_checkpoint(out, shards, fsync=False, metadata={})
    ix = CheckpointIndex.open(out)
    for path, given_ in zip(paths, shards):
        infos = list(read_header(path).values())
        assert [i.name for i in infos] == [n for n, _ in given_]
        ref = safetensors.torch.load_file(str(path))
        for (name, t), info in zip(given_, infos):
            assert ix.get(name) == info
            assert bits(ref[name]) == bits(t) == bits(load_tensor(info))


def test_writer_is_atomic_on_failure(tmp_path, monkeypatch):
    real = writer_mod._as_bytes
    calls = []

    def boom(e):
        calls.append(e.name)
        if len(calls) == 3:
            raise RuntimeError("killed mid-write")
        return real(e)

    monkeypatch.setattr(writer_mod, "_as_bytes", boom)
    with pytest.raises(RuntimeError):
        write_checkpoint(tmp_path, _layout_tensors(), fsync=False)
    assert os.listdir(tmp_path) == []  # no partial shard, no temp file, no index


def test_writer_validates_before_writing(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        write_checkpoint(tmp_path, [[("a", torch.zeros(2))], [("a", torch.zeros(3))]], fsync=False)
    with pytest.raises(TypeError):
        write_checkpoint(tmp_path, [[("a", [1, 2])]], fsync=False)
    with pytest.raises(ValueError, match="same file name"):
        write_checkpoint(tmp_path, [[("a", torch.zeros(2))], [("b", torch.zeros(2))]], name_fmt="x.safetensors", fsync=False)
    assert not tmp_path.exists() or os.listdir(tmp_path) == []


def test_write_safetensors_single_file_and_metadata(tmp_path):
    p = write_safetensors(tmp_path / "model.safetensors", [("b", torch.ones(3)), ("a", torch.zeros(2, dtype=torch.bfloat16))], metadata={"k": "v"}, fsync=False)
    assert list(read_header(p)) == ["b", "a"]
    with safetensors.safe_open(str(p), "pt") as f:
        assert f.metadata() == {"k": "v"}
    ix = CheckpointIndex.open(tmp_path)  # single-file model, no index
    assert ix.names() == ["b", "a"] and ix.shards() == [str(p)]


# --------------------------------------------------------------------------------------
# refusals: each a CheckpointError naming the file (and tensor)
# --------------------------------------------------------------------------------------


def _refused(path, *needles) -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        read_header(path)
    err = ei.value
    assert err.exit_code == EXIT_CHECKPOINT
    msg = str(err)
    assert str(path) in msg
    for n in needles:
        assert n in msg, msg
    assert "\n" not in msg
    return err


def test_refuse_truncated_shard(tmp_path):
    p = write_safetensors(tmp_path / "m.safetensors", [("a", torch.ones(100)), ("last.tensor", torch.ones(100))], fsync=False)
    size = p.stat().st_size
    os.truncate(p, size - 1)
    _refused(p, "last.tensor", "truncated")
    os.truncate(p, 5)
    _refused(p, "8-byte")
    os.truncate(p, 0)
    _refused(p)


def test_refuse_header_larger_than_file(tmp_path):
    p = raw_st(tmp_path / "h.safetensors", {"a": entry("U8", [4], 0, 4)}, b"1234", hlen=10_000)
    _refused(p, "larger than the file")
    p = raw_st(tmp_path / "h2.safetensors", b"{}", hlen=1 << 62)
    _refused(p, "not a sane")


def test_refuse_span_out_of_bounds(tmp_path):
    p = raw_st(tmp_path / "o.safetensors", {"ok": entry("U8", [4], 0, 4), "far.away": entry("F32", [4], 16, 32)}, b"x" * 20)
    _refused(p, "far.away", "past the end")


def test_refuse_overlapping_spans(tmp_path):
    p = raw_st(tmp_path / "ov.safetensors", {"first": entry("U8", [8], 0, 8), "second": entry("U8", [4], 6, 10)}, b"x" * 10)
    _refused(p, "second", "first", "overlap")


def test_refuse_duplicate_tensor_name(tmp_path):
    text = '{"dup.name": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "dup.name": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}'
    p = raw_st(tmp_path / "d.safetensors", text, b"abcd")
    _refused(p, "dup.name", "twice")


def test_refuse_bad_dtype(tmp_path):
    p = raw_st(tmp_path / "t.safetensors", {"weird": entry("F12", [2], 0, 2)}, b"ab")
    _refused(p, "weird", "F12")


def test_refuse_shape_nbytes_mismatch(tmp_path):
    p = raw_st(tmp_path / "s.safetensors", {"w": entry("BF16", [3, 4], 0, 23)}, b"x" * 24)
    _refused(p, "'w'", "24")


@pytest.mark.parametrize(
    "ent,needle",
    [
        (entry("U8", [-1], 0, 0), "shape"),
        (entry("U8", [True], 0, 1), "shape"),
        (entry("U8", [2.0], 0, 2), "shape"),
        (entry("U8", [2], 2, 0), "data_offsets"),
        ({"dtype": "U8", "shape": [2], "data_offsets": [0]}, "data_offsets"),
        ({"dtype": "U8", "shape": [2]}, "lacks data_offsets"),
        ("not an object", "not an object"),
    ],
)
def test_refuse_malformed_entries(tmp_path, ent, needle):
    p = raw_st(tmp_path / "e.safetensors", {"the.tensor": ent}, b"xx")
    _refused(p, "the.tensor", needle)


@pytest.mark.parametrize(
    "raw,needle",
    [(b"[1, 2]", "not an object"), (b"{not json", "not valid JSON"), (b"\xff\xfe{}", "UTF-8"), ('{"__metadata__": {"a": 1}}', "__metadata__")],
)
def test_refuse_bad_header_json(tmp_path, raw, needle):
    _refused(raw_st(tmp_path / "j.safetensors", raw), needle)


def test_gaps_and_zero_size_tensors_are_fine(tmp_path):
    p = raw_st(tmp_path / "g.safetensors", {"z": entry("F32", [0], 4, 4), "a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 6, 8)}, b"abcdefgh")
    h = read_header(p)
    assert ShardFiles().read_bytes(h["b"]).tobytes() == b"gh"
    assert load_tensor(h["z"]).shape == (0,)


def _two_shard_dir(tmp_path, *, vision_only_shard=False):
    shards = [[("lm.a", torch.ones(2)), ("lm.b", torch.zeros(3))], [("lm.c", torch.ones(4))]]
    if vision_only_shard:
        shards.append([("vision_tower.x", torch.ones(2)), ("mm_projector.y", torch.ones(2))])
    return write_checkpoint(tmp_path, shards, fsync=False)


def test_refuse_missing_shard_named_by_index(tmp_path):
    paths = _two_shard_dir(tmp_path)
    paths[1].unlink()
    with pytest.raises(CheckpointError) as ei:
        CheckpointIndex.open(tmp_path)
    msg = str(ei.value)
    assert paths[1].name in msg and "incomplete" in msg and str(tmp_path) in msg
    assert ei.value.exit_code == EXIT_CHECKPOINT


def test_refuse_missing_shard_without_index(tmp_path):
    paths = write_checkpoint(tmp_path, [[("a", torch.ones(1))], [("b", torch.ones(1))], [("c", torch.ones(1))]], index=False, fsync=False)
    paths[1].unlink()
    with pytest.raises(CheckpointError, match="incomplete") as ei:
        CheckpointIndex.open(tmp_path)
    assert "model-00002-of-00003.safetensors" in str(ei.value)


def test_refuse_tensor_absent_from_named_shard(tmp_path):
    paths = _two_shard_dir(tmp_path)
    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    idx["weight_map"]["lm.c"] = paths[0].name  # index points at the wrong shard
    (tmp_path / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as ei:
        CheckpointIndex.open(tmp_path)
    assert "lm.c" in str(ei.value) and str(paths[0]) in str(ei.value)


def test_refuse_index_path_escape(tmp_path):
    _two_shard_dir(tmp_path)
    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    idx["weight_map"]["lm.c"] = "../elsewhere.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="plain file name"):
        CheckpointIndex.open(tmp_path)


def test_refuse_duplicate_tensor_across_shards_without_index(tmp_path):
    write_checkpoint(tmp_path, [[("a", torch.ones(1))]], index=False, fsync=False)
    write_safetensors(tmp_path / "extra.safetensors", [("a", torch.ones(1))], fsync=False)
    with pytest.raises(CheckpointError, match="two checkpoint files"):
        CheckpointIndex.open(tmp_path)


def test_missing_tensor_and_missing_dir(tmp_path):
    _two_shard_dir(tmp_path)
    ix = CheckpointIndex.open(tmp_path)
    with pytest.raises(CheckpointError) as ei:
        ix.get("lm.nope")
    assert "lm.nope" in str(ei.value) and str(tmp_path) in str(ei.value)
    assert "lm.nope" not in ix and "lm.a" in ix
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointIndex.open(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="No checkpoint"):
        CheckpointIndex.open(tmp_path / "empty")


def test_vision_and_projector_are_not_indexed(tmp_path):
    paths = _two_shard_dir(tmp_path, vision_only_shard=True)
    ix = CheckpointIndex.open(tmp_path)
    assert sorted(ix.names()) == ["lm.a", "lm.b", "lm.c"]
    assert "vision_tower.x" not in ix
    # a missing vision-only shard does not block the text model
    paths[2].unlink()
    ix = CheckpointIndex.open(tmp_path)
    assert sorted(ix.names()) == ["lm.a", "lm.b", "lm.c"] and len(ix.shards()) == 2


def test_refuse_bad_index_json(tmp_path):
    _two_shard_dir(tmp_path)
    (tmp_path / INDEX_NAME).write_text('{"weight_map": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointIndex.open(tmp_path)
    (tmp_path / INDEX_NAME).write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        CheckpointIndex.open(tmp_path)


# --------------------------------------------------------------------------------------
# read failures: ReadError, exit code 4
# --------------------------------------------------------------------------------------


@pytest.fixture
def blob(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 5 * ALIGN + 777, dtype=np.uint8)
    p = tmp_path / "blob.safetensors"
    write_safetensors(p, [("blob.t", torch.from_numpy(data.copy()))], fsync=False)
    return read_header(p)["blob.t"], data.tobytes()


def _assert_read_error(ei, info):
    err = ei.value
    assert err.exit_code == EXIT_READ
    msg = str(err)
    assert info.file in msg and str(info.offset) in msg and str(info.nbytes) in msg and info.name in msg


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("kind", ["eio", "eof"])
def test_injected_failure_raises_read_error(blob, kind, direct):
    info, _ = blob
    hook = FaultHook(kind, file=info.file)
    with ShardFiles(hook=hook) as r:
        with pytest.raises(ReadError) as ei:
            if direct:
                r.read_direct(info)
            else:
                load_tensor(info, r)
    _assert_read_error(ei, info)
    assert hook.fired >= 1
    if kind == "eio":
        assert "Input/output error" in str(ei.value)


@pytest.mark.parametrize("direct", [False, True])
def test_short_reads_are_continued(blob, direct):
    info, data = blob
    hook = FaultHook("short", short_bytes=1000)  # every syscall comes back short
    with ShardFiles(hook=hook) as r:
        got = r.read_direct(info) if direct else r.read_bytes(info)
        assert got.tobytes() == data
        assert hook.fired > 1
        if direct and direct_works(info.file):
            assert r.direct_fallbacks == {}
        # a direct read that comes back short at an unaligned count is finished correctly
        hook2 = FaultHook("short", short_bytes=ALIGN + 5, direct=True, times=1)
        r.hook = hook2
        assert r.read_direct(info).tobytes() == data and hook2.fired == 1
        assert r.read_direct(info.file, info.offset + 7, 9000).tobytes() == data[7:9007]


def test_fault_hook_targeting(blob):
    info, data = blob
    hook = FaultHook("eio", file=os.path.basename(info.file), at=info.offset + 3 * ALIGN, after=1, times=1)
    with ShardFiles(hook=hook) as r:
        assert r.read_bytes(info).tobytes() == data  # first matching call passes (after=1)
        with pytest.raises(ReadError):
            r.read_bytes(info)
        assert r.read_bytes(info).tobytes() == data  # times=1: only once
        assert r.read_bytes((info.file, info.offset, 100)).tobytes() == data[:100]  # `at` not covered
    assert hook.fired == 1


def test_subclass_can_override_the_read_primitive(blob):
    info, _ = blob

    class Broken(ShardFiles):
        def _pread_once(self, path, fd, view, offset, direct):
            raise OSError(errno.EIO, "simulated")

    with pytest.raises(ReadError) as ei:
        load_tensor(info, Broken())
    _assert_read_error(ei, info)


def test_real_truncation_after_indexing_is_a_read_error(blob):
    info, data = blob
    os.truncate(info.file, info.offset + 1234)
    with ShardFiles() as r:
        with pytest.raises(ReadError, match="ended after 1234 of") as ei:
            r.read_bytes(info)
        _assert_read_error(ei, info)
        with pytest.raises(ReadError):
            r.read_direct(info)


def test_vanished_file_is_a_read_error(tmp_path):
    info = TensorInfo("x", str(tmp_path / "gone.safetensors"), 0, 4, "U8", (4,))
    with pytest.raises(ReadError, match="gone.safetensors") as ei:
        ShardFiles().read_bytes(info)
    assert ei.value.exit_code == EXIT_READ


def test_read_into_targets(blob):
    info, data = blob
    with ShardFiles() as r:
        arr = np.zeros(info.nbytes + 10, np.uint8)
        mv = r.read_into(info, arr)
        assert bytes(mv) == data and arr[info.nbytes :].sum() == 0
        ba = bytearray(info.nbytes)
        r.read_into((info.file, info.offset, info.nbytes), ba)
        assert bytes(ba) == data
        t = torch.empty(info.nbytes // 4, dtype=torch.float32)
        r.read_into((Path(info.file), info.offset, t.numel() * 4), t)
        assert bits(t) == data[: t.numel() * 4]
        with pytest.raises(ValueError):
            r.read_into(info, np.zeros(10, np.uint8))
        assert r.reads >= 3 and r.bytes_read >= 2 * info.nbytes


def test_index_on_many_tensors_is_quick(tmp_path):
    """A shard header with tens of thousands of entries parses without per-tensor overhead blowups."""
    import time

    n = 20000
    hdr = {f"language_model.model.layers.{i // 600}.block_sparse_moe.experts.{i % 600}.w1.weight_packed": entry("U8", [2], 2 * i, 2 * i + 2) for i in range(n)}
    p = raw_st(tmp_path / "big.safetensors", hdr, bytes(2 * n))
    t0 = time.perf_counter()
    ix = CheckpointIndex.open(tmp_path)
    assert len(ix) == n
    assert time.perf_counter() - t0 < 5.0
    random.seed(0)
    name = random.choice(ix.names())
    assert ix.get(name).file == str(p)


def _vma_flags(addr: int) -> list[str]:
    """VmFlags of this process's mapping holding ``addr`` (from /proc/self/smaps)."""
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                cur = lo <= addr < hi
            elif head == "VmFlags:" and cur:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("nbytes", [(2 << 20) - 1, 2 << 20, (5 << 20) + 12345])
def test_aligned_empty_huge(nbytes, monkeypatch):
    """Weights get 2 MiB-aligned buffers whose whole 2 MiB pages (only those: a tail
    must not fault a huge page's worth of memory in) are advised as huge pages."""
    from k3.checkpoint.io import HUGE
    monkeypatch.delenv("K3_NOHUGE", raising=False)
    a = aligned_empty(nbytes, huge=True)
    assert a.shape == (nbytes,) and a.ctypes.data % ALIGN == 0
    a[:] = 7
    if nbytes < HUGE:
        return
    assert a.ctypes.data % HUGE == 0
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("this kernel has no transparent huge pages")
    whole = nbytes // HUGE * HUGE
    assert "hg" in _vma_flags(a.ctypes.data) and "hg" in _vma_flags(a.ctypes.data + whole - 1)
    if whole < nbytes:
        assert "hg" not in _vma_flags(a.ctypes.data + whole)
