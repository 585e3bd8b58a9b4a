"""Strict safetensors header parser and the checkpoint index.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON, then the data section. Each JSON entry (except ``__metadata__``) is
``name: {"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to
the start of the data section.

Nothing here maps or reads tensor data: the parser reads only the header (``pread``),
and :class:`TensorInfo` records the *absolute* byte offset of each tensor in its file
so that readers (:mod:`k3.checkpoint.io`) can issue one ``pread`` per tensor.

Everything the parser refuses is a :class:`~k3.errors.CheckpointError` (exit code 3)
whose message names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from typing import Iterator, NoReturn

from ..fsutil import JSONProblem, key_name, loads_json, path_problem, read_json_file
from k3.errors import CheckpointError, UsageError

__all__ = [
    "DTYPE_SIZES",
    "IGNORED_PREFIXES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "CheckpointIndex",
    "ShardHeader",
    "TensorInfo",
    "read_header",
    "read_index",
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

#: K3's index (~500k tensors) is ~50 MB; anything far larger is not an index.
MAX_INDEX_BYTES = 1 << 30

#: Tensors of the multimodal parts; the text engine never indexes them.
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")

INDEX_NAME = "model.safetensors.index.json"

_SHARD_OF_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")

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


def read_index(index_path: str | os.PathLike) -> tuple[dict[str, str], dict | None]:
    """(weight_map, metadata) of a ``model.safetensors.index.json``, strictly: the file
    must be a regular file holding a JSON object whose ``weight_map`` is a non-empty
    object mapping each tensor name to a plain shard file name (a string naming a file
    in the same directory). Anything else is a CheckpointError naming the file (and the
    tensor, where one is at fault). ``metadata`` is None unless it is an object."""
    index_path = os.fspath(index_path)
    redo = "Re-download the index file."
    idx = read_json_file(index_path, what="the checkpoint index", error=CheckpointError, hint=redo,
                         limit=MAX_INDEX_BYTES)
    if not isinstance(idx, dict):
        raise CheckpointError(
            f"Refusing checkpoint index {index_path}: it holds a JSON {type(idx).__name__}, not an object "
            f"with a 'weight_map'. {redo}"
        )
    wm = idx.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        what = ("is missing" if wm is None else "is empty" if isinstance(wm, dict)
                else f"is a JSON {type(wm).__name__}, not an object")
        raise CheckpointError(
            f"Refusing checkpoint index {index_path}: its 'weight_map' {what}; it must be a non-empty "
            f"object (tensor name -> shard file). {redo}"
        )
    ok: set[str] = set()  # shard names already checked (K3: ~500k entries, ~100 shards)
    for name, shard in wm.items():
        if type(shard) is str and shard in ok:
            continue
        if (
            not isinstance(shard, str)
            or not shard
            or shard != os.path.basename(shard)
            or shard in (".", "..")
            or "\0" in shard
        ):
            raise CheckpointError(
                f"Refusing checkpoint index {index_path}: tensor {_short(name)} is mapped to "
                f"{_short(shard)}, which is not a plain file name in the checkpoint "
                f"directory. {redo}"
            )
        ok.add(shard)
    meta = idx.get("metadata")
    return wm, meta if isinstance(meta, dict) else None


def _ignored(name: str) -> bool:
    return name.startswith(IGNORED_PREFIXES)


def _list_names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    if len(names) > limit:
        shown += f" and {len(names) - limit} more"
    return shown


def shard_paths(d: str, shards, extra_dirs=()) -> dict[str, str]:
    """Where each shard named by the index is: in the model folder ``d``, else in the
    first of ``extra_dirs`` (shards spread over several drives) that holds it; a shard
    found nowhere maps to ``d`` (and is then reported missing there)."""
    out = {}
    for s in shards:
        out[s] = os.path.join(d, s)
        if os.path.lexists(out[s]):
            continue
        for e in extra_dirs:
            p = os.path.join(e, s)
            if os.path.lexists(p):
                out[s] = p
                break
    return out


def _check_shard_files(d: str, shards: list[str], named: str, where: dict[str, str] | None = None) -> None:
    """Refuse, in one message, shard names that are not regular files: missing ones
    (a partial download) and ones that are something else (a directory, a broken
    symbolic link, a link loop, a FIFO), each said as what it is."""
    found = [(s, path_problem((where or {}).get(s) or os.path.join(d, s))) for s in shards]
    missing = [s for s, why in found if why == "does not exist"]
    odd = [(s, why) for s, why in found if why is not None and why != "does not exist"]
    if odd:
        shown = "; ".join(f"{key_name(s)} {why}" for s, why in odd[:10])
        if len(odd) > 10:
            shown += f"; and {len(odd) - 10} more"
        also = f" ({len(missing)} more are missing: {_list_names(missing, 10)})" if missing else ""
        raise CheckpointError(
            f"The checkpoint in {d} is not usable: {len(odd)} of the {len(shards)} shard files "
            f"{named} are not regular files: {shown}{also}. Replace each with the downloaded "
            f"shard file."
        )
    if missing:
        raise CheckpointError(
            f"The checkpoint in {d} is incomplete: {len(missing)} of the "
            f"{len(shards)} shard files {named} are missing "
            f"({_list_names(missing, 10)}). The download is incomplete; download the "
            f"missing files (e.g. re-run the download command, which resumes)."
        )


class CheckpointIndex:
    """All text-model tensors of a checkpoint directory, by name.

    Open with :meth:`open`. Tensors named ``vision_tower.*`` / ``mm_projector.*`` are
    not indexed. Every shard header is parsed (strictly) exactly once.
    """

    __slots__ = ("model_dir", "_tensors", "_shards", "_headers", "index_metadata")

    def __init__(
        self,
        model_dir: str,
        tensors: dict[str, TensorInfo],
        headers: dict[str, ShardHeader],
        index_metadata: dict | None = None,
    ):
        self.model_dir = model_dir
        self._tensors = tensors
        self._headers = headers
        self._shards = list(headers)
        self.index_metadata = index_metadata

    # -- construction -------------------------------------------------------------
    @classmethod
    def open(cls, model_dir: str | os.PathLike, extra_dirs=()) -> "CheckpointIndex":
        """Index ``model_dir``; with ``extra_dirs``, the shards its index names may be in
        those folders too (one per drive, `--model-dirs`), looked up in order.

        With ``model.safetensors.index.json``: its ``weight_map`` (tensor -> shard
        file name) is authoritative; every shard it names for a text tensor must
        exist (else one error listing all missing shards) and every text tensor must
        be present in the shard it is mapped to. Shards named only for ignored
        (vision/projector) tensors are not required. Without an index: every
        ``*.safetensors`` in the directory, in name order; ``-NNNNN-of-MMMMM`` shard
        names must form the complete set 1..MMMMM; a tensor in two shards is refused.
        """
        d = os.path.abspath(os.fspath(model_dir))
        if not os.path.isdir(d):
            why = path_problem(d) or "is a file, not a directory"
            raise CheckpointError(
                f"Checkpoint directory {d} {why}. Pass the "
                f"directory that holds the model's *.safetensors files."
            )
        for e in extra_dirs:
            if not os.path.isdir(e):
                raise UsageError(f"--model-dirs {e}: not a folder. Give the folders that hold the checkpoint's shards.")
        index_path = os.path.join(d, INDEX_NAME)
        # ~500k small objects are created here: cyclic GC passes over a growing heap
        # would double the time, and nothing created here forms cycles.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            if os.path.lexists(index_path):  # a broken link is reported, not skipped
                return cls._open_indexed(d, index_path, [os.path.abspath(os.fspath(e)) for e in extra_dirs])
            if extra_dirs:
                raise CheckpointError(
                    f"--model-dirs needs {INDEX_NAME} in {d}: the index says which shard is which, wherever it is; "
                    "without one, put every shard in the model folder.")
            return cls._open_glob(d)
        finally:
            if gc_was_enabled:
                gc.enable()

    @classmethod
    def _open_indexed(cls, d: str, index_path: str, extra_dirs=()) -> "CheckpointIndex":
        wm, meta = read_index(index_path)
        by_shard: dict[str, list[str]] = {}
        for name, shard in wm.items():
            names = by_shard.get(shard)
            if names is None:
                names = by_shard[shard] = []
            if not name.startswith(IGNORED_PREFIXES):
                names.append(name)
        needed = [s for s, names in by_shard.items() if names]
        where = shard_paths(d, sorted(needed), extra_dirs)
        _check_shard_files(d, sorted(needed), f"named by {INDEX_NAME}" + (
            f" (looked for in {d} and {', '.join(extra_dirs)})" if extra_dirs else ""), where)
        headers: dict[str, ShardHeader] = {}
        tensors: dict[str, TensorInfo] = {}
        for shard in sorted(needed):
            hdr = read_shard_header(where[shard])
            headers[hdr.file] = hdr
            infos = hdr.tensors
            names = by_shard[shard]
            absent = [n for n in names if n not in infos]
            if absent:
                raise CheckpointError(
                    f"Checkpoint file {hdr.file} lacks {len(absent)} tensor(s) that "
                    f"{INDEX_NAME} places in it: {_list_names(absent)}. The shard and the "
                    f"index do not belong together or the shard is a different/partial "
                    f"version; re-download both."
                )
            tensors.update([(n, infos[n]) for n in names])
        return cls(d, tensors, headers, meta)

    @classmethod
    def _open_glob(cls, d: str) -> "CheckpointIndex":
        try:
            listed = os.listdir(d)
        except OSError as e:
            raise CheckpointError(f"Cannot list checkpoint directory {d}: {e.strerror or e}.") from None
        files = sorted(f for f in listed if f.endswith(".safetensors"))
        # a directory, broken link or link loop named *.safetensors is reported as what it is
        _check_shard_files(d, files, "in the directory")
        if not files:
            raise CheckpointError(
                f"No checkpoint found in {d}: there is neither {INDEX_NAME} nor any "
                f"*.safetensors file. Point k3 at the directory holding the model files."
            )
        # Shard sets named "<stem>-00001-of-00096.safetensors" must be complete.
        groups: dict[tuple[str, str], tuple[int, set[int]]] = {}
        for f in files:
            m = _SHARD_OF_RE.match(f)
            if m:
                groups.setdefault((m["stem"], m["n"]), (len(m["i"]), set()))[1].add(int(m["i"]))
        for (stem, n_str), (width, have) in groups.items():
            n = int(n_str)
            lacking = [i for i in range(1, n + 1) if i not in have]
            if lacking:
                names = [f"{stem}-{i:0{width}d}-of-{n_str}.safetensors" for i in lacking]
                raise CheckpointError(
                    f"The checkpoint in {d} is incomplete: {len(lacking)} of {n} shard files "
                    f"are missing ({_list_names(names, 10)}) and there is no {INDEX_NAME}. "
                    f"The download is incomplete; download the missing files."
                )
        headers: dict[str, ShardHeader] = {}
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            hdr = read_shard_header(os.path.join(d, f))
            headers[hdr.file] = hdr
            for name, info in hdr.tensors.items():
                if _ignored(name):
                    continue
                prev = tensors.get(name)
                if prev is not None:
                    raise CheckpointError(
                        f"Tensor {name!r} appears in two checkpoint files, {prev.file} and "
                        f"{info.file}, and there is no {INDEX_NAME} to say which is meant. "
                        f"Remove the stray file or add the index."
                    )
                tensors[name] = info
        return cls(d, tensors, headers, None)

    # -- queries --------------------------------------------------------------
    def get(self, name: str) -> TensorInfo:
        """The tensor ``name``; a missing name is a CheckpointError, never KeyError."""
        info = self._tensors.get(name)
        if info is None:
            raise CheckpointError(
                f"Tensor {name!r} is missing from the checkpoint in {self.model_dir} "
                f"({len(self._tensors)} tensors in {len(self._shards)} shard file(s)). The "
                f"download is incomplete or this directory holds a different model; check "
                f"the model directory and re-download if needed."
            )
        return info

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def names(self) -> list[str]:
        """Indexed tensor names (shard order, then header order)."""
        return list(self._tensors)

    def items(self):
        return self._tensors.items()

    def shards(self) -> list[str]:
        """Absolute paths of the shard files whose headers were parsed, sorted."""
        return list(self._shards)

    def shard_header(self, path: str) -> ShardHeader:
        return self._headers[os.path.abspath(path)]

    def tensors_in(self, path: str) -> list[TensorInfo]:
        """Indexed tensors of one shard, sorted by offset."""
        p = os.path.abspath(path)
        return sorted((t for t in self._tensors.values() if t.file == p), key=lambda t: t.offset)

    @property
    def total_bytes(self) -> int:
        """Sum of the payload bytes of all indexed tensors."""
        return sum(t.nbytes for t in self._tensors.values())

    def __repr__(self) -> str:
        return f"CheckpointIndex({self.model_dir!r}, {len(self)} tensors, {len(self._shards)} shards)"

