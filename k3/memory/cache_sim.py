"""Replay an expert trace (`k3 cache-sim`) against cache capacities (LRU and Belady).

A trace is what ``ExpertCache.dump_trace`` writes (and the C engine's
``expert_trace.bin``): little-endian int32 pairs (layer, expert) in request order.
Replaying it answers "what hit rate would an expert cache of C slots get on this
workload" without running the model:

* LRU: the cache's own policy (one request at a time).
* Belady (OPT): on a miss with the cache full, evict the resident expert whose next
  request is farthest in the future (never requested again counts as infinitely far);
  the requested expert is always admitted (it is about to be multiplied). No demand-
  fetching policy can do better, so it bounds what a smarter policy could gain.
* Compulsory-miss ceiling: 1 - distinct/requests, the hit rate of an infinite cache.

Implementation: keys = layer * n_experts + expert; next-use indices come from one
stable argsort; Belady keeps a max-heap of (next use, key) with lazy deletion,
O(N log N) overall, about 0.2 s for the 100k-request reference trace.
"""

from __future__ import annotations

import heapq
import os
from collections import OrderedDict

import numpy as np

from ..errors import UsageError

__all__ = ["DEFAULT_GB", "DEFAULT_SLOT_MB", "capacities", "format_table", "load_trace", "simulate", "table"]

#: the C engine's slot size for K3 (expert bytes + O_DIRECT widening)
DEFAULT_SLOT_MB = 17.56
#: the capacities of the C engine's published table
DEFAULT_GB = (8.0, 16.0, 32.0, 64.0, 128.0, 192.0)
POLICIES = ("lru", "belady")


def load_trace(path) -> np.ndarray:
    """Read an expert trace: int32 [N, 2] (layer, expert). Refuses (UsageError) a
    missing file, a size that is not a multiple of 8 bytes and negative entries."""
    p = os.fspath(path)
    try:
        size = os.path.getsize(p)
    except OSError as e:
        raise UsageError(f"cannot read the expert trace {p}: {e.strerror or e}. Give the path of an "
                         f"expert_trace.bin written by `k3 run --dump-trace`.") from None
    if size % 8:
        raise UsageError(
            f"the expert trace {p} is {size} bytes, not a multiple of 8: a trace is int32 pairs "
            f"(layer, expert), so this file is truncated or is not an expert trace.")
    try:
        tr = np.fromfile(p, dtype="<i4").astype(np.int32, copy=False).reshape(-1, 2)
    except OSError as e:
        raise UsageError(f"cannot read the expert trace {p}: {e.strerror or e}.") from None
    if len(tr) and int(tr.min()) < 0:
        i = int(np.argmax((tr < 0).any(axis=1)))
        raise UsageError(
            f"the expert trace {p} has a negative entry at request {i} (layer {tr[i, 0]}, expert "
            f"{tr[i, 1]}): it is not an expert trace (int32 pairs layer, expert).")
    return tr


def _keys(trace: np.ndarray) -> np.ndarray:
    tr = np.asarray(trace)
    if tr.ndim != 2 or tr.shape[1] != 2:
        raise ValueError(f"a trace is an [N, 2] array of (layer, expert), got shape {tr.shape}")
    tr = tr.astype(np.int64)
    width = int(tr[:, 1].max()) + 1 if len(tr) else 1
    return tr[:, 0] * width + tr[:, 1]


def next_use(keys: np.ndarray) -> np.ndarray:
    """For each request i, the index of the next request of the same key (N if none)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    nxt = np.full(n, n, dtype=np.int64)
    same = ks[:-1] == ks[1:]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def _lru(keys: list, capacity: int) -> int:
    cache: OrderedDict = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[k] = None
    return hits


def _belady(keys: list, nxt: list, capacity: int) -> int:
    resident: dict = {}  # key -> index of its next request
    heap: list = []  # (-next use, key); stale entries skipped lazily
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for k, nu in zip(keys, nxt):
        if k in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                neg, victim = pop(heap)
                if resident.get(victim) == -neg:
                    break
            del resident[victim]
        resident[k] = nu
        push(heap, (-nu, k))
    return hits


def simulate(trace: np.ndarray, capacity: int, policy: str = "lru") -> dict:
    """Replay ``trace`` (int32 [N, 2]) on a cache of ``capacity`` experts.

    Returns {policy, capacity, requests, hits, misses, hit_rate, evictions, distinct,
    ceiling} (``ceiling`` = 1 - distinct/requests, an infinite cache's hit rate)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 slot, got {capacity}")
    keys = _keys(trace)
    n = len(keys)
    distinct = int(len(np.unique(keys))) if n else 0
    kl = keys.tolist()
    hits = _lru(kl, capacity) if policy == "lru" else _belady(kl, next_use(keys).tolist(), capacity)
    misses = n - hits
    return {
        "policy": policy, "capacity": capacity, "requests": n, "hits": hits, "misses": misses,
        "hit_rate": hits / n if n else 0.0, "evictions": max(0, misses - capacity),
        "distinct": distinct, "ceiling": 1 - distinct / n if n else 0.0,
    }


def capacities(slots=(), gb=(), slot_mb: float = DEFAULT_SLOT_MB) -> list[int]:
    """Sorted distinct slot counts from explicit ``slots`` and budgets in ``gb``."""
    if slot_mb <= 0:
        raise UsageError(f"--slot-mb must be > 0, got {slot_mb}.")
    out = set()
    for c in slots:
        if c < 1:
            raise UsageError(f"--capacity must be >= 1 slot, got {c}.")
        out.add(int(c))
    for g in gb:
        n = int(g * 1e9 // (slot_mb * 1e6))
        if n < 1:
            raise UsageError(f"--gb {g} holds no {slot_mb} MB slot; give at least {slot_mb / 1000:.5f} GB.")
        out.add(n)
    return sorted(out)


def table(trace: np.ndarray, caps, slot_mb: float = DEFAULT_SLOT_MB) -> list[dict]:
    """One row per capacity: {slots, gb, lru, belady, distinct, ceiling} (rates 0..1)."""
    rows = []
    for c in caps:
        a = simulate(trace, c, "lru")
        b = simulate(trace, c, "belady")
        rows.append({"slots": c, "gb": c * slot_mb / 1000, "lru": a["hit_rate"], "belady": b["hit_rate"],
                     "lru_hits": a["hits"], "belady_hits": b["hits"], "requests": a["requests"],
                     "distinct": a["distinct"], "ceiling": a["ceiling"]})
    return rows


def format_table(path, trace: np.ndarray, rows: list[dict], slot_mb: float) -> str:
    n = len(trace)
    distinct = rows[0]["distinct"] if rows else int(len(np.unique(_keys(trace)))) if n else 0
    ceil = 1 - distinct / n if n else 0.0
    lines = [
        f"expert trace {path}: {n:,} requests, {distinct:,} distinct experts; compulsory-miss "
        f"ceiling {100 * ceil:.2f}% (the hit rate of an unbounded cache)",
        f"slot size {slot_mb} MB; hit % of one request at a time; Belady = optimal eviction (upper bound)",
        f"{'slots':>8} {'GB':>9} {'LRU hit %':>10} {'Belady hit %':>13} {'distinct':>9} {'ceiling %':>10}",
        "-" * 64,
    ]
    for r in rows:
        lines.append(f"{r['slots']:>8,} {r['gb']:>9.2f} {100 * r['lru']:>10.2f} {100 * r['belady']:>13.2f} "
                     f"{r['distinct']:>9,} {100 * r['ceiling']:>10.2f}")
    return "\n".join(lines)
