"""Storage probe for `k3 doctor`: how fast can this drive feed the engine?

Two access patterns matter (the C engine's design): the trunk is read sequentially in
large runs, routed experts are read as random expert-sized blocks (17,547,264 bytes
for K3) several at a time. The probe measures both with O_DIRECT (page cache
bypassed, as the engine reads), each for a bounded time:

  * sequential: 8 MiB reads in file order, queue depth 1 and 4;
  * random: expert-sized reads at aligned random offsets, queue depths 1, 4 and 16.

Queue depth n = n threads each issuing one pread at a time (pread releases the GIL).
It reads the model's own shards when a model folder is given (read-only), otherwise
a scratch file written into the target folder and deleted afterwards. Where O_DIRECT
is not supported (tmpfs, some network file systems) it falls back to buffered reads
after dropping the file from the page cache, and says so.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

ALIGN = 4096
K3_EXPERT_BYTES = 17_547_264  # one K3 expert (MXFP4 w1/w2/w3 + scales), as the release stores it
SEQ_BLOCK = 8 << 20


@dataclass
class ProbeResult:
    target: str
    device: str = ""
    rotational: bool | None = None
    direct: bool = True
    files: int = 0
    sequential: dict = field(default_factory=dict)  # queue depth -> MB/s
    random: dict = field(default_factory=dict)  # queue depth -> MB/s
    read_size: int = K3_EXPERT_BYTES
    bytes_read: int = 0
    seconds: float = 0.0
    scratch: bool = False
    note: str = ""

    @property
    def seq_rate(self) -> float:
        """Best sequential rate, bytes/s."""
        return max(self.sequential.values(), default=0.0) * 1e6

    @property
    def random_rate(self) -> float:
        """Random expert-sized reads at queue depth 4 (what the engine's expert
        loader issues), else the best measured; bytes/s."""
        if 4 in self.random:
            return self.random[4] * 1e6
        return max(self.random.values(), default=0.0) * 1e6

    def as_dict(self) -> dict:
        d = asdict(self)
        d["sequential"] = {str(k): v for k, v in self.sequential.items()}
        d["random"] = {str(k): v for k, v in self.random.items()}
        return d


def block_device(path, disk: bool = False) -> tuple[str, bool | None]:
    """(device name, rotational?) of the block device holding `path`, best effort;
    with ``disk``, the whole disk a partition is on (two partitions are one drive)."""
    try:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        sys_path = Path("/sys/dev/block") / dev
        real = sys_path.resolve()
        if disk and (real / "partition").is_file():
            real = real.parent
        name = real.name
        for q in (real / "queue" / "rotational", real.parent / "queue" / "rotational"):
            if q.is_file():
                return name, q.read_text().strip() == "1"
        return name if sys_path.exists() else f"dev {dev}", None
    except (OSError, ValueError):
        return "unknown", None


def _aligned(n: int):
    from .buffers import aligned_empty
    return aligned_empty(n, ALIGN)


class _Files:
    """Open descriptors of the probed files, O_DIRECT when possible."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = list(paths)
        self.sizes = [p.stat().st_size for p in self.paths]
        self.direct = hasattr(os, "O_DIRECT")
        self.fds = []
        for p in self.paths:
            fd = None
            if self.direct:
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                    buf = _aligned(ALIGN)
                    os.preadv(fd, [memoryview(buf)], 0)
                except OSError:
                    if fd is not None:
                        os.close(fd)
                    fd = None
                    self.direct = False
            if fd is None:
                fd = os.open(p, os.O_RDONLY)
            self.fds.append(fd)
        if not self.direct:  # all buffered then, with the cache dropped
            for i, p in enumerate(self.paths):
                os.close(self.fds[i])
                self.fds[i] = os.open(p, os.O_RDONLY)
            self.drop_cache()

    def drop_cache(self) -> None:
        if self.direct or not hasattr(os, "posix_fadvise"):
            return
        for fd in self.fds:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _run_threads(qd: int, seconds: float, max_bytes: int, next_job, size: int, files: _Files) -> tuple[int, float]:
    """Run `qd` reader threads until `seconds` or `max_bytes`; returns (bytes, s)."""
    lock = threading.Lock()
    total = [0]
    errors: list[BaseException] = []
    deadline = time.perf_counter() + seconds

    def worker():
        buf = _aligned(size)
        mv = memoryview(buf)
        try:
            while time.perf_counter() < deadline:
                with lock:
                    if total[0] >= max_bytes:
                        return
                    job = next_job()
                    if job is None:
                        return
                    total[0] += job[2]
                fi, off, n = job
                got = os.preadv(files.fds[fi], [mv[:n]], off)
                if got <= 0:
                    return
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(qd)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return total[0], dt


