"""Memory planning, in one place: budgets in, the whole plan out, before anything large
is allocated.

The planner turns a :class:`Budgets` request and the model's sizes
(:class:`ModelSizes`: trunk layer sizes, model tables, the expert-cache slot) into a
:class:`Plan`: which trunk layers are pinned and how large the ring arena is
(:func:`plan_trunk`), how many expert-cache slots there are, whether the model tables
are held or streamed, the recurrent state and KV cache, the activation buffers and the
interpreter's own measured footprint. The trunk streamer and the expert cache receive
their part of the plan; they never size anything themselves.

Invariants:
  * the plan is a forecast that must not under-state the measured peak RSS: every row
    is an upper bound of what the run allocates;
  * a plan that does not fit (more than 95% of the memory available) is refused with the
    shortfall and the options;
  * ``auto`` chooses, among the plans that fit, the one that reads the fewest bytes per
    token, by the cost model of :func:`bytes_per_token` (stated in docs/TUNING.md).
GB here are decimal (1e9 bytes), as in the C engine's tables. Nothing here imports torch.

The parts it plans with live beside it, by subject: the presets and the user's budgets
(:mod:`k3.memory.budgets`), what a model needs in memory (:mod:`k3.memory.sizes`), the
trunk's pins and ring (:mod:`k3.memory.trunkplan`). Their names are importable from
here too, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import K3Error, UsageError
from ..units import align_up, gb, gb_up, human
from .budgets import (CEILING_PRESETS, PRESET_NAMES, PRESETS, Budgets, Preset, _ceilings, _explicit, cache_fixed,
                      presets_table, recommend_preset)
from .passcost import PassShape, pass_bytes, plan_groups
from .sizes import (ATTENTION_TILE_BYTES, TABLE_CHUNK_BYTES, TABLE_STREAM_BYTES, ModelSizes, activation_bytes,
                    kv_bytes_per_position, layer_ids, recurrent_state_bytes, spec_bytes, stream_table_bytes)
from .trunkplan import TrunkPlan, _plan_trunk_memo, min_budget_for, plan_trunk, trunk_ladder

#: share of the available memory a plan may use (the rest absorbs allocator slack)
PLAN_FRACTION = 0.95


# ====================================================================== the expert cache
def expert_cache_slots(sizes: ModelSizes, budget_bytes: int) -> int:
    """Slots an expert cache of ``budget_bytes`` has: ``budget // slot_bytes``, capped at
    the model's number of routed experts (more could never be used). A budget below
    top-k + 1 slots is refused (K3Error, exit 1) with the minimum to use: a cache
    smaller than one token's working set would evict an expert still being multiplied."""
    slot, need = sizes.slot_bytes, sizes.top_k + 1
    if not sizes.routed_experts:  # no MoE layer among the layers run
        return 0
    fit = int(budget_bytes) // slot
    if fit < need:
        raise K3Error(
            f"expert cache budget {gb(budget_bytes)} GB holds {fit} slots of {human(slot)}; one token needs "
            f"top-k + 1 = {need} slots (a cache smaller than one token's working set would evict an expert that "
            f"is still being multiplied). Raise --cache-gb to at least {gb_up(need * slot)} GB.")
    return int(min(fit, max(sizes.routed_experts, need)))


# ====================================================================== the cost model
def pass_shape(sizes: ModelSizes, trunk: TrunkPlan | None, cache_slots: int, stream_tables: bool) -> PassShape:
    """The constants the pass cost model (k3.memory.passcost) takes from a plan."""
    return PassShape(sizes.moe_layers, sizes.experts, sizes.top_k, sizes.expert_bytes, cache_slots,
                     0 if trunk is None else trunk.streamed_bytes, sizes.head_bytes if stream_tables else 0)


