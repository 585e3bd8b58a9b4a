"""Shared harness for the streaming benchmarks (memory_ladder.py, split_sweep.py, bars).

* `run_k3`      one `k3 run ... --out JSON`, optionally inside a fresh cgroup-v1 memory
                group with a hard ceiling (the ceiling counts page cache too, which is
                the point: a budget that only fits because the kernel caches the
                checkpoint is not a budget). The group is removed afterwards.
* `metrics`     the figures every table uses, scraped from the run's JSON:
                decode s/token (steps after the prefill step), warm s/token (steps
                after the first decode step), bytes read during decode and their rate,
                pinned layers, cache slots, expert hit %, GB read/token, peak RSS,
                I/O share, generated ids.
* `Tsv`         append-only TSV writer (one row per rep, a run id per invocation).
* stats         mean / sd / spread = (max - min) / mean, Spearman rho (average ranks).
* `device_rate` a reduced bench_io: O_DIRECT sequential QD1 (64 MiB) and random
                expert-sized reads at QD1/4/16, best median per arm, measured now.
* `plot`        a PNG if matplotlib is importable (optional: `pip install matplotlib`).

The 33 % noise floor (docs/BENCHMARKS.md): three identical runs of the reference engine
spread 33 % in s/token; on this 2-core VM shared with other jobs, expect the same.
Claim direction only from rank correlation, magnitude only with replication.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
K3 = str(ROOT / ".venv" / "bin" / "k3")
if not os.path.exists(K3):
    K3 = "k3"
CGROUP_V1 = Path("/sys/fs/cgroup/memory")

# A prompt inside a realdims synth's vocabulary (2304 ids) -- the reference engine's
# ladder prompt 1008,10484,318,15383,387 with the two out-of-vocabulary ids replaced.
DEFAULT_IDS = "1008,104,318,1538,387"
GB = 1e9


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def cgroup_available() -> bool:
    return (CGROUP_V1 / "cgroup.procs").exists() and os.access(CGROUP_V1, os.W_OK)


def run_k3(model: str, flags: list[str], *, ceiling_gb: float | None = None,
           ids: str = DEFAULT_IDS, gen: int = 4, tag: str = "run",
           workdir: Path | None = None, timeout: float = 1800, raw: bool = False) -> dict:
    """Run `k3 run MODEL --greedy --incremental --ids IDS --gen GEN FLAGS --out JSON`
    (`raw`: `k3 run MODEL FLAGS --out JSON`, the flags say everything).

    Returns the JSON (plus `_rc`, `_wall`, `_log`, `_ceiling_gb`, `_load1`); on failure the
    dict holds only the underscore keys and `_error`.
    """
    workdir = workdir or Path(os.environ.get("K3_BENCH_TMP", "/tmp/k3bench"))
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = f"{tag}-{os.getpid()}-{int(time.time() * 1000)}"
    out = workdir / f"{stamp}.json"
    log = workdir / f"{stamp}.log"
    if len(ids) > 60_000:  # past what one command-line argument may hold
        ids_file = workdir / f"{stamp}.ids"
        ids_file.write_text(ids)
        ids = f"@{ids_file}"
    cmd = [K3, "run", model, *([] if raw else ["--greedy", "--incremental", "--ids", ids, "--gen", str(gen)]),
           *flags, "--out", str(out)]
    group = None
    if ceiling_gb is not None:
        if not cgroup_available():
            raise RuntimeError("cgroup v1 memory controller not writable: cannot apply a ceiling")
        group = make_group(ceiling_gb)
        cmd = in_group(group, cmd)
    load1 = loadavg()
    t0 = time.perf_counter()
    try:
        with open(log, "w") as lf:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout).returncode
    finally:
        wall = time.perf_counter() - t0
        failcnt, maxu = drop_group(group) if group is not None else (None, None)
    meta = {"_rc": rc, "_wall": wall, "_log": str(log), "_ceiling_gb": ceiling_gb, "_load1": load1,
            "_cg_failcnt": failcnt, "_cg_max_usage": maxu, "_cmd": " ".join(cmd)}
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
        meta["_error"] = f"rc={rc}: {tail}"
        return meta
    d = json.loads(out.read_text())
    d.update(meta)
    return d


def pool_parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """The arguments every benchmark on the 896-pool realdims checkpoint takes: the model,
    its packed trunk, the reps and the memory caps."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--trunk", required=True)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--caps", default="stream,pinned")
    return ap


