"""A pipeline of two ranks against one process, each process under the same memory
ceiling (docs/SCALING.md "Measured").

Each rank of the pipeline runs in a cgroup-v1 memory group of its own with the ceiling
(as if on a machine that size), so the pair can pin twice the trunk one process can;
the single process runs under one such group. Both arms stream the trunk from the same
packed trunk and read the same prompt greedily; reps are interleaved across the arms.
Per rep: decode s/token, bytes read from storage per decoded token (every rank's trunk
and expert reads), bytes sent between ranks per decoded token, each group's peak usage
and failcnt, the generated ids (the arms must agree), the load and the CPU flags.

    python benchmarks/bench_pipeline.py --model /work/rd4 --trunk /work/rd4-trunk --ceiling 4.5 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

COLS = ["arm", "rep", "model", "ranks", "ceiling_gib", "threads", "s_tok", "prefill_s", "disk_gb_tok", "net_kb_tok",
        "pinned_layers", "n_layers", "cg_max_gb", "failcnt", "ids", "load1", "cpu", "note"]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_arm(world: int, a, work: Path, rep: int) -> dict:
    """One run of `world` processes (1: plain), each in its own group; rank 0's JSON."""
    out = work / f"pipe{world}-{rep}-{int(time.time())}.json"
    argv = [bl.K3, "run", a.model, "--trunk", a.trunk, "--greedy", "--ids", a.ids, "--gen", str(a.gen),
            "--threads", str(a.threads), "--pipeline-timeout", "900", "--out", str(out)]
    port = free_port()
    procs, groups = [], []
    for r in range(world):
        g = bl.make_group(a.ceiling, f"r{r}_")
        groups.append(g)
        env = dict(os.environ)
        if world > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        log = open(work / f"pipe{world}-{rep}-r{r}.log", "w")
        procs.append(subprocess.Popen(bl.in_group(g, argv), env=env, stdout=log, stderr=subprocess.STDOUT))
    load1 = bl.loadavg()
    rcs = [p.wait(timeout=3600) for p in procs]
    stats = [bl.drop_group(g) for g in groups]
    res = {"_rc": rcs, "_fail": [s[0] for s in stats], "_max": [s[1] for s in stats], "_load1": load1}
    if any(rcs) or not out.exists():
        res["_error"] = (work / f"pipe{world}-{rep}-r0.log").read_text(errors="replace")[-600:]
        return res
    res.update(json.loads(out.read_text()))
    return res


def figures(d: dict) -> dict:
    steps = d["steps"]
    dec = steps[1:]
    n = max(1, len(dec))
    pipe = d.get("pipeline") or {}
    pinned = sum(1 for r in pipe["ranks"] if r["pinned_bytes"] >= r["trunk_bytes"]) if pipe else 0
    tr = d.get("trunk") or {}
    return {
        "s_tok": statistics.fmean(d["step_seconds"][1:]),
        "prefill_s": d["step_seconds"][0],
        "disk_gb_tok": sum(s.get("bytes_read", 0) for s in dec) / n / 1e9,
        "net_kb_tok": sum(s.get("net_bytes", 0) for s in dec) / n / 1e3,
        "pinned_layers": (f"{pinned}/{len(pipe['ranks'])} ranks all pinned" if pipe
                          else f"{tr.get('pinned', 0)}/{tr.get('n_layers', 0)}"),
        "n_layers": d.get("layers"),
        "ids": ",".join(map(str, d["generated_ids"])),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/work/rd4")
    ap.add_argument("--trunk", default=None, help="packed trunk (default MODEL-trunk)")
    ap.add_argument("--ceiling", type=float, default=4.5, help="memory ceiling of each process, GiB")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ids", default=bl.DEFAULT_IDS)
    ap.add_argument("--tsv", default=str(bl.RESULTS / "pipeline.tsv"))
    a = ap.parse_args(argv)
    a.trunk = a.trunk or a.model.rstrip("/") + "-trunk"
    if not bl.cgroup_available():
        print("bench_pipeline: needs a writable cgroup v1 memory controller (root).", file=sys.stderr)
        return 2
    work = Path(os.environ.get("K3_BENCH_TMP", "/tmp/k3bench"))
    work.mkdir(parents=True, exist_ok=True)
    tsv = bl.Tsv(Path(a.tsv), COLS)
    cpu = bl.cpu_flags()
    rows = {1: [], a.ranks: []}
    for rep in range(a.reps):
        for world in ((1, a.ranks) if rep % 2 == 0 else (a.ranks, 1)):
            bl.drop_caches()
            d = run_arm(world, a, work, rep)
            arm = "one process" if world == 1 else f"pipeline x{world}"
            base = {"arm": arm, "rep": rep, "model": a.model, "ranks": world, "ceiling_gib": a.ceiling,
                    "threads": a.threads, "cg_max_gb": max(x or 0 for x in d["_max"]) / 1e9,
                    "failcnt": sum(x or 0 for x in d["_fail"]), "load1": d["_load1"], "cpu": cpu}
            if "_error" in d:
                tsv.add(**{**base, "note": "FAILED rc=%s: %s" % (d["_rc"], d["_error"].strip().splitlines()[-1:])})
                print(f"{arm} rep {rep}: FAILED {d['_rc']}: {d['_error'][-300:]}", flush=True)
                continue
            f = figures(d)
            rows[world].append(f)
            tsv.add(**{**base, **f, "note": ""})
            print(f"{arm:<14} rep {rep}: {f['s_tok']:.3f} s/token, {f['disk_gb_tok']:.3f} GB read/token, "
                  f"{f['net_kb_tok']:.1f} KB sent/token, peak group {base['cg_max_gb']:.2f} GB, failcnt "
                  f"{base['failcnt']}", flush=True)
    print()
    for world, fs in rows.items():
        if not fs:
            continue
        s = [f["s_tok"] for f in fs]
        m, sd, spread = bl.mean_sd_spread(s)
        print(f"{'one process' if world == 1 else f'pipeline x{world}':<14} s/token mean {m:.3f} sd {sd:.3f} "
              f"(reps {', '.join(f'{x:.3f}' for x in s)}); disk {statistics.fmean(f['disk_gb_tok'] for f in fs):.3f} "
              f"GB/token; net {statistics.fmean(f['net_kb_tok'] for f in fs):.1f} KB/token")
    ids = {f["ids"] for fs in rows.values() for f in fs}
    print(f"ids identical across all runs: {len(ids) == 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
