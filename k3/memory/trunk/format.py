"""The packed trunk's on-disk format: ``trunk.bin`` (every layer's non-expert tensors,
one 4096-aligned run per layer) and ``trunk.json`` describing it, and
:class:`PackedTrunk`, which opens a packed trunk and refuses one that does not belong
to the checkpoint beside it.

``trunk.json``::

    {"format": "k3-trunk", "version": 2, "align": 4096, "config_fingerprint": ...,
     "source": {shard name: {"size", "header_sha256", "mtime_ns", "inode"}},  # shards the layers come from
     "n_layers": N, "total_bytes": ...,
     "layers": [{"layer", "run_nbytes", "nbytes" (multiple of 4096), "file_off",
                 "segments": [{"shard", "src_off", "nbytes", "off"}],
                 "tensors": {rel name: {"off", "nbytes", "dtype", "shape"}},
                 "sha256": of the layer's packed bytes, "sample": {"block", "sha256"}}]}

A layer's packed run is its non-expert tensors laid out by *segments*: maximal runs of
tensors that lie back to back in one shard, each copied verbatim (a release checkpoint
stores every layer as one run in one shard: one segment, copied as it is). Tensors of
a layer spread over several shards, or interleaved with expert tensors (a checkpoint
re-saved by common tools), make several segments, each placed at a 64-byte boundary
after the previous one. ``rel name`` is relative to the layer
(``self_attn.q_proj.weight``): the keys a WeightProvider's ``layer(i)`` returns.
Staleness: ``PackedTrunk.open`` refuses a trunk whose source shards are not the files
it was packed from (size, header hash, modification time, inode), so a shard rewritten
in place, even 4 KiB of one tensor, is caught without reading it. ``sample`` is the
SHA-256 of a few 4 KiB blocks of every segment, re-read from the shards and from
trunk.bin at open (a trunk.bin that is not the one described; a shard replaced by
another with the same identity). ``sha256`` hashes the whole packed layer:
``k3 pack-trunk MODEL OUT --verify`` re-hashes every byte from the shards and from
trunk.bin (and, when all match, accepts shards that were only copied or touched).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from ...checkpoint.io import ALIGN, TORCH_DTYPES
from ...units import align_up
from ...checkpoint.layout import CheckpointLayout
from ...checkpoint.safetensors import CheckpointIndex, pread_exact
from ...errors import CheckpointError
from ...fsutil import read_json_file

FORMAT = "k3-trunk"
VERSION = 2
TRUNK_BIN = "trunk.bin"
TRUNK_JSON = "trunk.json"
PARTIAL = "trunk.bin.partial"
PROGRESS = "trunk.progress.json"
SAMPLE_BLOCK = 4096
SAMPLE_COUNT = 8  # sample blocks per segment
SEGMENT_ALIGN = 64  # where a segment after the first starts in the run (dtype alignment for views)


@dataclass(frozen=True)
class TrunkTensor:
    off: int  # byte offset within the layer's run (= within its buffer)
    nbytes: int
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Segment:
    shard: str  # shard file name (no directory)
    src_off: int  # absolute offset in the shard
    nbytes: int
    off: int  # offset within the layer's run

    def to_json(self) -> dict:
        return {"shard": self.shard, "src_off": self.src_off, "nbytes": self.nbytes, "off": self.off}


@dataclass(frozen=True)
class TrunkLayer:
    layer: int
    run_nbytes: int  # end of the last segment in the run
    nbytes: int  # run_nbytes rounded up to ALIGN: the read size and buffer size
    file_off: int  # offset in trunk.bin (multiple of ALIGN)
    tensors: dict[str, TrunkTensor]
    segments: tuple[Segment, ...]

    @property
    def shards(self) -> set[str]:
        return {g.shard for g in self.segments}

    def to_json(self) -> dict:
        return {
            "layer": self.layer, "run_nbytes": self.run_nbytes, "nbytes": self.nbytes, "file_off": self.file_off,
            "segments": [g.to_json() for g in self.segments],
            "tensors": {k: {"off": t.off, "nbytes": t.nbytes, "dtype": t.dtype, "shape": list(t.shape)}
                        for k, t in self.tensors.items()},
        }


def _plan_layout(cfg, index, n_layers: int | None = None) -> list[TrunkLayer]:
    """Where each layer's tensors are in the checkpoint and where they go in trunk.bin:
    every layer's tensors (checked against the schema first) grouped into segments of
    tensors that lie back to back in one shard."""
    layout = CheckpointLayout(cfg, index, n_layers)
    layout.validate(experts=False)
    out, file_off = [], 0
    for i in range(layout.n_layers):
        ts = sorted(layout.layer_infos(i).items(), key=lambda x: (x[1].file, x[1].offset))
        segments: list[Segment] = []
        tensors = {}
        end = 0  # run bytes used so far
        for rel, t in ts:
            g = segments[-1] if segments else None
            shard = os.path.basename(t.file)
            if g is not None and g.shard == shard and t.offset == g.src_off + g.nbytes:
                segments[-1] = g = Segment(g.shard, g.src_off, g.nbytes + t.nbytes, g.off)
            else:
                off = align_up(end, SEGMENT_ALIGN)
                g = Segment(shard, t.offset, t.nbytes, off)
                segments.append(g)
            tensors[rel] = TrunkTensor(g.off + t.offset - g.src_off, t.nbytes, t.dtype, tuple(t.shape))
            end = g.off + g.nbytes
        out.append(TrunkLayer(i, end, align_up(end), file_off, dict(sorted(tensors.items())), tuple(segments)))
        file_off += align_up(end)
    return out


def _header_sha(path: str, data_start: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(data_start)).hexdigest()


def _sources(index, layers: list[TrunkLayer]) -> dict[str, dict]:
    by_name = {os.path.basename(p): p for p in index.shards()}
    out = {}
    for name in sorted(set().union(*(L.shards for L in layers))):
        p = by_name[name]
        h = index.shard_header(p)
        st = os.stat(p)
        out[name] = {"size": h.file_size, "header_sha256": _header_sha(p, h.data_start),
                     "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    return out


def _sample_offsets(nbytes: int) -> list[int]:
    """Offsets (within a segment) of the blocks whose hash identifies its bytes."""
    blk = min(SAMPLE_BLOCK, nbytes)
    last = nbytes - blk
    if last <= 0:
        return [0]
    return sorted({last * k // (SAMPLE_COUNT - 1) for k in range(SAMPLE_COUNT)})


def sample_hash(L: TrunkLayer, where) -> str:
    """SHA-256 of the sample blocks of every segment of layer L, read through
    ``where(segment) -> (fd, file offset of the segment's first byte)``: the shards it
    was copied from, or trunk.bin."""
    h = hashlib.sha256()
    for g in L.segments:
        fd, base = where(g)
        blk = min(SAMPLE_BLOCK, g.nbytes)
        for o in _sample_offsets(g.nbytes):
            h.update(pread_exact(fd, blk, base + o))
    return h.hexdigest()


def _plan_doc(cfg, index, layers: list[TrunkLayer]) -> dict:
    return {
        "format": FORMAT, "version": VERSION, "align": ALIGN, "config_fingerprint": cfg.fingerprint(),
        "source": _sources(index, layers), "n_layers": len(layers),
        "total_bytes": sum(L.nbytes for L in layers),
        "layers": [L.to_json() for L in layers],
    }


def _doc_sha(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class PackedTrunk:
    """A verified packed trunk: ``path`` (trunk.bin) and its per-layer layout."""

    def __init__(self, directory: str, meta: dict, layers: list[TrunkLayer]):
        self.directory = directory
        self.path = os.path.join(directory, TRUNK_BIN)
        self.meta = meta
        self.layers = layers
        self.n_layers = len(layers)

    @property
    def layer_bytes(self) -> list[int]:
        return [L.nbytes for L in self.layers]

    def slice(self, first: int, end: int) -> "PackedTrunk":
        """Layers first .. end - 1 only (one pipeline stage's), indexed from 0; the same
        trunk.bin (each layer keeps its file offset)."""
        return PackedTrunk(self.directory, self.meta, self.layers[first:end])

    @property
    def total_bytes(self) -> int:
        return sum(L.nbytes for L in self.layers)

    @classmethod
    def open(cls, trunk_dir, cfg, index: CheckpointIndex, verify_samples: bool = True,
             check_identity: bool = True) -> "PackedTrunk":
        """Open and verify ``trunk_dir`` against the checkpoint ``index`` read with ``cfg``.

        Refuses (CheckpointError, exit 3) a missing or unreadable trunk.json, a trunk from
        an interrupted pack, a config fingerprint, source shard size/header, layer layout
        or tensor list that differs from this checkpoint, source shards that are not the
        files packed (``check_identity``: modification time or inode changed), a truncated
        or oversized trunk.bin, and (``verify_samples``) sample blocks whose bytes differ
        between the shard, trunk.bin and what was recorded when packing."""
        d = os.path.abspath(os.fspath(trunk_dir))
        model = index.model_dir
        redo = f"Re-run `k3 pack-trunk {model} {d}` to pack it again from this checkpoint."
        jpath = os.path.join(d, TRUNK_JSON)
        if not os.path.isfile(jpath):
            if os.path.exists(os.path.join(d, PARTIAL)) or os.path.exists(os.path.join(d, PROGRESS)):
                raise CheckpointError(
                    f"{d} holds an unfinished packed trunk ({PARTIAL} without {TRUNK_JSON}): a `k3 pack-trunk` "
                    f"was interrupted. Re-run `k3 pack-trunk {model} {d}`; it resumes where it stopped.")
            raise CheckpointError(
                f"{d}: no packed trunk here ({TRUNK_JSON} is missing). Create one with "
                f"`k3 pack-trunk {model} {d}`.")
        meta = read_json_file(jpath, what=TRUNK_JSON, error=CheckpointError, hint=redo)

        def stale(why: str) -> CheckpointError:
            return CheckpointError(
                f"The packed trunk in {d} does not belong to the checkpoint in {model}: {why}. It is stale "
                f"(the checkpoint or config changed since it was packed) or was packed from another model. {redo}")

        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{jpath} is not a k3 packed-trunk description (format != {FORMAT!r}). {redo}")
        if meta.get("version") != VERSION:
            raise CheckpointError(f"{jpath} is packed-trunk format version {meta.get('version')!r} (packed by "
                                  f"another k3 version); this k3 reads version {VERSION}. {redo}")
        if meta.get("align") != ALIGN:
            raise CheckpointError(f"{jpath} declares alignment {meta.get('align')!r}, k3 needs {ALIGN}. {redo}")
        if meta.get("config_fingerprint") != cfg.fingerprint():
            raise stale(f"its config fingerprint is {meta.get('config_fingerprint')!r}, this config's is "
                        f"{cfg.fingerprint()!r}")
        if meta.get("n_layers") != cfg.num_hidden_layers:
            raise stale(f"it has {meta.get('n_layers')!r} layers, the config {cfg.num_hidden_layers}")
        try:
            expect = _plan_layout(cfg, index)
        except CheckpointError as e:
            raise stale(f"this checkpoint does not hold the trunk the config implies ({e})") from None
        by_name = {os.path.basename(p): p for p in index.shards()}
        src = meta.get("source")
        if not isinstance(src, dict):
            raise stale("trunk.json has no source table")
        for name in sorted(set().union(*(L.shards for L in expect)) | set(src)):
            if name not in by_name:
                raise stale(f"it was packed from shard {name}, which this checkpoint does not have")
            if name not in src:
                raise stale(f"it does not record shard {name}")
            h = index.shard_header(by_name[name])
            rec = src[name]
            if not isinstance(rec, dict) or rec.get("size") != h.file_size:
                raise stale(f"shard {name} is {h.file_size} bytes now, "
                            f"{rec.get('size') if isinstance(rec, dict) else '?'} when packed")
            if rec.get("header_sha256") != _header_sha(by_name[name], h.data_start):
                raise stale(f"the header of shard {name} changed since packing")
            st = os.stat(by_name[name])
            if check_identity and (rec.get("mtime_ns"), rec.get("inode")) != (st.st_mtime_ns, st.st_ino):
                raise stale(
                    f"shard {name} is not the file it was packed from (its modification time or inode changed: it "
                    f"was rewritten, copied or touched). If it was only copied or touched, `k3 pack-trunk {model} "
                    f"{d} --verify` re-hashes every byte and accepts it again when they are the ones packed")
        got = meta.get("layers")
        if not isinstance(got, list) or len(got) != len(expect):
            raise stale("its layer table does not have one entry per layer")
        for L, g in zip(expect, got):
            if not isinstance(g, dict) or not isinstance(g.get("sha256"), str):
                raise stale(f"layer {L.layer}'s entry is malformed or has no hash")
            e = L.to_json()
            for k in ("layer", "segments", "run_nbytes", "nbytes", "file_off"):
                if g.get(k) != e[k]:
                    raise stale(f"layer {L.layer}: {k} is {g.get(k)!r} in trunk.json, {e[k]!r} for this checkpoint")
            if g.get("tensors") != e["tensors"]:
                gt = g.get("tensors") if isinstance(g.get("tensors"), dict) else {}
                diff = sorted(set(gt) ^ set(e["tensors"])) or sorted(k for k in gt if gt[k] != e["tensors"].get(k))
                raise stale(f"layer {L.layer}: its tensor list differs ({', '.join(diff[:5])})")
        need = sum(L.nbytes for L in expect)
        bpath = os.path.join(d, TRUNK_BIN)
        try:
            size = os.path.getsize(bpath)
        except OSError:
            raise CheckpointError(f"{d}: {TRUNK_JSON} is there but {TRUNK_BIN} is missing. {redo}") from None
        if size != need:
            what = "truncated" if size < need else "longer than described"
            raise CheckpointError(f"{bpath} is {what}: {size} bytes, trunk.json describes {need}. {redo}")
        trunk = cls(d, meta, expect)
        if verify_samples:
            trunk._verify_samples(index, got, stale, redo)
        return trunk

    def _verify_samples(self, index, got: list, stale, redo: str) -> None:
        by_name = {os.path.basename(p): p for p in index.shards()}
        fds: dict[str, int] = {}  # shard name -> fd
        try:
            tfd = os.open(self.path, os.O_RDONLY)
            for L, g in zip(self.layers, got):
                want = (g.get("sample") or {}).get("sha256")
                if not want:
                    raise stale(f"layer {L.layer} has no sample hash")
                for name in L.shards:
                    if name not in fds:
                        fds[name] = os.open(by_name[name], os.O_RDONLY)
                if sample_hash(L, lambda seg: (fds[seg.shard], seg.src_off)) != want:
                    raise stale(f"the bytes of layer {L.layer} in {', '.join(sorted(L.shards))} differ from the "
                                "ones packed")
                if sample_hash(L, lambda seg: (tfd, L.file_off + seg.off)) != want:
                    raise CheckpointError(
                        f"{self.path}: layer {L.layer}'s bytes differ from the ones recorded when packing "
                        f"(the file is damaged or not the one trunk.json describes). {redo}")
            os.close(tfd)
        except OSError as e:
            raise CheckpointError(f"{self.directory}: cannot verify the packed trunk ({e}). {redo}") from None
        finally:
            for fd in fds.values():
                os.close(fd)

    def views(self, i: int, buf: np.ndarray) -> dict[str, torch.Tensor]:
        """Layer i's tensors as views into ``buf`` (which holds the layer's run at 0)."""
        out = {}
        for rel, t in self.layers[i].tensors.items():
            dt = TORCH_DTYPES[t.dtype]
            a = buf[t.off : t.off + t.nbytes]
            if a.ctypes.data % dt.itemsize:  # never for safetensors' 8-aligned offsets
                a = a.copy()
            out[rel] = torch.from_numpy(a).view(dt).reshape(t.shape)
        return out


