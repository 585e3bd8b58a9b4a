"""Strict safetensors header parser: one shard file's header, nothing else.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON, then the data section. Each JSON entry (except ``__metadata__``) is
``name: {"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to
the start of the data section.

Nothing here maps or reads tensor data: the parser reads only the header (``pread``),
and :class:`TensorInfo` records the *absolute* byte offset of each tensor in its file
so that readers (:mod:`k3.checkpoint.io`) can issue one ``pread`` per tensor.

Everything the parser refuses is a :class:`~k3.errors.CheckpointError` (exit code 3)
whose message names the file and, where there is one, the tensor. The index over all
shards of a checkpoint directory is :mod:`k3.checkpoint.index`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn

from ..fsutil import JSONProblem, loads_json, path_problem
from k3.errors import CheckpointError

__all__ = [
    "DTYPE_SIZES",
    "MAX_HEADER_BYTES",
    "ShardHeader",
    "TensorInfo",
    "pread_exact",
    "read_header",
    "read_shard_header",
]

#: Element size in bytes of every dtype we accept, in safetensors spelling.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# Canonical string objects, so that 500k TensorInfo share a handful of dtype strings.
_DTYPE_CANON: dict[str, str] = {k: k for k in DTYPE_SIZES}

#: Same limit as the safetensors library: a header above this is refused as corrupt.
MAX_HEADER_BYTES = 100_000_000

#: Most dimensions a tensor may have (numpy's and torch's own limit is 64; K3's
#: tensors have at most 4). Bounds the work of checking a damaged shape.
MAX_RANK = 64
#: Largest single dimension accepted (2**53: beyond any file; keeps sizes exact in a
#: float64 and the product of a damaged shape cheap to check).
MAX_DIM = 1 << 53

_REDOWNLOAD = (
    "The file is truncated or corrupt (or not a safetensors file); re-download it "
    "and check that its size matches the published one."
)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes live.

    ``file`` is an absolute path, ``offset`` the absolute byte offset in that file
    (header included), ``nbytes`` the payload size, ``dtype`` the safetensors
    spelling (``"BF16"``, ``"U8"``...), ``shape`` a tuple of ints (``()`` for a
    scalar).
    """

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        """Absolute end offset (exclusive)."""
        return self.offset + self.nbytes

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """A parsed shard header: tensors in file order of their JSON entries."""

    file: str
    file_size: int
    data_start: int  # absolute offset of the data section (8 + header length)
    metadata: dict[str, str] | None
    tensors: dict[str, TensorInfo]


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to n bytes at offset (fewer only at end of file), continuing after short reads."""
    chunks = []
    got = 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _bad(path: str, problem: str, tensor: str | None = None) -> CheckpointError:
    where = f"tensor {tensor!r} in checkpoint file {path}" if tensor is not None else f"checkpoint file {path}"
    return CheckpointError(f"Refusing {where}: {problem}. {_REDOWNLOAD}")


def _is_int(v: object) -> bool:
    return type(v) is int  # excludes bool (JSON true/false) and floats


def _short(v: object, limit: int = 80) -> str:
    """repr cut short: a damaged header can hold huge values."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def read_shard_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and validate one shard header; see :func:`read_header`."""
    apath = os.path.abspath(os.fspath(path))
    why = path_problem(apath)
    if why == "does not exist":
        raise CheckpointError(
            f"Checkpoint file {apath} does not exist. The download is incomplete or the "
            f"path is wrong; download the missing file or point k3 at the right directory."
        )
    if why is not None:
        raise CheckpointError(
            f"Checkpoint file {apath} {why}. Replace it with the downloaded shard file."
        )
    try:
        # O_NONBLOCK: should the path have become a FIFO since the check, open does not hang.
        fd = os.open(apath, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(
            f"Cannot open checkpoint file {apath}: {e.strerror or e}. Check the path and "
            f"its permissions."
        ) from None
    try:
        try:
            file_size = os.fstat(fd).st_size
            prefix = pread_exact(fd, 8, 0)
            if len(prefix) < 8:
                raise _bad(
                    apath,
                    f"the file is only {file_size} bytes long, shorter than the 8-byte "
                    f"header-length prefix",
                )
            hlen = int.from_bytes(prefix, "little")
            if hlen < 2 or hlen > MAX_HEADER_BYTES:
                raise _bad(
                    apath,
                    f"the header length prefix says {hlen} bytes, which is not a sane "
                    f"safetensors header size (2..{MAX_HEADER_BYTES})",
                )
            if 8 + hlen > file_size:
                raise _bad(
                    apath,
                    f"the header length prefix says {hlen} bytes but the file has only "
                    f"{file_size - 8} bytes after the prefix (file size {file_size}), so the "
                    f"header is larger than the file",
                )
            raw = pread_exact(fd, hlen, 8)
        except OSError as e:
            raise CheckpointError(
                f"Reading the header of checkpoint file {apath} failed: {e.strerror or e}. "
                f"Check the disk (dmesg) and re-run."
            ) from None
    finally:
        os.close(fd)
    if len(raw) < hlen:
        raise _bad(apath, f"the file ended while reading its {hlen}-byte header")
    return _parse_header(apath, file_size, hlen, raw)


def _diagnose(
    apath: str, name: str, ent: object, data_len: int, *, file_size: int = -1, hlen: int = -1
) -> NoReturn:
    """Raise the precise CheckpointError for a header entry the fast path rejected."""
    if not isinstance(ent, dict):
        raise _bad(apath, "its header entry is not an object with dtype/shape/data_offsets", name)
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in ent]
    if missing:
        raise _bad(apath, f"its header entry lacks {', '.join(missing)}", name)
    dtype, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _bad(
            apath, f"dtype {_short(dtype)} is not a known safetensors dtype ({', '.join(DTYPE_SIZES)})", name
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(apath, f"shape {_short(shape)} is not a list of non-negative integers", name)
    if len(shape) > MAX_RANK:
        raise _bad(apath, f"shape has {len(shape)} dimensions, more than the {MAX_RANK} any tensor can have", name)
    if any(d > MAX_DIM for d in shape):
        raise _bad(apath, f"shape {_short(shape)} has a dimension above 2**53, larger than any file", name)
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not _is_int(offs[0])
        or not _is_int(offs[1])
        or offs[0] < 0
        or offs[1] < offs[0]
    ):
        raise _bad(
            apath,
            f"data_offsets {_short(offs)} is not a pair [begin, end] of integers with 0 <= begin <= end",
            name,
        )
    begin, end = offs
    numel = 1
    for d in shape:
        numel *= d
    itemsize = DTYPE_SIZES[dtype]
    if end - begin != numel * itemsize:
        raise _bad(
            apath,
            f"data_offsets [{begin}, {end}] span {end - begin} bytes but shape {shape} of "
            f"{dtype} needs {numel} x {itemsize} = {numel * itemsize} bytes",
            name,
        )
    if end > data_len:
        raise _bad(
            apath,
            f"its bytes [{begin}, {end}) of the data section run past the end of the file: "
            f"the data section has only {data_len} bytes (file size {file_size}, header "
            f"{hlen} bytes), so the file is truncated or the offsets are wrong",
            name,
        )
    raise AssertionError(f"header entry {name!r} of {apath} rejected without a reason")  # pragma: no cover


