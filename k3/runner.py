"""From budgets to a running model: resolve presets and budget flags (later flags win),
build and check the memory plan before anything large is allocated, open the
budgeted provider, and collect per-step statistics for the report.

Front ends (k3 run, chat) call `open_session` and then drive k3.engine.generate.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

from .errors import UsageError
from .memory import planner
from .memory.planner import GB, PRESETS, human
from .model.schema import layer_specs
from .model.stack import Model

BASELINE_MARGIN = 300 * 1000 * 1000  # numba code, thread stacks, allocator slack above the measured RSS


class BudgetEvent(argparse.Action):
    """--preset / --trunk-gb / --cache-gb are applied in command-line order."""

    def __call__(self, parser, ns, value, option_string=None):
        ev = list(getattr(ns, "budget_events", None) or [])
        ev.append((self.dest, value))
        ns.budget_events = ev


def add_budget_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory (later flags override earlier ones)")
    g.add_argument("--preset", dest="preset", action=BudgetEvent, metavar="NAME",
                   help="laptop | desktop | workstation | server | max | ultra | auto (default auto)")
    g.add_argument("--trunk-gb", dest="trunk_gb", action=BudgetEvent, metavar="X|auto",
                   help="budget for pinned trunk layers + the ring (with --trunk)")
    g.add_argument("--cache-gb", dest="cache_gb", action=BudgetEvent, metavar="X",
                   help="routed-expert cache arena")
    g.add_argument("--trunk", metavar="DIR", help="packed trunk (k3 pack-trunk): stream the trunk within --trunk-gb")
    g.add_argument("--trunk-ring", type=int, default=2, metavar="N", help="ring slots for streamed layers (default 2)")
    g.add_argument("--ultra-low-memory", action="store_true",
                   help="stream the embedding and lm_head too (bit-identical, slower)")
    g.add_argument("--io-threads", type=int, default=4, metavar="N", help="parallel reads (default 4)")
    g.add_argument("--dump-cache-trace", metavar="DIR", help="write expert_trace.bin + expert_hist.json here")
    p.set_defaults(budget_events=[])


@dataclass
class Budgets:
    trunk: int | None
    cache: int
    preset: str
    ultra: bool
    notes: list = field(default_factory=list)


def _gb(value: str, flag: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise UsageError(f"{flag} takes a number of GB (or auto), got {value!r}.") from None
    if not x > 0:
        raise UsageError(f"{flag} must be > 0, got {value}.")
    return x


def layer_run_bytes(layout, i) -> int:
    return sum(layout.info(f"layers.{i}.{rel}").nbytes for rel in layer_specs(layout.cfg, i))


def resolve_budgets(args, cfg, layer_bytes: list[int], slot_bytes: int, mem=None) -> Budgets:
    events = list(args.budget_events or [])
    if not events:
        events = [("preset", "auto")]
    trunk = cache = None
    preset = "custom"
    ultra = bool(args.ultra_low_memory)
    notes = []
    trunk_total = sum(layer_bytes)
    topk = cfg.num_experts_per_token
    cache_floor = max((topk + 1) * slot_bytes, min(int(0.5 * GB), cfg.num_experts * slot_bytes))

    def auto():
        from .memory.trunk import min_budget_for
        m = mem or planner.meminfo()
        order = "prefix" if os.environ.get("K3_PIN_PREFIX") == "1" else "largest"
        overlap = min_budget_for(layer_bytes, 2, order) if len(layer_bytes) > 1 else None
        return planner.auto_budget(m["MemAvailable"], m["MemTotal"], trunk_total,
                                   planner.embed_head_bytes(cfg) if not ultra else 0,
                                   max(layer_bytes), cache_floor, overlap)

    for kind, value in events:
        if kind == "preset":
            if value not in planner.PRESET_NAMES:
                raise UsageError(f"unknown --preset {value!r}; choose one of {', '.join(planner.PRESET_NAMES)} "
                                 "(k3 presets lists them).")
            preset = value
            if value == "auto":
                trunk, cache, msg = auto()
                notes.append(msg)
            else:
                p = PRESETS[value]
                trunk, cache = int(p.trunk_gb * GB), int(p.cache_gb * GB)
                if value == "ultra":
                    ultra = True
        elif kind == "trunk_gb":
            if value == "auto":
                trunk, _, msg = auto()
                notes.append(msg)
            else:
                trunk = int(_gb(value, "--trunk-gb") * GB)
            preset = "custom" if preset != "custom" else preset
        elif kind == "cache_gb":
            cache = int(_gb(value, "--cache-gb") * GB)
            preset = "custom"
    if cache is None:
        _, cache, msg = auto()
        notes.append(msg)
    if ultra and not args.trunk:
        raise UsageError("--ultra-low-memory (and --preset ultra) stream the trunk too, so they need --trunk DIR "
                         "(a packed trunk: k3 pack-trunk MODEL OUT).")
    if not args.trunk and any(k == "trunk_gb" for k, _ in events):
        notes.append("note: --trunk-gb has no effect without --trunk (the trunk is held in RAM)")
    if args.trunk and trunk is None:
        trunk, _, msg = auto()
        notes.append(msg)
    return Budgets(trunk if args.trunk else None, cache, preset, ultra, notes)


@dataclass
class Session:
    cfg: object
    model: Model
    provider: object
    plan: planner.MemoryPlan
    budgets: Budgets
    trunk_plan: object = None
    load_seconds: float = 0.0


def build_plan(cfg, layout, budgets: Budgets, args, tokens: int, slot_bytes: int, n_slots: int,
               layer_bytes: list[int]):
    """layer_bytes: what the trunk will allocate per layer (the packed, 4096-rounded runs
    when streaming)."""
    plan = planner.MemoryPlan(available=planner.meminfo()["MemAvailable"])
    trunk_plan = None
    if budgets.trunk is not None:
        from .memory.trunk import plan_trunk
        order = "prefix" if os.environ.get("K3_PIN_PREFIX") == "1" else "largest"
        trunk_plan = plan_trunk(layer_bytes, budgets.trunk, ring=args.trunk_ring, order=order)
        plan.add("trunk (STREAMED)", trunk_plan.used_bytes,
                 f"{len(trunk_plan.pinned)}/{len(layer_bytes)} layers pinned + a {human(trunk_plan.arena_bytes)} ring "
                 f"({trunk_plan.ring_slots} slot(s) of {human(trunk_plan.slot_bytes)})")
    else:
        plan.add("trunk (resident)", sum(layer_bytes), "every layer held in RAM, as stored")
    if budgets.ultra:
        from .memory.tables import CHUNK_BYTES
        plan.add("embed + lm_head", CHUNK_BYTES + 64 * 1024 * 1024, "streamed: one chunk buffer + small tables")
    else:
        plan.add("embed + lm_head", planner.embed_head_bytes(cfg), "resident, as stored")
    plan.add("expert cache", n_slots * slot_bytes, f"{n_slots} slots x {human(slot_bytes)}")
    plan.add("recurrent state", planner.recurrent_state_bytes(cfg, layout.n_layers),
             "KDA conv + recurrent state, fp32")
    if args.incremental:
        per = planner.kv_bytes_per_position(cfg, layout.n_layers)
        kv = tokens * per
        if kv > 0.9 * plan.available:
            raise UsageError(
                f"REFUSING: the KV cache for {tokens} positions needs {human(kv)} but only {human(plan.available)} "
                f"is available. This is a memory limit, not a bug: --incremental keeps, for each of the "
                f"{sum(1 for i in range(layout.n_layers) if cfg.is_mla(i))} MLA layers, the expanded fp32 keys and "
                f"values of every position ({human(per)} per position). Shorten the prompt or --gen, or drop "
                "--incremental (full recompute needs no KV cache).")
        plan.add("KV cache", kv, f"{tokens} positions x {human(per)}")
    plan.add("buffers", planner.activation_bytes(cfg, tokens), "activations, scratch, logits")
    # the peak so far, not just the current RSS: compiling a kernel (a fresh install)
    # peaks well above what it leaves resident
    base = max(planner.rss_bytes(), planner.peak_rss_bytes())
    plan.add("interpreter + libs", base + BASELINE_MARGIN, "measured peak RSS so far + margin")
    return plan, trunk_plan


def open_session(args, cfg, model_dir, tokens: int, log=print) -> Session:
    """Index, plan, check, then allocate: the order matters (refuse before allocating)."""
    from .checkpoint.io import ShardFiles
    from .checkpoint.safetensors import CheckpointIndex
    from .memory.expert_cache import expert_cache_slots, expert_slot_bytes
    from .memory.resident import CheckpointLayout
    from .memory.streaming import StreamingWeights

    t0 = time.perf_counter()
    index = CheckpointIndex.open(model_dir)
    log(f"indexed {len(index)} tensors from {len(index.shards())} shards in {time.perf_counter() - t0:.2f} s")
    layout = CheckpointLayout(cfg, index, args.layers)
    layout.validate()
    slot = expert_slot_bytes(layout)
    packed = None
    if args.trunk:
        from .memory.trunk import PackedTrunk
        packed = PackedTrunk.open(args.trunk, cfg, index)
        layer_bytes = packed.layer_bytes[: layout.n_layers]
    else:
        layer_bytes = [layer_run_bytes(layout, i) for i in range(layout.n_layers)]
    budgets = resolve_budgets(args, cfg, layer_bytes, slot)
    for n in budgets.notes:
        log(n)
    n_slots = expert_cache_slots(layout, budgets.cache)
    if budgets.preset != "custom":
        trunk_txt = f"trunk {budgets.trunk / GB:.2f} GB" if budgets.trunk is not None else "trunk resident (no --trunk)"
        log(f"  preset   : {budgets.preset} ({trunk_txt} / expert cache {budgets.cache / GB:.2f} GB)")
    warm_kernels()  # load the compiled kernels now, so the measured baseline includes them
    plan, trunk_plan = build_plan(cfg, layout, budgets, args, tokens, slot, n_slots, layer_bytes)
    log(plan.render())
    plan.check()
    if trunk_plan is not None and trunk_plan.message:
        log(trunk_plan.message)
    t0 = time.perf_counter()
    order = "prefix" if os.environ.get("K3_PIN_PREFIX") == "1" else "largest"
    faults = test_faults()
    prov = StreamingWeights(cfg, model_dir, cache_budget=budgets.cache, trunk_dir=packed,
                            trunk_budget=budgets.trunk, ring=args.trunk_ring, pin_order=order,
                            ultra=budgets.ultra, n_layers=args.layers, io_threads=args.io_threads,
                            trace=bool(args.dump_cache_trace), layout=layout, reader=ShardFiles(),
                            expert_reader=ShardFiles(hook=faults.get("experts")),
                            trunk_reader=ShardFiles(hook=faults.get("trunk")))
    load = time.perf_counter() - t0
    model = Model(prov, n_layers=args.layers)
    return Session(cfg, model, prov, plan, budgets, trunk_plan, load)


def set_threads(n: int | None) -> int:
    """Compute threads for torch and the numba kernels (default: every usable core)."""
    import torch

    from .quant import set_num_threads
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n < 1:
        raise UsageError(f"--threads must be >= 1, got {n}.")
    torch.set_num_threads(n)
    set_num_threads(n)
    return n


def warm_kernels() -> None:
    """Run each numba kernel once on tiny inputs (loads it from the cache, or compiles it
    on a fresh install): their code then counts in the RSS the plan measures."""
    import torch

    from .quant import bf16_linear, mxfp4_linear
    w = torch.zeros(2, 64, dtype=torch.bfloat16)
    p, sc = torch.zeros(2, 32, dtype=torch.uint8), torch.full((2, 2), 127, dtype=torch.uint8)
    for t in (1, 3):
        x = torch.zeros(t, 64)
        bf16_linear(x, w)
        mxfp4_linear(x, p, sc)


def test_faults() -> dict:
    """Read failures injected for tests of the failure path, from K3_TEST_FAULT =
    "KIND:TARGET[:after=N]" (KIND eio|eof|short, TARGET experts|trunk). Not for users."""
    spec = os.environ.get("K3_TEST_FAULT")
    if not spec:
        return {}
    from .checkpoint.io import FaultHook
    parts = spec.split(":")
    if len(parts) < 2 or parts[1] not in ("experts", "trunk"):
        raise UsageError(f"K3_TEST_FAULT={spec!r}: expected KIND:experts|trunk[:after=N].")
    after = 0
    for p in parts[2:]:
        if p.startswith("after="):
            after = int(p[len("after="):])
    return {parts[1]: FaultHook(parts[0], after=after)}


class StepStats:
    """Per-step and whole-run I/O accounting from the provider's counters."""

    def __init__(self, prov):
        self.prov = prov
        self.rows = []

    def step(self, s) -> dict:
        cs = self.prov.cache.step_stats()
        self.prov.cache.end_step()
        row = {"step": s.step, "token": s.token, "seconds": s.seconds,
               "expert_requests": cs.get("requests", 0), "expert_hits": cs.get("hits", 0),
               "expert_hit_pct": 100.0 * cs.get("hits", 0) / cs["requests"] if cs.get("requests") else 0.0,
               "expert_bytes_read": cs.get("bytes_read", 0), "expert_read_seconds": cs.get("read_seconds", 0.0)}
        self.rows.append(row)
        return row
