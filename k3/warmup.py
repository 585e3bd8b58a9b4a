"""Compiling and warming k3's kernels, once per CPU and kernel version.

numba compiles each kernel the first time it runs and keeps the machine code in a
cache folder (k3.kernels.kcache). A run then loads the code instead of compiling it, in
well under a second. A cold folder (a first run after an install or an upgrade) means
compiling: several minutes of one core, and ~0.8 GB of the compiler's own memory that
numba never hands back.

So a cold folder is filled by helper processes, not by the process that runs the model:

* the warm-up is split into jobs (:data:`JOBS`), one per group of kernels a model uses
  (the matmuls, attention's tiles, KDA's step, the three one-launch decode regions);
  a model needs only the jobs of the layers it has (:func:`jobs_for`);
* the jobs are shared out over up to one helper per core (longest first, by the
  :data:`JOBS` weights: their compile seconds measured on one core for the ISA path
  this CPU compiles, so the shares come out even and the estimate is this CPU's); each helper compiles its jobs into the cache folder and exits, handing
  the compiler's memory back;
* the process that runs the model then runs every job itself: it loads them from the
  folder, so its footprint is that of a warm start, and a first decode step compiles
  nothing.

Whoever calls :func:`ensure` is told before compiling starts (``notice``), and after each
job (``progress``). Results never depend on where a kernel was compiled.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import interrupt

#: the memory one compiling helper may reach (RSS: interpreter, torch, numba, LLVM's
#: modules; docs/PERFORMANCE.md, "First run")
HELPER_BYTES = 1_000_000_000
#: what loading every compiled kernel adds to a process (RSS, with a margin)
KERNELS_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class Job:
    name: str
    label: str
    needs: str  # "all" | "kda" | "mla" | "moe": the layers a model must have for it
    #: its compile seconds alone on one core, per kernel ISA path (k3.kernels.cpu: the
    #: paths compile different code, so their costs differ); measured, docs/PERFORMANCE.md
    seconds: dict

    def weight(self, isa: str | None = None) -> float:
        """Its compile seconds on path ``isa`` (default: the path this process compiles)."""
        return self.seconds[isa or this_isa()]


def _job(name, label, needs, avx512, avx2, generic) -> Job:
    return Job(name, label, needs, {"avx512": avx512, "avx2": avx2, "generic": generic})


#: the warm-up's jobs, in the order the process that runs the model goes through them,
#: with each one's compile seconds alone (a fresh kernel folder, its own helper, nothing
#: else running) on the reference host: an AMD EPYC Zen 3 (AVX2), its own path and LLVM
#: CPU (benchmarks/bench_warmup_isa.py jobs native; docs/PERFORMANCE.md, "First run").
#: The avx512 and generic columns are those seconds times each job's cost on that path
#: over its avx2 cost, as measured on an Intel Xeon where all three paths ran. Alone,
#: not after the jobs before it: the helpers start together, so a job's callees are
#: rarely in the folder yet. matmul includes the sampler's kernels.
JOBS = {j.name: j for j in (
    #    name          label                     needs   avx512 avx2  generic
    _job("matmul", "BF16 and MXFP4 matmuls, the sampler", "all", 42.6, 47.1, 41.8),
    _job("attention", "attention tiles", "mla", 36.3, 39.3, 37.6),
    _job("kda", "KDA step", "kda", 26.7, 27.2, 27.5),
    _job("kda_region", "KDA decode region", "kda", 89.1, 85.4, 84.1),
    _job("moe_region", "MoE decode region", "moe", 24.2, 22.9, 20.7),
    _job("mla_region", "MLA decode region", "mla", 93.4, 89.1, 91.2),
)}

#: compile_probe()'s seconds on the reference host (the median of six probes there, in a
#: bare process and in one that imported the loader, as a run's is); the estimate
#: scales by this host's over it
PROBE_REF = 0.20


def this_isa() -> str:
    """The kernel ISA path this process compiles (k3.kernels.cpu.kernel_isa)."""
    from .kernels.cpu import kernel_isa
    return kernel_isa()


def jobs_for(cfg=None, layers=None) -> list[str]:
    """The jobs a model of ``cfg`` needs when it runs ``layers`` (a count, a range, or
    None: all its layers); every job without a config."""
    if cfg is None:
        return list(JOBS)
    if layers is None:
        ids = range(cfg.num_hidden_layers)
    else:
        ids = layers if isinstance(layers, range) else range(int(layers))
    has = {"all": True, "kda": any(not cfg.is_mla(i) for i in ids), "mla": any(cfg.is_mla(i) for i in ids),
           "moe": any(cfg.is_moe(i) for i in ids)}
    return [n for n, j in JOBS.items() if has[j.needs]]


# ---------------------------------------------------------------- the jobs themselves
def _matmul() -> None:
    import torch

    from .kernels import bf16_linear, mxfp4_linear
    w = torch.zeros(2, 64, dtype=torch.bfloat16)
    p, sc = torch.zeros(2, 32, dtype=torch.uint8), torch.full((2, 2), 127, dtype=torch.uint8)
    for t in (1, 3):
        x = torch.zeros(t, 64)
        bf16_linear(x, w)
        mxfp4_linear(x, p, sc)
    from .sampling import Sampler   # its kernels (k3.kernels.sample): every path of the filter and pick
    x = torch.arange(64, dtype=torch.float32)
    for top_p, top_k in ((1.0, 0), (0.9, 0), (0.9, 8)):
        Sampler(1.0, top_p, top_k)(x, 0)


def _attention() -> None:
    """The parallel tiles of attention (dots and prods) and the one-tile softmax that only
    a decode step's single query row takes."""
    import torch

    from .kernels import attention
    attention.scores_softmax(torch.zeros(8), torch.zeros(8), 0.125, 2, 4)
    H, L = 2, 64
    x = torch.zeros(1, H * L)
    for w in (torch.zeros(8, L), torch.zeros(2 * L, L, dtype=torch.bfloat16)):
        attention.dots(x, w, H, 1, 4, L, x_at=(0, 0, 0, L), causal=3)
        attention.dots(x, w, H, 1, 4, L, x_at=(0, 0, 0, L))
    p = torch.zeros(1, H * 8)
    cwn = attention._CWN
    for w in (torch.zeros(H * 8, 2 * cwn), torch.zeros(H * 8, 2 * cwn, dtype=torch.bfloat16)):
        attention.prods(p, w, H, 1, 2 * cwn, 8, x_at=(0, 0, 0, 8), w_at=(0, 8, 0, 0), causal=7)
        attention.prods(p, w, H, 1, 2 * cwn, 8, x_at=(0, 0, 0, 8), w_at=(0, 8, 0, 0))


