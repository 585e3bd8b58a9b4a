"""Memory budgets: presets, `auto`, and the memory plan printed and checked before
anything large is allocated.

Invariants:
  * the plan is a forecast that must not under-state the measured peak RSS: every
    component is an upper bound of what the run allocates (the arena and slot sizes
    used here are the ones the trunk streamer and expert cache will allocate);
  * trunk first: `auto` gives the trunk (re-read every token) everything but a small
    expert-cache floor unless the whole trunk fits;
  * a plan that does not fit is refused with the shortfall and the options.
GB here are decimal (1e9 bytes), as in the C engine's tables.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field

from ..errors import K3Error, UsageError

GB = 1e9


@dataclass(frozen=True)
class Preset:
    name: str
    trunk_gb: float
    cache_gb: float
    note: str


# The C engine's figures (reference-engine.md 2.2); notes quote its measured peak RSS.
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("laptop", 3.0, 1.0, "8.2 GB peak RSS with K3: the floor"),
    Preset("desktop", 16.0, 10.0, "31.9 GB peak RSS with K3"),
    Preset("workstation", 60.0, 30.0, "95.5 GB peak RSS with K3; the expert cache starts to matter"),
    Preset("server", 110.0, 13.0, "~128 GB with K3; 90/93 trunk layers pinned, fastest"),
    Preset("max", 110.0, 109.0, "~224 GB with K3"),
    Preset("ultra", 2.5, 0.31, "~3 GB planned: streamed model tables, one state slot. Slow."),
)}
PRESET_NAMES = tuple(PRESETS) + ("auto",)


def presets_table() -> str:
    lines = ["presets (trunk / expert-cache, in GB):"]
    for p in PRESETS.values():
        lines.append(f"  {p.name:<12}{p.trunk_gb:6.2f} / {p.cache_gb:<6.2f}  {p.note}")
    lines.append(f"  {'auto':<12}{'fit':>6} / {'fit':<6}  sizes both from this machine's free RAM, trunk-first. Recommended.")
    lines.append("All presets stream the trunk, so they need --trunk <packed_dir> (k3 pack-trunk MODEL OUT);")
    lines.append("without it the whole trunk is held in RAM. Run `k3 doctor MODEL` to see what this machine can do.")
    return "\n".join(lines)


def meminfo() -> dict:
    """MemTotal / MemAvailable in bytes from /proc/meminfo."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                parts = v.split()
                if parts and parts[0].isdigit():
                    out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    if "MemAvailable" not in out or "MemTotal" not in out:
        raise UsageError("/proc/meminfo is not readable here, so `auto` cannot size the budgets; "
                         "give --trunk-gb and --cache-gb (or a named --preset) instead.")
    res = {"MemTotal": out["MemTotal"], "MemAvailable": out["MemAvailable"]}
    lim = cgroup_limit()
    if lim is not None:  # a container or a benchmark's memory ceiling: the real budget
        limit, usage = lim
        res["CgroupLimit"] = limit
        res["MemTotal"] = min(res["MemTotal"], limit)
        res["MemAvailable"] = max(0, min(res["MemAvailable"], limit - usage))
    return res


def cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup (v2 memory.max or v1
    memory.limit_in_bytes), or None when unlimited / not visible. v1 usage counts
    page cache, which is reclaimable, so only the anonymous part (rss) is used."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrl, path = parts
        try:
            if ctrl == "" and os.path.exists("/sys/fs/cgroup/unified" + path + "/memory.max"):
                base = "/sys/fs/cgroup/unified" + path
            elif ctrl == "" and os.path.exists("/sys/fs/cgroup" + path + "/memory.max"):
                base = "/sys/fs/cgroup" + path
            else:
                base = None
            if base is not None:
                raw = open(base + "/memory.max").read().strip()
                if raw != "max":
                    usage = int(open(base + "/memory.current").read())
                    return int(raw), usage
            if "memory" in ctrl.split(","):
                base = "/sys/fs/cgroup/memory" + path
                limit = int(open(base + "/memory.limit_in_bytes").read())
                if limit < (1 << 60):
                    usage = 0
                    for ln in open(base + "/memory.stat"):
                        k, v = ln.split()
                        if k == "rss":
                            usage = int(v)
                    return limit, usage
        except (OSError, ValueError):
            continue
    return None


