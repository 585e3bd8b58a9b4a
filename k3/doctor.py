"""`k3 doctor [MODEL]`: can this machine run the model, with which preset, how fast?

Reports Python and dependency versions, cores and SIMD features, MemTotal /
MemAvailable and the preset the memory planner recommends, free disk, a storage
probe on the drive holding the model (k3.probe), the model folder's completeness
(every shard the index names present with the size its header implies, config
readable, tokenizer present, packed trunk present and current), the seconds per
token to expect from the measured storage rates and the model's bytes per token, and
the exact commands to run next.

Exit status: 0 unless a problem blocks running at all (a required package missing,
a shard missing or truncated, the config unreadable): then 1. Works without a model.

The model-folder check is k3.doctor_model; the Report every check fills is
k3.doctor_report (both importable from here, as before).
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import sys
from pathlib import Path

from .version import __version__
from .cpuinfo import cpuinfo
from .doctor_model import ModelFacts, check_model
from .doctor_report import Report
from .errors import K3Error
from .probe import K3_EXPERT_BYTES
from .units import GB, human

REQUIRED = ("torch", "numpy", "numba", "safetensors", "tiktoken", "rich")
OPTIONAL = {"jinja2": "Jinja chat templates (Kimi-Linear chat)", "regex": "tokenizer parity tests",
            "pexpect": "REPL tests", "huggingface_hub": "the `hf download` command"}
TESTED_TORCH = "2.13.0"
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")
# The released K3, for estimates when no model folder is given (the C engine's measured sizes).
K3_TRUNK_BYTES = 108.81e9
K3_EXPERT_BYTES_PER_TOKEN = 25.83e9
K3_DOWNLOAD_BYTES = 1_560_936_091_448
K3_SLOT_BYTES = 17_559_552  # one expert's cache slot: its bytes widened to 4096-byte boundaries
K3_REPO = "moonshotai/Kimi-K3"


# ---------------------------------------------------------------- system
def _version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version(name)
    except PackageNotFoundError:
        return None
    except Exception:  # pragma: no cover
        return None


def check_python(rep: Report) -> None:
    lines = rep.section("system")
    lines.append(f"k3 {__version__}, Python {platform.python_version()} ({platform.python_implementation()}) "
                 f"on {platform.platform()}")
    if sys.version_info < (3, 11):
        rep.blocking.append(f"Python {platform.python_version()} is too old: k3 needs Python 3.11 or newer.")
    deps = []
    versions = {}
    for name in REQUIRED:
        v = _version(name)
        versions[name] = v
        if v is None:
            rep.blocking.append(f"the required package {name} is not installed (pip install -e . in the k3 folder "
                                "installs everything).")
            deps.append(f"{name} MISSING")
        else:
            deps.append(f"{name} {v}")
    lines.append("required: " + ", ".join(deps))
    opt = []
    for name, why in OPTIONAL.items():
        v = _version(name)
        versions[name] = v
        opt.append(f"{name} {v}" if v else f"{name} - ({why})")
    lines.append("optional: " + ", ".join(opt))
    tv = versions.get("torch")
    if tv and tv.split("+")[0] != TESTED_TORCH:
        rep.warnings.append(f"torch {tv} is installed; k3 is pinned to and tested with torch {TESTED_TORCH} "
                            "(exactness is only checked there).")
    if versions.get("jinja2") is None:
        rep.warnings.append("jinja2 is not installed: `k3 chat` cannot render a Kimi-Linear chat template "
                            "(K3's own format needs nothing). pip install jinja2.")
    rep.data["versions"] = versions


def check_cpu(rep: Report) -> None:
    lines = rep.section("cpu")
    info = cpuinfo()
    logical = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    phys = info.physical
    lines.append(f"{info.model}: {usable} CPUs usable of {logical} logical"
                 + (f", {phys} physical cores" if phys else ""))
    have = [f for f in SIMD_FLAGS if f in info.flags]
    cap = None
    try:
        import torch
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover
        pass
    lines.append("SIMD: " + (" ".join(have) if have else "none reported")
                 + (f" (torch kernels use {cap})" if cap else ""))
    kern = None
    try:
        from .kernels.cpu import kernel_path
        kern = kernel_path()
        lines.append(f"k3 kernels: {kern['isa']} path ({kern['lanes']}-lane vectors, {kern['tile']} token x row tiles"
                     + (f", one token {kern['t1_rows']} rows at a time from K = {kern['t1_rows_from_k']}"
                        if kern["t1_rows_from_k"] else "") + ")"
                     + (f"; {kern['vendor']} tuning: " + ", ".join(kern["vendor_tuning"]) if kern["vendor_tuning"]
                        else ""))
    except Exception as e:  # noqa: BLE001 - a report line, never a reason to fail the doctor
        lines.append(f"k3 kernels: not available ({type(e).__name__}: {e})")
    regions = None
    try:
        from .model.compiled import why_plain
        why = why_plain()
        regions = {"on": why is None, "plain_because": why}
        lines.append("layer regions: " + ("on (a decode step runs most of a layer in a few parallel regions; "
                                          "K3_FUSED=0 runs the plain forward, the same bits)" if why is None
                                          else f"off, the plain forward runs: {why}"))
    except Exception as e:  # noqa: BLE001 - a report line, never a reason to fail the doctor
        lines.append(f"layer regions: not available ({type(e).__name__}: {e})")
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64") and info.flags and "avx2" not in info.flags:
        rep.warnings.append("this CPU has no AVX2: the BF16 and MXFP4 kernels run without vector units and "
                            "decoding will be several times slower.")
    bw = None
    try:
        from .probe import memory_bandwidth
        bw = memory_bandwidth(256 << 20, reps=3)
        lines.append(f"memory read bandwidth: {bw:.1f} GB/s (sum over 256 MiB, best of 3, {usable} threads): a "
                     "memory-bound decode step reads its weights at most this fast")
    except Exception:  # pragma: no cover - no torch in this build
        pass
    cold = None
    try:
        from .probe import COLD_LINES, SLOW_READ_US, cold_reads_after_stream
        first, hot = cold_reads_after_stream()
        cold = {"lines": COLD_LINES, "first_us": first, "hot_us": hot}
        per = max(0.0, first - hot) / COLD_LINES
        lines.append(f"cold reads after a weight stream: {COLD_LINES} lines {first:.0f} us, again {hot:.0f} us "
                     f"({per * 1e3:.0f} ns a line)")
        if per > SLOW_READ_US:
            rep.warnings.append(
                f"memory reads that miss the caches are slow on this machine now ({per:.1f} us a line right after a "
                "128 MB stream; other programs loading the memory, or a VM inside a VM): the Python glue between a "
                "decode step's kernels waits on them, so small and mid-sized models spend several times their "
                "quiet-machine glue time per token (docs/PERFORMANCE.md, \"Per-token overhead\").")
    except Exception:  # noqa: BLE001 - a report line, never a reason to fail the doctor
        pass
    rep.data["cpu"] = {"model": info.model, "vendor": info.vendor, "usable": usable, "logical": logical,
                       "physical": phys, "simd": have, "torch_capability": cap, "kernels": kern, "layer_regions": regions, "memory_gbps": bw,
                       "cold_reads": cold}


# ---------------------------------------------------------------- memory
def check_memory(rep: Report) -> dict:
    lines = rep.section("memory")
    try:
        from .memory import planner, sysmem
    except ImportError:  # pragma: no cover - planner not in this build
        lines.append("the memory planner is not available in this build")
        return {}
    try:
        mi = sysmem.meminfo()
    except K3Error as e:
        rep.warnings.append(str(e))
        return {}
    total, avail = mi["MemTotal"], mi["MemAvailable"]
    lim = f", cgroup limit {human(mi['CgroupLimit'])}" if "CgroupLimit" in mi else ""
    lines.append(f"MemTotal {human(total)}, MemAvailable {human(avail)}{lim}")
    name = planner.recommend_preset(avail)
    p = planner.PRESETS[name]
    lines.append(f"recommended preset for K3: {name} (trunk {p.trunk_gb:g} GB / expert cache {p.cache_gb:g} GB) - "
                 f"{p.note}")
    if name == "ultra" and avail < 3.5 * GB:
        rep.warnings.append(f"only {human(avail)} of memory is available; even --preset ultra plans ~3 GB for K3. "
                            "Close other programs or use a machine with more memory.")
    rep.data["memory"] = {"MemTotal": total, "MemAvailable": avail, "preset": name}
    return {"total": total, "avail": avail, "preset": name, "planner": planner}


# ---------------------------------------------------------------- disk and storage
def check_disk(rep: Report, where: Path, have_model: bool) -> None:
    lines = rep.section("disk")
    try:
        du = shutil.disk_usage(where)
    except OSError as e:
        rep.warnings.append(f"{where}: cannot read the free space ({e.strerror}).")
        return
    from .probe import block_device
    dev, rot = block_device(where)
    kind = {True: "reported rotational", False: "solid state", None: "type unknown"}[rot]
    lines.append(f"{where}: {human(du.free)} free of {human(du.total)} (device {dev}, {kind})")
    if not have_model and du.free < K3_DOWNLOAD_BYTES * 1.02:
        rep.warnings.append(f"{human(du.free)} free at {where}: the K3 download is {human(K3_DOWNLOAD_BYTES)} "
                            "(and a packed trunk another 109 GB). Download to a bigger drive.")
    rep.data["disk"] = {"path": str(where), "free": du.free, "total": du.total, "device": dev, "rotational": rot}


def check_storage(rep: Report, where: Path, files, seconds: float, read_size: int, scratch_bytes: int = 512 << 20,
                  title: str = "storage probe"):
    from .probe import probe_storage

    lines = rep.section(title)
    try:
        res = probe_storage(where, files, seconds=seconds, read_size=read_size, scratch_bytes=scratch_bytes)
    except OSError as e:
        rep.warnings.append(f"the storage probe failed at {where} ({e.strerror or e}).")
        return None
    src = "a scratch file" if res.scratch else f"{res.files} model shard{'s' if res.files != 1 else ''}"
    mode = "O_DIRECT" if res.direct else "buffered"
    lines.append(f"{mode} reads of {src} on {res.device}, {res.seconds:.1f} s, {human(res.bytes_read)} read")
    if res.note:
        lines.append(res.note)
    if res.sequential:
        lines.append("sequential 8 MiB: " + ", ".join(f"QD{q} {v:,.0f} MB/s" for q, v in res.sequential.items()))
    if res.random:
        lines.append(f"random {human(res.read_size)}: " + ", ".join(f"QD{q} {v:,.0f} MB/s" for q, v in res.random.items()))
    if title == "storage probe":  # the model folder's drive; others go under storage_dirs
        rep.data["storage"] = res.as_dict()
    if res.random and res.random_rate < 500e6:
        rep.warnings.append(f"random expert-sized reads run at {res.random_rate / 1e6:,.0f} MB/s on {res.device}: a "
                            "streamed K3 reads ~26 GB of experts per token, so expect minutes per token. An NVMe "
                            "SSD reads 1-6 GB/s.")
    return res if res.sequential else None


# ---------------------------------------------------------------- estimate and next steps
def estimate(rep: Report, mem: dict, facts: ModelFacts | None, probe) -> tuple[str, bool]:
    """Prints the expected s/token; returns (preset to suggest, runs resident?)."""
    lines = rep.section("expected speed")
    preset = mem.get("preset", "laptop")
    avail = mem.get("avail")
    if facts is not None and not facts.ok:
        lines.append("the model folder has problems (below); no estimate until they are fixed")
        return preset, False
    if facts is not None and facts.cfg is not None and facts.total_bytes:
        trunk, experts, tables = facts.trunk_bytes, facts.expert_bytes_per_token, facts.table_bytes
        what = "this model"
        if avail and facts.total_bytes + 2 * GB < 0.8 * avail:
            lines.append(f"the whole model ({human(facts.total_bytes)}) fits in memory ({human(avail)} available): "
                         "it runs resident, no preset or packed trunk needed, nothing is read per token.")
            if facts.sizes is not None and mem.get("planner") is not None:
                from .memory.sysmem import baseline_bytes
                _context_line(lines, rep, mem["planner"], facts.cfg, facts.sizes, avail, baseline_bytes(), None)
            return preset, True
    else:
        trunk, experts, tables = K3_TRUNK_BYTES, K3_EXPERT_BYTES_PER_TOKEN, 4.70e9
        what = "the released K3"
    planner = mem.get("planner")
    if planner is None:
        lines.append("no memory information, no estimate")
        return preset, False
    p = planner.PRESETS[preset]
    pinned = min(trunk, p.trunk_gb * GB)
    if avail is not None:
        sizes = facts.sizes if facts is not None and facts.sizes is not None else _k3_sizes(trunk, tables)
        cfg = facts.cfg if facts is not None and facts.cfg is not None else None
        if cfg is not None:
            from .memory.sysmem import baseline_bytes
            try:
                plan = planner.plan(cfg, sizes, planner.Budgets(preset="auto", trunk="(packed)"), tokens=4096,
                                    incremental=True, available=avail, baseline=baseline_bytes())
                plan.check()
                lines.append(f"with a packed trunk, {plan.summary()}")
                for n in plan.notes:
                    lines.append(n)
            except K3Error as e:
                lines.append(f"auto: {str(e).splitlines()[0]}")
            _context_line(lines, rep, planner, cfg, sizes, avail, baseline_bytes(), "(packed)")
    streamed = max(0.0, trunk - pinned)
    per_token = streamed + experts
    lines.append(f"{what} at preset {preset}: {human(pinned)} of the trunk pinned, per token {human(streamed)} "
                 f"trunk streamed + {human(experts)} experts (no expert-cache hits assumed) = {human(per_token)} read")
    if probe is None or not probe.seq_rate or not probe.random_rate:
        lines.append("no storage measurement (run without --no-probe for a seconds-per-token estimate)")
        return preset, False
    s = streamed / probe.seq_rate + experts / probe.random_rate
    lines.append(f"expect roughly {s:.1f} s/token from storage alone ({probe.seq_rate / 1e6:,.0f} MB/s sequential, "
                 f"{probe.random_rate / 1e6:,.0f} MB/s random at QD4); compute and cache hits move it")
    rep.data["estimate"] = {"preset": preset, "bytes_per_token": per_token, "seconds_per_token": s}
    return preset, False


def _context_line(lines: list, rep: Report, planner, cfg, sizes, avail: int, baseline: int, trunk) -> None:
    """The longest context an auto plan fits (trunk resident, or packed), in both KV forms."""
    from .decode import max_piece
    kw = dict(available=avail, baseline=baseline, incremental=True, prefill_tokens=max_piece())
    budgets = planner.Budgets(preset="auto", trunk=trunk)
    n = planner.longest_context(cfg, sizes, budgets, kv_latent=True, **kw)
    n_exp = planner.longest_context(cfg, sizes, budgets, kv_latent=False, **kw)
    per = planner.kv_bytes_per_position(cfg)
    lines.append(f"longest context that fits (auto plan, {'packed' if trunk else 'resident'} trunk): {n:,} positions with the latent KV cache "
                 f"({human(per)} a position), {n_exp:,} with --kv expanded")
    rep.data["longest_context"] = {"latent": n, "expanded": n_exp, "kv_bytes_per_position": per}


def _k3_sizes(trunk: float, tables: float):
    """The released K3's sizes, for estimates without a model."""
    from .memory.planner import ModelSizes
    dense = int(2.34 * GB)
    rest = int((trunk - dense) / 92)
    return ModelSizes(layer_bytes=(dense,) + (rest,) * 92, table_bytes=int(tables), head_bytes=int(tables / 2),
                      slot_bytes=K3_SLOT_BYTES, expert_bytes=K3_EXPERT_BYTES, moe_layers=92, experts=896, top_k=16)


