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

**Streaming** (:class:`TrunkStreamer`): ``layer(i)`` returns layer i's tensors as views
into a pinned buffer or a ring slot; a reader thread prefetches the next unpinned layers
in the forward walk (wrapping to layer 0 for the next token) into free slots, each layer
read as aligned ``O_DIRECT`` chunks by a small thread pool (``pread`` releases the GIL,
so the chunks are in flight together and the device sees a queue depth of
``io_threads``). A slot being read, held by the caller, or holding a layer the walk
needs within the next ``ring`` unpinned layers is never overwritten.
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
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..checkpoint.io import ALIGN, TORCH_DTYPES, ShardFiles, aligned_empty
from ..checkpoint.safetensors import CheckpointIndex, pread_exact
from ..errors import CheckpointError, K3Error, ReadError, UsageError
from ..fsutil import fsync_dir
from ..model.schema import alog_ok, layer_specs
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

    @property
    def used_bytes(self) -> int:
        """Bytes of buffers this plan allocates: pinned layers + ring slots."""
        return self.pinned_bytes + self.ring_slots * self.slot_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes read per pass over the layers once the pinned layers are in."""
        return self.total_bytes - self.pinned_bytes

    def describe(self, n_layers: int | None = None) -> str:
        n = n_layers if n_layers is not None else (max(self.pinned, default=-1) + 1)
        if not self.ring_slots:
            return f"trunk: all {len(self.pinned)} layers pinned ({_gb(self.pinned_bytes)} GB), no ring"
        how = "LARGEST FIRST" if self.order == "largest" else "as a PREFIX"
        return (f"trunk: pinned {len(self.pinned)}/{n} layers {how} ({_gb(self.pinned_bytes)} GB), ring "
                f"{self.ring_slots} slot{'s' if self.ring_slots != 1 else ''} x {_gb(self.slot_bytes)} GB (sized to "
                f"the largest UNPINNED layer); {_gb(self.streamed_bytes)} GB read per token")


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
                   f"so reads are NOT overlapped with compute. Raise --trunk-gb above {_gb_up(x)} GB to enable it.")
        else:
            x = min_budget_for(a, ring, order)
            msg = (f"ring held at {k} slots: {ring} slots need {_gb_up(x)} GB and the trunk budget is {_gb(B)} GB. "
                   f"Raise --trunk-gb above {_gb_up(x)} GB to enable them.")
    return TrunkPlan(sorted(pinned), k, slot, pinned_bytes, total, msg, order, B)


# =========================================================================== streaming
_EMPTY, _READING, _READY = 0, 1, 2


class _Buf:
    __slots__ = ("buf", "size", "layer", "state", "refs", "views")

    def __init__(self, buf, size: int):
        self.buf = buf  # aligned uint8 array or None (pinned: allocated on first read)
        self.size = size
        self.layer = None
        self.state = _EMPTY
        self.refs = 0
        self.views = None


class TrunkStreamer:
    """Layer tensors from a packed trunk within ``budget_bytes`` (see the module docstring).

    ``layer(i)`` blocks until layer i is resident and returns its tensors as views
    into the buffer: they are valid until ``release_layer(i)`` (a ring slot is reused
    afterwards; pinned layers stay). Reads run on one scheduler thread plus a pool of
    ``io_threads`` chunk readers. ``n_layers`` limits the walk to the first layers
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
        self._pin: dict[int, _Buf] = {i: _Buf(None, packed.layers[i].nbytes) for i in self.plan.pinned}
        self._slots = [_Buf(aligned_empty(self.plan.slot_bytes), self.plan.slot_bytes)
                       for _ in range(self.plan.ring_slots)]
        self._in_slot: dict[int, _Buf] = {}  # unpinned layer -> slot holding it (READING or READY)
        self._errors: dict[int, BaseException] = {}
        self._fatal: BaseException | None = None
        self._cursor = 0
        self._closed = False
        self._cond = threading.Condition()
        # statistics
        self._binds = self._hits = self._misses = self._reads = 0
        self._bytes = 0
        self._device_s = self._wait_s = 0.0
        self._layer_reads = [0] * self.n
        self._pool = (ThreadPoolExecutor(io_threads, thread_name_prefix="k3-trunk-io")
                      if io_threads > 1 else None)
        self._thread = threading.Thread(target=self._run, name="k3-trunk-reader", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- scheduling
    def _buf_of(self, i: int) -> _Buf | None:
        return self._pin[i] if i in self._pinned else self._in_slot.get(i)

    def _window(self) -> tuple[list[int], set[int]]:
        """Layers to have resident, in walk order from the cursor: every pinned layer not
        yet read up to the ring's reach, and the next ``ring`` unpinned layers."""
        jobs, want = [], set()
        k = len(self._slots)
        for step in range(self.n):
            j = (self._cursor + step) % self.n
            if j in self._pinned:
                if self._pin[j].state == _EMPTY:
                    jobs.append(j)
                continue
            if len(want) >= k:
                break
            want.add(j)
            jobs.append(j)
        return jobs, want

    def _claimable(self, want: set[int]) -> _Buf | None:
        """A slot that may be (re)filled: not being read, not held, not holding a layer in
        ``want``. An empty one first, else the one whose layer the walk needs last
        (Belady's choice for a known future: a spare slot then keeps the layer it
        will meet soonest, a free hit per pass)."""
        cand, dist = None, -1
        for s in self._slots:
            if s.state == _READING or s.refs or (s.layer is not None and s.layer in want):
                continue
            if s.layer is None:
                return s
            d = (s.layer - self._cursor) % self.n
            if d > dist:
                cand, dist = s, d
        return cand

    def _next_job(self):
        jobs, want = self._window()
        for j in jobs:
            if j in self._errors:
                continue
            if j in self._pinned:
                b = self._pin[j]
                if b.state != _EMPTY:
                    continue
                if b.buf is None:
                    try:
                        b.buf = aligned_empty(b.size)
                    except MemoryError:
                        self._errors[j] = K3Error(
                            f"trunk: cannot allocate {_gb(b.size)} GB to pin layer {j}; the machine has less "
                            "free memory than the trunk budget assumed. Lower --trunk-gb.")
                        continue
            else:
                if j in self._in_slot:
                    continue
                b = self._claimable(want)
                if b is None:
                    continue
                if b.layer is not None:
                    self._in_slot.pop(b.layer, None)
                self._in_slot[j] = b
            b.layer, b.state, b.views = j, _READING, None
            return j, b
        return None

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # pragma: no cover - a bug: make layer() raise, never hang
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
                    job = self._next_job()
                    if job is not None:
                        break
                    cond.wait()
            j, b = job
            t0 = time.perf_counter()
            err = None
            try:
                self._read_layer(j, b.buf)
            except BaseException as e:  # handed to the caller of layer(j), never swallowed
                err = e
            dt = time.perf_counter() - t0
            with cond:
                self._device_s += dt
                self._reads += 1
                self._layer_reads[j] += 1
                if err is None:
                    b.state = _READY
                    self._bytes += self.packed.layers[j].nbytes
                else:
                    b.state, b.layer, b.views = _EMPTY, None, None
                    if j not in self._pinned:
                        self._in_slot.pop(j, None)
                    self._errors[j] = err
                cond.notify_all()

    # ---------------------------------------------------------------------- reads
    def _read_chunk(self, off: int, n: int, out: np.ndarray) -> None:
        self.reader.read_direct(self.packed.path, off, n, out=out)

    def _read_layer(self, j: int, buf: np.ndarray) -> None:
        L = self.packed.layers[j]
        n, base = L.nbytes, L.file_off
        cs = self.chunk_bytes
        spans = [(o, min(cs, n - o)) for o in range(0, n, cs)]
        try:
            if self._pool is None or len(spans) == 1:
                for o, m in spans:
                    self._read_chunk(base + o, m, buf[o : o + m])
                return
            futs = [self._pool.submit(self._read_chunk, base + o, m, buf[o : o + m]) for o, m in spans]
            wait_futures(futs)  # every chunk finished before the buffer can be reused
            for f in futs:
                e = f.exception()
                if e is not None:
                    raise e
        except ReadError as e:
            raise ReadError(
                f"Reading layer {j} of the packed trunk ({n} bytes at offset {base} of {self.packed.path}) "
                f"failed: {e}") from e
        except OSError as e:
            raise ReadError(
                f"Reading layer {j} of the packed trunk ({n} bytes at offset {base} of {self.packed.path}) "
                f"failed: {e.strerror or e}. The weights of this run are incomplete, so its output is invalid; "
                "check the disk and re-run.") from e

    # ------------------------------------------------------------------------ API
    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's tensors (views into its buffer), once it is fully read."""
        if not 0 <= i < self.n:
            raise IndexError(f"layer {i} out of range 0..{self.n - 1}")
        cond = self._cond
        with cond:
            if self._closed:
                raise K3Error("the trunk streamer is closed")
            self._binds += 1
            self._cursor = i
            b = self._buf_of(i)
            if b is not None and b.state == _READY and b.layer == i:
                self._hits += 1
            else:
                self._misses += 1
                t0 = time.perf_counter()
                cond.notify_all()  # the scheduler re-plans around the new cursor
                try:
                    while True:
                        if i in self._errors:
                            raise self._errors.pop(i)
                        b = self._buf_of(i)
                        if b is not None and b.state == _READY and b.layer == i:
                            break
                        if self._closed:
                            raise K3Error("the trunk streamer was closed while a layer was awaited")
                        if self._fatal is not None:
                            raise K3Error(f"the trunk reader thread failed: {self._fatal!r}") from self._fatal
                        if b is None:
                            self._check_progress(i)
                        cond.wait(0.5)
                finally:
                    self._wait_s += time.perf_counter() - t0
            b.refs += 1
            if b.views is None:
                b.views = self.packed.views(i, b.buf)
            return b.views

    def _check_progress(self, i: int) -> None:
        """Layer i needs a slot: refuse if every slot is held by the caller."""
        _, want = self._window()
        if self._claimable(want) is not None or any(s.state == _READING for s in self._slots):
            return
        held = sorted(s.layer for s in self._slots if s.refs)
        raise K3Error(
            f"trunk ring: layer {i} needs a slot but all {len(self._slots)} are held (layers {held}); "
            "release_layer() each layer before asking for the next one, or use a larger ring.")

    def release_layer(self, i: int) -> None:
        """The caller is done with layer i for this step (its slot may be reused)."""
        with self._cond:
            b = self._buf_of(i)
            if b is not None and b.layer == i and b.refs > 0:
                b.refs -= 1
            if i == self._cursor:
                self._cursor = (i + 1) % self.n
            self._cond.notify_all()

    def load_pinned(self) -> None:
        """Read every pinned layer now (instead of on first touch)."""
        for i in self.plan.pinned:
            self.layer(i)
            self.release_layer(i)

    def stats(self) -> dict:
        with self._cond:
            dev, wait = self._device_s, self._wait_s
            allocated = sum(b.size for b in self._pin.values() if b.buf is not None)
            allocated += sum(s.size for s in self._slots)
            return {
                "binds": self._binds, "hits": self._hits, "misses": self._misses,
                "hit_rate": self._hits / self._binds if self._binds else 0.0,
                "reads": self._reads, "bytes_read": self._bytes,
                "device_seconds": dev, "wait_seconds": wait, "overlap_seconds": dev - wait,
                "device_gbps": self._bytes / dev / 1e9 if dev > 0 else 0.0,
                "pinned": len(self.plan.pinned), "n_layers": self.n,
                "pinned_bytes": self.plan.pinned_bytes, "ring_slots": self.plan.ring_slots,
                "slot_bytes": self.plan.slot_bytes, "allocated_bytes": allocated,
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
            f"{'s' if st['ring_slots'] != 1 else ''}",
            f"  binds {b}, hits {st['hits']} ({100.0 * st['hits'] / b if b else 0.0:.1f}%), reads {st['reads']}",
            f"  read {st['bytes_read'] / 1e9:.2f} GB in {dev:.2f} s ({st['device_gbps'] * 1000:.0f} MB/s)",
        ]
        if dev > 0:
            hidden = max(0.0, dev - wait)
            lines.append(f"  waited {wait:.2f} s for reads; {hidden:.2f} s ({100.0 * hidden / dev:.0f}%) of device "
                         "time overlapped compute on the reader thread")
        return lines

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._own_reader:
            self.reader.close()
        for b in list(self._pin.values()) + self._slots:
            b.views = None
            b.buf = None  # freed now unless the caller still holds tensors viewing it
            b.state, b.layer = _EMPTY, None

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
