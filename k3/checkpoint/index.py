"""The checkpoint index: every text-model tensor of a checkpoint directory, by name.

Reads ``model.safetensors.index.json`` strictly (:func:`read_index`), finds the shards
it names (in the model folder or in extra folders, one per drive) and parses each
shard header once with :mod:`k3.checkpoint.header`. Everything refused is a
:class:`~k3.errors.CheckpointError` (exit code 3) naming the file and, where there is
one, the tensor.
"""

from __future__ import annotations

import gc
import os
import re
from typing import Iterator

from ..fsutil import key_name, path_problem, read_json_file
from k3.errors import CheckpointError, UsageError
from .header import ShardHeader, TensorInfo, _short, read_shard_header

__all__ = [
    "IGNORED_PREFIXES",
    "INDEX_NAME",
    "MAX_INDEX_BYTES",
    "CheckpointIndex",
    "read_index",
    "shard_paths",
]

#: K3's index (~500k tensors) is ~50 MB; anything far larger is not an index.
MAX_INDEX_BYTES = 1 << 30

#: Tensors of the multimodal parts; the text engine never indexes them.
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")

INDEX_NAME = "model.safetensors.index.json"

_SHARD_OF_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")


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