def next_steps(rep: Report, model: Path | None, facts: ModelFacts | None, preset: str, resident: bool) -> None:
    q = shlex.quote
    if model is None:
        rep.next_steps += [
            ("k3 synth /tmp/k3-tiny && k3 chat /tmp/k3-tiny", "try k3 now on a small synthetic model"),
            (f"hf download {K3_REPO} --local-dir DIR",
             f"the released checkpoint, {human(K3_DOWNLOAD_BYTES)} (pip install huggingface_hub for `hf`)"),
            ("k3 doctor DIR", "check the download and get the commands for this machine"),
        ]
        return
    m = q(str(model))
    if facts is None or not facts.ok:
        if facts is not None and facts.shard_problems:
            rep.next_steps.append((f"hf download REPO {' '.join(q(s) for s in facts.shard_problems[:8])}"
                                   f"{' ...' if len(facts.shard_problems) > 8 else ''} --local-dir {m}",
                                   "fetch the missing or damaged shards again (REPO: where the model came from)"))
        rep.next_steps.append((f"k3 doctor {m}", "check again"))
        return
    if resident:
        rep.next_steps += [(f"k3 run {m} --prompt 'The capital of France is' --gen 16 --incremental", "a first run"),
                           (f"k3 chat {m}", "talk to it")]
        return
    tdir = facts.trunk_dir or (model / "trunk")
    t = q(str(tdir))
    if facts.trunk_state not in ("current",) and not facts.trunk_state.startswith("present"):
        rep.next_steps.append((f"k3 pack-trunk {m} {t}", "pack the trunk once so presets can stream it"))
    mem = f"--trunk {t} --preset {preset}"
    rep.next_steps += [(f"k3 run {m} {mem} --prompt 'The capital of France is' --gen 8 --incremental",
                        "a first run (prints the memory plan before allocating)"),
                       (f"k3 chat {m} {mem}", "talk to it")]


