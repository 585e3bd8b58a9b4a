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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..errors import K3Error, UsageError
from ..units import ALIGN, GB, align_up, gb, gb_up, human
from .passcost import PassShape, pass_bytes, plan_groups

#: share of the available memory a plan may use (the rest absorbs allocator slack)
PLAN_FRACTION = 0.95
#: streamed model tables (ultra-low-memory): one lm_head chunk buffer, plus room for the
#: embedding rows and the small global vectors
TABLE_CHUNK_BYTES = 64 * 1024 * 1024
TABLE_STREAM_BYTES = TABLE_CHUNK_BYTES + 64 * 1024 * 1024


# ====================================================================== presets
@dataclass(frozen=True)
class Preset:
    name: str
    trunk_gb: float
    cache_gb: float
    note: str


# The C engine's presets; each note quotes the peak RSS it measured with K3.
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("laptop", 3.0, 1.0, "8.2 GB peak RSS with K3: the floor"),
    Preset("desktop", 16.0, 10.0, "31.9 GB peak RSS with K3"),
    Preset("workstation", 60.0, 30.0, "95.5 GB peak RSS with K3; the expert cache starts to matter"),
    Preset("server", 110.0, 13.0, "~128 GB with K3; 90/93 trunk layers pinned, fastest"),
    Preset("max", 110.0, 109.0, "~224 GB with K3"),
    Preset("ultra", 2.5, 0.31, "at most ~3 GB planned, less where less fits: streamed model tables. Slow."),
)}
PRESET_NAMES = tuple(PRESETS) + ("auto",)


def presets_table() -> str:
    lines = ["presets (trunk / expert-cache, in GB):"]
    for p in PRESETS.values():
        lines.append(f"  {p.name:<12}{p.trunk_gb:6.2f} / {p.cache_gb:<6.2f}  {p.note}")
    lines.append(f"  {'auto':<12}{'fit':>6} / {'fit':<6}  the plan that fits this machine's free memory and reads the "
                 "fewest bytes per token. Recommended.")
    lines.append("All presets stream the trunk, so they need --trunk <packed_dir> (k3 pack-trunk MODEL OUT);")
    lines.append("without it the whole trunk is held in RAM. Run `k3 doctor MODEL` to see what this machine can do.")
    return "\n".join(lines)


def recommend_preset(mem_available: int) -> str:
    """The largest named preset whose C-engine peak RSS with K3 fits in ``mem_available``."""
    need = {"max": 224, "server": 128, "workstation": 95.5, "desktop": 31.9, "laptop": 8.2}
    for name, g in need.items():
        if mem_available >= g * GB * 1.02:
            return name
    return "ultra"


@dataclass
class Budgets:
    """What the user asks for. ``preset`` names a preset or ``auto``; ``trunk_gb`` /
    ``cache_gb`` override it (``trunk_gb="auto"``: the trunk gets what the plan leaves).
    ``trunk`` is a packed-trunk folder (``k3 pack-trunk``): without it the trunk is held
    in RAM. Only the command line builds this from argv; the Python API takes the same
    fields as keyword arguments of :func:`k3.load`."""

    preset: str = "auto"
    trunk_gb: float | str | None = None
    cache_gb: float | None = None
    trunk: str | None = None
    trunk_ring: int = 2
    ultra_low_memory: bool = False
    io_threads: int = 4
    stage_gb: float | None = None  # the memory this process may plan in (one pipeline rank's), if less than available

    def check(self) -> None:
        if self.preset not in PRESET_NAMES:
            raise UsageError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESET_NAMES)} "
                             "(k3 presets lists them).")
        for name in ("trunk_gb", "cache_gb"):
            v = getattr(self, name)
            if v is None or (name == "trunk_gb" and v == "auto"):
                continue
            flag = "--" + name.replace("_", "-")
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise UsageError(f"{flag} takes a number of GB{' (or auto)' if name == 'trunk_gb' else ''}, "
                                 f"got {v!r}.") from None
            if not x > 0 or x != x or x == float("inf"):
                raise UsageError(f"{flag} must be a finite number of GB > 0, got {v}.")
        if self.stage_gb is not None and not (isinstance(self.stage_gb, (int, float)) and 0 < self.stage_gb < 1e9):
            raise UsageError(f"--stage-budget must be a finite number of GB > 0, got {self.stage_gb}.")
        if int(self.trunk_ring) < 1:
            raise UsageError(f"--trunk-ring must be >= 1, got {self.trunk_ring}.")
        if int(self.io_threads) < 1:
            raise UsageError(f"--io-threads must be >= 1, got {self.io_threads}.")

    @property
    def stream_tables(self) -> bool | None:
        """True: stream the model tables; None: let ``auto`` decide."""
        if self.ultra_low_memory or self.preset == "ultra":
            return True
        return None if self.preset == "auto" else False


