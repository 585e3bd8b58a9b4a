"""Compiling k3's kernels on a first run (k3.warmup): said before it starts, shown while
it runs, shared over the cores, only what the model needs."""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3 import warmup
from k3.commands.common import CompileReport
from k3.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_jobs_follow_the_layers_a_model_runs(tmp_path):
    from k3.synth import synthesize
    cfg = load_config(synthesize(tmp_path / "m", preset="tiny", arch="k3", seed=2))
    assert warmup.jobs_for(cfg) == list(warmup.JOBS)
    assert warmup.jobs_for() == list(warmup.JOBS)
    first_mla = min(cfg.mla_layers)
    # only KDA layers before the first MLA layer: no attention, no MLA region
    kda_only = warmup.jobs_for(cfg, first_mla)
    assert "mla_region" not in kda_only and "attention" not in kda_only and "kda_region" in kda_only
    assert set(warmup.jobs_for(cfg, range(first_mla, first_mla + 1))) == {"matmul", "attention", "mla_region"} | (
        {"moe_region"} if cfg.is_moe(first_mla) else set())


def test_the_shares_are_even_and_complete():
    names = list(warmup.JOBS)
    for workers in (1, 2, 3, 8):
        parts = warmup.share(names, workers)
        assert sorted(n for p in parts for n in p) == sorted(names)
        assert len(parts) == min(workers, len(names))
    for isa in ("avx512", "avx2", "generic"):
        two = [sum(warmup.JOBS[n].weight(isa) for n in p) for p in warmup.share(names, 2, isa)]
        assert max(two) - min(two) <= max(j.weight(isa) for j in warmup.JOBS.values())
        assert warmup.estimate_seconds(names, 1, isa) == pytest.approx(sum(j.weight(isa) for j in warmup.JOBS.values()))
        assert warmup.estimate_seconds(names, 2, isa) == max(two)


def test_the_estimate_is_the_path_this_cpu_compiles(monkeypatch):
    """The notice's estimate and the shares use the weights of the kernel ISA path this
    process compiles (K3_KERNEL_ISA forces one), not one path's for every CPU."""
    from k3.kernels import cpu
    names = list(warmup.JOBS)
    here = cpu.kernel_isa()
    assert warmup.estimate_seconds(names, 2) == warmup.estimate_seconds(names, 2, here)
    monkeypatch.setenv("K3_KERNEL_ISA", "generic")
    assert warmup.this_isa() == "generic"
    assert warmup.estimate_seconds(names, 2) == warmup.estimate_seconds(names, 2, "generic")
    paths = {isa: warmup.estimate_seconds(names, 1, isa) for isa in ("avx512", "avx2", "generic")}
    assert len(set(paths.values())) == 3  # measured per path: three different totals


def test_the_estimate_follows_this_hosts_compile_speed(monkeypatch):
    """The JOBS seconds are one host's; the notice scales them by this host's compile
    probe over that host's (a CPU that compiles 2x slower, or a busy one, is told 2x
    longer), and the probe is a real compile: positive, and not a constant."""
    names = list(warmup.JOBS)
    base = warmup.estimate_seconds(names, 2)
    assert warmup.estimate_seconds(names, 2, speed=warmup.host_speed(2 * warmup.PROBE_REF)) == pytest.approx(2 * base)
    p = warmup.compile_probe()
    assert 0.005 < p < 30
    said = []
    monkeypatch.setattr(warmup, "compile_probe", lambda: 3 * warmup.PROBE_REF)
    monkeypatch.setattr(warmup, "compile_in_helpers", lambda *a, **k: {"seconds": 1.0, "workers": 2, "failed": []})
    monkeypatch.setattr(warmup, "run_job", lambda name: None)
    from k3.kernels import kcache
    monkeypatch.setattr(kcache, "missing", lambda names: list(names))
    monkeypatch.setattr(kcache, "mark", lambda name: None)
    info = warmup.ensure(names, notice=said.append)
    workers = min(warmup.usable_cores(), len(names))
    assert info["estimate_seconds"] == pytest.approx(3 * warmup.estimate_seconds(names, workers), abs=0.1)
    assert warmup._minutes(info["estimate_seconds"]) in said[0]


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_the_report_is_one_line_a_stage_off_a_terminal():
    out = _Stream(False)
    r = CompileReport(out)
    r.notice("compiling k3's kernels for this CPU, once (about 90 s with 2 processes); cached in /x")
    r.progress(0, 3, "", 0.0)
    r.progress(1, 3, "KDA decode region", 50.0)
    r.progress(2, 3, "MoE decode region", 5.0)
    r.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("compiling k3's kernels for this CPU, once") and "cached in /x" in lines[0]
    assert lines[1].startswith("  compiled KDA decode region (1/3 stages,")
    assert lines[2].startswith("  compiled MoE decode region (2/3 stages,")
    assert len(lines) == 3 and "\r" not in out.getvalue()


def test_the_report_is_a_ticking_bar_on_a_terminal():
    out = _Stream(True)
    r = CompileReport(out)
    r.notice("compiling k3's kernels for this CPU, once (about 90 s with 2 processes); cached in /x")
    r.progress(0, 4, "", 0.0)
    time.sleep(1.3)  # the bar redraws itself between stages
    r.progress(1, 4, "attention tiles", 20.0)
    r.close()
    text = out.getvalue()
    assert "\r  compiling [" in text and "0/4 stages" in text and "1/4 stages" in text and "attention tiles" in text
    assert text.count("0/4 stages") >= 2  # redrawn by the ticker before the first stage ended
    assert text.endswith("\r")  # cleared


def test_a_cold_first_run_says_so_before_compiling(tmp_path):
    """With an empty kernel folder, `k3 run` says what it is doing, about how long it
    takes and where the kernels go, before the compiling starts; nothing else of the
    run comes first but the config line. (Killed once it has said so: the compile
    itself is measured by benchmarks/bench_coldstart.py.)"""
    from k3.synth import synthesize
    model = synthesize(tmp_path / "m", preset="tiny", arch="k3", seed=2)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["K3_CACHE"] = str(tmp_path / "cache")
    p = subprocess.Popen([sys.executable, "-m", "k3", "run", str(model), "--ids", "5,6", "--gen", "1"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
                         start_new_session=True)
    lines = []
    try:
        t0 = time.time()
        while time.time() - t0 < 120:
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if "compiling k3's kernels" in line:
                break
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    said = [ln for ln in lines if "compiling k3's kernels" in ln]
    assert said, lines
    assert lines[0].startswith("config:") and lines[1] == said[0], lines
    msg = said[0]
    assert msg.startswith("compiling k3's kernels for this CPU, once (about ")
    assert f"cached in {tmp_path / 'cache' / 'numba'}" in msg


@pytest.mark.slow
def test_helpers_compile_what_is_missing_and_the_run_loads_it(tmp_path):
    """A cold folder: the helpers compile the missing groups (here one), the process
    loads them, and marks them; the next call compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["K3_CACHE"] = str(tmp_path / "cache")
    code = ("import json; from k3 import warmup; said = []; "
            "r = warmup.ensure(['moe_region'], notice=said.append); "
            "r2 = warmup.ensure(['moe_region'], notice=said.append); print(json.dumps([r, r2, said]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    import json
    r, r2, said = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["compiled"] == ["moe_region"] and r["workers"] == 1 and r["compile_seconds"] > 0
    assert r2["compiled"] == [] and len(said) == 1