def _parse_header(apath: str, file_size: int, hlen: int, raw: bytes) -> ShardHeader:
    try:
        hdr = loads_json(raw)
    except JSONProblem as e:
        dup = e.kind == "duplicate"  # a tensor name given twice (or a field of an entry)
        raise _bad(
            apath,
            f"its header {e.problem}" + (" (duplicate tensor name or duplicate field)" if dup else ""),
            tensor=e.field if dup else None,
        ) from None
    if not isinstance(hdr, dict):
        raise _bad(apath, f"its JSON header is a {type(hdr).__name__}, not an object")

    data_start = 8 + hlen
    data_len = file_size - data_start
    meta = hdr.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise _bad(apath, "its __metadata__ entry is not an object of string -> string")

    sizes = DTYPE_SIZES
    canon = _DTYPE_CANON
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # share equal shape tuples
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, ent in hdr.items():
        # Fast path for well-formed entries; anything odd goes to _diagnose, which raises.
        try:
            dtype = ent["dtype"]
            shape = ent["shape"]
            begin, end = ent["data_offsets"]
            numel = sizes[dtype]  # starts at itemsize
        except (TypeError, KeyError, ValueError):
            _diagnose(apath, name, ent, data_len)
        if (type(shape) is not list or len(shape) > MAX_RANK or type(begin) is not int
                or type(end) is not int or begin < 0):
            _diagnose(apath, name, ent, data_len)
        for d in shape:
            if type(d) is not int or d < 0 or d > MAX_DIM:
                _diagnose(apath, name, ent, data_len)
            numel *= d
        if end - begin != numel or end > data_len:
            _diagnose(apath, name, ent, data_len, file_size=file_size, hlen=hlen)
        if end > begin:
            spans.append((begin, end, name))
        shp = tuple(shape)
        tensors[name] = TensorInfo(
            name, apath, data_start + begin, end - begin, canon[dtype], shapes.setdefault(shp, shp)
        )

    spans.sort()
    prev_end = 0
    prev_name = None
    for begin, end, name in spans:
        if begin < prev_end:
            raise _bad(
                apath,
                f"its bytes [{begin}, {end}) overlap those of tensor {prev_name!r}, which "
                f"end at {prev_end}; two tensors cannot share bytes",
                name,
            )
        if end > prev_end:
            prev_end, prev_name = end, name
    return ShardHeader(apath, file_size, data_start, meta, tensors)


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Strictly parse the header of one safetensors file.

    Returns ``name -> TensorInfo`` in header order (``__metadata__`` excluded).
    Refuses (``CheckpointError``) a file shorter than 8 bytes, an insane header
    length or one larger than the file, non-UTF-8 / non-JSON / non-object headers,
    duplicate JSON keys, unknown dtypes, bad shapes or offsets, a byte span that does
    not match ``prod(shape) * itemsize``, spans outside the data section, and
    overlapping spans. Gaps between tensors are allowed.
    """
    return read_shard_header(path).tensors