def stream_table_bytes(sizes: "ModelSizes") -> int:
    """What streamed model tables hold: one lm_head chunk buffer and the embedding rows,
    never more than the tables themselves (a small model's lm_head is one chunk)."""
    return min(TABLE_STREAM_BYTES, sizes.table_bytes)


# ====================================================================== model-derived sizes
def layer_ids(cfg, layers=None) -> range:
    """The layers a plan covers: all (None), the first ``layers`` (an int, ``--layers``),
    or a range (one stage of a pipeline, k3.pipeline)."""
    if layers is None:
        return range(cfg.num_hidden_layers)
    return layers if isinstance(layers, range) else range(int(layers))


def recurrent_state_bytes(cfg, n_layers: int | range | None = None) -> int:
    """One sequence's KDA state: per KDA layer the conv histories and the recurrent
    matrix twice - a pass replaces every layer's matrix while the decode loop's undo
    snapshot keeps the one before until the pass is settled; then those go to the pool
    (k3.model.kda) that the next pass's steps write into."""
    kda = sum(1 for i in layer_ids(cfg, n_layers) if not cfg.is_mla(i))
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    return (2 * H * D * D + 3 * H * D * (cfg.conv_kernel - 1)) * 4 * kda


def kv_bytes_per_position(cfg, n_layers: int | range | None = None, latent: bool = True) -> int:
    """Bytes of the MLA KV cache per position, fp32: the latent form holds the normalised
    latent and the shared rope key per MLA layer, the expanded form every head's key and
    value (k3.model.mla)."""
    mla = sum(1 for i in layer_ids(cfg, n_layers) if cfg.is_mla(i))
    if latent:
        return mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    return mla * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 4


#: attention's score tiles (k3.model.mla.SCORE_TILE_BYTES) and their temporaries
ATTENTION_TILE_BYTES = 4 * (16 << 20)


