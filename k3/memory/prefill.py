"""Prefill priced like decode: the tokens one prefill pass reads, chosen by the plan.

At K3's ratio (896 experts, top-16) a pass of T tokens touches 1 - (1 - 16/896)^T of a
layer's experts: 99% at T = 256. Every prefill pass therefore reads nearly the whole
pool (and the streamed part of the trunk), whatever its length, so a prompt costs about
one pool read per pass: the fewer passes, the fewer bytes. What limits a pass is its
activations (k3.memory.planner.activation_bytes, linear in its tokens).

The plan is first made for the floor piece (``PREFILL_CHUNK`` tokens, k3.decode). Then
the longest prompt the run can be given (its context) is read in the fewest passes
whose activations fit, taken from the plan's slack and then from the expert cache down
to its floor: a prefill pass touches nearly every expert anyway, and at K3's ratio a
cache of a few percent of the pool saves decode a few percent of its expert reads. The
trunk and the tables stay as planned. A cache budget the user fixed is not touched.
Among the pieces that give that number of passes, the shortest is taken (the least
memory). Every piece size gives the same numbers (k3.decode.prefill_pieces).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..units import human
from .passcost import pass_bytes
from .planner import (PLAN_FRACTION, Plan, ModelSizes, activation_bytes, bytes_per_token, cache_fixed,
                      expert_cache_slots, pass_shape)


@dataclass(frozen=True)
class PrefillPlan:
    """The piece a plan affords, and what a prompt of ``span`` tokens is predicted to read."""

    piece: int  # prompt tokens one pass reads (per sequence)
    span: int  # the prompt length priced (the run's context)
    passes: int
    read_bytes: float  # predicted bytes the span's prefill reads, at ``piece``
    floor_piece: int
    floor_read_bytes: float  # ... and at the floor piece
    lent_bytes: int  # activations taken from the expert cache

    def line(self) -> str:
        lent = f"; {human(self.lent_bytes)} of activations lent by the expert cache" if self.lent_bytes else ""
        return (f"prefill: {self.piece} tokens a pass: a {self.span}-token prompt (the context) in {self.passes} "
                f"pass{'es' if self.passes != 1 else ''}, ~{human(self.read_bytes)} read (~"
                f"{human(self.floor_read_bytes)} in {self.floor_piece}-token pieces){lent}")

    def short(self) -> str:
        return f"prefill {self.piece} tokens a pass (~{human(self.read_bytes)} read for {self.span} tokens)"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def passes_for(span: int, piece: int) -> int:
    """Passes k3.decode.prefill_pieces makes of ``span`` tokens at ``piece`` (a short
    tail joins the piece before it)."""
    from ..decode import prefill_pieces
    return len(prefill_pieces(max(1, int(span)), piece))


def prompt_read_bytes(plan: Plan, sizes: ModelSizes, span: int, piece: int) -> float:
    """Bytes a prefill of ``span`` tokens at ``piece`` tokens a pass reads under ``plan``
    (the pass cost model's uniform prior: the streamed trunk and tables once a pass, each
    touched expert the cache misses once a pass and layer)."""
    from ..decode import prefill_pieces
    shape = pass_shape(sizes, plan.trunk, plan.cache_slots, plan.stream_tables)
    return sum(pass_bytes(shape, [b - a]) for a, b in prefill_pieces(max(1, int(span)), piece))


def _grid(n: int, floor_piece: int) -> int:
    """``n`` rounded up to whole floor pieces: the cuts of a widened prefill fall where the
    floor piece's do, so that a prompt's numbers are those of any other plan's (where a
    piece ends also decides how attention's sums group: k3.decode.check_prefill_chunk)."""
    return -(-int(n) // floor_piece) * floor_piece


def _lendable(plan: Plan, sizes: ModelSizes) -> tuple[int, int]:
    """(bytes the plan leaves unused, bytes of the expert cache above its floor that may be
    lent: none where the user fixed the cache)."""
    slack = max(0, int(PLAN_FRACTION * plan.available) - plan.total) if plan.available else 1 << 62
    fixed_cache = cache_fixed(plan.budgets)
    floor = (sizes.top_k + 1) * sizes.slot_bytes if sizes.routed_experts else 0
    cache = plan.cache_slots * sizes.slot_bytes
    return slack, 0 if fixed_cache else max(0, cache - floor)


def widen(plan: Plan, cfg, sizes: ModelSizes, *, span: int, floor_piece: int, sequences: int = 1,
          auto: bool = True) -> tuple[Plan, PrefillPlan]:
    """The plan with its prefill piece widened to read ``span`` tokens in the fewest
    passes that fit (see the module's docstring), and that piece's :class:`PrefillPlan`;
    without ``auto`` (the user chose the piece) only the latter."""
    span = max(1, int(span))
    rows = {name: b for name, b, _ in plan.rows}
    base = rows.get("buffers", 0)
    slack, lendable = _lendable(plan, sizes)
    piece, need = floor_piece, 0
    for n in range(1, passes_for(span, floor_piece) if auto else 1):
        p = max(floor_piece, _grid(math.ceil(span / n), floor_piece))
        more = activation_bytes(cfg, _tokens(plan, p, sequences), rows=sequences) - base
        if more <= slack + lendable:
            piece, need = p, more
            break
    lent = max(0, need - slack)
    if piece != floor_piece:
        plan = _with_buffers(plan, cfg, sizes, piece, sequences, lent)
    pp = PrefillPlan(piece=piece, span=span, passes=passes_for(span, piece),
                     read_bytes=prompt_read_bytes(plan, sizes, span, piece), floor_piece=floor_piece,
                     floor_read_bytes=prompt_read_bytes(plan, sizes, span, floor_piece), lent_bytes=lent)
    plan.notes.append(pp.line())
    plan.prefill = pp.short()
    return plan, pp


def _tokens(plan: Plan, piece: int, sequences: int) -> int:
    """The most tokens one pass reads at ``piece`` (no more than the plan's positions)."""
    from ..decode import max_piece
    n = max_piece(piece) * sequences
    return min(n, plan.kv_positions) if plan.kv_positions else n


def _with_buffers(plan: Plan, cfg, sizes: ModelSizes, piece: int, sequences: int, lent: int) -> Plan:
    """``plan`` with the buffers row sized for ``piece`` and ``lent`` bytes fewer in the
    expert cache (whole slots)."""
    slots = plan.cache_slots
    if lent:
        slots = expert_cache_slots(sizes, plan.cache_slots * sizes.slot_bytes - lent)
    tokens = _tokens(plan, piece, sequences)
    rows = []
    for name, b, note in plan.rows:
        if name == "buffers":
            b, note = (activation_bytes(cfg, tokens, rows=sequences),
                       f"activations of {tokens} tokens (a prefill pass: the plan's piece), attention tiles, logits")
        elif name == "expert cache":
            b, note = slots * sizes.slot_bytes, f"{slots} slots x {human(sizes.slot_bytes)}" + (
                f" ({plan.cache_slots - slots} lent to the prefill's activations)" if slots != plan.cache_slots
                else "")
        rows.append((name, b, note))
    budget = slots * sizes.slot_bytes if lent else plan.cache_budget
    return dataclasses.replace(plan, rows=rows, cache_slots=slots, cache_budget=budget,
                               read_per_token=bytes_per_token(sizes, plan.trunk, slots, plan.stream_tables,
                                                              plan.sequences),
                               notes=list(plan.notes))