def run_doctor(model=None, trunk=None, probe: bool = True, probe_seconds: float = 8.0,
               probe_dir=None, read_size: int | None = None, scratch_bytes: int = 512 << 20,
               model_dirs=(), project: dict | None = None) -> Report:
    rep = Report()
    check_python(rep)
    check_cpu(rep)
    mem = check_memory(rep)
    model_p = Path(model) if model is not None else None
    facts = check_model(rep, model_p, Path(trunk) if trunk else None, model_dirs) if model_p is not None else None
    where = Path(probe_dir) if probe_dir else (model_p if model_p is not None and model_p.is_dir() else Path.cwd())
    check_disk(rep, where, model_p is not None and model_p.is_dir())
    res = None
    if probe:
        shards = []
        if model_p is not None and model_p.is_dir() and probe_dir is None:
            shards = sorted(model_p.glob("*.safetensors"), key=lambda p: -p.stat().st_size)[:8]
        size = read_size or K3_EXPERT_BYTES
        res = check_storage(rep, where, shards, probe_seconds, size, scratch_bytes)
        for d in model_dirs:  # shards on other drives: each drive is probed with its own shards
            more = sorted(Path(d).glob("*.safetensors"), key=lambda p: -p.stat().st_size)[:8]
            other = check_storage(rep, Path(d), more, probe_seconds, size, scratch_bytes,
                                  title=f"storage probe ({d})")
            if other is not None:
                rep.data.setdefault("storage_dirs", {})[str(d)] = other.as_dict()
    preset, resident = estimate(rep, mem, facts, res)
    if project is not None:
        if model_p is not None and model_dirs:
            from .probe import block_device

            disks = {block_device(d, disk=True)[0] for d in (model_p, *model_dirs)}
            project = dict(project, drives=max(1, len({d for d in disks if d != "unknown" and
                                                        not d.startswith("dev 0:")})))
        projection(rep, facts, res, project)
    next_steps(rep, model_p, facts, preset, resident)
    return rep