def activation_bytes(cfg, tokens: int, rows: int = 1) -> int:
    """Upper bound of the working set of one forward over `tokens` tokens: the AttnRes
    bank and partial sums, the widest projections of a layer (several live at once),
    fp64 norm statistics, the router's scores and sort, the MoE contributions, the
    chunked-KDA pairwise-decay scratch (a step's new KDA matrices are in the recurrent
    state row, ``recurrent_state_bytes``), attention's tiles
    (bounded whatever the length), the logits of ``rows`` positions (a pass computes
    them only where a sequence is done reading: k3.decode.Batch._logit_rows; a
    speculative pass's drafts are counted by :func:`spec_bytes`)."""
    d = cfg.hidden_size
    banks = (cfg.num_hidden_layers // cfg.attn_res_block_size + 2) if cfg.attn_res_block_size else 1
    kda = cfg.kda_num_heads * cfg.kda_head_dim
    mla = cfg.mla_num_heads * (cfg.qk_head_dim + cfg.qk_head_dim + cfg.v_head_dim)
    # grouped experts (k3.model.moe.routed_experts, k3.kernels.moe.expert_ffn): per (token,
    # expert) pair its contribution (e_in); per tile of at most PAIR_TILE pairs, by phase:
    # the tile's inputs and outputs (2 e_in), the gate | up call, gate | up (2 e_mid) and
    # the input split into even / odd halves and (AVX2, few tokens per expert) those
    # permuted (2 e_in); the GLU, in place in gate | up and its output (3 e_mid); the down
    # call, the GLU output, its split (2 e_mid) and the down output (e_in)
    from ..model.moe import PAIR_TILE
    e_in, e_mid = cfg.expert_in, cfg.moe_intermediate_size
    k = cfg.num_experts_per_token
    widest = max(6 * kda, 2 * mla, 3 * cfg.intermediate_size, 3 * cfg.shared_width, k * e_in)
    tile = 4 * min(int(tokens) * k, PAIR_TILE) * max(4 * e_in + 2 * e_mid, 2 * e_in + 3 * e_mid, 3 * e_in + 3 * e_mid)
    per_token = 4 * ((banks + 16) * d + widest) + 24 * cfg.num_experts
    chunk = 16
    kda_scratch = 4 * cfg.kda_num_heads * chunk * chunk * cfg.kda_head_dim * 4
    logits = 4 * min(int(tokens), max(1, int(rows))) * cfg.vocab_size
    return tokens * per_token + tile + kda_scratch + ATTENTION_TILE_BYTES + logits


@dataclass(frozen=True)
class ModelSizes:
    """What the planner needs to know about a model, measured from its checkpoint.

    ``layer_bytes``: what the trunk allocates per layer (the packed, 4096-rounded runs
    when streaming from a packed trunk; the tensors as stored when resident);
    ``table_bytes``: embedding + lm_head as stored; ``head_bytes``: lm_head (read once per
    token when the tables are streamed); ``slot_bytes``: one expert-cache slot;
    ``expert_bytes``: one routed expert's payload; ``moe_layers`` and ``experts``: MoE
    layers run and routed experts per layer; ``top_k``."""

    layer_bytes: tuple[int, ...]
    table_bytes: int
    head_bytes: int
    slot_bytes: int
    expert_bytes: int
    moe_layers: int
    experts: int
    top_k: int

    @property
    def trunk_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def routed_experts(self) -> int:
        return self.moe_layers * self.experts


# ====================================================================== the trunk
@dataclass
class TrunkPlan:
    pinned: list[int]
    ring_slots: int
    slot_bytes: int
    pinned_bytes: int
    total_bytes: int
    message: str | None = None
    order: str = "largest"
    budget_bytes: int = 0
    arena_bytes: int = 0  # the ring's memory: every budget byte not pinned (>= ring_slots x slot_bytes)
    n_layers: int = 0  # layers planned (the first ones of the trunk)

    @property
    def used_bytes(self) -> int:
        """Bytes of buffers this plan allocates: pinned layers + the ring arena."""
        return self.pinned_bytes + self.arena_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes read per pass over the layers once the pinned layers are in."""
        return self.total_bytes - self.pinned_bytes

    def describe(self) -> str:
        n = self.n_layers
        if not self.ring_slots:
            return f"trunk: all {len(self.pinned)} layers pinned ({gb(self.pinned_bytes)} GB), no ring"
        how = "LARGEST FIRST" if self.order == "largest" else "as a PREFIX"
        spare = self.arena_bytes - self.ring_slots * self.slot_bytes
        extra = f" + {human(spare)} of read-ahead" if spare >= ALIGN else ""
        return (f"trunk: pinned {len(self.pinned)}/{n} layers {how} ({gb(self.pinned_bytes)} GB), ring "
                f"{self.ring_slots} slot{'s' if self.ring_slots != 1 else ''} x {gb(self.slot_bytes)} GB (sized to "
                f"the largest UNPINNED layer){extra}; {gb(self.streamed_bytes)} GB read per token")


def _order(a: list[int], order: str) -> list[int]:
    if order == "largest":
        return sorted(range(len(a)), key=lambda j: (-a[j], j))
    return list(range(len(a)))


def _min_cost_largest(a: list[int], k: int) -> int:
    """Smallest budget that holds some pinned set plus k slots (slot = largest unpinned)."""
    best = None
    for s in set(a):
        c = sum(x for x in a if x > s) + k * s
        best = c if best is None else min(best, c)
    return best


def _min_cost_prefix(a: list[int], k: int) -> int:
    best, pref = None, 0
    suffix_max = [0] * (len(a) + 1)
    for j in range(len(a) - 1, -1, -1):
        suffix_max[j] = max(a[j], suffix_max[j + 1])
    for m in range(len(a)):  # pin a[:m], stream the rest
        c = pref + k * suffix_max[m]
        best = c if best is None else min(best, c)
        pref += a[m]
    return best


def min_budget_for(layer_bytes: list[int], slots: int, order: str = "largest") -> int:
    """The smallest trunk budget for which :func:`plan_trunk` can keep ``slots`` ring slots."""
    a = [align_up(x) for x in layer_bytes]
    return (_min_cost_largest if order == "largest" else _min_cost_prefix)(a, slots)


def _pin_prefix(a: list[int], B: int, k: int) -> list[int] | None:
    """Longest prefix 0..m-1 that fits with k slots sized to the largest layer after it."""
    n = len(a)
    suffix_max = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        suffix_max[j] = max(a[j], suffix_max[j + 1])
    best, pref = None, 0
    for m in range(n):  # m < n: at least one layer streams
        if pref + k * suffix_max[m] <= B:
            best = m
        pref += a[m]
    return None if best is None else list(range(best))


def _pin_largest(a: list[int], B: int, k: int) -> list[int] | None:
    """Largest-first pinning with k slots; None if k slots cannot fit.

    For each candidate slot size s (a layer size), every layer larger than s is pinned
    (the slot must hold every unpinned layer), then the remaining layers are tried in
    order of size (ties: lower index first), each pinned when the plan — with the slot
    re-sized to the largest layer still unpinned — stays within the budget; a layer that
    does not fit is skipped and smaller ones are still tried. Passes repeat until
    nothing more fits (the fixed point). The candidate pinning the most bytes wins."""
    n = len(a)
    order = _order(a, "largest")
    best, best_key = None, None
    for s in sorted(set(a), reverse=True):
        pinned = [False] * n
        pin_sum = 0
        counts: dict[int, int] = {}
        for j in range(n):
            if a[j] > s:
                pinned[j] = True
                pin_sum += a[j]
            else:
                counts[a[j]] = counts.get(a[j], 0) + 1
        if not counts:
            continue
        sizes = sorted(counts, reverse=True)  # distinct unpinned sizes, largest first
        if pin_sum + k * sizes[0] > B:
            continue
        changed = True
        while changed:
            changed = False
            for j in order:
                if pinned[j]:
                    continue
                x = a[j]
                slot = sizes[0]
                if x == slot and counts[x] == 1:
                    if len(sizes) == 1:
                        continue  # the last unpinned layer: pinning it means no ring at all
                    new_slot = sizes[1]
                else:
                    new_slot = slot
                if pin_sum + x + k * new_slot <= B:
                    pinned[j] = True
                    pin_sum += x
                    counts[x] -= 1
                    if not counts[x]:
                        del counts[x]
                        sizes.remove(x)
                    changed = True
        used = pin_sum + k * sizes[0]
        key = (pin_sum, sum(pinned), -used)
        if best_key is None or key > best_key:
            best, best_key = [j for j in range(n) if pinned[j]], key
    return best


def plan_trunk(layer_bytes: list[int], budget_bytes: int, ring: int = 2, order: str = "largest") -> TrunkPlan:
    """Choose the pinned layers and the ring within ``budget_bytes`` (pure function).

    Layer sizes are rounded up to 4096. If the whole trunk fits, every layer is pinned
    and there is no ring. Otherwise the ring has ``ring`` uniform slots, each the size
    of the largest *unpinned* layer, or fewer (at least 1) when the budget cannot pay
    for them — then ``message`` says so with the budget that would (the C engine's ring
    message). Within the slots chosen, layers are pinned largest first (``order=
    "largest"``; ties by lower index; pinning the largest layers also shrinks the
    slot) or as the longest prefix that fits (``order="prefix"``, v1.0.0 behaviour).
    The result is a fixed point: the slot is the largest unpinned layer and no further
    layer can be pinned within the budget. Every budget byte not pinned is the ring
    arena (read-ahead room). Raises K3Error (exit 1) if not even one slot fits."""
    if order not in ("largest", "prefix"):
        raise ValueError(f"order must be 'largest' or 'prefix', got {order!r}")
    if ring < 1:
        raise ValueError(f"ring must be >= 1, got {ring}")
    if any(x < 0 for x in layer_bytes):
        raise ValueError("layer sizes must be >= 0")
    a = [align_up(int(x)) for x in layer_bytes]
    B = int(budget_bytes)
    total = sum(a)
    if total <= B:
        return TrunkPlan(list(range(len(a))), 0, 0, total, total, None, order, B, 0, len(a))
    pin = _pin_largest if order == "largest" else _pin_prefix
    for k in range(ring, 0, -1):
        pinned = pin(a, B, k)
        if pinned is not None:
            break
    else:
        need = min_budget_for(a, 1, order)
        raise K3Error(
            f"The trunk budget of {gb(B)} GB cannot hold even one ring slot: the largest layer is "
            f"{gb(max(a))} GB and streaming needs a slot for the largest layer that is not pinned "
            f"(at least {gb_up(need)} GB in all with {order} pinning). Raise --trunk-gb to at least "
            f"{gb_up(need)} GB.")
    ps = set(pinned)
    slot = max(a[j] for j in range(len(a)) if j not in ps)
    pinned_bytes = sum(a[j] for j in pinned)
    msg = None
    if k < ring:
        if k == 1:
            x = min_budget_for(a, 2, order)
            msg = (f"ring held at 1 slot: a second slot needs {gb_up(x)} GB and the trunk budget is {gb(B)} GB, "
                   f"so the next layer is read ahead only into the {human(max(0, B - pinned_bytes - slot))} beside "
                   f"that slot while a layer computes (compute still overlaps the reading of its own layer, tensor "
                   f"by tensor). Raise --trunk-gb above {gb_up(x)} GB to enable it.")
        else:
            x = min_budget_for(a, ring, order)
            msg = (f"ring held at {k} slots: {ring} slots need {gb_up(x)} GB and the trunk budget is {gb(B)} GB. "
                   f"Raise --trunk-gb above {gb_up(x)} GB to enable them.")
    arena = max(k * slot, (B - pinned_bytes) // ALIGN * ALIGN)
    return TrunkPlan(sorted(pinned), k, slot, pinned_bytes, total, msg, order, B, arena, len(a))


@functools.lru_cache(maxsize=4096)
def _plan_trunk_memo(layer_bytes: tuple, budget_bytes: int, ring: int, order: str) -> TrunkPlan:
    """plan_trunk for the planner's candidates (the same budgets recur across plans:
    auto's sweep, a pipeline's stages, `k3 doctor --project`'s memory sizes). A refusal
    is not cached: it raises each time."""
    return plan_trunk(list(layer_bytes), budget_bytes, ring, order)


@functools.lru_cache(maxsize=64)
def trunk_ladder(layer_bytes: tuple, ring: int, order: str = "largest") -> tuple[int, ...]:
    """Every trunk plan the pin order can make, as the budget each needs (its pinned
    layers plus its ring slots), from the whole trunk down to one slot: each step asks
    plan_trunk for the best plan one byte below the last one's need. The planner tries
    each rung that fits, so memory added never takes a plan away (more memory, never
    more bytes read)."""
    a = [align_up(int(x)) for x in layer_bytes]
    floor = min_budget_for(a, 1, order)
    out, t = [], sum(a) - 1
    while t >= floor:
        tp = _plan_trunk_memo(tuple(a), t, ring, order)
        need = tp.pinned_bytes + tp.ring_slots * tp.slot_bytes
        out.append(need)
        t = min(t, need) - ALIGN
    return tuple(sorted(set(out)))


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


def spec_bytes(cfg, n_layers: int | range, spec: int, logits: bool = True) -> int:
    """What a speculative pass of 1 + spec tokens keeps to roll back: per KDA layer its
    pre-conv q/k/v and the recurrence's k, v, g (6 x [T, heads x head_dim] fp32) and beta,
    plus the logits of every position."""
    if not spec:
        return 0
    T = spec + 1
    kda = sum(1 for i in layer_ids(cfg, n_layers) if not cfg.is_mla(i))
    return kda * T * (6 * cfg.kda_num_heads * cfg.kda_head_dim + cfg.kda_num_heads) * 4 + logits * T * cfg.vocab_size * 4


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


#: presets whose budgets are ceilings that the plan shrinks to what fits, as auto sizes
#: them, instead of fixed sizes: ultra, the smallest plan, is never refused where some
#: plan fits
CEILING_PRESETS = ("ultra",)


def _ceilings(budgets: Budgets) -> tuple[int | None, int | None]:
    """(trunk, cache) ceilings of a ceiling preset (each None where a flag fixed it)."""
    if budgets.preset not in CEILING_PRESETS:
        return None, None
    p = PRESETS[budgets.preset]
    return (int(p.trunk_gb * GB) if budgets.trunk_gb is None else None,
            int(p.cache_gb * GB) if budgets.cache_gb is None else None)


def _explicit(budgets: Budgets) -> tuple[str, int | None, int | None]:
    """(preset name applied, trunk bytes or None for 'the plan decides', cache bytes or None)."""
    trunk = cache = None
    preset = budgets.preset
    if preset != "auto" and preset not in CEILING_PRESETS:
        p = PRESETS[preset]
        trunk, cache = int(p.trunk_gb * GB), int(p.cache_gb * GB)
    if budgets.trunk_gb not in (None, "auto"):
        trunk, preset = int(float(budgets.trunk_gb) * GB), "custom"
    elif budgets.trunk_gb == "auto":
        trunk = None
    if budgets.cache_gb is not None:
        cache, preset = int(float(budgets.cache_gb) * GB), "custom"
    return preset, trunk, cache


def cache_fixed(budgets: Budgets) -> bool:
    """Whether the user fixed the expert cache's size (--cache-gb, or a preset that sets it)."""
    return _explicit(budgets)[2] is not None


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

    def trunk_plan(t):
        return _plan_trunk_memo(tuple(sizes.layer_bytes), t, budgets.trunk_ring, pin_order) if streaming else None

    candidates = []  # (bytes/token, -trunk budget, stream_tables, trunk budget, cache budget, TrunkPlan)
    for stream_tables in table_choices:
        tables = stream_table_bytes(sizes) if stream_tables else sizes.table_bytes
        left = room - tables
        if not streaming:
            trunk_sizes = [None]
        elif trunk_req is not None:
            trunk_sizes = [trunk_req]
        else:
            cache_part = cache_req if cache_req is not None else floor_cache
            top = min(left - cache_part, sum(align_up(x) for x in sizes.layer_bytes))
            if trunk_cap is not None:
                top = min(top, max(trunk_cap, min_budget_for(list(sizes.layer_bytes), 1, pin_order)))
            one_slot = min_budget_for(list(sizes.layer_bytes), 1, pin_order)
            # every pinned set the pin order passes through (not only the largest one that
            # fits), so that memory added never takes a plan away: more memory, never more bytes
            steps = trunk_ladder(tuple(sizes.layer_bytes), budgets.trunk_ring, pin_order)
            trunk_sizes = sorted({t for t in (top, *steps) if one_slot <= t <= top})
            # the same pinned set for less budget leaves the rest to the cache
            more = set()
            for t in trunk_sizes:
                tp = trunk_plan(t)
                more.add(tp.pinned_bytes + tp.ring_slots * tp.slot_bytes)
            trunk_sizes = sorted(set(trunk_sizes) | more)
        for t in trunk_sizes:
            try:
                tp = trunk_plan(t)
            except K3Error:
                continue
            trunk_mem = tp.used_bytes if tp is not None else sizes.trunk_bytes
            cache = cache_req if cache_req is not None else min(max_cache, left - trunk_mem)
            if cache < floor_cache or trunk_mem + cache > left:
                continue
            slots = expert_cache_slots(sizes, cache)
            cost = bytes_per_token(sizes, tp, slots, stream_tables, sequences)
            candidates.append((cost, -(trunk_mem), stream_tables, t, cache, tp, slots))
    explicit_all = (not streaming or trunk_req is not None) and cache_req is not None and len(table_choices) == 1
    if candidates and not explicit_all:
        cost, _, stream_tables, t, cache, tp, slots = min(candidates, key=lambda c: c[:2])
    else:
        # Nothing fits (or nothing was left to choose): build the plan that was asked for,
        # so that check() refuses it with every row shown.
        stream_tables = table_choices[-1] if budgets.stream_tables is None else budgets.stream_tables
        tables = stream_table_bytes(sizes) if stream_tables else sizes.table_bytes
        if streaming:
            t = trunk_req if trunk_req is not None else max(
                min_budget_for(list(sizes.layer_bytes), 1, pin_order), room - tables - floor_cache)
            tp = trunk_plan(t)
        else:
            t, tp = None, None
        if cache_req is not None:
            cache = cache_req
        else:
            trunk_mem = tp.used_bytes if tp is not None else sizes.trunk_bytes
            cache = min(max_cache, max(floor_cache, room - tables - trunk_mem))
        slots = expert_cache_slots(sizes, cache)
        cost = bytes_per_token(sizes, tp, slots, stream_tables, sequences)
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
    rows += fixed
    p = Plan(budgets, preset, tp, t if streaming else None, cache, slots, stream_tables, available, cost, rows, notes,
             kv_positions=tokens, kv_per_position=kv_bytes_per_position(cfg, n_layers, kv_latent),
             sequences=max(1, int(sequences)))
    if (preset == "auto" or budgets.trunk_gb == "auto" or (budgets.cache_gb is None and preset == "custom")
            or (preset in CEILING_PRESETS and candidates)):
        why = []
        if budgets.stream_tables is None:
            why.append("model tables " + ("STREAMED: the memory they free pins more of the trunk than lm_head "
                                          f"costs to read ({human(sizes.head_bytes)} a token)" if stream_tables
                                          else "resident"))
        if tp is not None:
            why.append(f"trunk {human(tp.used_bytes)} ({len(tp.pinned)}/{len(sizes.layer_bytes)} layers pinned)")
        why.append(f"expert cache {human(slots * sizes.slot_bytes)} ({slots} slots)")
        within = (f" within the {preset} preset's ceilings ({gb(trunk_cap or 0)} GB trunk, "
                  f"{gb(cache_cap or 0)} GB expert cache)" if preset in CEILING_PRESETS else "")
        p.notes.append(f"{'auto' if preset not in CEILING_PRESETS else preset}: {'; '.join(why)}: the fewest bytes "
                       f"read per token (~{human(cost)}{p._at_batch()}) of the {len(candidates)} plans that fit{within}.")
    return p
