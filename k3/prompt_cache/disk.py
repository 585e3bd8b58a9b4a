"""The prompt cache's disk tier: prefill snapshots on the grid, kept in a folder across
runs and processes (``--prompt-cache DIR``).

Layout: ``DIR/k3pc-<identity>/`` per checkpoint (:func:`checkpoint_identity`: its
config, tensor index and the shards' sizes and mtimes, the layers bound and the KV
form), holding two kinds of files, both in the state-file format of k3.state
(safetensors, written atomically, a sha256 of the data in the header; format
``k3-prompt-cache``):

  snap-<key(p)>.k3pc        the state after a prefill of the first p tokens, less the
                            MLA KV: ``ids`` [p] and each KDA layer's conv histories and
                            S; metadata ``segments``: the KV segments of its prefix
  kv-<key(b)>-<a>.k3pc      the MLA KV rows of positions a..b-1 (each MLA layer's k, v)
                            of the prefix of b tokens

key(p) is the sha256 of the identity and the first p tokens. The KV of a prefix is
stored once, as the segments between consecutive snapshots along it, and shared by
every snapshot on it. Names are derived from the contents, so two processes that write
the same entry write the same bytes (the rename of one replaces the other's whole);
readers verify the checksum and the tokens. Eviction (LRU by mtime, a use touches the
files) takes a lock file, so two evictors never race. Any failure is one warning and a
miss (a damaged entry is removed); a folder that cannot be written stops the writes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..version import __version__
from ..errors import K3Error
from ..model.kda_state import KDAState
from ..model.mla import MLAState
from ..model.stack import InferenceState
from ..state import (_SHA_RE, _count, _kda_shapes, _mla_shapes, _refuse, StateFileError, checksum,
                     read_state_header, read_tensors)

FORMAT = "k3-prompt-cache"
VERSION = 1
SUFFIX = ".k3pc"
_KDA = ("conv_q", "conv_k", "conv_v", "S")
STALE_SECONDS = 3600  # a write in progress (a dot-name) older than this was abandoned


def checkpoint_identity(model_dir, cfg, n_layers: int, latent: bool) -> str:
    """What an entry is valid for: the config, the tensor index, every shard's name, size
    and mtime, the layers bound and the KV form (a re-downloaded or edited shard is
    another checkpoint)."""
    d = Path(model_dir)
    h = hashlib.sha256(f"{FORMAT} {VERSION} {cfg.fingerprint()} layers={n_layers} latent={latent}".encode())
    for name in ("config.json", "model.safetensors.index.json"):
        try:
            h.update(name.encode() + b"=" + hashlib.sha256((d / name).read_bytes()).digest())
        except OSError:
            h.update(name.encode() + b"=-")
    try:
        shards = sorted(p for p in d.iterdir() if p.name.endswith(".safetensors"))
    except OSError:
        shards = []
    for p in shards:
        try:
            st = p.stat()
            h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        except OSError:
            h.update(f"|{p.name}:?".encode())
    return h.hexdigest()


def prefix_keys(identity: str, ids, positions) -> dict[int, str]:
    """key(p) for each p of ``positions``: the sha256 of the identity and ids[:p]."""
    arr = np.asarray(list(ids), dtype="<i8")
    h = hashlib.sha256(identity.encode())
    out, at = {}, 0
    for p in sorted(set(positions)):
        h.update(arr[at:p].tobytes())
        at = p
        out[p] = h.copy().hexdigest()
    return out


class DiskTier:
    """Snapshots of prefills in a folder (see the module). ``warn`` prints one warning."""

    def __init__(self, root, identity: str, cfg, n_layers: int, latent: bool, max_bytes: int, warn):
        self.root = Path(root)
        self.folder = self.root / f"k3pc-{identity[:32]}"
        self.identity, self.cfg, self.n_layers, self.latent = identity, cfg, n_layers, latent
        self.max_bytes = int(max_bytes)
        self._warn, self._warned = warn, set()
        self.writable = True
        self.reads = self.writes = self.damaged = self.evicted = 0
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._stop_writes(e)

    # ------------------------------------------------------------ warnings
    def warn_once(self, kind: str, msg: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            self._warn(msg)

    def _stop_writes(self, e) -> None:
        self.writable = False
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space" in why
        self.warn_once("write", f"warning: the prompt cache folder {self.root} cannot be written ({why}"
                                f"{'; the disk is full' if full else ''}): decoding goes on without saving "
                                "snapshots to it.")

    def _damaged(self, path: Path, why: str) -> None:
        self.damaged += 1
        self.warn_once(f"damaged:{path.name}", f"warning: ignoring a damaged prompt cache entry: {why} It is removed.")
        try:
            path.unlink()
        except OSError:
            pass

    def _snap(self, key: str) -> Path:
        return self.folder / f"snap-{key}{SUFFIX}"

    def _kv(self, key_b: str, a: int) -> Path:
        return self.folder / f"kv-{key_b}-{a}{SUFFIX}"

    # ------------------------------------------------------------ lookup
    def lookup(self, prompt, positions, capacity: int):
        """The longest snapshot among ``positions`` (grid points, each leaving enough of
        ``prompt`` to read) that is on disk and sound: (p, state, chain), or None."""
        keys = prefix_keys(self.identity, prompt, positions)
        for p in sorted(keys, reverse=True):
            path = self._snap(keys[p])
            if not path.exists():
                continue
            try:
                got = self._load(path, prompt, p, capacity)
            except StateFileError as e:
                self._damaged(path, str(e))
                continue
            except (OSError, K3Error, ValueError, RuntimeError) as e:
                self._damaged(path, f"{path}: {type(e).__name__}: {e}.")
                continue
            if got is not None:
                self.reads += 1
                return got
        return None

    def _header(self, path: Path, kind: str) -> tuple:
        meta, entries, start, size = read_state_header(path, FORMAT)
        if meta.get("version") != str(VERSION) or meta.get("kind") != kind:
            raise _refuse(path, f"it is not a version {VERSION} prompt cache {kind}; the file is damaged.")
        if meta.get("identity") != self.identity:
            raise _refuse(path, "it was written for another checkpoint; it is in the wrong folder.")
        sha = meta.get("sha256")
        if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
            raise _refuse(path, "its metadata field `sha256` is not a SHA-256 hex digest; the file is damaged.")
        return meta, entries, start, size, sha

    def _load(self, path: Path, prompt, p: int, capacity: int):
        meta, entries, start, size, sha = self._header(path, "snapshot")
        if _count(path, meta, "positions", "tokens in the snapshot") != p:
            raise _refuse(path, "its position count does not match its name; the file is damaged.")
        chain = _chain(path, meta.get("segments"), p)
        kda = [i for i in range(self.n_layers) if not self.cfg.is_mla(i)]
        expect = [("ids", "I64", (p,))] + [(f"layers.{i}.{k}", "F32", s) for i in kda
                                           for k, s in _kda_shapes(self.cfg).items()]
        t = read_tensors(path, entries, start, size, expect, sha)
        if t["ids"].tolist() != list(prompt[:p]):
            return None  # another prefix with the same key: not this prompt's
        segs = []
        for a, b, key_b in chain:
            seg = self._read_segment(a, b, key_b)
            if seg is None:  # evicted: the snapshot is of no use without it
                path.unlink(missing_ok=True)
                return None
            segs.append(seg)
        st = InferenceState.fresh(self.cfg, self.n_layers, capacity, self.latent)
        st.ids = list(prompt[:p])
        for i, ls in enumerate(st.layers):
            if isinstance(ls, KDAState):
                ls.conv_q, ls.conv_k, ls.conv_v, ls.S = (t[f"layers.{i}.{k}"] for k in _KDA)
            else:
                for seg in segs:
                    ls.append(seg[f"layers.{i}.k"], seg[f"layers.{i}.v"])
        _touch(path)
        return p, st, chain

    def _read_segment(self, a: int, b: int, key_b: str):
        path = self._kv(key_b, a)
        if not path.exists():
            return None
        try:
            meta, entries, start, size, sha = self._header(path, "kv")
            if (_count(path, meta, "start", "first position"), _count(path, meta, "end", "end position")) != (a, b):
                raise _refuse(path, "its positions do not match its name; the file is damaged.")
            expect = [(f"layers.{i}.{k}", "F32", s) for i in range(self.n_layers) if self.cfg.is_mla(i)
                      for k, s in _mla_shapes(self.cfg, b - a, self.latent).items()]
            seg = read_tensors(path, entries, start, size, expect, sha)
        except StateFileError as e:
            self._damaged(path, str(e))
            return None
        _touch(path)
        return seg

    # ------------------------------------------------------------ save
    def save(self, state, chain) -> list | None:
        """Write the snapshot of ``state`` (a prefill of state.position tokens on the grid)
        and the KV segment since the last snapshot of ``chain`` (the segments of an earlier
        snapshot of this prefix, or None); returns the snapshot's chain (None when the
        folder cannot be written)."""
        if not self.writable:
            return None
        p = state.position
        chain = [c for c in (chain or []) if c[1] < p]
        keys = prefix_keys(self.identity, state.ids, [c[1] for c in chain] + [p])
        chain = chain + [(chain[-1][1] if chain else 0, p, keys[p])]
        try:
            for a, b, key_b in chain:   # every segment of the prefix on disk (an evicted one again)
                if not _touch(self._kv(key_b, a)):
                    self._write_kv(state, a, b, key_b)
            if not _touch(self._snap(keys[p])):
                self._write_snap(state, chain, keys[p])
        except (K3Error, OSError) as e:
            self._stop_writes(e)
            return None
        self.writes += 1
        self.evict()
        return chain

    def _write(self, path: Path, kind: str, tensors: list, meta: dict) -> None:
        from ..checkpoint.writer import write_safetensors
        meta = {"format": FORMAT, "version": str(VERSION), "kind": kind, "identity": self.identity,
                "sha256": checksum(tensors), "written_by": f"k3 {__version__}", **meta}
        # a name of its own, then renamed: writers in other processes or threads never share a half file
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}")
        write_safetensors(tmp, tensors, metadata=meta, fsync=False, what="a prompt cache entry")
        try:
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _write_kv(self, state, a: int, b: int, key_b: str) -> None:
        tensors = []
        for i, ls in enumerate(state.layers):
            if isinstance(ls, MLAState):
                tensors += [(f"layers.{i}.k", ls.k[a:b].contiguous()), (f"layers.{i}.v", ls.v[a:b].contiguous())]
        self._write(self._kv(key_b, a), "kv", tensors, {"start": str(a), "end": str(b)})

    def _write_snap(self, state, chain: list, key: str) -> None:
        tensors = [("ids", torch.tensor(list(state.ids), dtype=torch.int64))]
        for i, ls in enumerate(state.layers):
            if isinstance(ls, KDAState):
                tensors += [(f"layers.{i}.{k}", getattr(ls, k).contiguous()) for k in _KDA]
        self._write(self._snap(key), "snapshot", tensors,
                    {"positions": str(state.position), "segments": json.dumps([list(c) for c in chain])})

    # ------------------------------------------------------------ the budget
    def usage(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every entry under the root (every checkpoint's)."""
        out = []
        for sub in _listdir(self.root):
            if sub.name.startswith("k3pc-") and sub.is_dir():
                for f in _listdir(sub):
                    try:
                        st = f.stat()
                    except OSError:
                        continue
                    if not f.name.startswith("."):
                        out.append((st.st_mtime, st.st_size, f))
                    elif time.time() - st.st_mtime > STALE_SECONDS:   # left by a writer that died before its rename
                        f.unlink(missing_ok=True)
        return out

    def evict(self) -> None:
        """Past the budget: remove the least recently used entries (under the lock file;
        another process evicting now does it instead)."""
        files = self.usage()
        total = sum(s for _, s, _ in files)
        if total <= self.max_bytes:
            return
        import fcntl
        try:
            lock = open(self.root / ".lock", "a+")
        except OSError:
            return
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return
            for _, size, f in sorted(files, key=lambda x: x[0]):
                if total <= self.max_bytes:
                    break
                try:
                    f.unlink()
                    total -= size
                    self.evicted += 1
                except OSError:
                    pass


def _chain(path, raw, p: int) -> list:
    """The `segments` field: [[a, b, key(b)], ...] tiling 0..p, else a refusal."""
    try:
        segs = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        segs = None
    ok = isinstance(segs, list) and all(isinstance(s, list) and len(s) == 3 and type(s[0]) is int
                                        and type(s[1]) is int and isinstance(s[2], str) and _SHA_RE.fullmatch(s[2])
                                        for s in segs)
    if ok:
        ends = [0] + [s[1] for s in segs]
        ok = bool(segs) and all(s[0] == e and s[1] > s[0] for s, e in zip(segs, ends)) and ends[-1] == p
    if not ok:
        raise _refuse(path, "its `segments` field is not a list of KV segments covering its tokens; the file is "
                            "damaged.")
    return [tuple(s) for s in segs]


def _touch(path: Path) -> bool:
    """Mark ``path`` used now (LRU); False when it is not there."""
    try:
        os.utime(path)
        return True
    except OSError:
        return False


def _listdir(d: Path) -> list[Path]:
    try:
        return [d / n for n in os.listdir(d)]
    except OSError:
        return []
