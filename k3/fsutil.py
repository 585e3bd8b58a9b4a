"""Atomic writes of user data (results, histories, state, configs): write a temporary
file beside the target, fsync it, rename it over the target, fsync the directory. A
killed write leaves the old file (or none), never a half-written one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import EXIT_RUNTIME, K3Error


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


def atomic_write_bytes(path, data: bytes, *, what: str = "the file", fsync: bool = True) -> None:
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
        if fsync:
            fsync_dir(p.parent if str(p.parent) else ".")
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise K3Error(f"{path}: could not write {what} ({e.strerror or e}).", EXIT_RUNTIME) from None


def atomic_write_json(path, obj, *, what: str = "the file", indent: int | None = 1, fsync: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode("utf-8"),
                       what=what, fsync=fsync)
