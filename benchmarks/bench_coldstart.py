"""A new user's first run: `k3 run` of a synthetic model with an empty kernel cache.

Each rep points K3_CACHE at a fresh, empty folder (so numba's cache and k3's compile
markers start empty, as on a fresh machine) and times, from the outside, one
`k3 run MODEL --greedy --ids IDS --gen N` to exit ("cold"), then the same command again
on the folder the first one filled ("warm"). Per run it records:

  wall        seconds from spawn to exit (interpreter start, imports, compile, load, decode)
  compile     the seconds k3's own progress lines attribute to compiling (the sum of the
              per-stage lines k3 prints when stderr is not a terminal)
  announced   whether stderr said "compiling k3's kernels" before the first compiled stage
  peak RSS    of the k3 process itself, from its summary line (the compile helpers are
              separate processes, not counted in it)
  ids         the generated ids (cold and warm must agree)

The checkpoint is generated once into --models (default /tmp/k3bench) and reused. One
TSV row per run (benchmarks/results/coldstart.tsv), with the CPU model and flags and the
1-minute load average before the run.

    python benchmarks/bench_coldstart.py [--preset small] [--reps 2] [--gen 4] [--tsv FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchlib import K3, RESULTS, Tsv, cpu_flags, loadavg, table  # noqa: E402

STAGE = re.compile(r"^\s*compiled (.+?) \((\d+)/(\d+) stages, ([\d.]+) s\)")


def one(model: Path, cache: Path, ids: str, gen: int, threads: int | None) -> dict:
    env = dict(os.environ, K3_CACHE=str(cache))
    env.pop("NUMBA_CACHE_DIR", None)
    cmd = [K3, "run", str(model), "--greedy", "--ids", ids, "--gen", str(gen)]
    if threads:
        cmd += ["--threads", str(threads)]
    load = loadavg()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out, err = p.communicate()
    wall = time.perf_counter() - t0
    # k3's summary line carries the process's own peak RSS (the compile helpers are
    # separate processes and are not in it).
    rss = re.search(r"peak RSS ([\d.]+) ([GM])B", err)
    rss_gb = (float(rss.group(1)) / (1 if rss.group(2) == "G" else 1000)) if rss else float("nan")
    lines = err.splitlines()
    stages = [STAGE.match(x) for x in lines]
    first_stage = next((i for i, m in enumerate(stages) if m), None)
    notice = next((i for i, x in enumerate(lines) if "compiling k3's kernels" in x), None)
    compile_s = max((float(m.group(4)) for m in stages if m), default=0.0)
    return {"rc": p.returncode, "wall_s": wall, "compile_s": compile_s, "stages": sum(1 for m in stages if m),
            "announced": notice is not None and (first_stage is None or notice < first_stage),
            "notice": lines[notice].strip() if notice is not None else "",
            "peak_rss_gb": rss_gb, "ids": out.strip(), "load1": load, "err_tail": "\n".join(lines[-5:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--arch", default="k3")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--ids", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--models", default=os.environ.get("K3_BENCH_TMP", "/tmp/k3bench"))
    ap.add_argument("--tsv", default=str(RESULTS / "coldstart.tsv"))
    a = ap.parse_args(argv)

    model = Path(a.models) / f"coldstart-{a.preset}-{a.arch}"
    if not (model / "model.safetensors.index.json").is_file():
        print(f"generating {model}", file=sys.stderr)
        subprocess.run([K3, "synth", str(model), "--preset", a.preset, "--arch", a.arch], check=True)
    cpu = cpu_flags()
    print(f"cpu: {cpu}; cores: {os.cpu_count()}", file=sys.stderr)
    tsv = Tsv(Path(a.tsv), ["preset", "arch", "rep", "arm", "rc", "wall_s", "compile_s", "stages", "announced",
                            "peak_rss_gb", "ids_equal", "load1", "cores", "cpu", "notice"])
    rows = []
    for rep in range(a.reps):
        with tempfile.TemporaryDirectory(prefix="k3-coldcache-") as d:
            runs = {}
            for arm in ("cold", "warm"):
                r = one(model, Path(d), a.ids, a.gen, a.threads)
                runs[arm] = r
                if r["rc"] != 0:
                    print(f"rep {rep} {arm}: exit {r['rc']}\n{r['err_tail']}", file=sys.stderr)
            same = runs["cold"]["ids"] == runs["warm"]["ids"]
            for arm, r in runs.items():
                tsv.add(preset=a.preset, arch=a.arch, rep=rep, arm=arm, rc=r["rc"], wall_s=r["wall_s"],
                        compile_s=r["compile_s"], stages=r["stages"], announced=r["announced"],
                        peak_rss_gb=r["peak_rss_gb"], ids_equal=same, load1=r["load1"],
                        cores=os.cpu_count(), cpu=cpu, notice=r["notice"])
                rows.append([rep, arm, r["rc"], f"{r['wall_s']:.1f}", f"{r['compile_s']:.1f}", r["stages"],
                             r["announced"], f"{r['peak_rss_gb']:.2f}", same, f"{r['load1']:.2f}"])
                print(f"rep {rep} {arm}: {r['wall_s']:.1f} s (compile {r['compile_s']:.1f} s, "
                      f"{r['stages']} stages), announced {r['announced']}", file=sys.stderr)
    print(table(rows, ["rep", "arm", "rc", "wall s", "compile s", "stages", "announced", "peak RSS GB",
                       "ids equal", "load1"]))
    print(f"run {tsv.run} -> {tsv.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
