"""``k3 pack-trunk``: copy the checkpoint's dense trunk into ``trunk.bin`` + ``trunk.json``
(the format of :mod:`.format`).

Crash safety and resume: data goes to ``trunk.bin.partial``; after each layer is on disk
(``fdatasync``) ``trunk.progress.json`` records how many layers are done. ``trunk.bin``
appears by rename only when every layer is copied, and ``trunk.json`` is written last
(atomically), so a directory without ``trunk.json`` is never mistaken for a trunk. A
re-run whose plan (source shards, headers, layout) is unchanged resumes at the first
layer not recorded as done (the partial file is cut back there); otherwise it starts
from scratch. Re-packing over a complete, matching trunk is a no-op unless ``force``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ...checkpoint.io import ALIGN, ShardFiles, aligned_empty
from ...checkpoint.safetensors import CheckpointIndex
from ...errors import CheckpointError, K3Error, ReadError, UsageError
from ...fsutil import atomic_write_json, fsync_dir, read_json_file
from ...units import gb
from .format import (PARTIAL, PROGRESS, SAMPLE_BLOCK, TRUNK_BIN, TRUNK_JSON, PackedTrunk, TrunkLayer, _doc_sha,
                     _plan_doc, _plan_layout, sample_hash)

COPY_CHUNK = 64 << 20  # bytes per copy request while packing

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
                                                  gb=f"{gb(start_bytes)}/{gb(total)} GB", rate="")
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
            self.bar.update(self.task, completed=self.done, gb=f"{gb(self.done)}/{gb(self.total)} GB",
                            rate=f"{self.rate():.2f} GB/s")

    def layer_done(self, i: int, nbytes: int) -> None:
        self.layers += 1
        if self.bar is not None:
            self.bar.update(self.task, layers=f"layers {self.layers}/{self.n}")
        else:
            self.say(f"  layer {i}: {gb(nbytes)} GB | {self.layers}/{self.n} layers, {gb(self.done)} of "
                     f"{gb(self.total)} GB, {self.rate():.2f} GB/s")

    def message(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.console.print(msg, markup=False, highlight=False)
        else:
            self.say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


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


def _fill(reader: ShardFiles, paths: dict, L: TrunkLayer, w0: int, w1: int, buf, rbuf) -> None:
    """Bytes [w0, w1) of layer L's packed run into buf: its segments' bytes from the
    shards, zeros between and after them."""
    pos = w0
    for g in L.segments:
        a, b = max(w0, g.off), min(w1, g.off + g.nbytes)
        if a >= b:
            continue
        buf[pos - w0:a - w0] = 0
        buf[a - w0:b - w0] = reader.read_direct(paths[g.shard], g.src_off + a - g.off, b - a, out=rbuf)
        pos = b
    buf[pos - w0:w1 - w0] = 0


def _copy_layer(reader: ShardFiles, paths: dict, L: TrunkLayer, w: _Writer, bufs, rbuf, pool,
                prog: _Progress) -> str:
    """Copy layer L into trunk.bin at L.file_off (L.nbytes, zero-padded): windows of
    COPY_CHUNK bytes, the next one read on the pool while this one is written. Returns
    the SHA-256 of what was written."""
    h = hashlib.sha256()
    for w0, w1, buf in _windows(reader, paths, L, bufs, rbuf, pool):
        h.update(memoryview(buf)[:w1 - w0])
        w.write(memoryview(buf)[:w1 - w0], L.file_off + w0)
        prog.advance(w1 - w0)
    return h.hexdigest()


def _windows(reader: ShardFiles, paths: dict, L: TrunkLayer, bufs, rbuf, pool):
    """(w0, w1, buffer) for the COPY_CHUNK windows of layer L's packed bytes, rebuilt from
    the shards; the next window is filled on the pool while the caller uses this one."""
    windows = [(o, min(L.nbytes, o + COPY_CHUNK)) for o in range(0, L.nbytes, COPY_CHUNK)]

    def fill(k):
        _fill(reader, paths, L, *windows[k], bufs[k % 2], rbuf)
        return bufs[k % 2]

    fut = pool.submit(fill, 0)
    for k, (w0, w1) in enumerate(windows):
        buf = fut.result()
        if k + 1 < len(windows):
            fut = pool.submit(fill, k + 1)  # the other buffer: read ahead while this one is used
        yield w0, w1, buf


def verify_trunk(model_dir, out_dir, progress=None, *, config_path=None, model_dirs=()) -> list[int]:
    """Re-hash every byte of the packed trunk in ``out_dir``, rebuilt from the shards and
    read from trunk.bin, against the hashes recorded when packing. Returns the layers
    that differ (empty: all good). When all match, the shards' current identities
    (modification time, inode) are recorded, so a checkpoint that was only copied or
    touched is accepted again."""
    from ...config import load_config

    cfg = load_config(config_path if config_path is not None else Path(model_dir))
    index = CheckpointIndex.open(model_dir, model_dirs)
    d = str(Path(out_dir).resolve())
    trunk = PackedTrunk.open(d, cfg, index, verify_samples=False, check_identity=False)
    say = (lambda m: None) if progress is False else (progress if callable(progress) else
                                                       (lambda m: print(m, file=sys.stderr, flush=True)))
    paths = {os.path.basename(p): p for p in index.shards()}
    reader = ShardFiles()
    bufs = [aligned_empty(COPY_CHUNK) for _ in range(2)]
    rbuf = aligned_empty(COPY_CHUNK + 2 * ALIGN)
    bad = []
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="k3-verify-read") as pool:
            for L, entry in zip(trunk.layers, trunk.meta["layers"]):
                src = hashlib.sha256()
                for w0, w1, buf in _windows(reader, paths, L, bufs, rbuf, pool):
                    src.update(memoryview(buf)[:w1 - w0])
                packed = hashlib.sha256()
                for w0 in range(0, L.nbytes, COPY_CHUNK):
                    n = min(COPY_CHUNK, L.nbytes - w0)
                    packed.update(reader.read_direct(trunk.path, L.file_off + w0, n, out=rbuf))
                if not src.hexdigest() == packed.hexdigest() == entry["sha256"]:
                    bad.append(L.layer)
                    say(f"  layer {L.layer}: DIFFERS (shards {'match' if src.hexdigest() == entry['sha256'] else 'differ'},"
                        f" trunk.bin {'matches' if packed.hexdigest() == entry['sha256'] else 'differs'})")
    finally:
        reader.close()
    if not bad:
        meta = dict(trunk.meta)
        meta["source"] = _plan_doc(cfg, index, trunk.layers)["source"]
        atomic_write_json(os.path.join(d, TRUNK_JSON), meta, what="the packed-trunk description")
    say(f"pack-trunk --verify: {len(trunk.layers) - len(bad)} of {len(trunk.layers)} layers match "
        f"({gb(trunk.total_bytes)} GB hashed twice in {time.perf_counter() - t0:.1f} s)")
    return bad


def pack_trunk(model_dir, out_dir, progress=None, *, config_path=None, force: bool = False,
               restart: bool = False, model_dirs=()) -> Path:
    """Pack the checkpoint's dense trunk into ``out_dir`` (trunk.bin + trunk.json).

    ``progress``: None (a rich bar on a terminal stderr, plain lines otherwise),
    False (silent) or a callable receiving plain lines. An interrupted pack resumes by
    layer on the next call (``restart`` starts over); a complete trunk that matches the
    checkpoint is kept as it is (``force`` re-packs). Returns ``out_dir``."""
    from ...config import load_config

    cfg = load_config(config_path if config_path is not None else Path(model_dir))
    index = CheckpointIndex.open(model_dir, model_dirs)
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
            say_early(f"pack-trunk: {d} already holds this checkpoint's trunk ({gb(total)} GB); nothing to do "
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
            prog_doc = read_json_file(prpath, error=K3Error)
            if prog_doc.get("plan_sha256") == sha:
                k = int(prog_doc.get("layers_done", 0))
                samples = prog_doc.get("samples", [])
                if 0 < k <= len(layers) and len(samples) == k and \
                        os.path.getsize(ppath) >= layers[k - 1].file_off + layers[k - 1].nbytes:
                    start = k
        except (K3Error, ValueError, TypeError, AttributeError):  # a damaged progress record: start over
            start = 0
    samples = prog_doc["samples"][:start] if start else []
    if start == 0:
        _unlink(prpath)
    resume_at = layers[start - 1].file_off + layers[start - 1].nbytes if start else None

    need = total - (resume_at or 0)
    free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
    if need > free:
        raise UsageError(
            f"pack-trunk: the packed trunk needs {gb(need)} GB more but {d} has {gb(free)} GB free. Free space "
            "or choose another output directory.")

    by_name = {os.path.basename(p): p for p in index.shards()}
    reader = ShardFiles()
    w = _Writer(ppath, resume_at)
    bufs = [aligned_empty(COPY_CHUNK) for _ in range(2)]
    rbuf = aligned_empty(COPY_CHUNK + 2 * ALIGN)  # used by the one fill in flight
    prog = _Progress(progress if progress is not False else (lambda m: None), len(layers), total,
                     resume_at or 0, start)
    t0 = time.perf_counter()
    try:
        if start:
            prog.message(f"pack-trunk: resuming at layer {start} of {len(layers)} ({gb(resume_at)} GB already "
                         f"packed in {PARTIAL})")
        else:
            prog.message(f"pack-trunk: {len(layers)} layers, {gb(total)} GB from {index.model_dir} -> {bpath}")
        with ThreadPoolExecutor(1, thread_name_prefix="k3-pack-read") as pool:
            rfd = os.open(ppath, os.O_RDONLY)
            try:
                for L in layers[start:]:
                    full = _copy_layer(reader, by_name, L, w, bufs, rbuf, pool, prog)
                    w.sync()
                    h = sample_hash(L, lambda g: (rfd, L.file_off + g.off))
                    if sample_hash(L, lambda g: (reader.fd(by_name[g.shard]), g.src_off)) != h:
                        raise ReadError(f"pack-trunk: layer {L.layer}'s copy in {ppath} differs from its bytes in "
                                        f"{', '.join(sorted(L.shards))} (the source changed while packing, or the "
                                        "disk returned bad data). Re-run `k3 pack-trunk` with --restart.")
                    samples.append({"block": SAMPLE_BLOCK, "sha256": h, "full": full})
                    atomic_write_json(prpath, {"plan_sha256": sha, "layers_done": L.layer + 1, "samples": samples})
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
    for entry, smp in zip(doc["layers"], samples):
        entry["sample"] = {"block": smp["block"], "sha256": smp["sha256"]}
        entry["sha256"] = smp["full"]
    os.replace(ppath, bpath)
    fsync_dir(d)
    atomic_write_json(jpath, doc, what="the packed-trunk description")
    fsync_dir(d)
    _unlink(prpath)
    dt = time.perf_counter() - t0
    copied = total - (resume_at or 0)
    (say_early)(f"pack-trunk: wrote {bpath} ({gb(total)} GB, {len(layers)} layers) in {dt:.1f} s "
                f"({copied / max(dt, 1e-9) / 1e9:.2f} GB/s) and {jpath}")
    return out