def probe_storage(target, files: Sequence[Path] | None = None, *, seconds: float = 8.0,
                  read_size: int = K3_EXPERT_BYTES, scratch_bytes: int = 512 << 20,
                  seq_qds: Sequence[int] = (1, 4), random_qds: Sequence[int] = (1, 4, 16),
                  seed: int = 0) -> ProbeResult:
    """Measure `files` (e.g. the model's shards), or a scratch file written into the
    folder `target` when none are given. `seconds` is the whole probe's time budget."""
    target = Path(target)
    read_size = max(ALIGN, read_size - read_size % ALIGN)
    res = ProbeResult(str(target), read_size=read_size)
    res.device, res.rotational = block_device(target)
    scratch = None
    paths = [Path(f) for f in (files or []) if Path(f).is_file() and Path(f).stat().st_size >= read_size + ALIGN]
    if not paths:
        free = shutil.disk_usage(target).free
        size = min(scratch_bytes, max(0, free - (1 << 30)))
        size -= size % ALIGN
        if size < read_size + ALIGN:
            res.note = "not enough free space for a scratch file; storage not measured"
            return res
        scratch = target / f".k3-probe-{os.getpid()}.tmp"
        block = os.urandom(1 << 20)
        try:
            with open(scratch, "wb") as f:
                for _ in range(size // len(block)):
                    f.write(block)
                f.write(block[: size % len(block)])
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            scratch.unlink(missing_ok=True)
            res.note = f"could not write a scratch file in {target} ({e.strerror}); storage not measured"
            return res
        paths = [scratch]
        res.scratch = True
    fs = _Files(paths)
    res.direct = fs.direct
    res.files = len(paths)
    if not fs.direct:
        res.note = "O_DIRECT is not supported here: buffered reads after dropping the page cache (may overstate)"
    n_tests = len(seq_qds) + len(random_qds)
    slot = seconds / max(1, n_tests)
    t_start = time.perf_counter()
    try:
        # sequential: consecutive 8 MiB blocks through the files in order
        for qd in seq_qds:
            fs.drop_cache()
            state = {"fi": 0, "off": 0}

            def next_seq():
                while state["fi"] < len(paths):
                    fi, off = state["fi"], state["off"]
                    n = min(SEQ_BLOCK, fs.sizes[fi] - off)
                    n -= n % ALIGN
                    if n > 0:
                        state["off"] = off + n
                        return fi, off, n
                    state["fi"], state["off"] = fi + 1, 0
                return None

            nbytes, dt = _run_threads(qd, slot, 1 << 62, next_seq, SEQ_BLOCK, fs)
            res.sequential[qd] = nbytes / dt / 1e6 if dt > 0 else 0.0
            res.bytes_read += nbytes
        # random expert-sized reads
        rng = random.Random(seed)
        for qd in random_qds:
            fs.drop_cache()

            def next_rand():
                fi = rng.randrange(len(paths))
                hi = (fs.sizes[fi] - read_size) // ALIGN
                return fi, rng.randint(0, max(0, hi)) * ALIGN, read_size

            nbytes, dt = _run_threads(qd, slot, 1 << 62, next_rand, read_size, fs)
            res.random[qd] = nbytes / dt / 1e6 if dt > 0 else 0.0
            res.bytes_read += nbytes
    finally:
        fs.close()
        if scratch is not None:
            scratch.unlink(missing_ok=True)
    res.seconds = time.perf_counter() - t_start
    return res


def memory_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """A STREAM-like read probe: the best GB/s (1e9 bytes) of ``reps`` sums over an fp32
    array of ``nbytes`` on torch's threads. A decode step at T = 1 reads each weight
    once, so this is the rate a memory-bound kernel can hope for (docs/PERFORMANCE.md)."""
    import time

    import torch
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(reps + 1):  # the first pass also faults the pages in
        t0 = time.perf_counter()
        float(a.sum())
        dt = time.perf_counter() - t0
        best = max(best, a.numel() * 4 / dt / 1e9)
    return best


#: above this many microseconds a line, the doctor says cold reads are slow here
SLOW_READ_US = 0.4
#: the lines cold_reads_after_stream reads by default
COLD_LINES = 256


def cold_reads_after_stream(stream_bytes: int = 128 << 20, lines: int = COLD_LINES,
                            reps: int = 7) -> tuple[float, float]:
    """What reading ``lines`` cache lines, one in each of as many 4 KiB pages, costs right
    after a weight-sized stream, and at once again: (first, hot) in microseconds,
    medians of ``reps``.

    Decode alternates kernels that stream weights with short glue (Python, torch
    bookkeeping) whose code and data lie scattered over many lines. The stream evicts
    them from the caches, so the glue then waits on memory line by line: ~0.1 us a line
    on a quiet machine, several times that where other tenants load the memory, which
    then multiplies a small model's per-token glue (docs/PERFORMANCE.md, "Per-token
    overhead"). One thread; the stream is a numpy sum over a part of
    a buffer twice its size, a new part each time."""
    import statistics
    import time

    import numpy as np
    n = stream_bytes // 4
    big = np.ones(2 * n, np.float32)
    small = np.ones(lines * 4096, np.uint8)
    idx = np.arange(lines) * 4096
    first, hot = [], []
    for r in range(reps + 1):                   # the first round faults the pages in
        o = (r % 2) * n
        float(big[o:o + n].sum())
        t0 = time.perf_counter()
        int(small[idx].sum())
        t1 = time.perf_counter()
        int(small[idx].sum())
        t2 = time.perf_counter()
        if r:
            first.append((t1 - t0) * 1e6)
            hot.append((t2 - t1) * 1e6)
    return statistics.median(first), statistics.median(hot)