_H, _DK, _DV = 2, 8, 8


def _kda() -> None:
    """KDA's step after its projections, with every argument kind decode gives it."""
    import torch

    from .kernels import kda
    H, dk, dv = _H, _DK, _DV
    u, z = torch.zeros(1, H * dk), torch.zeros(1, H * dv)
    xs, ws = [u, u, z], [torch.zeros(H * dk, 1, 4)] * 2 + [torch.zeros(H * dv, 1, 4)]
    for ow in (torch.ones(dv), torch.ones(dv, dtype=torch.bfloat16)):
        for lb in (None, -5.0):
            for S0 in (None, torch.zeros(H, dk, dv)):
                states = [None] * 3 if S0 is None else [torch.zeros(3, x.shape[1]) for x in xs]
                kda.kda_decode(xs, torch.zeros(1, H), u, z, states, S0, torch.empty(H, dk, dv),
                               kda.KdaWeights(ws, torch.zeros(H), torch.zeros(H * dk), ow),
                               kda.KdaConsts(H, 1e-6, 0.5, lb, 1e-6))


def _mat(n: int, k: int):
    import torch
    return torch.zeros(n, k, dtype=torch.bfloat16)


def _kda_region() -> None:
    import torch

    from .kernels import kda, kda_region
    H, dk, dv = _H, _DK, _DV
    d, r = 64, 8
    ws = [_mat(n, d) for n in (H * dk, H * dk, H * dv, r, H, r)]
    kda_region.kda_decode_layer(torch.zeros(1, d), kda_region.KdaProj(ws, _mat(H * dk, r), _mat(H * dv, r), _mat(d, H * dv)),
                                kda.KdaWeights([torch.zeros(c, 1, 4) for c in (H * dk, H * dk, H * dv)], torch.zeros(H),
                                               torch.zeros(H * dk), torch.ones(dv, dtype=torch.bfloat16)),
                                kda.KdaConsts(H, 1e-6, 0.5, None, 1e-6), [None] * 3, None, None)