def make_group(ceiling_gib: float, tag: str = "") -> Path:
    """A fresh cgroup-v1 memory group with a hard ceiling of ``ceiling_gib`` GiB."""
    g = CGROUP_V1 / f"k3bench_{tag}{os.getpid()}_{int(time.time() * 1000) % 10**9}"
    g.mkdir()
    (g / "memory.limit_in_bytes").write_text(str(int(ceiling_gib * (1 << 30))))
    return g


def in_group(group: Path, cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that it runs inside ``group``."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *cmd]


def drop_group(group: Path) -> tuple[int | None, int | None]:
    """Remove ``group`` (once its processes are gone); returns (failcnt, peak usage bytes)."""
    failcnt = _read_int(group / "memory.failcnt")
    maxu = _read_int(group / "memory.max_usage_in_bytes")
    for _ in range(50):
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    return failcnt, maxu


def _read_int(p: Path):
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return None


def metrics(d: dict) -> dict:
    """Per-run figures from a `k3 run --out` JSON (see module doc)."""
    if "_error" in d:
        return {"ok": False, "error": d["_error"].strip().splitlines()[-1:] or [""], "rc": d["_rc"]}
    steps = d["steps"]
    secs = d["step_seconds"]
    n = len(secs)
    dec = secs[1:] if n > 1 else secs
    warm = secs[2:] if n > 2 else dec
    tr = d.get("trunk") or {}
    ec = d.get("expert_cache") or {}
    # Trunk bytes per step: every step binds each unpinned layer once (incremental decode),
    # pinned layers are read once, before/at the first step. So the streamed share of the
    # whole-run trunk bytes splits evenly over the steps.
    tb = d.get("trunk_bytes_read") or 0
    pinned_b = tr.get("pinned_bytes", 0) or 0
    # Resident trunk (no streamer stats): trunk_bytes_read is the one-off load, not decode.
    streamed = max(0, tb - pinned_b) if tr.get("layer_reads") else 0
    trunk_dec = streamed * (len(dec) / n) if n > 1 else streamed
    exp_dec = sum(s.get("expert_bytes_read", 0) for s in steps[1:]) if n > 1 else d.get("expert_bytes_read", 0)
    dec_s = sum(dec)
    req = sum(s.get("expert_requests", 0) for s in steps[1:])
    hits = sum(s.get("expert_hits", 0) for s in steps[1:])
    return {
        "ok": True,
        "s_tok": statistics.fmean(dec),            # decode mean (steps 1..)
        "s_tok_warm": statistics.fmean(warm),      # steps 2.. (after the first decode step)
        "s_tok_all": d["seconds_per_token"],
        "prefill_s": secs[0],
        "dec_gb": (trunk_dec + exp_dec) / GB,
        # every byte the decode steps read: trunk, experts and streamed tables, as each step reports it
        "dec_read_gb": (sum(s.get("bytes_read", 0) for s in steps[1:]) if n > 1 else d.get("bytes_read", 0)) / GB,
        "dec_gbps": (trunk_dec + exp_dec) / dec_s / GB if dec_s > 0 else float("nan"),
        "trunk_gb_tok": trunk_dec / max(1, len(dec)) / GB,
        "expert_gb_tok": exp_dec / max(1, len(dec)) / GB,
        "pinned": tr.get("pinned", 0), "n_layers": tr.get("n_layers", d.get("layers")),
        "ring": tr.get("ring_slots", 0), "pinned_gb": pinned_b / GB,
        "slots": ec.get("n_slots", 0),
        "hit_pct": 100.0 * hits / req if req else 0.0,
        "peak_rss_gb": d["peak_rss_bytes"] / GB,
        "io_share": 100.0 * (d.get("io_share") or 0.0),
        "trunk_gb": (d.get("trunk_budget_bytes") or 0) / GB,
        "cache_gb": (d.get("cache_budget_bytes") or 0) / GB,
        "preset": d.get("preset"),
        "ids": ",".join(map(str, d["generated_ids"])),
        "cg_max_gb": (d["_cg_max_usage"] / GB) if d.get("_cg_max_usage") else float("nan"),
        "failcnt": d.get("_cg_failcnt"),
        "load1": d.get("_load1", float("nan")),
        "wall": d.get("_wall", float("nan")),
    }


# ---------------------------------------------------------------- TSV + stats

class Tsv:
    def __init__(self, path: Path, cols: list[str]):
        self.path = Path(path)
        self.cols = ["run"] + cols
        self.run = time.strftime("%Y%m%dT%H%M%S")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.path.write_text("\t".join(self.cols) + "\n")
            return
        with open(self.path) as f:
            head = f.readline().rstrip("\n").split("\t")
        if head == self.cols:
            return
        if self.cols[:len(head)] != head:
            raise SystemExit(f"{self.path}: its columns ({', '.join(head)}) are not these "
                             f"({', '.join(self.cols)}); pass another file")
        # columns added at the end: the header grows, older rows leave them empty
        text = self.path.read_text()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\t".join(self.cols) + "\n" + text.split("\n", 1)[1])
        os.replace(tmp, self.path)

    def add(self, **row):
        vals = [self.run] + [_fmt(row.get(c, "")) for c in self.cols[1:]]
        with open(self.path, "a") as f:
            f.write("\t".join(vals) + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}" if abs(v) >= 1000 or abs(v) < 0.01 and v != 0 else f"{v:.3f}"
    return str(v)


def mean_sd_spread(xs: list[float]) -> tuple[float, float, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan"), float("nan")
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return m, sd, (max(xs) - min(xs)) / m if m else float("nan")


def arm_summary(ms: list[dict]) -> dict:
    """What every sweep prints per arm, from its reps' :func:`metrics`: decode s/token
    mean / sd / spread, the first rep's plan (trunk/cache GB, pinned), GB read per token,
    the largest peak RSS, and every rep's s/token."""
    mean, sd, sp = mean_sd_spread([m["s_tok"] for m in ms])
    k = ms[0]
    return {
        "mean": mean, "sd": sd, "spread": f"{sp:.0%}",
        "budgets": f"{k['trunk_gb']:.2f}/{k['cache_gb']:.2f}", "pinned": f"{k['pinned']}/{k['n_layers']}",
        "gb_read": statistics.fmean(m["trunk_gb_tok"] + m["expert_gb_tok"] for m in ms),
        "rss_max": max(m["peak_rss_gb"] for m in ms),
        "every": " ".join(f"{m['s_tok']:.2f}" for m in ms),
    }


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (Pearson on average ranks; ties allowed)."""
    if len(x) < 3:
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def table(rows: list[list], header: list[str]) -> str:
    """A GitHub markdown table (also readable on a terminal)."""
    srows = [[_fmt(v) for v in r] for r in rows]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in srows]
    return "\n".join(out)


# ---------------------------------------------------------------- device rate

def device_rate(model: str, reps: int = 3, quick: bool = True, log=print) -> dict:
    """Best O_DIRECT read rate of the device holding `model`, measured now.

    A reduced bench_io: sequential QD1 in 64 MiB requests over 512 MiB (2 GiB without
    quick), and random expert-sized (17.5 MB) reads at QD1/4/16. Returns
    {arm: [GB/s per rep]} plus "best" = the highest per-arm median.
    """
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_io  # noqa: E402
    from k3.checkpoint.io import ALIGN, ShardFiles  # noqa: E402
    from k3.checkpoint.safetensors import CheckpointIndex  # noqa: E402

    ix = CheckpointIndex.open(model)
    files = sorted(((p, os.path.getsize(p)) for p in ix.shards()), key=lambda x: -x[1])
    reader = ShardFiles()
    big, big_size = files[0]
    mib = 1 << 20
    span = min(big_size // ALIGN * ALIGN, (512 if quick else 2048) * mib)
    esize = bench_io.align_up(17_551_360)
    n_rand = 16 if quick else 48
    rng = random.Random(1)
    out: dict = {}
    bench_io.seq_read(reader, big, 64 * mib, 64 * mib, 1)
    for rep in range(reps):
        # a different 512 MiB window each rep so the host cache serves as little as possible
        off_span = span
        dt = bench_io.seq_read(reader, big, off_span, 64 * mib, 1)
        out.setdefault("seq-qd1", []).append(off_span / dt / GB)
    for depth in (1, 4, 16):
        for rep in range(reps):
            dt = bench_io.random_reads(reader, files, esize, n_rand, depth, rng)
            out.setdefault(f"rand-qd{depth}", []).append(esize * n_rand / dt / GB)
    out["best"] = max(statistics.median(v) for k, v in out.items())
    for k, v in out.items():
        if k != "best":
            log(f"  device {k:<10} " + " ".join(f"{x:.2f}" for x in v) + f"  GB/s (median {statistics.median(v):.2f})")
    return out


# ---------------------------------------------------------------- plot

def plot(path: Path, xs, ys, *, xlabel: str, ylabel: str, title: str, means=None) -> bool:
    """Scatter every rep (and a line through per-arm means); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG; pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(xs, ys, s=18, alpha=0.7, label="every rep")
    if means:
        mx, my = zip(*sorted(means))
        ax.plot(mx, my, "-o", color="C1", label="arm mean")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def evict(*folders) -> None:
    """Every file under ``folders`` out of the page cache (posix_fadvise DONTNEED: no
    privilege needed). A cgroup-v1 ceiling charges a cached page to the group that first
    read it, so a checkpoint cached by an earlier process would be read from memory,
    uncharged, by a run under a ceiling: its streamed lm_head came from the page cache in
    full at an 8 GiB ceiling (decode_drive_bytes 0.194 of 2.543 GB a token)."""
    for folder in folders:
        for p in Path(folder).rglob("*"):
            if p.is_file():
                try:
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
                except OSError:
                    pass


def drop_caches() -> None:
    """Best effort: drop the page cache (root only) so runs start equally cold."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


# ---------------------------------------------------------------- bars (python benchmarks/benchlib.py bars)

BARS_COLS = ["bar", "arm", "rep", "model", "flags", "ceiling_gb", "s_tok", "s_tok_warm", "dec_gb", "dec_gbps",
             "device_best_gbps", "ratio", "trunk_gb_tok", "expert_gb_tok", "pinned", "ring", "slots",
             "hit_pct", "peak_rss_gb", "cg_max_gb", "io_share", "ids", "load1", "note"]


def bars_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchlib.py bars", description="Streaming bars a/b/c (docs/BENCHMARKS.md)")
    ap.add_argument("--model", default="/work/rd4")
    ap.add_argument("--trunk", default=None, help="packed trunk (default MODEL-trunk)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 rep, smaller device probe")
    ap.add_argument("--only", default="ab", help="which bars: any of a, b, c (default ab)")
    ap.add_argument("--big-model", default="/work/rd40", help="bar c: checkpoint >= 1.5x RAM")
    ap.add_argument("--big-trunk", default=None)
    ap.add_argument("--big-ceiling", type=float, default=8.0)
    ap.add_argument("--tsv", default=str(RESULTS / "bars.tsv"))
    a = ap.parse_args(argv)
    trunk = a.trunk or a.model.rstrip("/") + "-trunk"
    reps = 1 if a.quick else a.reps
    tsv = Tsv(Path(a.tsv), BARS_COLS)
    summary = []

    def one(bar, arm, rep, model, flags, ceiling=None, note="", extra=None):
        d = run_k3(model, flags, ceiling_gb=ceiling, tag=f"bar{bar}")
        m = metrics(d)
        if not m["ok"]:
            print(f"  bar {bar} {arm} rep {rep}: FAILED {m['error']}", file=sys.stderr)
            tsv.add(bar=bar, arm=arm, rep=rep, model=model, flags=" ".join(flags), ceiling_gb=ceiling or "",
                    note=f"FAILED rc={m['rc']}")
            return None
        row = dict(m, bar=bar, arm=arm, rep=rep, model=model, flags=" ".join(flags),
                   ceiling_gb=ceiling or "", note=note, **(extra or {}))
        if "device_best_gbps" in row and row["device_best_gbps"]:
            row["ratio"] = row["dec_gbps"] / row["device_best_gbps"]
        tsv.add(**row)
        print(f"  bar {bar} {arm:<10} rep {rep}: {m['s_tok']:.2f} s/tok decode ({m['s_tok_warm']:.2f} warm), "
              f"{m['dec_gbps']:.2f} GB/s decode reads, peak RSS {m['peak_rss_gb']:.2f} GB, "
              f"ids {m['ids']}  (load {m['load1']:.1f})", file=sys.stderr)
        return row

    if "a" in a.only:
        print("bar a: decode read rate vs the device's best O_DIRECT rate (same session)", file=sys.stderr)
        dev = device_rate(a.model, reps=3, quick=True, log=lambda s: print(s, file=sys.stderr))
        for k, v in dev.items():
            if k != "best":
                for i, x in enumerate(v):
                    tsv.add(bar="a", arm=f"device-{k}", rep=i, model=a.model, dec_gbps=x, note="O_DIRECT probe")
        flags = ["--trunk", trunk, "--trunk-gb", "2.5", "--cache-gb", "0.4"]
        rows = [one("a", "stream", r, a.model, flags, ceiling=5.0, extra={"device_best_gbps": dev["best"]})
                for r in range(reps)]
        rows = [r for r in rows if r]
        # the device again after the runs: the rate drifts with other people's load
        dev2 = device_rate(a.model, reps=1, quick=True, log=lambda s: print(s, file=sys.stderr))
        for k, v in dev2.items():
            if k != "best":
                tsv.add(bar="a", arm=f"device-{k}", rep=3, model=a.model, dec_gbps=v[0], note="O_DIRECT probe after")
        best = max(dev["best"], dev2["best"])
        if rows:
            m, sd, sp = mean_sd_spread([r["dec_gbps"] for r in rows])
            summary.append(["a", "decode GB/s / best device GB/s", f"{m:.2f} / {best:.2f}",
                            f"{m / best:.0%} (reps: " + ", ".join(f"{r['dec_gbps'] / best:.0%}" for r in rows) + ")",
                            ">= 85%", f"sd {sd:.2f} spread {sp:.0%}"])

    if "b" in a.only:
        print("bar b: streaming machinery with everything fitting vs resident (warm s/token)", file=sys.stderr)
        res, st = [], []
        for r in range(reps):  # interleaved so drift hits both arms alike
            x = one("b", "resident", r, a.model, ["--cache-gb", "10"])
            y = one("b", "streamed", r, a.model, ["--trunk", trunk, "--trunk-gb", "20", "--cache-gb", "10"])
            res += [x] if x else []
            st += [y] if y else []
        if res and st:
            mr, sdr, spr = mean_sd_spread([x["s_tok_warm"] for x in res])
            ms, sds, sps = mean_sd_spread([x["s_tok_warm"] for x in st])
            same = len({x["ids"] for x in res + st}) == 1
            summary.append(["b", "warm s/token streamed / resident", f"{ms:.3f} / {mr:.3f}",
                            f"{ms / mr:.3f}x", "within 10%",
                            f"spread {sps:.0%} / {spr:.0%}; ids identical: {same}"])

    if "c" in a.only:
        print("bar c: checkpoint >= 1.5x RAM inside a cgroup ceiling vs a larger budget", file=sys.stderr)
        bt = a.big_trunk or a.big_model.rstrip("/") + "-trunk"
        size = sum(os.path.getsize(os.path.join(a.big_model, f)) for f in os.listdir(a.big_model))
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        note = f"checkpoint {size / GB:.1f} GB = {size / ram:.2f}x RAM"
        small = one("c", f"ceiling{a.big_ceiling:g}", 0, a.big_model,
                    ["--trunk", bt, "--trunk-gb", "4", "--cache-gb", "1.5"], ceiling=a.big_ceiling, note=note)
        big = one("c", "large", 0, a.big_model, ["--trunk", bt, "--trunk-gb", "10", "--cache-gb", "4"], note=note)
        if small and big:
            summary.append(["c", f"{note}; ceiling {a.big_ceiling:g} GiB",
                            f"{small['s_tok']:.2f} / {big['s_tok']:.2f} s/tok",
                            f"ids identical: {small['ids'] == big['ids']}; peak RSS {small['peak_rss_gb']:.2f} GB, "
                            f"cgroup max {small['cg_max_gb']:.2f} GB",
                            "same tokens, RSS < ceiling", f"failcnt {small['failcnt']}"])
    print(table(summary, ["bar", "what", "value", "result", "bar", "note"]))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "bars":
        sys.exit(bars_main(sys.argv[2:]))
    print("usage: python benchmarks/benchlib.py bars [--model M] [--trunk T] [--reps N] [--only abc] [--quick]")
    sys.exit(2)


def cpu_flags() -> str:
    """The CPU model and the SIMD flags the kernels care about, for every result row."""
    from k3.cpuinfo import cpuinfo
    info = cpuinfo()
    name, flags = info.model, info.flags
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    line = f"{name} [{' '.join(simd) or 'no avx2'}]"
    try:
        import numba
        from k3.kernels.cpu import kernel_isa
        if numba.config.CPU_FEATURES or numba.config.CPU_NAME not in (None, "", "host"):
            line += f", kernels compiled for {numba.config.CPU_NAME or 'host'} ({kernel_isa()} path)"
    except Exception:  # noqa: BLE001 - a label, never a reason to fail a benchmark
        pass
    return line
