"""Property-based fuzzing of k3's input readers (hypothesis, derandomized: the same
examples on every run, so CI is reproducible).

Property, for every reader: on any input it either succeeds or raises a K3Error with
exit code 2 (config, state file) or 3 (checkpoint) whose message is one line - never
another exception, never a hang (each call is timed).

Readers: the safetensors header parser (random bytes, random JSON structures, byte
mutations of a valid header), the config reader (random JSON trees, field mutations
of a valid synthetic config from k3.synth.build_config, byte mutations of its file),
the checkpoint index reader (random weight maps), and the state-file reader (mutated
headers and truncations of a real state file written by k3.state.save_state on a
tiny model).

The examples are fixed (derandomized) and each test takes a few seconds; set
K3_FUZZ_EXAMPLES=5000 for a deeper random search on a developer machine."""

from __future__ import annotations

import copy
import json
import math
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.checkpoint.safetensors import DTYPE_SIZES, CheckpointIndex, read_header
from k3.checkpoint.writer import write_checkpoint, write_safetensors
from k3.config import load_config, parse_config
from k3.errors import K3Error
from k3.state import load_state, read_state_header, save_state
from k3.synth import build_config, synthesize

from engines import greedy_ids, open_engine

# K3_FUZZ_EXAMPLES=N runs N random (not derandomized) examples per test, for a deeper local search.
_DEEP = int(os.environ.get("K3_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_DEEP or 150, deadline=None, derandomize=not _DEEP, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
MAX_SECONDS = 5.0  # one call on a small input; far above the normal milliseconds, far below a hang


def outcome(fn, codes=(2, 3)):
    """Call fn: it returns normally (-> its value) or raises a K3Error with an allowed
    exit code and a one-line message (-> None). Anything else fails the property."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except K3Error as e:
        assert e.exit_code in codes, (e.exit_code, str(e))
        msg = str(e)
        assert msg and "\n" not in msg, msg
        out = None
    dt = time.perf_counter() - t0
    assert dt < MAX_SECONDS, f"took {dt:.1f} s"
    return out


# ---------------------------------------------------------------- JSON strategies
scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 300)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["BF16", "F32", "U8", "I64", "situ", "silu", "mxfp4-pack-quantized", "k3-state"]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


def dumps(v) -> bytes:
    return json.dumps(v, allow_nan=True).encode()  # NaN/Infinity as Python's json reads them


def paths_of(tree, prefix=()):
    """Every (path) of a nested dict/list tree, containers included."""
    out = [prefix] if prefix else []
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += paths_of(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += paths_of(v, prefix + (i,))
    return out


def mutate(tree, path, op, value):
    """A copy of tree with the node at path replaced by value (op "set") or removed ("del")."""
    t = copy.deepcopy(tree)
    node = t
    for k in path[:-1]:
        node = node[k]
    if op == "del":
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return t


byte_ops = st.lists(st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "digits"]),
                              st.integers(0, 10 ** 6), st.integers(0, 255)), min_size=1, max_size=4)


def mutate_bytes(raw: bytes, ops) -> bytes:
    b = bytearray(raw)
    for op, pos, val in ops:
        if not b:
            break
        i = pos % len(b)
        if op == "flip":
            b[i] ^= 1 << (val % 8)
        elif op == "set":
            b[i] = val
        elif op == "insert":
            b[i:i] = bytes([val])
        elif op == "delete":
            del b[i:i + 1 + val % 8]
        else:  # a run of digits: huge numbers where a small one stood
            b[i:i] = b"9" * (1 + val * 20)
    return bytes(b)


# ================================================================ safetensors header
def st_file(path: Path, header: bytes, data: bytes = b"", hlen: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if hlen is None else hlen) + header + data)
    return path


@pytest.fixture(scope="module")
def valid_shard(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("st") / "v.safetensors"
    write_safetensors(p, [("a.weight", torch.ones(3, 4, dtype=torch.bfloat16)), ("b", torch.arange(5)),
                          ("c.scale", torch.zeros(0, 2)), ("d", torch.ones(2, dtype=torch.uint8))],
                      metadata={"format": "pt"}, fsync=False)
    return p.read_bytes()


@FUZZ
@given(raw=st.binary(max_size=400))
def test_header_parser_random_bytes(tmp_path, raw):
    p = tmp_path / "r.safetensors"
    p.write_bytes(raw)
    outcome(lambda: read_header(p), codes=(3,))
    # the same bytes as a header under a correct length prefix
    outcome(lambda: read_header(st_file(p, raw, b"\0" * 64)), codes=(3,))


entry_values = st.fixed_dictionaries(
    {}, optional={
        "dtype": st.sampled_from(list(DTYPE_SIZES) + ["F12", ""]) | json_values,
        "shape": st.lists(st.integers(-2, 6) | st.integers(0, 2 ** 64), max_size=5) | json_values,
        "data_offsets": st.lists(st.integers(-4, 80) | st.integers(0, 2 ** 64), max_size=3) | json_values,
    }) | json_values


@FUZZ
@given(tree=json_values, entries=st.dictionaries(st.text(max_size=6), entry_values, max_size=5),
       meta=st.none() | json_values, data=st.binary(max_size=80))
def test_header_parser_random_json(tmp_path, tree, entries, meta, data):
    p = tmp_path / "j.safetensors"
    outcome(lambda: read_header(st_file(p, dumps(tree), data)), codes=(3,))
    hdr = dict(entries)
    if meta is not None:
        hdr["__metadata__"] = meta
    out = outcome(lambda: read_header(st_file(p, dumps(hdr), data)), codes=(3,))
    if out is not None:  # accepted: every tensor lies inside the data section, with a consistent size
        for info in out.values():
            assert 8 + len(dumps(hdr)) <= info.offset <= info.end <= p.stat().st_size
            assert info.nbytes == math.prod(info.shape) * DTYPE_SIZES[info.dtype]


@FUZZ
@given(ops=byte_ops, cut=st.none() | st.integers(0, 10 ** 6))
def test_header_parser_mutations_of_a_valid_header(tmp_path, valid_shard, ops, cut):
    n = struct.unpack("<Q", valid_shard[:8])[0]
    header, data = valid_shard[8:8 + n], valid_shard[8 + n:]
    p = tmp_path / "m.safetensors"
    st_file(p, mutate_bytes(header, ops), data)
    if cut is not None:
        os.truncate(p, cut % (p.stat().st_size + 1))
    outcome(lambda: read_header(p), codes=(3,))
    # mutating the whole file, length prefix included
    p.write_bytes(mutate_bytes(valid_shard, ops))
    outcome(lambda: read_header(p), codes=(3,))


def test_header_parser_deep_nesting(tmp_path):
    for depth in (10, 1000, 100_000):
        for open_, close in ((b"[", b"]"), (b'{"a":', b"}")):
            text = open_ * depth + b"1" + close * depth
            outcome(lambda: read_header(st_file(tmp_path / "d.safetensors", text)), codes=(3,))


# ================================================================ config.json
CONFIGS = {arch: build_config("tiny", arch) for arch in ("k3", "kimi_linear")}
CONFIG_PATHS = {arch: paths_of(c) for arch, c in CONFIGS.items()}


def _config_is_usable(cfg) -> None:
    """An accepted config can be used: its fingerprint, summary and tensor graph."""
    from k3.schema import global_specs, layer_specs

    cfg.fingerprint()
    cfg.summary()
    global_specs(cfg)
    for i in range(cfg.num_hidden_layers):
        layer_specs(cfg, i)


@FUZZ
@given(tree=json_values)
def test_config_reader_random_json(tmp_path, tree):
    cfg = outcome(lambda: parse_config(tree, "fuzz.json"), codes=(2,))
    assert cfg is None or isinstance(cfg.hidden_size, int)
    p = tmp_path / "config.json"
    p.write_bytes(dumps(tree))
    outcome(lambda: load_config(p), codes=(2,))


@FUZZ
@given(arch=st.sampled_from(["k3", "kimi_linear"]), data=st.data())
def test_config_reader_mutations_of_a_valid_config(tmp_path, arch, data):
    raw = CONFIGS[arch]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(CONFIG_PATHS[arch]))
        try:
            raw = mutate(raw, path, data.draw(st.sampled_from(["set", "set", "del"])), data.draw(json_values))
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed or replaced the parent
            pass
    cfg = outcome(lambda: parse_config(raw, "fuzz.json"), codes=(2,))
    if cfg is not None:
        _config_is_usable(cfg)
    p = tmp_path / "config.json"
    p.write_bytes(dumps(raw))
    outcome(lambda: load_config(p), codes=(2,))


@FUZZ
@given(arch=st.sampled_from(["k3", "kimi_linear"]), ops=byte_ops)
def test_config_reader_byte_mutations(tmp_path, arch, ops):
    p = tmp_path / "config.json"
    p.write_bytes(mutate_bytes(json.dumps(CONFIGS[arch], indent=1).encode(), ops))
    cfg = outcome(lambda: load_config(p), codes=(2,))
    if cfg is not None:
        _config_is_usable(cfg)


# ================================================================ checkpoint index
@pytest.fixture(scope="module")
def two_shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("idx")
    write_checkpoint(d, [[("lm.a", torch.ones(2)), ("lm.b", torch.zeros(3))], [("lm.c", torch.ones(4))]],
                     fsync=False)
    return d


@FUZZ
@given(data=st.data())
def test_index_reader_random_weight_maps(two_shards, data):
    shards = sorted(p.name for p in two_shards.glob("*.safetensors"))
    names = ["lm.a", "lm.b", "lm.c", "vision_tower.x", "other"]
    value = st.sampled_from(shards + ["", ".", "..", "../x.safetensors", "nope.safetensors", "a\0b"]) | json_values
    wm = data.draw(st.dictionaries(st.sampled_from(names) | st.text(max_size=6), value, max_size=6)
                   | json_values)
    doc = data.draw(st.sampled_from(["plain", "with-meta", "raw"]))
    if doc == "raw":
        body = wm
    else:
        body = {"weight_map": wm}
        if doc == "with-meta":
            body["metadata"] = data.draw(json_values)
    (two_shards / "model.safetensors.index.json").write_bytes(dumps(body))
    ix = outcome(lambda: CheckpointIndex.open(two_shards), codes=(3,))
    if ix is not None:
        assert set(ix.names()) <= set(wm) and all(not n.startswith("vision_tower.") for n in ix.names())


# ================================================================ state files
@pytest.fixture(scope="module")
def real_state(tmp_path_factory):
    """(path, cfg): a state file written by save_state after a real decode on a tiny K3."""
    d = tmp_path_factory.mktemp("k3")
    synthesize(d, preset="tiny", arch="k3", seed=21)
    with open_engine(d) as eng:
        st_ = eng.model.new_state()
        out = greedy_ids(eng, list(range(100, 110)), 3, state=st_)
        p = d / "conv.k3state"
        save_state(p, st_, eng.model.cfg, pending=out[-1:], extra={"messages": [{"role": "user", "content": "é"}]},
                   fsync=False)
        return p, eng.model.cfg


def _split(raw: bytes):
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _load(p: Path, cfg):
    outcome(lambda: read_state_header(p), codes=(2,))
    return outcome(lambda: load_state(p, cfg), codes=(2,))


@FUZZ
@given(data=st.data())
def test_state_reader_mutated_headers(tmp_path, real_state, data):
    path, cfg = real_state
    hdr, body = _split(path.read_bytes())
    meta_keys = list(hdr["__metadata__"])
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.sampled_from(["meta", "meta", "entry", "tree"]))
        if what == "meta":
            key = data.draw(st.sampled_from(meta_keys + ["other"]))
            v = data.draw(st.integers(-5, 10 ** 20).map(str) | st.text(max_size=8) | json_values
                          | st.just("[" * 5000) | st.builds(json.dumps, json_values))
            if not isinstance(hdr.get("__metadata__"), dict):  # an earlier mutation replaced it
                hdr["__metadata__"] = {}
            hdr["__metadata__"][key] = v
        elif what == "entry":
            name = data.draw(st.sampled_from(sorted(k for k in hdr if k != "__metadata__") or ["ids"]))
            field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            hdr[name] = dict(hdr[name]) if isinstance(hdr[name], dict) else {}
            hdr[name][field] = data.draw(json_values | st.lists(st.integers(-2, 2 ** 64), max_size=4))
        else:
            p_ = data.draw(st.sampled_from(paths_of(hdr)))
            try:
                hdr = mutate(hdr, p_, data.draw(st.sampled_from(["set", "del"])), data.draw(json_values))
            except (KeyError, IndexError, TypeError):
                pass
    text = dumps(hdr)
    p = tmp_path / "m.k3state"
    p.write_bytes(struct.pack("<Q", len(text)) + text + body)
    loaded = _load(p, cfg)
    if loaded is not None:
        assert isinstance(loaded.extra, dict) and len(loaded.tokens) == 13


@FUZZ
@given(cut=st.integers(0, 10 ** 7), ops=st.none() | byte_ops)
def test_state_reader_truncations_and_byte_mutations(tmp_path, real_state, cut, ops):
    path, cfg = real_state
    raw = path.read_bytes()
    if ops is not None:
        raw = mutate_bytes(raw, ops)
    p = tmp_path / "t.k3state"
    p.write_bytes(raw[:cut % (len(raw) + 1)])
    _load(p, cfg)


def test_state_reader_accepts_the_real_file(real_state):
    path, cfg = real_state
    ld = load_state(path, cfg)
    assert ld.extra["messages"][0]["content"] == "é" and len(ld.tokens) == 13
