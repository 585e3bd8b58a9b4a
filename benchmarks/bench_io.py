"""Read rates of this machine's checkpoint device, and of the trunk streamer on it.

Arms (every one O_DIRECT into 4096-aligned buffers, so the page cache plays no part):
  seq            one file read front to back in --seq-chunk requests (default 64 MiB),
                 one request at a time (queue depth 1)
  seq-qd4        the same span in 8 MiB requests, 4 in flight (how the streamer reads)
  seq-fresh      8 MiB requests, one at a time, into a newly allocated buffer each
                 rep, like the first read into a ring slot or pinned buffer (page faults
                 on first touch; on this VM they cost about as much as the read itself)
  rand-qdN       random expert-sized reads (the model's routed expert bytes, 17.5 MB for
                 K3 shapes; 4096-aligned offsets spread over all shards by size) with N
                 threads each issuing preads back to back: N = 1, 4, 16
  stream-ioN     TrunkStreamer over a packed trunk of the model with a ring of 2 slots
                 and nothing pinned, no compute between layers (pure read throughput),
                 after one untimed pass: GB read / wall seconds, io_threads N = 1, 4, 8 (8 MiB chunks); also
                 4 threads at 4, 16, 64 MiB chunks
  pack           `k3 pack-trunk` of the model (only when it has to create the trunk)

Caveat for virtual machines: the hypervisor may serve recently written or read blocks
from its own cache, so rates on a small checkpoint that was just synthesized can exceed
the device's cold rate (on the 2-core dev VM: ~3 GB/s warm vs ~1.4 GB/s on the first
read of a freshly packed trunk). Use a checkpoint much larger than the host's cache, or
note which you measured.

Each arm runs --reps times (default 3) after one untimed warm-up request; every rep goes
to benchmarks/results/io.tsv (appended, with a run id); the table shows median, min and
max. Other people's jobs share the machine: the load average is recorded per rep.

    python benchmarks/bench_io.py [--model /work/rd4] [--trunk /work/rd4-trunk] [--reps 3]
                                  [--quick] [--no-stream] [--tsv PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3.checkpoint.io import ALIGN, ShardFiles, aligned_empty  # noqa: E402
from k3.checkpoint.safetensors import CheckpointIndex  # noqa: E402
from k3.config import load_config  # noqa: E402
from k3.memory.planner import min_budget_for, plan_trunk  # noqa: E402
from k3.memory.trunk import PackedTrunk, TrunkStreamer, pack_trunk  # noqa: E402
from k3.schema import expert_nbytes  # noqa: E402

MiB = 1 << 20


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Tsv:
    COLS = ["run", "arm", "param", "chunk_bytes", "rep", "bytes", "seconds", "GBps", "load1", "note"]

    def __init__(self, path: Path):
        self.path = path
        self.run = time.strftime("%Y%m%dT%H%M%S")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.stat().st_size == 0:
            path.write_text("\t".join(self.COLS) + "\n")

    def add(self, arm, param, chunk, rep, nbytes, seconds, note=""):
        row = [self.run, arm, str(param), str(chunk), str(rep), str(nbytes), f"{seconds:.4f}",
               f"{nbytes / seconds / 1e9:.3f}", f"{loadavg():.2f}", note]
        with open(self.path, "a") as f:
            f.write("\t".join(row) + "\n")


def seq_read(reader: ShardFiles, path: str, span: int, chunk: int, depth: int) -> float:
    """Read [0, span) of `path` in `chunk` requests, `depth` in flight; returns seconds."""
    offs = list(range(0, span, chunk))
    bufs = [aligned_empty(chunk) for _ in range(depth)]
    t0 = time.perf_counter()
    if depth == 1:
        for o in offs:
            n = min(chunk, span - o)
            reader.read_direct(path, o, n, out=bufs[0])
    else:
        def work(k):
            buf = bufs[k]
            for o in offs[k::depth]:
                reader.read_direct(path, o, min(chunk, span - o), out=buf)
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(work, range(depth)))
    return time.perf_counter() - t0


def random_reads(reader: ShardFiles, files: list[tuple[str, int]], size: int, count: int, depth: int,
                 rng: random.Random) -> float:
    """`count` reads of `size` bytes at random aligned offsets, `depth` threads; seconds."""
    total = sum(s - size for _, s in files if s > size)
    picks = []
    for _ in range(count):
        x = rng.randrange(total)
        for p, s in files:
            if s <= size:
                continue
            if x < s - size:
                picks.append((p, x // ALIGN * ALIGN))
                break
            x -= s - size
    bufs = [aligned_empty(size + ALIGN) for _ in range(depth)]

    def work(k):
        for p, o in picks[k::depth]:
            reader.read_direct(p, o, size, out=bufs[k])

    t0 = time.perf_counter()
    if depth == 1:
        work(0)
    else:
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(work, range(depth)))
    return time.perf_counter() - t0


def stream_rate(pt: PackedTrunk, io_threads: int, chunk: int, passes: int) -> tuple[int, float, dict]:
    budget = min_budget_for(pt.layer_bytes, 2)
    with TrunkStreamer(pt, plan_trunk(pt.layer_bytes, budget, 2), io_threads=io_threads, chunk_bytes=chunk) as s:
        assert s.plan.ring_slots == 2
        for i in range(pt.n_layers):  # warm-up pass: both slots faulted in (see seq-fresh)
            s.layer(i)
            s.release_layer(i)
        b0 = s.stats()["bytes_read"]
        t0 = time.perf_counter()
        for _ in range(passes):
            for i in range(pt.n_layers):
                s.layer(i)
                s.release_layer(i)
        dt = time.perf_counter() - t0
        st = s.stats()
        return st["bytes_read"] - b0, dt, st


def summary(rows):
    vals = [r[2] for r in rows]
    return statistics.median(vals), min(vals), max(vals)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/work/rd4", help="checkpoint whose shards are read (default /work/rd4)")
    ap.add_argument("--trunk", default=None, help="packed trunk dir (default: <model>-trunk, packed if missing)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq-chunk", type=int, default=64, help="MiB per sequential request (default 64)")
    ap.add_argument("--quick", action="store_true", help="smaller spans and fewer reads")
    ap.add_argument("--no-stream", action="store_true", help="skip the packed-trunk streaming arms")
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "io.tsv"))
    args = ap.parse_args(argv)

    cfg = load_config(args.model)
    ix = CheckpointIndex.open(args.model)
    files = sorted(((p, os.path.getsize(p)) for p in ix.shards()), key=lambda x: -x[1])
    tsv = Tsv(Path(args.tsv))
    reader = ShardFiles()
    big, big_size = files[0]
    if not reader.direct_active(big):
        print(f"warning: O_DIRECT is not available for {big}; rates include the page cache", file=sys.stderr)
    span = min(big_size // ALIGN * ALIGN, (512 if args.quick else 2048) * MiB)
    esize = expert_nbytes(cfg)
    if esize < 8 * MiB:  # not K3 shapes: use K3's expert size
        esize = 17_551_360
    esize = align_up(esize)
    n_rand = 16 if args.quick else 48
    results: dict[str, list] = {}
    print(f"device read rates: {args.model} ({len(files)} shards, largest {big_size / 1e9:.2f} GB), "
          f"{args.reps} reps, load {loadavg():.2f}", file=sys.stderr)

    def record(arm, param, chunk, rep, nbytes, dt, note=""):
        tsv.add(arm, param, chunk, rep, nbytes, dt, note)
        results.setdefault(arm, []).append((rep, nbytes, nbytes / dt / 1e9))
        print(f"  {arm:<16} rep {rep}: {nbytes / 1e9:6.2f} GB in {dt:6.2f} s = {nbytes / dt / 1e9:5.2f} GB/s"
              f"  (load {loadavg():.2f})", file=sys.stderr)

    seq_chunk = args.seq_chunk * MiB
    seq_read(reader, big, seq_chunk, seq_chunk, 1)  # warm-up
    for rep in range(args.reps):
        record("seq", "qd1", seq_chunk, rep, span, seq_read(reader, big, span, seq_chunk, 1))
    for rep in range(args.reps):
        record("seq-qd4", "qd4", 8 * MiB, rep, span, seq_read(reader, big, span, 8 * MiB, 4))
    fresh_span = min(span, 1 << 30)
    for rep in range(args.reps):
        t0 = time.perf_counter()
        buf = aligned_empty(fresh_span)
        for o in range(0, fresh_span, 8 * MiB):
            n = min(8 * MiB, fresh_span - o)
            reader.read_direct(big, o, n, out=buf[o : o + n])
        dt = time.perf_counter() - t0
        del buf
        record("seq-fresh", "qd1 new buffer", 8 * MiB, rep, fresh_span, dt)
    rng = random.Random(1234)
    for depth in (1, 4, 16):
        random_reads(reader, files, esize, depth, depth, rng)  # warm-up
        for rep in range(args.reps):
            dt = random_reads(reader, files, esize, n_rand, depth, rng)
            record(f"rand-qd{depth}", f"qd{depth}", esize, rep, n_rand * esize, dt)

    if not args.no_stream:
        tdir = Path(args.trunk) if args.trunk else Path(str(Path(args.model).resolve()) + "-trunk")
        if not (tdir / "trunk.json").is_file():
            t0 = time.perf_counter()
            pack_trunk(args.model, tdir, progress=lambda m: print(m, file=sys.stderr))
            dt = time.perf_counter() - t0
            tot = PackedTrunk.open(tdir, cfg, ix).total_bytes
            record("pack", "k3 pack-trunk", 64 * MiB, 0, tot, dt)
        pt = PackedTrunk.open(tdir, cfg, ix)
        passes = 1 if args.quick else 2
        print(f"  trunk {tdir}: {pt.n_layers} layers, {pt.total_bytes / 1e9:.2f} GB, ring 2 x "
              f"{max(pt.layer_bytes) / 1e9:.2f} GB, {passes} passes per rep", file=sys.stderr)
        arms = [(1, 8 * MiB), (4, 8 * MiB), (8, 8 * MiB), (4, 4 * MiB), (4, 16 * MiB), (4, 64 * MiB)]
        for io, chunk in arms:
            name = f"stream-io{io}" + ("" if chunk == 8 * MiB else f"-{chunk // MiB}M")
            for rep in range(args.reps):
                nb, dt, st = stream_rate(pt, io, chunk, passes)
                record(name, f"io_threads={io}", chunk, rep, nb, dt,
                       f"device {st['device_gbps']:.2f} GB/s, direct={st['direct']}")

    print("", file=sys.stderr)
    hdr = f"{'arm':<16} {'request':>10} {'median GB/s':>12} {'min':>7} {'max':>7}  reps"
    print(hdr)
    print("-" * len(hdr))
    for arm, rows in results.items():
        med, lo, hi = summary(rows)
        req = {"seq": f"{seq_chunk // MiB} MiB", "seq-qd4": "8 MiB", "seq-fresh": "8 MiB", "pack": "64 MiB"}.get(
            arm, f"{esize / 1e6:.1f} MB" if arm.startswith("rand") else
            (arm.rsplit("-", 1)[1].replace("M", " MiB") if arm.count("-") == 2 else "8 MiB"))
        print(f"{arm:<16} {req:>10} {med:>12.2f} {lo:>7.2f} {hi:>7.2f}  {len(rows)}")
    print(f"\nwrote {args.tsv} (run {tsv.run})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
