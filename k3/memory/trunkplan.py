"""The trunk's part of the memory plan: which layers are pinned and how large the ring
arena is within a trunk budget (:func:`plan_trunk`, a pure function), the smallest
budget for a number of ring slots (:func:`min_budget_for`), and every plan the pin
order can make (:func:`trunk_ladder`), which the memory planner (:mod:`k3.memory.planner`)
tries. The trunk streamer (k3.memory.trunk.stream) receives its :class:`TrunkPlan`; it
never sizes anything itself. Nothing here imports torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import K3Error
from ..units import ALIGN, align_up, gb, gb_up, human


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