def bytes_per_token(sizes: ModelSizes, trunk: TrunkPlan | None, cache_slots: int, stream_tables: bool,
                    sequences: int = 1) -> int:
    """Bytes read from storage per decoded token when ``sequences`` sequences decode
    together, estimated by the pass cost model with its uniform prior: one pass reads
    the trunk layers not pinned and (tables streamed) lm_head once for all of them, and
    per MoE layer the distinct routed experts their tokens choose that the cache misses
    (T tokens choose E (1 - (1 - k/E)^T) of E experts; the hit rate is ``slots / routed
    experts``, uniform routing as K3's Quantile-Balanced router aims for)."""
    groups = plan_groups(sequences)
    return int(pass_bytes(pass_shape(sizes, trunk, cache_slots, stream_tables), groups) / len(groups))


# ====================================================================== the plan
@dataclass
class Plan:
    """The whole memory plan of one run. ``rows`` are (component, bytes, note)."""

    budgets: Budgets
    preset: str  # the preset applied, "custom" when flags override it
    trunk: TrunkPlan | None  # None: the trunk is held in RAM (no packed trunk)
    trunk_budget: int | None
    cache_budget: int
    cache_slots: int
    stream_tables: bool
    available: int
    read_per_token: int
    rows: list[tuple[str, int, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kv_positions: int = 0  # the positions the KV cache row holds (all sequences)
    kv_per_position: int = 0
    sequences: int = 1  # the batch the read per token is priced for
    prefill: str = ""  # the prefill piece and what a prompt reads (k3.memory.prefill), for the summary

    @property
    def total(self) -> int:
        return sum(r[1] for r in self.rows)

    def render(self) -> str:
        out = ["memory plan"]
        for name, n, note in self.rows:
            out.append(f"  {name:<18}{human(n):>12}  {note}".rstrip())
        out.append(f"  {'TOTAL':<18}{human(self.total):>12}")
        out.append(f"  {'available':<18}{human(self.available):>12}  (MemAvailable or the cgroup's limit)")
        return "\n".join(out)

    def summary(self) -> str:
        """One line: the plan's total against what is available, and its main choices."""
        if self.trunk is None:
            trunk = "trunk resident"
        elif not self.trunk.ring_slots:
            trunk = f"trunk all {len(self.trunk.pinned)} layers pinned"
        else:
            trunk = (f"trunk {len(self.trunk.pinned)} pinned + {human(self.trunk.arena_bytes)} ring "
                     f"({self.trunk.ring_slots} slot{'s' if self.trunk.ring_slots != 1 else ''})")
        return (f"memory plan: {human(self.total)} of {human(self.available)} available ({self.preset}): {trunk}, "
                f"expert cache {self.cache_slots} slots, tables {'streamed' if self.stream_tables else 'resident'}; "
                f"~{human(self.read_per_token)} read per token{self._at_batch()}"
                + (f"; {self.prefill}" if self.prefill else ""))

    def _at_batch(self) -> str:
        return f" at batch {self.sequences}" if self.sequences > 1 else ""

    def as_dict(self) -> dict:
        return {"components": {n: b for n, b, _ in self.rows}, "total": self.total, "available": self.available,
                "preset": self.preset, "stream_tables": self.stream_tables, "cache_slots": self.cache_slots,
                "trunk_budget": self.trunk_budget, "cache_budget": self.cache_budget,
                "estimated_read_per_token": self.read_per_token, "priced_for_batch": self.sequences}

    def check(self) -> None:
        if self.available and self.total > PLAN_FRACTION * self.available:
            short = self.total - PLAN_FRACTION * self.available
            fits = ""
            if self.kv_per_position:
                n = self.kv_positions - math.ceil(short / self.kv_per_position)
                fits = (f" With everything else as planned, the longest context that fits is about {n} positions "
                        f"(the KV cache takes {human(self.kv_per_position)} a position)." if n > 0 else
                        " Even an empty context does not fit with everything else as planned.")
            raise K3Error(
                f"REFUSING TO START: this needs {human(self.total)} and the machine has {human(self.available)} "
                f"available ({PLAN_FRACTION:.0%} of it may be planned), a shortfall of {human(short)}.{fits} Options: a "
                f"smaller --cache-gb or --trunk-gb (with --trunk), --preset auto, a smaller preset (--preset laptop "
                f"or ultra), --ultra-low-memory, fewer --layers, or a machine with more free memory.\n"
                + self.render())


def longest_context(cfg, sizes: ModelSizes, budgets: Budgets, *, available: int, baseline: int, **kw) -> int:
    """The most KV positions a plan for ``budgets`` fits (the other arguments as for
    :func:`plan`, without ``tokens``); 0 when not even an empty context fits."""
    def fits(n):
        try:
            plan(cfg, sizes, budgets, tokens=n, available=available, baseline=baseline, **kw).check()
            return True
        except K3Error:
            return False
    if not fits(0):
        return 0
    per = max(1, kv_bytes_per_position(cfg, kw.get("n_layers"), kw.get("kv_latent", True)))
    lo, hi = 0, int(available) // per + 1  # fits(lo); not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo




def _fixed_rows(cfg, n_layers: int, tokens: int, incremental: bool, baseline: int, available: int,
                prefill_tokens: int, spec: int = 0, kv_latent: bool = True, sequences: int = 1) -> list:
    each = "" if sequences == 1 else f", {sequences} sequences"
    rows = [("recurrent state", sequences * recurrent_state_bytes(cfg, n_layers),
             "KDA conv + recurrent state, fp32, the matrices twice (a pass's undo keeps the previous)" + each)]
    per = kv_bytes_per_position(cfg, n_layers, kv_latent)
    kv = tokens * per
    if kv > 0.9 * available:
        n_mla = sum(1 for i in layer_ids(cfg, n_layers) if cfg.is_mla(i))
        raise UsageError(
            f"REFUSING: the KV cache for {tokens} positions needs {human(kv)} but only {human(available)} "
            f"is available (the longest context that fits is about {int(0.9 * available) // per} positions). "
            f"This is a memory limit, not a bug: for each of the {n_mla} MLA layers, the "
            f"{'latent' if kv_latent else 'expanded'} fp32 cache of every position is held ({human(per)} per "
            "position), by "
            "incremental decoding for the whole sequence and by full recompute during each step. Use a shorter "
            "prompt, fewer tokens or a smaller context.")
    rows.append(("KV cache", kv, f"{tokens} positions x {human(per)} ({'latent' if kv_latent else 'expanded'})"
                 + ("" if incremental else ", rebuilt by every full-recompute step")))
    rows.append(("buffers", activation_bytes(cfg, min(tokens, prefill_tokens), rows=sequences),
                 f"activations of {min(tokens, prefill_tokens)} tokens (prefill runs in pieces), attention "
                 "tiles, logits"))
    if spec:
        rows.append(("speculation", sequences * spec_bytes(cfg, n_layers, spec),
                     f"rollback records of 1 + {spec} tokens{each}"))
    rows.append(("interpreter + libs", baseline, "measured peak RSS so far + margin"))
    return rows


def trunk_room(cfg, sizes: ModelSizes, budgets: Budgets, *, available: int, baseline: int, tokens: int,
               incremental: bool, prefill_tokens: int, spec: int = 0, kv_latent: bool = True, sequences: int = 1,
               n_layers: int | range | None = None, share: int = 1, tables: bool = True) -> int:
    """The trunk bytes a process can hold beside the rest of its plan, before it knows
    which layers it gets (a pipeline's layer assignment, k3.pipeline): its --trunk-gb
    when given with a packed trunk; otherwise what PLAN_FRACTION of ``available`` leaves
    after the fixed rows of ``n_layers`` (the per-layer ones - recurrent state, KV cache,
    speculation - divided among the ``share`` processes that split the layers), the
    model tables (when ``tables``) and the expert cache's floor (or its --cache-gb)."""
    _, trunk, cache = _explicit(budgets)
    if budgets.trunk is not None and trunk is not None:
        return trunk
    rows = _fixed_rows(cfg, layer_ids(cfg, n_layers), tokens, incremental, baseline, available, prefill_tokens, spec,
                       kv_latent, sequences)
    per_layer = sum(b for name, b, _ in rows if name in ("recurrent state", "KV cache", "speculation"))
    fixed = sum(b for _, b, _ in rows) - per_layer + per_layer // share
    if cache is None:
        cache = (sizes.top_k + 1) * sizes.slot_bytes
    t = (stream_table_bytes(sizes) if budgets.stream_tables else sizes.table_bytes) if tables else 0
    t_cap, c_cap = _ceilings(budgets)
    room = max(1, int(PLAN_FRACTION * available) - fixed - t - cache)
    return room if t_cap is None else min(room, t_cap)


@dataclass(frozen=True)
class _Search:
    """What the choice among plans works with (fixed for one :func:`plan`): the model, the
    request and its pin order, the batch priced, the budgets the request fixes (None: the
    plan decides), the trunk's ceiling (a ceiling preset's), and the expert cache's floor
    (top-k + 1 slots) and the most it could use."""

    sizes: ModelSizes
    budgets: Budgets
    pin_order: str
    sequences: int
    trunk_req: int | None
    cache_req: int | None
    trunk_cap: int | None
    floor_cache: int
    max_cache: int

    @property
    def streaming(self) -> bool:
        return self.budgets.trunk is not None

    def trunk_plan(self, t):
        if not self.streaming:
            return None
        return _plan_trunk_memo(tuple(self.sizes.layer_bytes), t, self.budgets.trunk_ring, self.pin_order)

    def trunk_budgets(self, left: int) -> list:
        """The trunk budgets to try with ``left`` bytes for the trunk and the expert cache
        ([None]: the trunk is held in RAM)."""
        sizes, pin_order = self.sizes, self.pin_order
        if not self.streaming:
            return [None]
        if self.trunk_req is not None:
            return [self.trunk_req]
        cache_part = self.cache_req if self.cache_req is not None else self.floor_cache
        top = min(left - cache_part, sum(align_up(x) for x in sizes.layer_bytes))
        if self.trunk_cap is not None:
            top = min(top, max(self.trunk_cap, min_budget_for(list(sizes.layer_bytes), 1, pin_order)))
        one_slot = min_budget_for(list(sizes.layer_bytes), 1, pin_order)
        # every pinned set the pin order passes through (not only the largest one that
        # fits), so that memory added never takes a plan away: more memory, never more bytes
        steps = trunk_ladder(tuple(sizes.layer_bytes), self.budgets.trunk_ring, pin_order)
        trunk_sizes = sorted({t for t in (top, *steps) if one_slot <= t <= top})
        # the same pinned set for less budget leaves the rest to the cache
        more = set()
        for t in trunk_sizes:
            tp = self.trunk_plan(t)
            more.add(tp.pinned_bytes + tp.ring_slots * tp.slot_bytes)
        return sorted(set(trunk_sizes) | more)

    def candidates(self, room: int, table_choices: list) -> list:
        """Every plan that fits in ``room`` (tables resident or streamed, each trunk budget
        with the expert cache it leaves)."""
        sizes = self.sizes
        candidates = []  # (bytes/token, -trunk budget, stream_tables, trunk budget, cache budget, TrunkPlan)
        for stream_tables in table_choices:
            tables = stream_table_bytes(sizes) if stream_tables else sizes.table_bytes
            left = room - tables
            for t in self.trunk_budgets(left):
                try:
                    tp = self.trunk_plan(t)
                except K3Error:
                    continue
                trunk_mem = tp.used_bytes if tp is not None else sizes.trunk_bytes
                cache = self.cache_req if self.cache_req is not None else min(self.max_cache, left - trunk_mem)
                if cache < self.floor_cache or trunk_mem + cache > left:
                    continue
                slots = expert_cache_slots(sizes, cache)
                cost = bytes_per_token(sizes, tp, slots, stream_tables, self.sequences)
                candidates.append((cost, -(trunk_mem), stream_tables, t, cache, tp, slots))
        return candidates

    def asked_for(self, room: int, table_choices: list) -> tuple:
        """The plan that was asked for, whether or not it fits: (bytes/token, stream_tables,
        trunk budget, cache budget, TrunkPlan, slots)."""
        sizes, budgets = self.sizes, self.budgets
        stream_tables = table_choices[-1] if budgets.stream_tables is None else budgets.stream_tables
        tables = stream_table_bytes(sizes) if stream_tables else sizes.table_bytes
        if self.streaming:
            t = self.trunk_req if self.trunk_req is not None else max(
                min_budget_for(list(sizes.layer_bytes), 1, self.pin_order), room - tables - self.floor_cache)
            tp = self.trunk_plan(t)
        else:
            t, tp = None, None
        if self.cache_req is not None:
            cache = self.cache_req
        else:
            trunk_mem = tp.used_bytes if tp is not None else sizes.trunk_bytes
            cache = min(self.max_cache, max(self.floor_cache, room - tables - trunk_mem))
        slots = expert_cache_slots(sizes, cache)
        cost = bytes_per_token(sizes, tp, slots, stream_tables, self.sequences)
        return cost, stream_tables, t, cache, tp, slots


def _component_rows(sizes: ModelSizes, tp: TrunkPlan | None, stream_tables: bool, slots: int) -> list:
    """The plan's rows for the trunk, the model tables and the expert cache."""
    rows = []
    if tp is not None:
        rows.append(("trunk (STREAMED)", tp.used_bytes,
                     f"{len(tp.pinned)}/{len(sizes.layer_bytes)} layers pinned + a {human(tp.arena_bytes)} ring "
                     f"({tp.ring_slots} slot(s) of {human(tp.slot_bytes)})"))
    else:
        rows.append(("trunk (resident)", sizes.trunk_bytes, "every layer held in RAM, as stored"))
    if stream_tables:
        rows.append(("embed + lm_head", stream_table_bytes(sizes), "streamed: one chunk buffer + the embedding rows"))
    else:
        rows.append(("embed + lm_head", sizes.table_bytes, "resident, as stored"))
    rows.append(("expert cache", slots * sizes.slot_bytes, f"{slots} slots x {human(sizes.slot_bytes)}"))
    return rows


def _auto_note(p: Plan, sizes: ModelSizes, n_plans: int, trunk_cap: int | None, cache_cap: int | None) -> str:
    """Why auto (or a ceiling preset) chose plan ``p`` among the ``n_plans`` that fit."""
    why = []
    if p.budgets.stream_tables is None:
        why.append("model tables " + ("STREAMED: the memory they free pins more of the trunk than lm_head "
                                      f"costs to read ({human(sizes.head_bytes)} a token)" if p.stream_tables
                                      else "resident"))
    tp, slots, preset = p.trunk, p.cache_slots, p.preset
    if tp is not None:
        why.append(f"trunk {human(tp.used_bytes)} ({len(tp.pinned)}/{len(sizes.layer_bytes)} layers pinned)")
    why.append(f"expert cache {human(slots * sizes.slot_bytes)} ({slots} slots)")
    within = (f" within the {preset} preset's ceilings ({gb(trunk_cap or 0)} GB trunk, "
              f"{gb(cache_cap or 0)} GB expert cache)" if preset in CEILING_PRESETS else "")
    return (f"{'auto' if preset not in CEILING_PRESETS else preset}: {'; '.join(why)}: the fewest bytes "
            f"read per token (~{human(p.read_per_token)}{p._at_batch()}) of the {n_plans} plans that fit{within}.")


def plan(cfg, sizes: ModelSizes, budgets: Budgets, *, tokens: int, incremental: bool, available: int,
         baseline: int, n_layers: int | range | None = None, pin_order: str = "largest", prefill_tokens: int = 1 << 30,
         spec: int = 0, kv_latent: bool = True, sequences: int = 1) -> Plan:
    """The memory plan for ``budgets`` on a model of ``sizes``: a KV cache for ``tokens``
    positions (incremental decoding holds it; full recompute rebuilds it every step), the
    recurrent state (and rollback records) of ``sequences`` sequences decoded together, and
    activations for the longest piece one forward pass reads (``prefill_tokens``). Budgets the user did not fix are chosen
    here: among the plans that fit (tables resident or streamed, how much of the rest
    goes to the trunk and how much to the expert cache), the one with the fewest bytes
    read per token (:func:`bytes_per_token`); ties go to the larger trunk budget (more
    read-ahead). Raises K3Error when nothing fits."""
    budgets.check()
    n_layers = layer_ids(cfg, n_layers)
    streaming = budgets.trunk is not None
    preset, trunk_req, cache_req = _explicit(budgets)
    trunk_cap, cache_cap = _ceilings(budgets)
    fixed = _fixed_rows(cfg, n_layers, tokens, incremental, baseline, available, prefill_tokens, spec, kv_latent,
                        sequences)
    room = int(PLAN_FRACTION * available) - sum(r[1] for r in fixed)
    table_choices = [budgets.stream_tables] if budgets.stream_tables is not None else [False, True]
    floor_cache = (sizes.top_k + 1) * sizes.slot_bytes
    max_cache = max(sizes.routed_experts, sizes.top_k + 1) * sizes.slot_bytes
    if cache_cap is not None:
        max_cache = max(floor_cache, min(max_cache, cache_cap))
    notes = []
    if not streaming and budgets.trunk_gb not in (None, "auto"):
        notes.append("note: --trunk-gb has no effect without --trunk (the trunk is held in RAM)")
    search = _Search(sizes, budgets, pin_order, sequences, trunk_req, cache_req, trunk_cap, floor_cache, max_cache)
    candidates = search.candidates(room, table_choices)
    explicit_all = (not streaming or trunk_req is not None) and cache_req is not None and len(table_choices) == 1
    if candidates and not explicit_all:
        cost, _, stream_tables, t, cache, tp, slots = min(candidates, key=lambda c: c[:2])
    else:
        # Nothing fits (or nothing was left to choose): build the plan that was asked for,
        # so that check() refuses it with every row shown.
        cost, stream_tables, t, cache, tp, slots = search.asked_for(room, table_choices)
    rows = _component_rows(sizes, tp, stream_tables, slots) + fixed
    p = Plan(budgets, preset, tp, t if streaming else None, cache, slots, stream_tables, available, cost, rows, notes,
             kv_positions=tokens, kv_per_position=kv_bytes_per_position(cfg, n_layers, kv_latent),
             sequences=max(1, int(sequences)))
    if (preset == "auto" or budgets.trunk_gb == "auto" or (budgets.cache_gb is None and preset == "custom")
            or (preset in CEILING_PRESETS and candidates)):
        p.notes.append(_auto_note(p, sizes, len(candidates), trunk_cap, cache_cap))
    return p


__all__ = [
    # the plan (here)
    "PLAN_FRACTION", "Plan", "plan", "trunk_room", "longest_context", "expert_cache_slots", "pass_shape",
    "bytes_per_token",
    # k3.memory.budgets
    "Preset", "PRESETS", "PRESET_NAMES", "CEILING_PRESETS", "Budgets", "presets_table", "recommend_preset",
    "cache_fixed",
    # k3.memory.sizes
    "TABLE_CHUNK_BYTES", "TABLE_STREAM_BYTES", "ATTENTION_TILE_BYTES", "ModelSizes", "stream_table_bytes",
    "layer_ids", "recurrent_state_bytes", "kv_bytes_per_position", "activation_bytes", "spec_bytes",
    # k3.memory.trunkplan
    "TrunkPlan", "plan_trunk", "min_budget_for", "trunk_ladder",
]
