"""Each warm-up job's compile seconds per kernel ISA path (k3.warmup.JOBS' weights), and
the cold warm-up of a model's jobs in N helper processes, on a path forced by
K3_KERNEL_ISA (with NUMBA_CPU_NAME set to a CPU of that path, so LLVM's own
vectorising also stays within it, as on such a host).

    python benchmarks/bench_warmup_isa.py jobs avx2        # each job alone (own helper, fresh folder), one core
    python benchmarks/bench_warmup_isa.py share avx2 2     # the small model's jobs over 2 helpers
    python benchmarks/bench_warmup_isa.py jobs native      # this host's own path and LLVM CPU, as a run compiles

Each `jobs` run ends with a row of k3.warmup.compile_probe() (this host's compile speed,
measured right after the jobs), so the JOBS seconds and PROBE_REF come from one host.

Every figure is from a fresh kernel cache folder (K3_CACHE in a temporary folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: a CPU of each path for LLVM (NUMBA_CPU_NAME): haswell has AVX2 + FMA and no AVX-512
CPU_NAME = {"generic": "x86-64", "avx2": "haswell", "avx512": None}


def _env(isa: str, cache: str) -> dict:
    e = dict(os.environ, K3_CACHE=cache, PYTHONPATH=str(ROOT))
    e.pop("NUMBA_CACHE_DIR", None)
    if isa == "native":
        return e
    e["K3_KERNEL_ISA"] = isa
    if CPU_NAME[isa]:
        e["NUMBA_CPU_NAME"] = CPU_NAME[isa]
    return e


def jobs(isa: str) -> dict:
    """Each job alone: its own helper and a fresh kernel folder (as the helpers start
    together on a cold folder, a job's callees are rarely there yet)."""
    from k3 import warmup
    out = {}
    for name in warmup.JOBS:
        with tempfile.TemporaryDirectory() as cache:
            r = subprocess.run([sys.executable, "-P", "-c", warmup._HELPER, name], env=_env(isa, cache),
                               capture_output=True, text=True, check=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("done ")][-1]
        out[name] = float(line.split()[2])
        print(f"{isa}\t{name}\t{out[name]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        probe = subprocess.run([sys.executable, "-P", "-c", "from k3 import warmup; print(warmup.compile_probe())"],
                               env=_env(isa, cache), capture_output=True, text=True, check=True)
    print(f"{isa}\tprobe\t{float(probe.stdout):.3f}", flush=True)
    return out


def share(isa: str, workers: int) -> None:
    from k3 import warmup
    from k3.config import load_config
    from k3.synth import synthesize
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(synthesize(Path(tmp) / "m", preset="small", seed=0))
        names = warmup.jobs_for(cfg)
        cache = str(Path(tmp) / "cache")
        code = ("import sys, json; from k3 import warmup; "
                f"r = warmup.compile_in_helpers({names!r}, {workers}); print(json.dumps(r))")
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-P", "-c", code], env=_env(isa, cache), capture_output=True, text=True,
                           check=True)
        print(f"{isa}\tshare {workers}\t{time.perf_counter() - t0:.1f}\t{r.stdout.strip()}\t"
              f"parts {warmup.share(names, workers)}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    what, isa = sys.argv[1], sys.argv[2]
    if what == "jobs":
        jobs(isa)
    else:
        share(isa, int(sys.argv[3]))
