"""Reading our JSON inputs, and the one atomic writer for user data and our own files (results, histories, state
files, checkpoints, packed-trunk descriptions): write a temporary file beside the
target, fsync it, rename it over the target, fsync the directory. A killed write leaves
the old file (or none), never a half-written one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import EXIT_RUNTIME, K3Error, UsageError


def fsync_dir(d) -> None:
    """Make a rename in directory `d` durable (best effort: not every FS allows it)."""
    try:
        fd = os.open(os.fspath(d), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, body: bytes | Callable[[BinaryIO], None], *, what: str = "the file",
                 fsync: bool = True) -> None:
    """Write ``body`` (bytes, or a function that writes to the open file) to ``path``
    atomically. A failure (disk full, no permission, no such folder) is a K3Error that
    names the path; the previous file, if any, is left as it was."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(body):
                body(f)
            else:
                f.write(body)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, p)
        if fsync:
            fsync_dir(p.parent if str(p.parent) else ".")
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, OSError):
            raise K3Error(f"{path}: could not write {what} ({e.strerror or e}).", EXIT_RUNTIME) from None
        raise


def atomic_write_json(path, obj, *, what: str = "the file", indent: int | None = 1, fsync: bool = True) -> None:
    atomic_write(path, (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode("utf-8"),
                 what=what, fsync=fsync)


def read_json_object(path, hint: str = "") -> dict:
    """A JSON file that must hold an object; UsageError naming the file otherwise."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not readable JSON ({e}).{' ' + hint if hint else ''}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected a JSON object.{' ' + hint if hint else ''}")
    return raw
