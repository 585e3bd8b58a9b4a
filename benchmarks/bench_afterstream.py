"""What a small call costs right after a weight stream (the glue between decode's kernels).

Decode alternates kernels that stream weights (MB each) with short Python glue
(routing, mixes, tensor bookkeeping). The glue runs far slower right after a stream
than in a hot loop: the stream evicts the glue's code and data from the caches, and
every line it reads next waits on memory, whose latency other programs' load can
multiply. This script measures that cost directly:

  touch      a numba loop reading one byte of each of P distinct 4 KiB pages (an
             anonymous mapping advised MADV_NOHUGEPAGE: P lines, P translations),
             first right after the stream, then again at once (hot)
  route      k3's router selection (``route_topk`` on [1, 64] logits, top-8, as small K3
             decodes), first after the stream, then again
  stream     the stream itself: a numba sum over S MB of a huge-page buffer, a
             different part of a buffer four times the largest S each time (cold)

Each figure is the median of --iters stream/call pairs; --reps repeats the set. One TSV
row per (rep, probe, stream size) in benchmarks/results/afterstream.tsv with the CPU
flags, the kernel release and the 1-minute load. docs/PERFORMANCE.md ("Per-token
overhead", seventeenth session) has what the sandbox VMs give.

    python benchmarks/bench_afterstream.py [--sizes 0,4,32,128] [--pages 64,256] [--iters 60] [--reps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit  # noqa: E402

from benchlib import Tsv, cpu_flags, loadavg  # noqa: E402
from k3.checkpoint.io import aligned_empty  # noqa: E402
from k3.kernels.moe import route_topk  # noqa: E402

MADV_NOHUGEPAGE = 15


@njit(cache=True, nogil=True)
def _stream(a):
    acc = np.zeros(16, np.float32)
    for i in range(0, a.size - 15, 16):
        for lane in range(16):
            acc[lane] += a[i + lane]
    return acc.sum()


@njit(cache=True, nogil=True)
def _touch(a, npages):
    s = 0
    for i in range(npages):
        s += a[i * 4096]
    return s


def small_pages(nbytes: int) -> np.ndarray:
    """An anonymous mapping on 4 KiB pages (THP declined where the kernel allows it), touched
    (the array keeps the mapping alive)."""
    mm = mmap.mmap(-1, nbytes)
    try:
        libc = ctypes.CDLL(None)
        libc.madvise(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(mm))), ctypes.c_size_t(nbytes),
                     MADV_NOHUGEPAGE)
    except (OSError, AttributeError):
        pass
    a = np.frombuffer(mm, np.uint8)
    a[:] = 1
    return a


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0,4,32,128", help="stream sizes in MB (0: no stream)")
    ap.add_argument("--pages", default="64,256", help="distinct 4 KiB pages the touch probe reads")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "afterstream.tsv"))
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    pages = [int(p) for p in args.pages.split(",")]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one core streams and calls, as decode's glue runs on one
    try:
        return _run(args, sizes, pages)
    finally:
        torch.set_num_threads(threads)


def _run(args, sizes, pages) -> int:
    # four times the largest stream (at least 64 MB), so each stream reads a cold part
    big = np.frombuffer(aligned_empty(max(64 << 20, int(4 * max(sizes) * (1 << 20))), huge=True), np.float32)
    big[:] = 1.0
    small = small_pages(max(pages) * 4096)
    logits, bias = torch.randn(1, 64), torch.randn(64)
    _stream(big[:64]), _touch(small, 1), route_topk(logits, bias, 8, True, 2.5)   # compile / warm

    probes = [(f"touch {p} pages", lambda p=p: _touch(small, p)) for p in pages]
    probes.append(("route_topk [1, 64] top-8", lambda: route_topk(logits, bias, 8, True, 2.5)))
    tsv = Tsv(Path(args.tsv), ["rep", "probe", "stream_mb", "iters", "first_us", "hot_us", "stream_gbs",
                               "load_before", "load_after", "kernel", "cpu"])
    flags, kernel = cpu_flags(), platform.release()
    print(f"# {flags}; kernel {kernel}", file=sys.stderr)
    m = statistics.median
    pos = 0
    for rep in range(args.reps):
        for name, probe in probes:
            for mb in sizes:
                n = int(mb * (1 << 20)) // 4
                l0 = loadavg()
                first, hot, st = [], [], []
                for _ in range(args.iters):
                    if n:
                        if pos + n > big.size:
                            pos = 0
                        t0 = time.perf_counter()
                        _stream(big[pos:pos + n])
                        st.append(time.perf_counter() - t0)
                        pos += n
                    t1 = time.perf_counter()
                    probe()
                    t2 = time.perf_counter()
                    probe()
                    t3 = time.perf_counter()
                    first.append(t2 - t1)
                    hot.append(t3 - t2)
                gbs = n * 4 / m(st) / 1e9 if st else float("nan")
                tsv.add(rep=rep, probe=name, stream_mb=mb, iters=args.iters, first_us=m(first) * 1e6,
                        hot_us=m(hot) * 1e6, stream_gbs=gbs, load_before=l0, load_after=loadavg(), kernel=kernel,
                        cpu=flags)
                print(f"rep {rep}  {name:26} after {mb:6.1f} MB: first {m(first) * 1e6:8.1f} us  "
                      f"hot {m(hot) * 1e6:7.1f} us  (stream {gbs:5.1f} GB/s)", file=sys.stderr)
    print(f"wrote {args.tsv} (run {tsv.run})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
