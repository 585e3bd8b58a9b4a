"""Files: reading our inputs strictly (JSON documents and paths: a value or one clear
error naming the file and field, whatever the bytes), and the one atomic writer for user
data and our own files (results, histories, state files, checkpoints, packed-trunk
descriptions): write a temporary file beside the target, fsync it, rename it over the
target, fsync the directory. A killed write leaves the old file (or none), never a
half-written one."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import EXIT_RUNTIME, ConfigError, K3Error


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


def short_repr(v, limit: int = 60) -> str:
    """repr of a config value, cut short (a damaged file can hold a huge list)."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def key_name(k: str) -> str:
    """A key from an input file, as it may appear in a one-line message: itself when it
    is short and printable, else its escaped repr (a key can hold a newline)."""
    return k if k.isprintable() and len(k) <= 60 else short_repr(k)


def json_kind(v) -> str:
    """The JSON name of a value's type, for messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {'true' if v else 'false'}"
    if isinstance(v, (int, float)):
        return f"the number {short_repr(v)}"
    if isinstance(v, str):
        return f"the string {short_repr(v)}"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


# ---------------------------------------------------------------- reading input files strictly
# One mechanism for every JSON input k3 reads (config.json, tokenizer_config.json,
# generation_config.json, the checkpoint index, safetensors and state-file headers):
# whatever the bytes, the outcome is a value or a JSONProblem that says what is wrong
# and where - never UnicodeDecodeError, RecursionError or the integer-length ValueError.

#: JSON configuration files are a few KB (K3's tokenizer_config.json, the largest, ~40 KB).
MAX_JSON_FILE_BYTES = 64 << 20


class JSONProblem(ValueError):
    """Why a JSON document was refused: `problem` reads after the document's name
    ("config.json is not valid JSON (...)"); `kind` is "utf8", "duplicate", "depth" or
    "syntax"; `field` names the key at fault when one is known."""

    def __init__(self, problem: str, kind: str, field: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.kind = kind
        self.field = field


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def _surrogate_field(text: str) -> str | None:
    """The dotted path of the first key or string value holding an undecodable byte
    (decoded with surrogateescape), or None when it cannot be told."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None

    def bad(s: str) -> bool:
        return any("\udc80" <= ch <= "\udcff" for ch in s)

    stack: list[tuple[str, object]] = [("", doc)]
    while stack:  # iterative: the document may be deep
        path, v = stack.pop()
        if isinstance(v, str) and bad(v):
            return path or "(the top-level value)"
        if isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                kp = f"{path}.{key_name(k)}" if path else key_name(k)
                if bad(k):
                    return kp
                stack.append((kp, x))
        elif isinstance(v, list):
            for j in range(len(v) - 1, -1, -1):
                stack.append((f"{path}[{j}]", v[j]))
    return None


def loads_json(data: bytes | str) -> object:
    """Parse one JSON document strictly: UTF-8, no duplicate keys (which value is meant
    would be ambiguous), bounded nesting. Raises JSONProblem, nothing else.

    NaN / Infinity are accepted here (Python's json reads them); each reader checks its
    numbers for finiteness and range, so the refusal can name the field."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
            where = _surrogate_field(data.decode("utf-8", "surrogateescape"))
            raise JSONProblem(
                f"is not UTF-8 text: the byte 0x{data[e.start]:02x} at line {line}, column {col}"
                + (f" (in `{where}`)" if where else f" (byte offset {e.start})") + f" is not valid UTF-8 "
                f"({e.reason})", "utf8", field=where) from None
    else:
        text = data
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise JSONProblem(f"names `{key_name(e.key)}` twice, so which value is meant is ambiguous", "duplicate",
                          field=e.key) from None
    except RecursionError:
        raise JSONProblem("is nested too deeply to be read (hundreds of levels of lists/objects; the file is "
                          "damaged)", "depth") from None
    except json.JSONDecodeError as e:
        raise JSONProblem(f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})", "syntax") from None
    except ValueError as e:  # e.g. an integer literal of more than 4300 digits
        raise JSONProblem(f"is not valid JSON ({e})", "syntax") from None


def path_problem(path) -> str | None:
    """None when `path` is (or links to) a regular file; otherwise what it is instead,
    phrased to follow the path: "does not exist", "is a directory", "is a broken
    symbolic link (to X)", "is a symbolic link loop", "is not a regular file (a FIFO)"."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        try:
            os.lstat(p)
        except OSError:
            return "does not exist"
        try:
            target = os.readlink(p)
        except OSError:
            target = "?"
        return f"is a broken symbolic link (to {target}, which does not exist)"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop (following it never reaches a file)"
        if e.errno == errno.ENOTDIR:
            return "does not exist (a part of its path is a file, not a folder)"
        if e.errno == errno.ENAMETOOLONG:
            return "is not a usable path (the name is too long)"
        return f"cannot be examined ({e.strerror or e})"
    except ValueError:  # an embedded NUL byte
        return "is not a usable path (it contains a NUL byte)"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "special")
        return f"is not a regular file (it is {kind})"
    return None


def read_json_file(path, *, what: str | None = None, error: type[K3Error] = ConfigError, hint: str = "",
                   missing: str | None = None, limit: int = MAX_JSON_FILE_BYTES) -> object:
    """The JSON value in the file `path`, strictly (loads_json). Anything wrong - the
    path is not a regular file, unreadable, larger than `limit` bytes, not UTF-8, not
    JSON - is an `error` (a K3Error subclass) naming the file; `missing` replaces the
    message for a file that does not exist, `hint` is appended to the others."""
    p = Path(path)
    name = what or p.name
    tail = f" {hint}" if hint else ""
    why = path_problem(p)
    if why == "does not exist" and missing is not None:
        raise error(missing)
    if why is not None:
        raise error(f"{p}: {why}; {name} must be a JSON file.{tail}")
    try:
        with open(p, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise error(f"{p}: {name} could not be read ({e.strerror or e}).{tail}") from None
    if len(data) > limit:
        raise error(f"{p}: {name} is larger than {limit >> 20} MiB, far more than any such file "
                    f"holds; it is not the right file.{tail}")
    try:
        return loads_json(data)
    except JSONProblem as e:
        raise error(f"{p}: {name} {e.problem}.{tail}") from None


