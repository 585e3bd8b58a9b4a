"""The dense trunk as one packed file, streamed through a pinned set + a ring of slots.

Three parts (reference engine spec 4.2, 4.3 and the post-v1.0 trunk rework of 10):

**Packing** (:func:`pack_trunk`, ``k3 pack-trunk MODEL OUT``). Every layer's non-expert
tensors (``k3.model.schema.layer_specs``) lie in one shard as one gap-free run (the
release's layout; anything else is refused). Each run is copied verbatim into
``trunk.bin`` at a 4096-aligned offset and padded to 4096, so one layer is one aligned
``O_DIRECT`` read. ``trunk.json`` describes it::

    {"format": "k3-trunk", "version": 1, "align": 4096, "config_fingerprint": ...,
     "source": {shard name: {"size", "header_sha256"}},   # shards the runs come from
     "n_layers": N, "total_bytes": ...,
     "layers": [{"layer", "shard", "run_start", "nbytes" (multiple of 4096), "run_nbytes",
                 "file_off", "tensors": {rel name: {"off", "nbytes", "dtype", "shape"}},
                 "sample": {"block", "offsets", "sha256"}}]}

``rel name`` is relative to the layer (``self_attn.q_proj.weight``): the keys a
WeightProvider's ``layer(i)`` returns. ``sample`` is the SHA-256 of a few 4 KiB blocks
of the run; ``PackedTrunk.open`` re-reads them from the shard *and* from trunk.bin, which
catches a trunk packed from different bytes with an identical header (another seed, a
re-download) and a trunk.bin whose content is not the one described.

Crash safety and resume: data goes to ``trunk.bin.partial``; after each layer is on disk
(``fdatasync``) ``trunk.progress.json`` records how many layers are done. ``trunk.bin``
appears by rename only when every layer is copied, and ``trunk.json`` is written last
(temp file + ``os.replace``), so a directory without ``trunk.json`` is never mistaken
for a trunk. A re-run whose plan (source shards, headers, layout) is unchanged resumes
at the first layer not recorded as done (the partial file is cut back there);
otherwise it starts from scratch. Re-packing over a complete, matching trunk is a no-op
unless ``force``.

**Planning** (:func:`plan_trunk`, pure): which layers stay pinned in RAM and how many
uniform ring slots stream the rest, within a byte budget. See its docstring.

**Streaming** (:class:`TrunkStreamer`): pinned layers live in their own buffers; every
other budget byte is one ring *arena* (at least ``ring`` slots of the largest unpinned
layer). A scheduler thread places the unpinned layers into the arena one after another
in forward-walk order (wrapping to layer 0 for the next token; a layer that meets the
arena's end is split there at a tensor boundary) and issues aligned ``O_DIRECT`` chunk
reads to a small thread pool (``pread`` releases the GIL, so ``io_threads`` chunks are
in flight at once, across layer boundaries). ``layer(i)`` hands over a mapping at once;
looking a tensor up waits only for the chunks under it, so compute follows the reads
tensor by tensor, and reads of the next layer start in whatever arena bytes the current
one leaves free. Bytes of a layer being read, not yet used, or held by the caller are
never overwritten; a released layer's bytes are reused as a hit if the walk comes back
before they are taken.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Callable

import numpy as np
import torch

from ..checkpoint.io import ALIGN, TORCH_DTYPES, ShardFiles, aligned_empty
from ..checkpoint.safetensors import CheckpointIndex, pread_exact
from ..errors import CheckpointError, K3Error, ReadError, UsageError
from ..fsutil import fsync_dir
from ..model.schema import alog_ok, layer_specs
from .planner import human
from .resident import CheckpointLayout

__all__ = [
    "PackedTrunk",
    "TrunkLayer",
    "TrunkPlan",
    "TrunkStreamer",
    "TrunkTensor",
    "main",
    "min_budget_for",
    "pack_trunk",
    "plan_trunk",
    "register",
]

FORMAT = "k3-trunk"
VERSION = 1
TRUNK_BIN = "trunk.bin"
TRUNK_JSON = "trunk.json"
PARTIAL = "trunk.bin.partial"
PROGRESS = "trunk.progress.json"
COPY_CHUNK = 64 << 20  # bytes per copy request while packing
SAMPLE_BLOCK = 4096
SAMPLE_COUNT = 8
DEFAULT_CHUNK = 8 << 20  # bytes per read request while streaming


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _gb_up(n: float) -> str:
    """GB with two decimals, rounded up (a threshold quoted to the user must suffice)."""
    return f"{math.ceil(n / 1e7 - 1e-9) / 100:.2f}"


# =============================================================================== layout
@dataclass(frozen=True)
class TrunkTensor:
    off: int  # byte offset within the layer's run (= within its buffer)
    nbytes: int
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TrunkLayer:
    layer: int
    shard: str  # shard file name (no directory)
    run_start: int  # absolute offset of the run in the shard
    run_nbytes: int
    nbytes: int  # run_nbytes rounded up to ALIGN: the read size and buffer size
    file_off: int  # offset in trunk.bin (multiple of ALIGN)
    tensors: dict[str, TrunkTensor]

    def to_json(self) -> dict:
        return {
            "layer": self.layer, "shard": self.shard, "run_start": self.run_start,
            "nbytes": self.nbytes, "run_nbytes": self.run_nbytes, "file_off": self.file_off,
            "tensors": {k: {"off": t.off, "nbytes": t.nbytes, "dtype": t.dtype, "shape": list(t.shape)}
                        for k, t in self.tensors.items()},
        }


def _layer_tensors(cfg, index, layout: CheckpointLayout, i: int):
    """[(rel, TensorInfo)] of layer i's non-expert tensors, checked against the schema."""
    missing, bad, out = [], [], []
    for rel, sp in layer_specs(cfg, i).items():
        full = layout.full(f"layers.{i}.{rel}")
        if full not in index:
            missing.append(full)
            continue
        ti = index.get(full)
        ok = alog_ok(ti.shape, cfg.kda_num_heads) if sp.kind == "alog" else tuple(ti.shape) == tuple(sp.shape)
        if not ok:
            bad.append(f"`{full}` has shape {list(ti.shape)}, the config implies {list(sp.shape)}")
        out.append((rel, ti))
    if missing:
        shown = ", ".join(f"`{m}`" for m in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise CheckpointError(
            f"{index.model_dir}: layer {i} lacks {len(missing)} of its trunk tensors ({shown}); a partial "
            "download cannot be packed. Download the missing shards and re-run `k3 pack-trunk`.")
    if bad:
        raise CheckpointError(
            f"{index.model_dir}: layer {i} does not match the config: {'; '.join(bad[:4])}. Point --config at "
            "the config this checkpoint was written with.")
    return out


def _plan_layout(cfg, index, n_layers: int | None = None) -> list[TrunkLayer]:
    """Where each layer's run is in the checkpoint and where it goes in trunk.bin.

    Refuses (CheckpointError) a layer whose tensors are in more than one shard or do not
    form one gap-free run."""
    layout = CheckpointLayout(cfg, index, n_layers)
    out, file_off = [], 0
    for i in range(layout.n_layers):
        ts = sorted(_layer_tensors(cfg, index, layout, i), key=lambda x: x[1].offset)
        files = sorted({t.file for _, t in ts})
        if len(files) > 1:
            where = "; ".join(
                f"{os.path.basename(f)}: " + ", ".join(rel for rel, t in ts if t.file == f)[:300] for f in files)
            raise CheckpointError(
                f"{index.model_dir}: layer {i}'s non-expert tensors are spread over {len(files)} shards ({where}). "
                "k3 pack-trunk needs each layer's trunk as one contiguous run in one shard, as the release "
                "stores it; this checkpoint was re-saved with a different layout and cannot be packed.")
        gaps = []
        for (ra, a), (rb, b) in zip(ts, ts[1:]):
            if a.end != b.offset:
                what = "a gap" if a.end < b.offset else "an overlap"
                gaps.append(f"{what} of {abs(b.offset - a.end)} bytes between `{ra}` and `{rb}`")
        if gaps:
            raise CheckpointError(
                f"{index.model_dir}: layer {i}'s non-expert tensors in {os.path.basename(files[0])} are not one "
                f"gap-free run ({'; '.join(gaps[:4])}). k3 pack-trunk copies each layer as one contiguous run, "
                "as the release stores it; this checkpoint's layout differs and cannot be packed.")
        start = ts[0][1].offset
        run = ts[-1][1].end - start
        nbytes = _align_up(run)
        tensors = {rel: TrunkTensor(t.offset - start, t.nbytes, t.dtype, tuple(t.shape))
                   for rel, t in sorted(ts, key=lambda x: x[0])}
        out.append(TrunkLayer(i, os.path.basename(files[0]), start, run, nbytes, file_off, tensors))
        file_off += nbytes
    return out


def _header_sha(path: str, data_start: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(data_start)).hexdigest()


def _sources(index, layers: list[TrunkLayer]) -> dict[str, dict]:
    by_name = {os.path.basename(p): p for p in index.shards()}
    out = {}
    for name in sorted({L.shard for L in layers}):
        p = by_name[name]
        h = index.shard_header(p)
        out[name] = {"size": h.file_size, "header_sha256": _header_sha(p, h.data_start)}
    return out


def _sample_offsets(run_nbytes: int) -> list[int]:
    """Offsets (within a run) of the blocks whose hash identifies the run's bytes."""
    blk = min(SAMPLE_BLOCK, run_nbytes)
    last = run_nbytes - blk
    if last <= 0:
        return [0]
    return sorted({last * k // (SAMPLE_COUNT - 1) for k in range(SAMPLE_COUNT)})


def _sample_hash(fd: int, base: int, run_nbytes: int) -> str:
    """SHA-256 of the sample blocks of a run that starts at ``base`` in the open file."""
    h = hashlib.sha256()
    blk = min(SAMPLE_BLOCK, run_nbytes)
    for o in _sample_offsets(run_nbytes):
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


# ======================================================================== packed trunk
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

    @property
    def total_bytes(self) -> int:
        return sum(L.nbytes for L in self.layers)

    @classmethod
    def open(cls, trunk_dir, cfg, index: CheckpointIndex, verify_samples: bool = True) -> "PackedTrunk":
        """Open and verify ``trunk_dir`` against the checkpoint ``index`` read with ``cfg``.

        Refuses (CheckpointError, exit 3) a missing or unreadable trunk.json, a trunk from
        an interrupted pack, a config fingerprint, source shard size/header, layer layout
        or tensor list that differs from this checkpoint, a truncated or oversized
        trunk.bin, and (``verify_samples``) sample blocks whose bytes differ between the
        shard, trunk.bin and what was recorded when packing."""
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
        try:
            meta = json.loads(Path(jpath).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{jpath} cannot be read as JSON ({e}). {redo}") from None

        def stale(why: str) -> CheckpointError:
            return CheckpointError(
                f"The packed trunk in {d} does not belong to the checkpoint in {model}: {why}. It is stale "
                f"(the checkpoint or config changed since it was packed) or was packed from another model. {redo}")

        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{jpath} is not a k3 packed-trunk description (format != {FORMAT!r}). {redo}")
        if meta.get("version") != VERSION:
            raise CheckpointError(f"{jpath} is packed-trunk format version {meta.get('version')!r}; this k3 "
                                  f"reads version {VERSION}. {redo}")
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
            raise stale(f"this checkpoint's layer layout cannot be packed ({e})") from None
        by_name = {os.path.basename(p): p for p in index.shards()}
        src = meta.get("source")
        if not isinstance(src, dict):
            raise stale("trunk.json has no source table")
        for name in sorted({L.shard for L in expect} | set(src)):
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
        got = meta.get("layers")
        if not isinstance(got, list) or len(got) != len(expect):
            raise stale("its layer table does not have one entry per layer")
        for L, g in zip(expect, got):
            if not isinstance(g, dict):
                raise stale(f"layer {L.layer}'s entry is malformed")
            e = L.to_json()
            for k in ("layer", "shard", "run_start", "run_nbytes", "nbytes", "file_off"):
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
        fds: dict[str, int] = {}
        try:
            tfd = os.open(self.path, os.O_RDONLY)
            for L, g in zip(self.layers, got):
                want = (g.get("sample") or {}).get("sha256")
                if not want:
                    raise stale(f"layer {L.layer} has no sample hash")
                p = by_name[L.shard]
                if p not in fds:
                    fds[p] = os.open(p, os.O_RDONLY)
                if _sample_hash(fds[p], L.run_start, L.run_nbytes) != want:
                    raise stale(f"the bytes of layer {L.layer} in {L.shard} differ from the ones packed")
                if _sample_hash(tfd, L.file_off, L.run_nbytes) != want:
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


# ============================================================================ packing
class _Progress:
    """Layers done, GB, GB/s: a rich bar on a terminal, plain lines otherwise."""

    def __init__(self, mode, n_layers: int, total: int, start_bytes: int = 0, start_layers: int = 0):
        self.say: Callable[[str], None] = lambda msg: None
        self.bar = None
        self.total, self.n = total, n_layers
        self.done, self.layers = start_bytes, start_layers
        self.t0 = time.perf_counter()
        self.b0 = start_bytes
        if callable(mode):
            self.say = mode
        elif mode is None or mode is True:
            if sys.stderr.isatty():
                try:
                    from rich.console import Console
                    from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                                               TimeRemainingColumn)

                    self.bar = Progress(
                        TextColumn("pack-trunk"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.fields[layers]}"), TextColumn("{task.fields[gb]}"),
                        TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                        console=Console(stderr=True), transient=False)
                    self.task = self.bar.add_task("pack", total=total, completed=start_bytes,
                                                  layers=f"layers {start_layers}/{n_layers}",
                                                  gb=f"{_gb(start_bytes)}/{_gb(total)} GB", rate="")
                    self.bar.start()
                except ImportError:  # pragma: no cover - rich is a dependency
                    self.bar = None
            if self.bar is None:
                self.say = lambda msg: print(msg, file=sys.stderr, flush=True)

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return (self.done - self.b0) / dt / 1e9 if dt > 0 else 0.0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, gb=f"{_gb(self.done)}/{_gb(self.total)} GB",
                            rate=f"{self.rate():.2f} GB/s")

    def layer_done(self, i: int, nbytes: int) -> None:
        self.layers += 1
        if self.bar is not None:
            self.bar.update(self.task, layers=f"layers {self.layers}/{self.n}")
        else:
            self.say(f"  layer {i}: {_gb(nbytes)} GB | {self.layers}/{self.n} layers, {_gb(self.done)} of "
                     f"{_gb(self.total)} GB, {self.rate():.2f} GB/s")

    def message(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.console.print(msg, markup=False, highlight=False)
        else:
            self.say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Writer:
    """Aligned writes to trunk.bin.partial: O_DIRECT when the file system takes it."""

    def __init__(self, path: str, resume_at: int | None):
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if resume_at is None:
            flags |= os.O_TRUNC
        self.direct = False
        self.fd = -1
        if hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                self.fd = -1
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        if resume_at is not None:
            os.ftruncate(self.fd, resume_at)

    def write(self, mv: memoryview, off: int) -> None:
        done = 0
        while done < len(mv):
            try:
                n = os.pwritev(self.fd, [mv[done:]], off + done)
            except OSError as e:
                if e.errno == 22 and self.direct and done == 0:  # EINVAL: O_DIRECT refused for I/O
                    self._go_buffered()
                    continue
                raise
            if n <= 0:
                raise OSError(28, "short write")
            done += n
            if n % ALIGN and self.direct and done < len(mv):
                self._go_buffered()

    def _go_buffered(self) -> None:
        import fcntl

        fl = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
        self.direct = False

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _copy_layer(reader: ShardFiles, src: str, L: TrunkLayer, w: _Writer, rbufs, wbuf, pool, prog: _Progress) -> None:
    """Copy one run into trunk.bin at L.file_off, padded with zeros to L.nbytes."""
    chunks = [(o, min(COPY_CHUNK, L.run_nbytes - o)) for o in range(0, L.run_nbytes, COPY_CHUNK)]

    def read(k):
        o, n = chunks[k]
        return reader.read_direct(src, L.run_start + o, n, out=rbufs[k % 2])

    fut = pool.submit(read, 0)
    for k, (o, n) in enumerate(chunks):
        payload = fut.result()
        if k + 1 < len(chunks):
            fut = pool.submit(read, k + 1)  # the other buffer: read ahead while this one is written
        m = _align_up(n)
        wbuf[:n] = payload
        wbuf[n:m] = 0
        w.write(memoryview(wbuf)[:m], L.file_off + o)
        prog.advance(n)


def pack_trunk(model_dir, out_dir, progress=None, *, config_path=None, force: bool = False,
               restart: bool = False) -> Path:
    """Pack the checkpoint's dense trunk into ``out_dir`` (trunk.bin + trunk.json).

    ``progress``: None (a rich bar on a terminal stderr, plain lines otherwise),
    False (silent) or a callable receiving plain lines. An interrupted pack resumes by
    layer on the next call (``restart`` starts over); a complete trunk that matches the
    checkpoint is kept as it is (``force`` re-packs). Returns ``out_dir``."""
    from ..config import load_config

    cfg = load_config(config_path if config_path is not None else Path(model_dir))
    index = CheckpointIndex.open(model_dir)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    d = str(out)
    jpath, bpath = os.path.join(d, TRUNK_JSON), os.path.join(d, TRUNK_BIN)
    ppath, prpath = os.path.join(d, PARTIAL), os.path.join(d, PROGRESS)
    say_early = (lambda m: None) if progress is False else (progress if callable(progress) else
                                                            (lambda m: print(m, file=sys.stderr, flush=True)))

    layers = _plan_layout(cfg, index)
    doc = _plan_doc(cfg, index, layers)
    sha = _doc_sha(doc)
    total = doc["total_bytes"]

    if os.path.isfile(jpath) and not force:
        try:
            PackedTrunk.open(d, cfg, index)
            say_early(f"pack-trunk: {d} already holds this checkpoint's trunk ({_gb(total)} GB); nothing to do "
                      "(--force re-packs)")
            return out
        except CheckpointError:
            pass
    # From here on the directory must not look complete.
    _unlink(jpath)
    fsync_dir(d)
    if os.path.isfile(bpath) and not os.path.exists(ppath) and os.path.isfile(prpath) and not restart:
        os.replace(bpath, ppath)  # killed between the rename and trunk.json: finish that pack
    _unlink(bpath)

    start = 0
    if not restart and os.path.isfile(ppath) and os.path.isfile(prpath):
        try:
            prog_doc = json.loads(Path(prpath).read_text(encoding="utf-8"))
            if prog_doc.get("plan_sha256") == sha:
                k = int(prog_doc.get("layers_done", 0))
                samples = prog_doc.get("samples", [])
                if 0 < k <= len(layers) and len(samples) == k and \
                        os.path.getsize(ppath) >= layers[k - 1].file_off + layers[k - 1].nbytes:
                    start = k
        except (OSError, ValueError, TypeError, AttributeError):
            start = 0
    samples = prog_doc["samples"][:start] if start else []
    if start == 0:
        _unlink(prpath)
    resume_at = layers[start - 1].file_off + layers[start - 1].nbytes if start else None

    need = total - (resume_at or 0)
    free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
    if need > free:
        raise UsageError(
            f"pack-trunk: the packed trunk needs {_gb(need)} GB more but {d} has {_gb(free)} GB free. Free space "
            "or choose another output directory.")

    by_name = {os.path.basename(p): p for p in index.shards()}
    reader = ShardFiles()
    w = _Writer(ppath, resume_at)
    rbufs = [aligned_empty(COPY_CHUNK + 2 * ALIGN) for _ in range(2)]
    wbuf = aligned_empty(COPY_CHUNK)
    prog = _Progress(progress if progress is not False else (lambda m: None), len(layers), total,
                     resume_at or 0, start)
    t0 = time.perf_counter()
    try:
        if start:
            prog.message(f"pack-trunk: resuming at layer {start} of {len(layers)} ({_gb(resume_at)} GB already "
                         f"packed in {PARTIAL})")
        else:
            prog.message(f"pack-trunk: {len(layers)} layers, {_gb(total)} GB from {index.model_dir} -> {bpath}")
        with ThreadPoolExecutor(1, thread_name_prefix="k3-pack-read") as pool:
            rfd = os.open(ppath, os.O_RDONLY)
            try:
                for L in layers[start:]:
                    src = by_name[L.shard]
                    _copy_layer(reader, src, L, w, rbufs, wbuf, pool, prog)
                    w.sync()
                    h = _sample_hash(rfd, L.file_off, L.run_nbytes)
                    sfd = reader.fd(src)
                    if _sample_hash(sfd, L.run_start, L.run_nbytes) != h:
                        raise ReadError(f"pack-trunk: layer {L.layer}'s copy in {ppath} differs from its bytes in "
                                        f"{src} (the source changed while packing, or the disk returned bad data). "
                                        "Re-run `k3 pack-trunk` with --restart.")
                    samples.append({"block": min(SAMPLE_BLOCK, L.run_nbytes),
                                    "offsets": _sample_offsets(L.run_nbytes), "sha256": h})
                    _write_json_atomic(prpath, {"plan_sha256": sha, "layers_done": L.layer + 1, "samples": samples})
                    prog.layer_done(L.layer, L.run_nbytes)
            finally:
                os.close(rfd)
        w.sync()
    except OSError as e:  # writing or re-reading the output (reads of the shards raise ReadError)
        raise K3Error(
            f"pack-trunk: writing the packed trunk in {d} failed: {e.strerror or e}. The layers packed so far "
            "are kept; fix the cause (disk space, permissions) and re-run the same command to resume.") from None
    finally:
        w.close()
        reader.close()
        prog.close()
    for entry, s in zip(doc["layers"], samples):
        entry["sample"] = s
    os.replace(ppath, bpath)
    fsync_dir(d)
    _write_json_atomic(jpath, doc)
    fsync_dir(d)
    _unlink(prpath)
    dt = time.perf_counter() - t0
    copied = total - (resume_at or 0)
    (say_early)(f"pack-trunk: wrote {bpath} ({_gb(total)} GB, {len(layers)} layers) in {dt:.1f} s "
                f"({copied / max(dt, 1e-9) / 1e9:.2f} GB/s) and {jpath}")
    return out


# ============================================================================ planning
@dataclass
class TrunkPlan:
    pinned: list[int]
    ring_slots: int
    slot_bytes: int
    pinned_bytes: int
    total_bytes: int
    message: str | None = None
    order: str = "largest"
    budget_bytes: int = 0
    arena_bytes: int = 0  # the ring's memory: every budget byte not pinned (>= ring_slots x slot_bytes)

    @property
    def used_bytes(self) -> int:
        """Bytes of buffers this plan allocates: pinned layers + the ring arena."""
        return self.pinned_bytes + self.arena_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes read per pass over the layers once the pinned layers are in."""
        return self.total_bytes - self.pinned_bytes

    def describe(self, n_layers: int | None = None) -> str:
        n = n_layers if n_layers is not None else (max(self.pinned, default=-1) + 1)
        if not self.ring_slots:
            return f"trunk: all {len(self.pinned)} layers pinned ({_gb(self.pinned_bytes)} GB), no ring"
        how = "LARGEST FIRST" if self.order == "largest" else "as a PREFIX"
        spare = self.arena_bytes - self.ring_slots * self.slot_bytes
        extra = f" + {human(spare)} of read-ahead" if spare >= ALIGN else ""
        return (f"trunk: pinned {len(self.pinned)}/{n} layers {how} ({_gb(self.pinned_bytes)} GB), ring "
                f"{self.ring_slots} slot{'s' if self.ring_slots != 1 else ''} x {_gb(self.slot_bytes)} GB (sized to "
                f"the largest UNPINNED layer){extra}; {_gb(self.streamed_bytes)} GB read per token")


def _order(a: list[int], order: str) -> list[int]:
    if order == "largest":
        return sorted(range(len(a)), key=lambda j: (-a[j], j))
    return list(range(len(a)))


def _min_cost_largest(a: list[int], k: int) -> int:
    """Smallest budget that holds some pinned set plus k slots (slot = largest unpinned)."""
    best = None
    for s in set(a):
        c = sum(x for x in a if x > s) + k * s
        best = c if best is None else min(best, c)
    return best


def _min_cost_prefix(a: list[int], k: int) -> int:
    best, pref = None, 0
    suffix_max = [0] * (len(a) + 1)
    for j in range(len(a) - 1, -1, -1):
        suffix_max[j] = max(a[j], suffix_max[j + 1])
    for m in range(len(a)):  # pin a[:m], stream the rest
        c = pref + k * suffix_max[m]
        best = c if best is None else min(best, c)
        pref += a[m]
    return best


def min_budget_for(layer_bytes: list[int], slots: int, order: str = "largest") -> int:
    """The smallest trunk budget for which :func:`plan_trunk` can keep ``slots`` ring slots."""
    a = [_align_up(x) for x in layer_bytes]
    return (_min_cost_largest if order == "largest" else _min_cost_prefix)(a, slots)


def _pin_prefix(a: list[int], B: int, k: int) -> list[int] | None:
    """Longest prefix 0..m-1 that fits with k slots sized to the largest layer after it."""
    n = len(a)
    suffix_max = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        suffix_max[j] = max(a[j], suffix_max[j + 1])
    best, pref = None, 0
    for m in range(n):  # m < n: at least one layer streams
        if pref + k * suffix_max[m] <= B:
            best = m
        pref += a[m]
    return None if best is None else list(range(best))


def _pin_largest(a: list[int], B: int, k: int) -> list[int] | None:
    """Largest-first pinning with k slots; None if k slots cannot fit.

    For each candidate slot size s (a layer size), every layer larger than s is pinned
    (the slot must hold every unpinned layer), then the remaining layers are tried in
    order of size (ties: lower index first), each pinned when the plan — with the slot
    re-sized to the largest layer still unpinned — stays within the budget; a layer that
    does not fit is skipped and smaller ones are still tried. Passes repeat until
    nothing more fits (the fixed point). The candidate pinning the most bytes wins."""
    n = len(a)
    order = _order(a, "largest")
    best, best_key = None, None
    for s in sorted(set(a), reverse=True):
        pinned = [False] * n
        pin_sum = 0
        counts: dict[int, int] = {}
        for j in range(n):
            if a[j] > s:
                pinned[j] = True
                pin_sum += a[j]
            else:
                counts[a[j]] = counts.get(a[j], 0) + 1
        if not counts:
            continue
        sizes = sorted(counts, reverse=True)  # distinct unpinned sizes, largest first
        if pin_sum + k * sizes[0] > B:
            continue
        changed = True
        while changed:
            changed = False
            for j in order:
                if pinned[j]:
                    continue
                x = a[j]
                slot = sizes[0]
                if x == slot and counts[x] == 1:
                    if len(sizes) == 1:
                        continue  # the last unpinned layer: pinning it means no ring at all
                    new_slot = sizes[1]
                else:
                    new_slot = slot
                if pin_sum + x + k * new_slot <= B:
                    pinned[j] = True
                    pin_sum += x
                    counts[x] -= 1
                    if not counts[x]:
                        del counts[x]
                        sizes.remove(x)
                    changed = True
        used = pin_sum + k * sizes[0]
        key = (pin_sum, sum(pinned), -used)
        if best_key is None or key > best_key:
            best, best_key = [j for j in range(n) if pinned[j]], key
    return best


def plan_trunk(layer_bytes: list[int], budget_bytes: int, ring: int = 2, order: str = "largest") -> TrunkPlan:
    """Choose the pinned layers and the ring within ``budget_bytes`` (pure function).

    Layer sizes are rounded up to 4096. If the whole trunk fits, every layer is pinned
    and there is no ring. Otherwise the ring has ``ring`` uniform slots, each the size
    of the largest *unpinned* layer, or fewer (at least 1) when the budget cannot pay
    for them — then ``message`` says so with the budget that would (the C engine's ring
    message). Within the slots chosen, layers are pinned largest first (``order=
    "largest"``; ties by lower index; pinning the largest layers also shrinks the
    slot) or as the longest prefix that fits (``order="prefix"``, v1.0.0 behaviour).
    The result is a fixed point: the slot is the largest unpinned layer and no further
    layer can be pinned within the budget. Raises K3Error (exit 1) if not even one
    slot fits."""
    if order not in ("largest", "prefix"):
        raise ValueError(f"order must be 'largest' or 'prefix', got {order!r}")
    if ring < 1:
        raise ValueError(f"ring must be >= 1, got {ring}")
    if any(x < 0 for x in layer_bytes):
        raise ValueError("layer sizes must be >= 0")
    a = [_align_up(int(x)) for x in layer_bytes]
    B = int(budget_bytes)
    total = sum(a)
    if total <= B:
        return TrunkPlan(list(range(len(a))), 0, 0, total, total, None, order, B)
    pin = _pin_largest if order == "largest" else _pin_prefix
    for k in range(ring, 0, -1):
        pinned = pin(a, B, k)
        if pinned is not None:
            break
    else:
        need = min_budget_for(a, 1, order)
        raise K3Error(
            f"The trunk budget of {_gb(B)} GB cannot hold even one ring slot: the largest layer is "
            f"{_gb(max(a))} GB and streaming needs a slot for the largest layer that is not pinned "
            f"(at least {_gb_up(need)} GB in all with {order} pinning). Raise --trunk-gb to at least "
            f"{_gb_up(need)} GB.")
    ps = set(pinned)
    slot = max(a[j] for j in range(len(a)) if j not in ps)
    pinned_bytes = sum(a[j] for j in pinned)
    msg = None
    if k < ring:
        if k == 1:
            x = min_budget_for(a, 2, order)
            msg = (f"ring held at 1 slot: a second slot needs {_gb_up(x)} GB and the trunk budget is {_gb(B)} GB, "
                   f"so the next layer is read ahead only into the {human(max(0, B - pinned_bytes - slot))} beside "
                   f"that slot while a layer computes (compute still overlaps the reading of its own layer, tensor "
                   f"by tensor). Raise --trunk-gb above {_gb_up(x)} GB to enable it.")
        else:
            x = min_budget_for(a, ring, order)
            msg = (f"ring held at {k} slots: {ring} slots need {_gb_up(x)} GB and the trunk budget is {_gb(B)} GB. "
                   f"Raise --trunk-gb above {_gb_up(x)} GB to enable them.")
    arena = max(k * slot, (B - pinned_bytes) // ALIGN * ALIGN)
    return TrunkPlan(sorted(pinned), k, slot, pinned_bytes, total, msg, order, B, arena)


# =========================================================================== streaming
class _Inst:
    """One read of one layer: where its bytes live, which chunks have arrived, who holds it.

    ``parts`` maps the layer's run onto memory: ``(lo, hi, pos)`` says run bytes
    ``[lo, hi)`` live at ``buf[pos : pos + hi - lo]``. A ring layer has one part, or two
    when it wraps round the arena's end (split at a tensor boundary, so every tensor
    stays contiguous; the two parts may share one 4 KiB page, read into both).
    ``chunks`` are the read requests, in run order; run bytes ``[0, ready_to)`` are
    readable once every chunk before them has arrived."""

    __slots__ = ("layer", "pinned", "buf", "parts", "chunks", "done", "prefix", "ready_to", "inflight",
                 "error", "refs", "views", "dropped")

    def __init__(self, layer: int, pinned: bool, buf: np.ndarray, parts, chunk_bytes: int):
        self.layer = layer
        self.pinned = pinned
        self.buf = buf
        self.parts = parts
        self.chunks = [(o, min(o + chunk_bytes, hi), pos + o - lo)
                       for lo, hi, pos in parts for o in range(lo, hi, chunk_bytes)]
        self.done = [False] * len(self.chunks)
        self.prefix = 0  # chunks[:prefix] have all arrived
        self.ready_to = 0
        self.inflight = 0
        self.error: BaseException | None = None
        self.refs = 0
        self.views: dict[str, torch.Tensor] = {}
        self.dropped = False  # cancelled or failed: its memory is free once nothing is in flight

    @property
    def complete(self) -> bool:
        return self.prefix == len(self.chunks)

    @property
    def regions(self) -> list[tuple[int, int]]:
        """Arena byte ranges [a, b) this layer occupies (none for a pinned buffer)."""
        return [] if self.pinned else [(pos, pos + hi - lo) for lo, hi, pos in self.parts]


def _overlaps(r: list[tuple[int, int]], s: list[tuple[int, int]]) -> bool:
    return any(a < d and c < b for a, b in r for c, d in s)


class _LayerView(Mapping):
    """Layer i's tensors by name, handed out before the layer has arrived: looking one up
    waits until the bytes it spans are read (compute on the first tensors overlaps the
    reading of the rest). Valid until ``release_layer(i)``."""

    __slots__ = ("_s", "_inst", "_specs")

    def __init__(self, streamer: "TrunkStreamer", inst: _Inst, specs: dict):
        self._s, self._inst, self._specs = streamer, inst, specs

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._inst.views.get(name)
        if v is None:
            t = self._specs[name]  # KeyError for an unknown name, as a dict would
            v = self._s._view(self._inst, name, t)
        return v

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


class TrunkStreamer:
    """Layer tensors from a packed trunk within ``budget_bytes`` (see the module docstring).

    Memory: the pinned layers (one buffer each, read on first use and kept) and one
    ring *arena* of everything else the budget allows (at least ``plan.ring_slots``
    slots of the largest unpinned layer). A scheduler thread walks the layers in forward
    order from the caller's position (wrapping to layer 0 for the next token), places
    each unpinned layer in the arena right after the previous one (wrapping round its
    end at a tensor boundary) and issues its reads as ``chunk_bytes`` O_DIRECT requests,
    ``io_threads`` in flight at once across layer boundaries, so the device never waits
    for a layer's last chunk before starting the next. It reads ahead as far as the
    arena allows: bytes of a layer being read, or handed to the caller and not yet
    released, are never overwritten.

    ``layer(i)`` returns at once with a mapping whose lookups wait for the tensor's
    bytes, so compute starts on a layer's first tensors while its last ones are still
    on their way: even a one-slot ring overlaps reads with compute inside a layer, and
    spare arena bytes beyond one layer let the next layer's reads start before the
    current one is released. Tensors are views into the buffers, valid until
    ``release_layer(i)``. ``n_layers`` limits the walk to the first layers
    (``--layers``). Not for concurrent callers: one forward at a time."""

    def __init__(self, packed: PackedTrunk, budget_bytes: int, ring: int = 2, order: str = "largest",
                 io_threads: int = 4, reader: ShardFiles | None = None, *, n_layers: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK):
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
        self.packed = packed
        self.n = packed.n_layers if n_layers is None else int(n_layers)
        if not 1 <= self.n <= packed.n_layers:
            raise ValueError(f"n_layers must be in 1..{packed.n_layers}")
        self.plan = plan_trunk(packed.layer_bytes[: self.n], budget_bytes, ring, order)
        self.io_threads = io_threads
        self.chunk_bytes = chunk_bytes
        self._own_reader = reader is None
        self.reader = reader if reader is not None else ShardFiles()
        self._pinned = set(self.plan.pinned)
        self._arena_bytes = self.plan.arena_bytes
        self._arena = aligned_empty(self._arena_bytes) if self._arena_bytes else None
        # (off, end) of each layer's tensors in run order: where a wrap may split it
        self._bounds = [sorted((t.off, t.off + t.nbytes) for t in packed.layers[i].tensors.values())
                        for i in range(self.n)]
        self._pin: dict[int, _Inst] = {}  # pinned layer -> its (complete or in-flight) read
        self._live: dict[int, _Inst] = {}  # ring layer -> instance scheduled for the walk
        self._cache: dict[int, _Inst] = {}  # released ring layers whose bytes are still intact
        self._dropped: list[_Inst] = []  # cancelled/failed, waiting for reads in flight
        self._head = 0  # arena offset after the latest placement
        self._next = 0  # next layer the scheduler places
        self._cursor = 0  # layer the caller asked for last
        self._blocked: int | None = None  # a layer that cannot be placed around held layers
        self._fatal: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._sem = threading.Semaphore(io_threads)
        # statistics
        self._binds = self._hits = self._misses = self._reads = self._splits = 0
        self._bytes = self._device_bytes = 0
        self._wait_s = self._busy_s = 0.0
        self._active = 0
        self._busy_t0 = 0.0
        self._layer_reads = [0] * self.n
        self._pool = (ThreadPoolExecutor(io_threads, thread_name_prefix="k3-trunk-io")
                      if io_threads > 1 else None)
        self._thread = threading.Thread(target=self._run, name="k3-trunk-reader", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- placement
    def _candidates(self, j: int) -> list[list[tuple[int, int, int]]]:
        """Ways to lay layer j's run into the arena, best first: whole right after the
        previous layer; split across the arena's end at a tensor boundary (the tail part
        at offset 0 must end before the head part starts); whole right after any layer
        now scheduled (a way round a layer the caller holds out of turn); whole at 0."""
        R, N, h = self._arena_bytes, self.packed.layers[j].nbytes, self._head
        out = []
        if h + N <= R:
            out.append([(0, N, h)])
        elif h < R:
            best = None
            b = self._bounds[j]
            for k in range(1, len(b)):  # tensors b[:k] before the arena's end, b[k:] from 0
                a_end = _align_up(b[k - 1][1])
                if a_end > R - h:
                    break
                w = b[k][0] // ALIGN * ALIGN
                if N - w <= h:
                    best = (a_end, w)
            if best is not None:
                out.append([(0, best[0], h), (best[1], N, 0)])
        for inst in self._live.values():
            for _, e in inst.regions:
                if e + N <= R:
                    out.append([(0, N, e)])
        out.append([(0, N, 0)])
        return out

    def _obstacles(self) -> list[tuple[int, int]]:
        """Arena ranges a placement must avoid: those held by the caller for a layer other
        than the one it is on (they may never be released in this walk)."""
        regs = []
        for inst in self._live.values():
            if inst.refs and inst.layer != self._cursor:
                regs += inst.regions
        return regs

    def _in_use(self, me: _Inst, a: int, b: int) -> _Inst | None:
        """Another read's layer occupying arena bytes [a, b): scheduled, held, or still
        being written into. Its bytes must not be overwritten yet."""
        for inst in list(self._live.values()) + self._dropped:
            if inst is not me and _overlaps([(a, b)], inst.regions):
                return inst
        return None

    def _next_job(self) -> _Inst | None:
        """The next read to issue, placed and registered, or None (nothing to do now)."""
        for _ in range(self.n):
            j = self._next
            if j in self._pinned:
                inst = self._pin.get(j)
                if inst is not None:  # read or being read: pinned layers stay
                    self._next = (j + 1) % self.n
                    continue
                L = self.packed.layers[j]
                try:
                    buf = aligned_empty(L.nbytes)
                except MemoryError:
                    inst = _Inst(j, True, None, [], self.chunk_bytes)
                    inst.error = K3Error(
                        f"trunk: cannot allocate {_gb(L.nbytes)} GB to pin layer {j}; the machine has less "
                        "free memory than the trunk budget assumed. Lower --trunk-gb.")
                    self._pin[j] = inst
                    return None
                inst = _Inst(j, True, buf, [(0, L.nbytes, 0)], self.chunk_bytes)
                self._pin[j] = inst
                self._next = (j + 1) % self.n
                return inst
            if j in self._live:  # its previous read is still in use: wait for the release
                return None
            if j in self._cache:  # released but intact: a read saved
                self._live[j] = self._cache.pop(j)
                self._next = (j + 1) % self.n
                continue
            stale = self._obstacles()
            place = next((c for c in self._candidates(j)
                          if not _overlaps([(p, p + hi - lo) for lo, hi, p in c], stale)), None)
            if place is None:
                self._blocked = j
                return None
            regs = [(p, p + hi - lo) for lo, hi, p in place]
            for k in [k for k, c in self._cache.items() if _overlaps(regs, c.regions)]:
                del self._cache[k]  # overwritten
            inst = _Inst(j, False, self._arena, place, self.chunk_bytes)
            self._splits += len(place) > 1
            self._live[j] = inst
            lo, hi, p = place[-1]
            self._head = p + hi - lo
            self._next = (j + 1) % self.n
            return inst
        return None

    # ---------------------------------------------------------------- the reader
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # pragma: no cover - a bug: make the caller raise, never hang
            with self._cond:
                self._fatal = e
                self._cond.notify_all()

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while True:
                    if self._closed:
                        return
                    inst = self._next_job()
                    if inst is not None:
                        break
                    cond.wait()
            for ci, (lo, hi, pos) in enumerate(inst.chunks):
                self._sem.acquire()
                with cond:
                    # A chunk goes out once the layers before it have left its arena bytes
                    # (the first chunks of a layer usually can: read-ahead into spare bytes).
                    while not (inst.dropped or self._closed) and not inst.pinned:
                        other = self._in_use(inst, pos, pos + hi - lo)
                        if other is None:
                            break
                        n, c = self.n, self._cursor
                        skipped = (other.layer - c) % n > (inst.layer - c) % n
                        if not other.refs and self._live.get(other.layer) is other and skipped:
                            self._drop(other)  # read ahead for a layer the caller skipped: its turn is next pass
                            continue
                        if other.refs and other.layer != self._cursor:  # held out of turn
                            if not inst.refs:  # not handed out yet: place it again, around that layer
                                self._drop(inst)
                                self._next = inst.layer
                                break
                            self._blocked = inst.layer  # the caller waits on it: tell the caller
                        cond.wait()
                    if inst.dropped or self._closed:
                        self._sem.release()
                        break
                    inst.inflight += 1
                    if not self._active:
                        self._busy_t0 = time.perf_counter()
                    self._active += 1
                if self._pool is None:
                    self._chunk(inst, ci)
                else:
                    self._pool.submit(self._chunk, inst, ci)

    def _chunk(self, inst: _Inst, ci: int) -> None:
        lo, hi, pos = inst.chunks[ci]
        L = self.packed.layers[inst.layer]
        err = None
        try:
            self.reader.read_direct(self.packed.path, L.file_off + lo, hi - lo, out=inst.buf[pos : pos + hi - lo])
        except ReadError as e:
            err = ReadError(f"Reading layer {inst.layer} of the packed trunk ({L.nbytes} bytes at offset "
                            f"{L.file_off} of {self.packed.path}) failed: {e}")
        except OSError as e:
            err = ReadError(
                f"Reading layer {inst.layer} of the packed trunk ({L.nbytes} bytes at offset {L.file_off} of "
                f"{self.packed.path}) failed: {e.strerror or e}. The weights of this run are incomplete, so its "
                "output is invalid; check the disk and re-run.")
        except BaseException as e:  # pragma: no cover - handed to the caller, never swallowed
            err = e
        with self._cond:
            self._active -= 1
            if not self._active:
                self._busy_s += time.perf_counter() - self._busy_t0
            inst.inflight -= 1
            if err is not None:
                if inst.error is None:
                    inst.error = err
                inst.dropped = True
            else:
                self._device_bytes += hi - lo
                inst.done[ci] = True
                while inst.prefix < len(inst.chunks) and inst.done[inst.prefix]:
                    inst.ready_to = max(inst.ready_to, inst.chunks[inst.prefix][1])
                    inst.prefix += 1
                if inst.complete and not inst.dropped:
                    self._reads += 1
                    self._layer_reads[inst.layer] += 1
                    self._bytes += L.nbytes
            if inst.dropped and not inst.inflight and inst in self._dropped:
                self._dropped.remove(inst)
            self._cond.notify_all()
        self._sem.release()

    # ---------------------------------------------------------------- helpers
    def _drop(self, inst: _Inst) -> None:
        """Forget a ring instance (cancelled or failed); its memory is reused once no read
        into it is in flight."""
        inst.dropped = True
        if self._live.get(inst.layer) is inst:
            del self._live[inst.layer]
        if inst.pinned:
            if self._pin.get(inst.layer) is inst:
                del self._pin[inst.layer]
        elif inst.inflight and inst not in self._dropped:
            self._dropped.append(inst)

    def _resync(self, i: int) -> None:
        """The caller left the walk the reader was following: drop read-ahead it does not
        hold and restart the walk at layer i."""
        for inst in list(self._live.values()):
            if inst.refs == 0 and inst.layer != i:
                if inst.complete and inst.error is None:
                    del self._live[inst.layer]
                    if not any(self._in_use(inst, a, b) for a, b in inst.regions):
                        self._cache[inst.layer] = inst
                else:
                    self._drop(inst)
        self._next = i

    def _instance(self, i: int) -> _Inst | None:
        return self._pin.get(i) if i in self._pinned else self._live.get(i)

    def _raise_for(self, inst: _Inst) -> None:
        err = inst.error
        if inst.refs:
            inst.refs -= 1
        self._drop(inst)
        self._cond.notify_all()
        raise err

    def _raise_held(self, i: int) -> None:
        held = sorted(x.layer for x in self._live.values() if x.refs and x.layer != i)
        raise K3Error(
            f"trunk ring: layer {i} ({_gb(self.packed.layers[i].nbytes)} GB) does not fit in the "
            f"{_gb(self._arena_bytes)} GB ring beside layers {held}, which are held; release_layer() each "
            "layer before asking for the next one, or raise --trunk-gb.")

    def _view(self, inst: _Inst, name: str, t: TrunkTensor) -> torch.Tensor:
        end = t.off + t.nbytes
        cond = self._cond
        with cond:
            if inst.ready_to < end or inst.error is not None:
                t0 = time.perf_counter()
                try:
                    while inst.ready_to < end or inst.error is not None:
                        if inst.error is not None:
                            self._raise_for(inst)
                        if self._closed:
                            raise K3Error("the trunk streamer was closed while a layer was awaited")
                        if self._fatal is not None:
                            raise K3Error(f"the trunk reader thread failed: {self._fatal!r}") from self._fatal
                        if inst.dropped:
                            raise K3Error(f"trunk: layer {inst.layer} was used after release_layer()")
                        if self._blocked == inst.layer:
                            self._raise_held(inst.layer)
                        cond.wait(0.5)
                finally:
                    self._wait_s += time.perf_counter() - t0
        lo, hi, pos = next(p for p in inst.parts if p[0] <= t.off and end <= p[1])
        dt = TORCH_DTYPES[t.dtype]
        a = inst.buf[pos + t.off - lo : pos + end - lo]
        if a.ctypes.data % dt.itemsize:  # never for safetensors' 8-aligned offsets
            a = a.copy()
        v = torch.from_numpy(a).view(dt).reshape(t.shape)
        inst.views[name] = v
        return v

    # ------------------------------------------------------------------------ API
    def layer(self, i: int) -> Mapping[str, torch.Tensor]:
        """Layer i's tensors as a mapping whose lookups wait for their bytes."""
        if not 0 <= i < self.n:
            raise IndexError(f"layer {i} out of range 0..{self.n - 1}")
        cond = self._cond
        with cond:
            if self._closed:
                raise K3Error("the trunk streamer is closed")
            self._binds += 1
            self._cursor = i
            self._blocked = None
            inst = self._instance(i)
            if inst is not None and inst.error is not None:
                self._misses += 1
                self._raise_for(inst)
            if inst is not None and inst.complete:
                self._hits += 1
            else:
                self._misses += 1
                if inst is None:
                    self._resync(i)  # in a forward walk this drops nothing: all before i were used
                    cond.notify_all()
                    t0 = time.perf_counter()
                    try:
                        while (inst := self._instance(i)) is None:
                            if self._closed:
                                raise K3Error("the trunk streamer was closed while a layer was awaited")
                            if self._fatal is not None:
                                raise K3Error(f"the trunk reader thread failed: {self._fatal!r}") from self._fatal
                            if self._blocked == i:
                                self._raise_held(i)
                            cond.wait(0.5)
                    finally:
                        self._wait_s += time.perf_counter() - t0
                    if inst.error is not None:
                        self._raise_for(inst)
            inst.refs += 1
            return _LayerView(self, inst, self.packed.layers[i].tensors)

    def release_layer(self, i: int) -> None:
        """The caller is done with layer i for this step (its ring bytes may be reused)."""
        with self._cond:
            inst = self._instance(i)
            if inst is not None and inst.refs > 0:
                inst.refs -= 1
                if not inst.refs and not inst.pinned and not inst.complete:
                    self._drop(inst)  # released before it was all read: nothing of it is kept
                elif not inst.refs and not inst.pinned:
                    del self._live[i]
                    inst.views = {}
                    if not any(self._in_use(inst, a, b) for a, b in inst.regions):
                        self._cache[i] = inst  # intact until a later placement takes its bytes

            if i == self._cursor:
                self._cursor = (i + 1) % self.n
            self._blocked = None
            self._cond.notify_all()

    def load_pinned(self) -> None:
        """Read every pinned layer now (instead of on first touch)."""
        for i in self.plan.pinned:
            w = self.layer(i)
            try:
                for name in w:
                    w[name]
            finally:
                self.release_layer(i)

    def stats(self) -> dict:
        with self._cond:
            busy = self._busy_s + (time.perf_counter() - self._busy_t0 if self._active else 0.0)
            wait = self._wait_s
            allocated = sum(x.buf.size for x in self._pin.values() if x.buf is not None) + self._arena_bytes
            return {
                "binds": self._binds, "hits": self._hits, "misses": self._misses,
                "hit_rate": self._hits / self._binds if self._binds else 0.0,
                "reads": self._reads, "bytes_read": self._bytes, "device_bytes": self._device_bytes,
                "device_seconds": busy, "wait_seconds": wait, "overlap_seconds": max(0.0, busy - wait),
                "device_gbps": self._device_bytes / busy / 1e9 if busy > 0 else 0.0,
                "pinned": len(self.plan.pinned), "n_layers": self.n,
                "pinned_bytes": self.plan.pinned_bytes, "ring_slots": self.plan.ring_slots,
                "slot_bytes": self.plan.slot_bytes, "arena_bytes": self._arena_bytes, "wrapped_layers": self._splits,
                "allocated_bytes": allocated,
                "io_threads": self.io_threads, "chunk_bytes": self.chunk_bytes,
                "layer_reads": list(self._layer_reads),
                "direct": self.reader.direct_active(self.packed.path),
            }

    def report(self) -> list[str]:
        """The C engine's `trunk [final]` statistics block, as lines."""
        st = self.stats()
        b = st["binds"]
        dev, wait = st["device_seconds"], st["wait_seconds"]
        lines = [
            f"trunk [final]: pinned {st['pinned']}/{st['n_layers']} layers, ring {st['ring_slots']} slot"
            f"{'s' if st['ring_slots'] != 1 else ''} ({_gb(st['arena_bytes'])} GB arena)",
            f"  binds {b}, hits {st['hits']} ({100.0 * st['hits'] / b if b else 0.0:.1f}%), reads {st['reads']}",
            f"  read {st['bytes_read'] / 1e9:.2f} GB in {dev:.2f} s of device time ({st['device_gbps'] * 1000:.0f} MB/s)",
        ]
        if dev > 0:
            hidden = max(0.0, dev - wait)
            lines.append(f"  waited {wait:.2f} s for reads; {hidden:.2f} s ({100.0 * hidden / dev:.0f}%) of device "
                         "time overlapped compute on the reader threads")
        return lines

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # every read into the buffers has finished
        if self._own_reader:
            self.reader.close()
        for inst in list(self._pin.values()) + list(self._live.values()) + list(self._cache.values()):
            inst.views = {}
        self._pin, self._live, self._cache, self._dropped = {}, {}, {}, []
        self._arena = None  # freed now unless the caller still holds tensors viewing it

    def __enter__(self) -> "TrunkStreamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            if not self._closed:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
        except Exception:
            pass


# ================================================================================= CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder (config.json, model.safetensors.index.json, shards)")
    p.add_argument("out", help="output folder for trunk.bin + trunk.json (created)")
    p.add_argument("--config", help="config.json to use instead of MODEL/config.json")
    p.add_argument("--force", action="store_true", help="re-pack even if OUT already holds this trunk")
    p.add_argument("--restart", action="store_true",
                   help="start over instead of resuming an interrupted pack")


def run(args) -> int:
    pack_trunk(args.model, args.out, None, config_path=args.config, force=args.force, restart=args.restart)
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add `k3 pack-trunk MODEL OUT` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "pack-trunk", help="pack the dense trunk into one file for streaming (trunk.bin + trunk.json)",
        description="Copy every layer's non-expert tensors into OUT/trunk.bin (one 4096-aligned run per "
                    "layer) and describe them in OUT/trunk.json. Interrupted packs resume by layer.")
    add_arguments(p)
    p.set_defaults(fn=run)
    return p


def main(argv=None) -> int:
    """`python -m k3.memory.trunk ...` is `k3 pack-trunk ...`."""
    from ..cli import main as k3_main

    return k3_main(["pack-trunk", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