def rss_bytes() -> int:
    """Current resident set size."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------- model-derived sizes
def embed_head_bytes(cfg, dtype_bytes: int = 2) -> int:
    n = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    return n if cfg.tie_word_embeddings else 2 * n


def recurrent_state_bytes(cfg, n_layers: int | None = None) -> int:
    n = cfg.num_hidden_layers if n_layers is None else n_layers
    kda = sum(1 for i in range(n) if not cfg.is_mla(i))
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    return (H * D * D + 3 * H * D * (cfg.conv_kernel - 1)) * 4 * kda


def kv_bytes_per_position(cfg, n_layers: int | None = None) -> int:
    n = cfg.num_hidden_layers if n_layers is None else n_layers
    mla = sum(1 for i in range(n) if cfg.is_mla(i))
    return mla * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 4


def activation_bytes(cfg, tokens: int) -> int:
    """Upper bound of the fp32 working set of one forward over `tokens` tokens: the
    AttnRes bank and partial sums, the widest projections of a layer (several live at
    once), the chunked-KDA pairwise-decay scratch, the MoE contributions, logits."""
    d = cfg.hidden_size
    banks = (cfg.num_hidden_layers // cfg.attn_res_block_size + 2) if cfg.attn_res_block_size else 1
    kda = cfg.kda_num_heads * cfg.kda_head_dim
    mla = cfg.mla_num_heads * (cfg.qk_head_dim + cfg.qk_head_dim + cfg.v_head_dim)
    widest = max(6 * kda, 2 * mla, 3 * cfg.intermediate_size, 3 * cfg.shared_width,
                 cfg.num_experts_per_token * (cfg.expert_in + 3 * cfg.moe_intermediate_size))
    per_token = 4 * ((banks + 12) * d + widest + cfg.num_experts + cfg.vocab_size)
    chunk = 16
    kda_scratch = 4 * cfg.kda_num_heads * chunk * chunk * cfg.kda_head_dim * 4
    return tokens * per_token + kda_scratch


# ---------------------------------------------------------------- auto
def auto_budget(mem_available: int, mem_total: int, trunk_total: int, embed_head: int,
                min_slot: int, cache_floor: int, overlap_min: int | None = None) -> tuple[int, int, str]:
    """(trunk bytes, cache bytes, explanation), trunk first (the C engine's rule):
    reserve = 2 GB + 2% of available + embed/lm_head + 1.7 GB (index, state, KV, scratch);
    if what is left holds the whole trunk plus the cache floor, pin it all and give the
    cache the rest; else the cache gets its floor and the trunk the rest, capped at
    0.55 x MemTotal - reserve - floor (pinning to ~90% of RAM measured slower than not
    pinning, because of reclaim), never below one ring slot, and raised to the smallest
    budget with two ring slots (`overlap_min`) when what is usable pays for it."""
    reserve = int(2 * GB + 0.02 * mem_available + embed_head + 1.7 * GB)
    usable = mem_available - reserve
    if usable < min_slot + cache_floor:
        raise K3Error(
            f"auto budget: {mem_available / GB:.2f} GB available, {reserve / GB:.2f} GB reserved (2 GB + 2% + "
            f"model tables {embed_head / GB:.2f} GB + 1.7 GB state/scratch), leaving {usable / GB:.2f} GB; the "
            f"floor is {(min_slot + cache_floor) / GB:.2f} GB (one trunk ring slot {min_slot / GB:.2f} GB + "
            f"expert-cache floor {cache_floor / GB:.2f} GB). Free memory, or use --preset ultra.")
    if usable - cache_floor >= trunk_total:
        trunk, cache = trunk_total, usable - trunk_total
    else:
        cache = cache_floor
        cap = int(0.55 * mem_total) - reserve - cache_floor
        trunk = max(min_slot, min(usable - cache_floor, cap))
        if overlap_min is not None and trunk < overlap_min <= usable - cache_floor:
            # The cap would leave one ring slot (the next layer read ahead only into what
            # is left beside it); when the memory pays for a second slot, that is worth
            # more than the cap (10-layer realdims trunk, 6 GB split sweep: two-slot arms
            # 4.44 / 4.14 s/token vs 4.69 / 4.51 with one slot, see docs/BENCHMARKS.md).
            trunk = overlap_min
    msg = (f"auto budget: {mem_available / GB:.2f} GB available, {reserve / GB:.2f} GB reserved -> "
           f"trunk {trunk / GB:.2f} GB / expert cache {cache / GB:.2f} GB")
    return trunk, cache, msg


def recommend_preset(mem_available: int, mem_total: int | None = None) -> str:
    """The largest named preset whose C-engine peak RSS fits in MemAvailable (K3)."""
    need = {"max": 224, "server": 128, "workstation": 95.5, "desktop": 31.9, "laptop": 8.2}
    for name, gb in need.items():
        if mem_available >= gb * GB * 1.02:
            return name
    return "ultra"


# ---------------------------------------------------------------- the plan
@dataclass
class MemoryPlan:
    rows: list[tuple[str, int, str]] = field(default_factory=list)
    available: int = 0

    def add(self, name: str, nbytes: int, note: str = "") -> None:
        self.rows.append((name, int(nbytes), note))

    @property
    def total(self) -> int:
        return sum(r[1] for r in self.rows)

    def render(self) -> str:
        out = ["memory plan"]
        for name, n, note in self.rows:
            out.append(f"  {name:<18}{human(n):>12}  {note}".rstrip())
        out.append(f"  {'TOTAL':<18}{human(self.total):>12}")
        out.append(f"  {'available':<18}{human(self.available):>12}  (MemAvailable)")
        return "\n".join(out)

    def as_dict(self) -> dict:
        return {"components": {n: b for n, b, _ in self.rows}, "total": self.total, "available": self.available}

    def check(self, fraction: float = 0.95) -> None:
        if self.available and self.total > fraction * self.available:
            short = self.total - fraction * self.available
            raise K3Error(
                f"REFUSING TO START: this needs {human(self.total)} and the machine has {human(self.available)} "
                f"available ({fraction:.0%} of it may be planned), a shortfall of {human(short)}. Options: a "
                f"smaller --cache-gb or --trunk-gb (with --trunk), a smaller preset (--preset laptop or ultra), "
                f"--ultra-low-memory, fewer --layers, or a machine with more free memory.")


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} TB"
