"""Presets and the user's budgets: the named presets (the C engine's, with the peak RSS
each measured), :class:`Budgets` (what the user asks for: a preset, --trunk-gb,
--cache-gb, a packed trunk), and how a request reads - which budgets it fixes and which
are ceilings the memory planner (:mod:`k3.memory.planner`) shrinks to what fits.
GB here are decimal (1e9 bytes), as in the C engine's tables. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..units import GB


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