def _moe_region() -> None:
    """The MoE block's region on MXFP4 and on BF16 experts."""
    import torch

    from .kernels import moe
    d, inter, G = 64, 64, 2
    packed, scale = torch.zeros(inter, d // 2, dtype=torch.uint8), torch.full((inter, d // 32), 127, dtype=torch.uint8)
    mx = moe.expert_descriptors("mxfp4", [(packed, scale)] * 3 * G).reshape(G, 3, -1)
    bf = moe.expert_descriptors("bf16", [_mat(inter, d)] * 3 * G).reshape(G, 3, -1)
    shared = (torch.zeros(1, inter), torch.zeros(1, inter))
    moe.moe_decode(torch.zeros(1, d), mx, torch.zeros(1, G), torch.ones(d, dtype=torch.bfloat16), 1e-6, shared,
                     (4.0, 25.0), _mat(d, d), _mat(d, inter))
    moe.moe_decode(torch.zeros(1, d), bf, torch.zeros(1, G), None, 1e-6, shared, None, None, _mat(d, inter))


def _mla_region() -> None:
    """MLA's region, alone and finished with K3's residual step, the router and the MoE
    block (a gated, q-LoRA layer: every argument type the region and LayerEnd.experts
    take)."""
    import numpy as np
    import torch

    from .kernels import layer_end, mla_region, moe
    H, d, inter = _H, 64, 64
    nope = rope = vd = 8
    qr, L, E = 16, 64, 8
    end = layer_end.mix_end([torch.zeros(1, d)], None, torch.ones(d), 1e-6, torch.ones(d, dtype=torch.bfloat16), 1e-6)
    if end is not None:
        end.route(d, [_mat(E, d), _mat(inter, d), _mat(inter, d)], None, E, True, 1.0)
        end.experts(moe.expert_descriptors("bf16", [_mat(inter, d)] * 3 * E).reshape(E, 3, -1), None, 1, None, 1e-6,
                    None, None, _mat(d, inter))
    for e in (None, end):
        w = mla_region.MlaWeights(_mat(qr, d), torch.ones(qr, dtype=torch.bfloat16), _mat(H * (nope + rope), qr),
                                  _mat(L + rope, d), torch.ones(L, dtype=torch.bfloat16), _mat(H * (nope + vd), L),
                                  _mat(H * vd, d), _mat(d, H * vd))
        mla_region.mla_decode_layer(torch.zeros(1, d), w, mla_region.MlaShape(H, nope, rope, vd, 1e-6, 0.25),
                                    np.zeros((4, L), np.float32), np.zeros((4, rope), np.float32), 0, e)


_RUN: dict[str, Callable[[], None]] = {"matmul": _matmul, "attention": _attention, "kda": _kda,
                                       "kda_region": _kda_region, "moe_region": _moe_region,
                                       "mla_region": _mla_region}


@contextlib.contextmanager
def _work_limits(value: int | None):
    """The work limits below which the kernels run their serial twins, set to ``value``
    (0: every call takes the parallel kernel) for the duration; None leaves them."""
    from .kernels import launch
    limits = launch.SERIAL_LIMITS
    kept = dict(limits)
    try:
        if value is not None:
            limits.update(dict.fromkeys(limits, value))
        yield
    finally:
        limits.update(kept)


def run_job(name: str) -> None:
    """Run one job's kernels on tiny inputs of the types a run gives them, both ways: the
    parallel kernels (work limits at 0), then as the limits are (the serial twins of
    decode's one-token calls and the fused ops)."""
    for value in (0, None):
        with _work_limits(value):
            _RUN[name]()


# ---------------------------------------------------------------- helpers
def share(names: list[str], workers: int, isa: str | None = None) -> list[list[str]]:
    """``names`` shared out over ``workers`` lists, longest job first to the least
    loaded (by the JOBS weights of path ``isa``, default this CPU's); empty lists dropped."""
    isa = isa or this_isa()
    loads = [[0.0, []] for _ in range(max(1, workers))]
    for n in sorted(names, key=lambda n: -JOBS[n].weight(isa)):
        least = min(loads, key=lambda a: a[0])
        least[0] += JOBS[n].weight(isa)
        least[1].append(n)
    return [names_ for _, names_ in loads if names_]


def estimate_seconds(names: list[str], workers: int, isa: str | None = None, speed: float = 1.0) -> float:
    """The compile's wall time by the JOBS weights of path ``isa`` (default this CPU's):
    the most loaded helper's share, times ``speed`` (this host's compile time over the
    reference host's: :func:`host_speed`)."""
    isa = isa or this_isa()
    return speed * max((sum(JOBS[n].weight(isa) for n in part) for part in share(names, workers, isa)), default=0.0)


def _probe_body(a, b, n):
    s = 0.0
    for i in range(n):
        x = a[i] * b[i % b.shape[0]]
        if x > 0.5:
            s += np.sqrt(x)
        else:
            s -= x * x
    out = np.empty(n, a.dtype)
    for i in range(n):
        out[i] = a[i] + s
    return out.sum() + s


def compile_probe() -> float:
    """Seconds this host takes, now, to compile one small function with numba (typing,
    LLVM's passes, machine code: what a job's compile is made of): the least of five
    fresh compiles after one that warms LLVM up (one compile varies by 20-30 % within a
    process; the least of five still by 0.17-0.29 s between processes on one quiet host,
    docs/PERFORMANCE.md "First run"). About 1.5-2 s in all on a slow host."""
    from numba import njit
    a = np.ones(10)
    times = []
    for _ in range(6):
        f = njit(_probe_body)   # a fresh dispatcher, nothing cached: it compiles
        t0 = time.perf_counter()
        f(a, a, 10)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def host_speed(probe: float | None = None) -> float:
    """This host's compile seconds over the reference host's (where JOBS was measured):
    ``probe`` (default: :func:`compile_probe` now) over PROBE_REF. It follows the CPU and
    the load on it, as the jobs' own compile times do."""
    return (compile_probe() if probe is None else probe) / PROBE_REF


def helper_main(argv: list[str]) -> int:
    """A compiling helper: run the named jobs (each into the cache folder), printing
    ``done NAME SECONDS`` after each so the parent can show progress."""
    for name in argv:
        t0 = time.perf_counter()
        run_job(name)
        print(f"done {name} {time.perf_counter() - t0:.1f}", flush=True)
    return 0


_HELPER = "import sys; from k3.warmup import helper_main; sys.exit(helper_main(sys.argv[1:]))"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_in_helpers(names: list[str], workers: int, progress=None) -> dict:
    """Run ``names`` in ``workers`` helper processes at once (their shares by
    :func:`share`); ``progress(done, total, name, seconds)`` after each job. Returns
    {"seconds", "workers", "failed": [job names a helper did not report]}."""
    import selectors

    from pathlib import Path

    parts = share(names, workers)
    t0 = time.perf_counter()
    # the helpers import this k3, wherever it was imported from
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    # -P: the current folder is not put on sys.path, so a k3/ folder there cannot stand in for this one
    procs = [subprocess.Popen([sys.executable, "-P", "-c", _HELPER, *part], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, text=True) for part in parts]
    sel = selectors.DefaultSelector()
    errs = {p.pid: [] for p in procs}
    for p in procs:
        sel.register(p.stdout, selectors.EVENT_READ, (p, "out"))
        sel.register(p.stderr, selectors.EVENT_READ, (p, "err"))
    done: list[str] = []
    open_ = 2 * len(procs)
    finished = False
    try:
        while open_:
            interrupt.check()  # a Ctrl-C / SIGTERM (k3.interrupt): the helpers are stopped below
            for key, _ in sel.select(timeout=0.2):
                p, kind = key.data
                line = key.fileobj.readline()
                if not line:
                    sel.unregister(key.fileobj)
                    open_ -= 1
                    continue
                if kind == "err":
                    errs[p.pid].append(line)
                    del errs[p.pid][:-20]
                    continue
                parts_ = line.split()
                if len(parts_) == 3 and parts_[0] == "done":
                    done.append(parts_[1])
                    if progress is not None:
                        progress(len(done), len(names), parts_[1], float(parts_[2]))
        finished = True
    finally:
        for p in procs:
            if not finished:  # interrupted (Ctrl-C, SIGTERM): the helpers stop with this process
                p.kill()
            p.wait()
        sel.close()
    failed = [n for n in names if n not in done]
    why = {p.returncode: "".join(errs[p.pid]).strip()[-400:] for p in procs if p.returncode}
    return {"seconds": time.perf_counter() - t0, "workers": len(procs), "failed": failed, "errors": why}


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"about {max(10, int(round(seconds / 10.0)) * 10)} s"
    return f"about {seconds / 60:.1f} min"


def ensure(names: list[str], *, available: int | None = None, notice=None, progress=None) -> dict:
    """Make the kernels of jobs ``names`` ready in this process: compile the ones the
    cache folder lacks in helper processes (one per core, at most one per
    HELPER_BYTES of ``available`` memory), telling ``notice`` first (what, about how
    long, where) and ``progress(done, total, label, seconds)`` after each job; then
    run every job here, which loads them. Raises K3Error (exit 1) when not even one
    helper's memory is available. Returns what it did (for --verbose and --out)."""
    from .errors import K3Error
    from .kernels import kcache
    from .units import human

    cold = kcache.missing(names)
    info = {"jobs": list(names), "compiled": list(cold), "workers": 0, "compile_seconds": 0.0}
    if cold:
        workers = min(usable_cores(), len(cold))
        if available is not None:
            if available < HELPER_BYTES:
                raise K3Error(
                    f"REFUSING TO START: k3's kernels are not compiled for this CPU yet (cache folder "
                    f"{kcache.where()}), and compiling them needs about {human(HELPER_BYTES)} for the compiler, once; "
                    f"{human(available)} is available. Run any k3 command once with more memory free (the kernels are "
                    "then cached for every later run), or free memory.")
            workers = max(1, min(workers, available // HELPER_BYTES))
        say = notice or (lambda msg: None)
        probe = compile_probe()
        info["compile_probe_seconds"] = round(probe, 3)
        info["estimate_seconds"] = round(estimate_seconds(cold, workers, speed=host_speed(probe)), 1)
        say(f"compiling k3's kernels for this CPU, once ({_minutes(info['estimate_seconds'])} with {workers} "
            f"process{'es' if workers > 1 else ''}); cached in {kcache.where()}")
        if progress is not None:
            progress(0, len(cold), "", 0.0)
        r = compile_in_helpers(cold, workers, None if progress is None else
                               (lambda done, total, name, s: progress(done, total, JOBS[name].label, s)))
        info.update(workers=r["workers"], compile_seconds=round(r["seconds"], 1))
        if r["failed"]:
            why = "; ".join(f"exit {code}: {text.splitlines()[-1] if text else 'no message'}"
                            for code, text in r["errors"].items()) or "no report"
            say(f"note: a compiling helper failed ({why}); compiling {', '.join(r['failed'])} in this process")
    for n in names:
        interrupt.check()  # between jobs, never inside a kernel (k3.interrupt)
        run_job(n)
        kcache.mark(n)
    return info