def projection(rep: Report, facts: ModelFacts | None, probe, opts: dict) -> None:
    """The --project table (k3.projection)."""
    from . import projection as pj
    from .memory.sysmem import baseline_bytes
    from .warmup import KERNELS_BYTES

    lines = rep.section("projection")
    if facts is not None and facts.ok and facts.sizes is not None:
        cfg, sizes, what = facts.cfg, facts.sizes, "this model"
    else:
        cfg, sizes = pj.release_model()
        what = "the released K3 (93 layers, 896 experts, 108.81 GB trunk)"
    if opts.get("disk_gbps"):
        seq = rnd = opts["disk_gbps"] * 1e9
        src = f"storage given: {opts['disk_gbps']:g} GB/s"
    elif probe is not None and probe.seq_rate and probe.random:
        # at queue depth 4 where probed: the ring and the expert loader each keep 4 reads in flight
        seq = probe.sequential.get(4, 0) * 1e6 or probe.seq_rate
        rnd = probe.random_rate
        src = "storage probed here at queue depth 4, as k3's readers issue"
    else:
        lines.append("no storage rate: run the probe (without --no-probe) or give --disk-gbps")
        return
    bf16, mx = pj.calibrate()
    drives = int(opts.get("drives") or 1)
    if drives > 1:
        src += f"; the shards spread over {drives} drives (--model-dirs), each at this rate"
    rates = pj.Rates(seq, rnd, bf16, mx, f"{src}; kernels measured here", drives=drives)
    if opts.get("prompt_tokens"):
        from .projection_ttft import calibrate_prefill
        rates.bf16_flops, rates.mxfp4_flops = calibrate_prefill()
    rows = pj.project(cfg, sizes, rates, opts["ram"], baseline=baseline_bytes() + KERNELS_BYTES,
                      acceptance=opts["acceptance"], trunk_gb=opts.get("trunk_gb"), cache_gb=opts.get("cache_gb"),
                      context=opts.get("context") or pj.CONTEXT, piece=opts.get("piece") or pj.PIECE)
    lines.extend(pj.render(rows, what, rates, opts["acceptance"]))
    rep.data["projection"] = {"model": what, "rates": {"sequential": seq, "random": rnd, "bf16": bf16, "mxfp4": mx},
                              "acceptance": opts["acceptance"], "rows": pj.as_dicts(rows)}
    if opts.get("prompt_tokens"):
        from .projection_ttft import report
        report(lines, rep.data["projection"], cfg, sizes, rates, opts, baseline_bytes() + KERNELS_BYTES)
