"""Byte-range reads from checkpoint shards: buffered ``pread`` and ``O_DIRECT``.

Shards are never memory-mapped (so RSS means residency). :class:`ShardFiles` keeps
one buffered and one ``O_DIRECT`` descriptor per file, opened lazily and shared by
threads (``pread`` has no file position).

* :meth:`ShardFiles.read_into` reads ``nbytes`` at ``offset`` into a caller buffer,
  continuing after short reads; end of file before ``nbytes`` or an OS error is a
  :class:`~k3.errors.ReadError` (exit code 4) naming file, offset and size.
* :meth:`ShardFiles.read_direct` widens the range outward to ``align`` (4096)
  boundaries, reads it with ``O_DIRECT`` into an aligned buffer and returns a view of
  the payload. If the file system refuses ``O_DIRECT`` (at open, or ``EINVAL`` on the
  first read) the file silently falls back to buffered reads; the reason is kept in
  :attr:`ShardFiles.direct_fallbacks`.
* :func:`load_tensor` turns a :class:`~k3.checkpoint.safetensors.TensorInfo` into a
  torch tensor that owns its memory.

Failure injection (tests): every read syscall goes through
:meth:`ShardFiles._pread_once`, which first calls the optional ``hook(path, offset,
nbytes, direct)``. The hook may raise ``OSError`` (simulated EIO), return ``0``
(simulated end of file) or a smaller count (short read, which a correct reader
survives), or ``None`` (no change). :class:`FaultHook` builds such hooks; a subclass
may also override ``_pread_once``.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Callable, Union

import numpy as np
import torch

from .. import env
from ..errors import ReadError
from ..buffers import HUGE, aligned_empty  # noqa: F401 - the checkpoint's readers' buffers
from ..units import ALIGN

from .safetensors import TensorInfo

__all__ = [
    "ALIGN",
    "TORCH_DTYPES",
    "FaultHook",
    "ReadHook",
    "ShardFiles",
    "aligned_empty",
    "load_tensors",
    "direct_span",
    "load_tensor",
]

# Largest single syscall; Linux caps one read at 0x7ffff000 bytes anyway. Aligned.
MAX_CHUNK = 1 << 30

#: safetensors dtype -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

#: hook(path, offset, nbytes, direct) -> None | int (bytes to allow; 0 = EOF); may raise OSError.
ReadHook = Callable[[str, int, int, bool], Union[int, None]]

Source = Union[TensorInfo, tuple]


def direct_span(offset: int, nbytes: int, align: int = ALIGN) -> tuple[int, int, int]:
    """``(start, length, lead)`` of the ``align``-widened read covering ``[offset, offset+nbytes)``.

    ``start`` and ``length`` are multiples of ``align``; the payload sits at
    ``buf[lead:lead+nbytes]``. A buffer for :meth:`ShardFiles.read_direct` needs
    ``length`` bytes (at most ``nbytes + 2*align - 2``).
    """
    start = offset - offset % align
    end = offset + nbytes
    end += (-end) % align
    return start, end - start, offset - start


def _as_byte_view(out) -> memoryview:
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("read target tensor must be a contiguous CPU tensor")
        out = out.reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(out)
    if mv.readonly:
        raise ValueError("read target buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError("read target buffer must be C-contiguous")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def _unpack(src: Source, nbytes: int | None = None) -> tuple[str, int, int, str | None]:
    if isinstance(src, TensorInfo):
        return src.file, src.offset, src.nbytes, src.name
    if len(src) != 3:
        raise ValueError("read source must be a TensorInfo or (file, offset, nbytes)")
    file, offset, n = src
    return os.fspath(file), int(offset), int(n), None


class ShardFiles:
    """Lazily opened read descriptors for checkpoint shards (thread safe).

    ``use_direct=False`` disables ``O_DIRECT`` altogether (``read_direct`` then reads
    buffered into the same aligned layout). ``hook`` injects failures, see the module
    docstring. Counters ``reads`` (completed read requests) and ``bytes_read``
    are kept (approximate under concurrent use).
    """

    def __init__(self, *, use_direct: bool = True, align: int = ALIGN, hook: ReadHook | None = None):
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
        self.align = align
        self.use_direct = use_direct and hasattr(os, "O_DIRECT")
        self.hook = hook
        self._buffered: dict[str, int] = {}
        self._direct: dict[str, int | None] = {}
        self._direct_ok: set[str] = set()  # files where an O_DIRECT read has succeeded
        #: path -> why O_DIRECT is not used for it (refused at open / EINVAL on read)
        self.direct_fallbacks: dict[str, str] = {}
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes_read = 0

    # -- descriptors --------------------------------------------------------------
    def fd(self, path: str) -> int:
        """Buffered read descriptor for ``path`` (opened on first use)."""
        fd = self._buffered.get(path)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._buffered.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise ReadError(
                        f"Cannot open checkpoint file {path} for reading: {e.strerror or e}. "
                        f"It was readable when the checkpoint was indexed; check that the disk "
                        f"is still mounted and the file was not moved, then re-run."
                    ) from None
                self._buffered[path] = fd
            return fd

    def direct_fd(self, path: str) -> int | None:
        """``O_DIRECT`` descriptor for ``path``, or None when O_DIRECT is unavailable."""
        if not self.use_direct:
            return None
        if path in self._direct:
            return self._direct[path]
        with self._lock:
            if path not in self._direct:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    if not os.path.exists(path):
                        raise ReadError(
                            f"Cannot open checkpoint file {path} for reading: it no longer "
                            f"exists. Check that the disk is mounted and the file was not "
                            f"moved, then re-run."
                        ) from None
                    fd = None
                    self.direct_fallbacks[path] = f"O_DIRECT open refused: {e.strerror or e}"
                self._direct[path] = fd
            return self._direct[path]

    def direct_active(self, path: str) -> bool:
        """Whether reads of ``path`` via :meth:`read_direct` use O_DIRECT (opens it)."""
        return self.direct_fd(path) is not None

    def _drop_direct(self, path: str, reason: str) -> None:
        with self._lock:
            fd = self._direct.get(path)
            self._direct[path] = None
            self.direct_fallbacks[path] = reason
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            fds = list(self._buffered.values()) + [f for f in self._direct.values() if f is not None]
            self._buffered.clear()
            self._direct.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "ShardFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- primitive (override or hook for failure injection) ---------------------------
    def _pread_once(self, path: str, fd: int, view: memoryview, offset: int, direct: bool) -> int:
        """One read syscall into ``view`` at ``offset``; returns the byte count."""
        n = len(view)
        if self.hook is not None:
            allow = self.hook(path, offset, n, direct)
            if allow is not None:
                allow = max(0, min(int(allow), n))
                if allow == 0:
                    return 0
                if not direct:
                    return os.preadv(fd, [view[:allow]], offset)
                # O_DIRECT needs aligned sizes: read it all, report only `allow`.
                return min(os.preadv(fd, [view], offset), allow)
        return os.preadv(fd, [view], offset)

    def _error(self, path, offset, nbytes, what, detail) -> ReadError:
        tname = f" (tensor {what!r})" if what else ""
        return ReadError(
            f"Reading {nbytes} bytes at offset {offset} of checkpoint file {path}{tname} "
            f"failed: {detail}. The weights of this run are incomplete, so its output is "
            f"invalid and k3 stops here; check the disk and the file (dmesg, file size "
            f"against the published one), then re-run."
        )

    def _os_error(self, path, req: tuple[int, int], what, e: OSError) -> ReadError:
        return self._error(path, req[0], req[1], what, f"{e.strerror or e} (errno {e.errno})")

    def _read_loop(self, path: str, fd: int, mv: memoryview, offset: int, what: str | None, req: tuple[int, int]) -> None:
        n = len(mv)
        done = 0
        while done < n:
            try:
                got = self._pread_once(path, fd, mv[done : done + min(n - done, MAX_CHUNK)], offset + done, False)
            except OSError as e:
                raise self._os_error(path, req, what, e) from e
            if got <= 0:
                raise self._error(
                    path, req[0], req[1], what,
                    f"the file ended after {offset + done - req[0]} of the {req[1]} bytes "
                    f"(end of file at offset {offset + done})",
                )
            done += got
        self.reads += 1
        self.bytes_read += n

    # -- public reads ------------------------------------------------------------------
    def read_into(self, src: Source, out) -> memoryview:
        """Read ``src`` (a TensorInfo or ``(file, offset, nbytes)``) into ``out``.

        ``out`` is any writable C-contiguous buffer (numpy array, bytearray,
        memoryview, contiguous CPU torch tensor) of at least ``nbytes`` bytes; the
        bytes land at its start. Returns a byte memoryview of the filled part.
        """
        path, offset, nbytes, what = _unpack(src)
        mv = _as_byte_view(out)
        if len(mv) < nbytes:
            raise ValueError(f"read target has {len(mv)} bytes, {nbytes} needed")
        mv = mv[:nbytes]
        if nbytes:
            self._read_loop(path, self.fd(path), mv, offset, what, (offset, nbytes))
        return mv

    def read_bytes(self, src: Source) -> np.ndarray:
        """Read ``src`` into a fresh uint8 array."""
        _, _, nbytes, _ = _unpack(src)
        out = np.empty(nbytes, dtype=np.uint8)
        self.read_into(src, out)
        return out

    def read_direct(self, file, offset: int | None = None, nbytes: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """O_DIRECT read of ``[offset, offset+nbytes)``; returns a uint8 view of the payload.

        ``file`` may also be a TensorInfo (then omit offset/nbytes). The read is
        widened to ``align`` boundaries (see :func:`direct_span`) into ``out`` — a
        1-D uint8 numpy array whose data pointer is aligned and which holds at least
        the widened length — or into a fresh :func:`aligned_empty` buffer. The
        returned view is ``out[lead:lead+nbytes]``; bytes around it are whatever the
        file holds there. Falls back to buffered reads when O_DIRECT is unavailable.
        """
        if isinstance(file, TensorInfo):
            path, offset, nbytes, what = file.file, file.offset, file.nbytes, file.name
        else:
            path, what = os.fspath(file), None
            if offset is None or nbytes is None:
                raise ValueError("read_direct needs offset and nbytes unless given a TensorInfo")
        a = self.align
        start, length, lead = direct_span(offset, nbytes, a)
        if out is None:     # a tensor that will live here: weights, streamed by the kernels
            out = aligned_empty(length, a, huge=True)
        else:
            if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
                raise ValueError("read_direct target must be a contiguous 1-D uint8 numpy array")
            if out.ctypes.data % a:
                raise ValueError(f"read_direct target is not {a}-byte aligned (use aligned_empty)")
            if out.size < length:
                raise ValueError(f"read_direct target has {out.size} bytes, widened read needs {length}")
        payload = out[lead : lead + nbytes]
        if nbytes == 0:
            return payload
        fd = self.direct_fd(path)
        if fd is None:
            self._read_loop(path, self.fd(path), memoryview(payload), offset, what, (offset, nbytes))
            return payload

        mv = memoryview(out)[:length]
        need = lead + nbytes  # bytes of the widened span that must arrive
        done = 0
        while done < need:
            try:
                got = self._pread_once(path, fd, mv[done : done + min(length - done, MAX_CHUNK)], start + done, True)
            except OSError as e:
                if e.errno == errno.EINVAL and path not in self._direct_ok:
                    # File system accepts the O_DIRECT flag but not the I/O: go buffered.
                    self._drop_direct(path, f"O_DIRECT read refused: {e.strerror or e}")
                    self._read_loop(path, self.fd(path), memoryview(payload), offset, what, (offset, nbytes))
                    return payload
                raise self._os_error(path, (offset, nbytes), what, e) from e
            if got <= 0:
                break
            if not done:
                self._direct_ok.add(path)  # O_DIRECT works here; later EINVAL is a real error
            done += got
            if got % a:
                break  # unaligned short read (end of file): O_DIRECT cannot continue from here
        if done < need:
            # Finish the payload through the buffered descriptor; a real end of file
            # before the payload ends is reported there as a ReadError.
            frm = max(done, lead)
            self._read_loop(path, self.fd(path), mv[frm:need], start + frm, what, (offset, nbytes))
        else:
            self.reads += 1
            self.bytes_read += done
        return payload


DIRECT_MIN_BYTES = 1 << 20


def load_tensor(info: TensorInfo, reader: ShardFiles | None = None, direct: bool = False) -> torch.Tensor:
    """Read ``info`` into a new torch tensor of its dtype and shape (owns its memory).

    With ``direct`` (and a reader), tensors of at least 1 MiB are read with O_DIRECT
    into an aligned buffer that the tensor then lives in (widened by < 8 KiB): cold
    reads run at device speed and the page cache is not filled with bytes that are
    about to be held in RAM anyway."""
    dt = TORCH_DTYPES.get(info.dtype)
    if dt is None:  # unreachable for headers parsed by read_header
        raise ValueError(f"no torch dtype for safetensors dtype {info.dtype!r}")
    if direct and reader is not None and info.nbytes >= DIRECT_MIN_BYTES:
        payload = reader.read_direct(info)
        if payload.ctypes.data % info.itemsize == 0:
            return torch.from_numpy(payload).view(dt).reshape(info.shape)
        return torch.from_numpy(payload.copy()).view(dt).reshape(info.shape)
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    if reader is None:
        with ShardFiles(use_direct=False) as r:
            r.read_into(info, buf)
    else:
        reader.read_into(info, buf)
    return buf.view(dt).reshape(info.shape)


def load_tensors(infos, reader: ShardFiles) -> list[torch.Tensor]:
    """Read several tensors (a layer's matrices) into ONE buffer, each with O_DIRECT into
    its own align-widened span, the buffer's whole 2 MiB pages advised as transparent
    huge pages (``aligned_empty``). Tensors read one by one got huge pages only when each
    was 2 MiB or more: the small matrices of small and mid-sized models sat in 4 KiB
    pages, one TLB entry per 4 KiB while a kernel streams them. Returns the tensors in ``infos``' order, views of the buffer
    (they keep it alive), each of its dtype and shape."""
    infos = list(infos)
    spans = [direct_span(i.offset, i.nbytes, reader.align)[1] for i in infos]
    arena = aligned_empty(sum(spans), reader.align, huge=True)
    out, at = [], 0
    for info, n in zip(infos, spans):
        dt = TORCH_DTYPES.get(info.dtype)
        if dt is None:  # unreachable for headers parsed by read_header
            raise ValueError(f"no torch dtype for safetensors dtype {info.dtype!r}")
        payload = reader.read_direct(info, out=arena[at:at + n])
        if payload.ctypes.data % info.itemsize:
            payload = payload.copy()
        out.append(torch.from_numpy(payload).view(dt).reshape(info.shape))
        at += n
    return out


class FaultHook:
    """A :data:`ReadHook` that injects one kind of read failure.

    ``kind``: ``"eio"`` raises ``OSError(EIO)``; ``"eof"`` makes the syscall return
    0 bytes (premature end of file); ``"short"`` cuts the syscall to
    ``short_bytes`` (default: half, at least 1) — a correct reader continues and
    still returns the right bytes.

    A read syscall matches when ``file`` is None or equals its path (or its base
    name), and ``at`` is None or lies in ``[offset, offset+nbytes)``. The first
    ``after`` matching calls pass untouched; then up to ``times`` (None: all) fire.
    ``direct`` restricts to O_DIRECT (True) or buffered (False) calls.
    ``calls``/``fired`` count matching calls and injected faults.
    """

    def __init__(
        self,
        kind: str = "eio",
        *,
        file: str | os.PathLike | None = None,
        at: int | None = None,
        after: int = 0,
        times: int | None = None,
        short_bytes: int | None = None,
        direct: bool | None = None,
    ):
        if kind not in ("eio", "eof", "short"):
            raise ValueError(f"unknown fault kind {kind!r} (eio, eof, short)")
        self.kind = kind
        self.file = os.fspath(file) if file is not None else None
        self.at = at
        self.after = after
        self.times = times
        self.short_bytes = short_bytes
        self.direct = direct
        self.calls = 0
        self.fired = 0
        self._lock = threading.Lock()

    def _matches(self, path: str, offset: int, nbytes: int, direct: bool) -> bool:
        if self.file is not None and path != self.file and os.path.basename(path) != self.file:
            return False
        if self.at is not None and not (offset <= self.at < offset + nbytes):
            return False
        if self.direct is not None and direct != self.direct:
            return False
        return True

    def __call__(self, path: str, offset: int, nbytes: int, direct: bool) -> int | None:
        if not self._matches(path, offset, nbytes, direct):
            return None
        with self._lock:
            self.calls += 1
            if self.calls <= self.after or (self.times is not None and self.fired >= self.times):
                return None
            self.fired += 1
        if self.kind == "eio":
            raise OSError(errno.EIO, "Input/output error (injected)")
        if self.kind == "eof":
            return 0
        return self.short_bytes if self.short_bytes is not None else max(1, nbytes // 2)
