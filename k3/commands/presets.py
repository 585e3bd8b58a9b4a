"""`k3 presets`: the memory presets (no torch is imported)."""

from __future__ import annotations

HELP = "print the memory presets (trunk / expert-cache GB)"


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    from ..memory.planner import presets_table
    print(presets_table())
    return 0
