"""The prompt cache's memory tier: inference states kept after a prompt was read or an
answer finished, or at a snapshot point of a prefill (k3.prompt_cache), keyed by the
exact tokens in them, so that a later request whose prompt extends those tokens reads
only the rest (a chat's next turn extends the last one).

The model extends states in place, so a state goes in as a copy and comes out as a copy
(``copy.deepcopy``: views that share a buffer keep sharing the copy's). A state holds
exactly the tokens of its key (``state.ids``), so continuing from it and reading the
rest is the engine's incremental decode. An ``exact`` entry (a prefill snapshot on the
grid, k3.prompt_cache) gives the bits of a fresh prefill when at least ``min_rest``
tokens are left to read; any other entry gives those of the incremental decode that
made it (a chat continued in one process).

Only one thread touches a MemoryTier (the scheduler's, or the engine's caller): no lock.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


def state_bytes(state) -> int:
    """Bytes held by a state's tensors (each buffer counted once)."""
    import torch

    seen, total = set(), 0
    for ls in state.layers:
        slots = []
        for cls in type(ls).__mro__:
            slots += list(getattr(cls, "__slots__", ()))
        values = [getattr(ls, s, None) for s in slots] + list(getattr(ls, "__dict__", {}).values())
        for v in values:
            if isinstance(v, torch.Tensor):
                st = v.untyped_storage()
                key = st.data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += st.nbytes()
    return total


def copy_state(state):
    """An independent copy of an InferenceState (every tensor copied)."""
    c = copy.deepcopy(state)
    for ls in c.layers:  # a pass being recorded for rollback belongs to the original only
        if hasattr(ls, "record"):
            ls.record = None
    return c


@dataclass
class Entry:
    key: tuple
    state: object
    nbytes: int
    exact: bool = False  # a prefill snapshot on the grid: continuing from it gives a fresh prefill's bits
    chain: object = None  # the disk tier's KV segments of its prefix, when it wrote them


class MemoryTier:
    """LRU of states keyed by their token sequence, bounded by entries and bytes."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self.entries: "OrderedDict[tuple, Entry]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.stored = self.evicted = self.too_big = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, prompt: Sequence[int], min_rest: int = 1):
        """The longest kept entry whose key is a proper prefix of ``prompt`` (at least one
        token left to read; ``min_rest`` for an exact entry), and a copy of its state; None."""
        best = None
        n = len(prompt)
        for key, e in self.entries.items():
            k = len(key)
            if k < n - (min_rest - 1 if e.exact else 0) and (best is None or k > len(best.key)) \
                    and tuple(prompt[:k]) == key:
                best = e
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best.key)
        return best, copy_state(best.state)

    def put(self, state, *, owned: bool = False, exact: bool = False, chain=None) -> bool:
        """Keep ``state`` under its tokens (a copy, unless ``owned``: nobody else will touch
        it). Returns whether it was kept."""
        if self.max_entries < 1 or not state.ids:
            return False
        key = tuple(state.ids)
        if key in self.entries and exact and not self.entries[key].exact:
            self.bytes -= self.entries.pop(key).nbytes   # the same tokens read by a prefill: the better entry
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        st = state if owned else copy_state(state)
        nb = state_bytes(st)
        if nb > self.max_bytes:
            self.too_big += 1
            return False
        self.entries[key] = Entry(key, st, nb, exact, chain)
        self.bytes += nb
        self.stored += 1
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1
        return key in self.entries

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
