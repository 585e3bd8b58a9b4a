"""Our own safetensors checkpoint writer, with the tensor layout under our control.

The ``safetensors`` library's writer orders tensors by dtype then name. Tests and
tools here need the layout of the real release instead: e.g. the six tensors of one
expert forming one contiguous run, experts out of id order, a layer's trunk tensors
forming one gap-free run. :func:`write_checkpoint` writes every tensor exactly in the
order given, gap-free, in files the ``safetensors`` library also loads.

Files are written to a temporary name (``.<name>.tmp-<pid>``, which does not end in
``.safetensors``) and renamed into place once complete, so an interrupted write never
leaves a file that looks complete. The index is written last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ..fsutil import atomic_write, fsync_dir
from .safetensors import DTYPE_SIZES, INDEX_NAME

__all__ = ["write_checkpoint", "write_safetensors", "safetensors_layout", "TORCH_TO_ST", "NUMPY_TO_ST"]

TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

NUMPY_TO_ST: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype("<u2"): "U16",
    np.dtype("<i2"): "I16",
    np.dtype("<f2"): "F16",
    np.dtype("<u4"): "U32",
    np.dtype("<i4"): "I32",
    np.dtype("<f4"): "F32",
    np.dtype("<u8"): "U64",
    np.dtype("<i8"): "I64",
    np.dtype("<f8"): "F64",
}

_CHUNK = 64 << 20


class _Entry:
    __slots__ = ("name", "dtype", "shape", "nbytes", "value")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, value: Any):
        self.name, self.dtype, self.shape, self.nbytes, self.value = name, dtype, shape, nbytes, value


def _describe(name: Any, t: Any) -> _Entry:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
    if name == "__metadata__":
        raise ValueError("'__metadata__' is reserved and cannot be a tensor name")
    if isinstance(t, torch.Tensor):
        dt = TORCH_TO_ST.get(t.dtype)
        if dt is None:
            raise ValueError(f"tensor {name!r}: torch dtype {t.dtype} cannot be stored in safetensors")
        shape = tuple(int(d) for d in t.shape)
    elif isinstance(t, np.ndarray):
        key = t.dtype.newbyteorder("<") if t.dtype.byteorder == ">" else t.dtype
        dt = NUMPY_TO_ST.get(np.dtype(key))
        if dt is None:
            raise ValueError(f"tensor {name!r}: numpy dtype {t.dtype} cannot be stored in safetensors")
        shape = tuple(int(d) for d in t.shape)
    else:
        raise TypeError(f"tensor {name!r}: expected a torch.Tensor or numpy.ndarray, got {type(t).__name__}")
    numel = 1
    for d in shape:
        numel *= d
    return _Entry(name, dt, shape, numel * DTYPE_SIZES[dt], t)


def _as_bytes(e: _Entry) -> memoryview:
    """Little-endian, C-ordered bytes of one tensor (a view where possible)."""
    t = e.value
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1).view(torch.uint8)
        arr = t.numpy()
    else:
        arr = np.ascontiguousarray(t)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = arr.reshape(-1).view(np.uint8)
    mv = memoryview(arr)
    if len(mv) != e.nbytes:  # pragma: no cover - defensive
        raise AssertionError(f"tensor {e.name!r}: got {len(mv)} bytes, expected {e.nbytes}")
    return mv


def _header_bytes(entries: Sequence[_Entry], metadata: dict[str, str] | None) -> bytes:
    hdr: dict[str, Any] = {}
    if metadata:
        hdr["__metadata__"] = metadata
    off = 0
    for e in entries:
        hdr[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    raw = json.dumps(hdr, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * ((-len(raw)) % 8)  # pad so that the data section starts 8-aligned
    return len(raw).to_bytes(8, "little") + raw


def safetensors_layout(tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
                       ) -> tuple[bytes, dict[str, int]]:
    """The header of a file holding ``(name, safetensors dtype, shape)`` tensors gap-free in
    that order, and each tensor's offset from the start of the data section: what
    :func:`write_safetensors` would write, for a writer that fills the data itself."""
    entries = []
    for name, dt, shape in tensors:
        numel = 1
        for d in shape:
            numel *= int(d)
        entries.append(_Entry(name, dt, tuple(int(d) for d in shape), numel * DTYPE_SIZES[dt], None))
    offsets, off = {}, 0
    for e in entries:
        if e.name in offsets:
            raise ValueError(f"tensor name {e.name!r} given twice")
        offsets[e.name] = off
        off += e.nbytes
    return _header_bytes(entries, _check_metadata(metadata)), offsets


def _check_metadata(metadata: dict | None) -> dict[str, str] | None:
    if metadata is None:
        return {"format": "pt"}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("metadata must be a dict of str -> str")
    return dict(metadata) or None


def _write_entries(path: Path, entries: Sequence[_Entry], metadata: dict[str, str] | None, fsync: bool,
                   what: str = "the safetensors file") -> None:
    header = _header_bytes(entries, metadata)

    def body(f):
        f.write(header)
        for e in entries:
            mv = _as_bytes(e)
            for i in range(0, len(mv), _CHUNK):
                f.write(mv[i : i + _CHUNK])

    atomic_write(path, body, what=what, fsync=fsync)


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, Any]],
    *,
    metadata: dict[str, str] | None = None,
    fsync: bool = True,
    what: str = "the safetensors file",
) -> Path:
    """Write one safetensors file with ``tensors`` (``(name, tensor)`` pairs) in the given order.

    ``metadata=None`` writes ``{"format": "pt"}`` (what transformers expects);
    ``metadata={}`` writes no ``__metadata__``. A failed write is a K3Error naming the
    path and ``what`` it was.
    """
    meta = _check_metadata(metadata)
    entries = [_describe(n, t) for n, t in tensors]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ValueError(f"tensor name {e.name!r} given twice")
        seen.add(e.name)
    path = Path(path)
    _write_entries(path, entries, meta, fsync, what)
    return path


def write_checkpoint(
    out_dir: str | os.PathLike,
    shards: Sequence[Iterable[tuple[str, Any]]],
    *,
    index: bool = True,
    name_fmt: str = "model-{i:05d}-of-{n:05d}.safetensors",
    metadata: dict[str, str] | None = None,
    fsync: bool = True,
) -> list[Path]:
    """Write a sharded checkpoint with an explicit layout; returns the shard paths.

    ``shards`` holds one ordered list of ``(name, tensor)`` per shard (torch tensor
    of any safetensors-storable dtype, or a numpy array). Inside each shard the
    tensors are stored gap-free in exactly the given order. Shard ``i`` (1-based) of
    ``n`` is named ``name_fmt.format(i=i, n=n)`` — the K3 release uses
    ``"model-{i:05d}-of-{n:06d}.safetensors"``. With ``index`` (default) also writes
    ``model.safetensors.index.json`` (``metadata.total_size`` = sum of tensor bytes,
    ``weight_map`` name -> shard file name), after all shards. ``metadata`` as in
    :func:`write_safetensors`, applied to every shard. All inputs are validated
    (names unique across shards, dtypes storable) before any file is written; each
    file is written atomically. ``fsync=False`` skips fsync (tests, scratch data).
    """
    out = Path(out_dir)
    meta = _check_metadata(metadata)
    n = len(shards)
    plans: list[tuple[Path, list[_Entry]]] = []
    seen: dict[str, str] = {}
    names_used: set[str] = set()
    for i, shard in enumerate(shards, start=1):
        fname = name_fmt.format(i=i, n=n)
        if not fname or fname != os.path.basename(fname) or fname == INDEX_NAME:
            raise ValueError(f"shard name {fname!r} from name_fmt is not a plain file name")
        if fname in names_used:
            raise ValueError(f"name_fmt gives the same file name {fname!r} to two shards")
        names_used.add(fname)
        entries = [_describe(nm, t) for nm, t in shard]
        for e in entries:
            if e.name in seen:
                raise ValueError(f"tensor name {e.name!r} given twice (in {seen[e.name]} and {fname})")
            seen[e.name] = fname
        plans.append((out / fname, entries))

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for path, entries in plans:
        _write_entries(path, entries, meta, fsync)
        paths.append(path)
    if index:
        total = sum(e.nbytes for _, entries in plans for e in entries)
        doc = {"metadata": {"total_size": total}, "weight_map": seen}
        raw = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        atomic_write(out / INDEX_NAME, raw, what="the checkpoint index", fsync=fsync)
    if fsync:
        fsync_dir(str(out))
    return paths
