"""Prefix reuse: inference states kept after a prompt was read or an answer finished,
keyed by the exact tokens in them, so that a later request whose prompt extends those
tokens reads only the rest (a chat's next turn extends the last one).

The model extends states in place, so a state goes in as a copy and comes out as a copy
(``copy.deepcopy``: views that share a buffer keep sharing the copy's). A state holds
exactly the tokens of its key (``state.ids``), so continuing from it and reading the
rest is the engine's incremental decode: the tokens are those of a fresh prefill.

Only the scheduler's thread touches a PrefixCache (no lock).
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


class PrefixCache:
    """LRU of states keyed by their token sequence, bounded by entries and bytes."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self.entries: "OrderedDict[tuple, Entry]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.stored = self.evicted = self.too_big = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, prompt: Sequence[int]):
        """(tokens reused, a copy of the state holding them) for the longest kept key that
        is a proper prefix of ``prompt`` (at least one token is left to read); None."""
        best = None
        n = len(prompt)
        for key, e in self.entries.items():
            k = len(key)
            if k < n and (best is None or k > len(best.key)) and tuple(prompt[:k]) == key:
                best = e
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best.key)
        return len(best.key), copy_state(best.state)

    def put(self, state, *, owned: bool = False) -> bool:
        """Keep ``state`` under its tokens (a copy, unless ``owned``: nobody else will touch
        it). Returns whether it was kept."""
        if self.max_entries < 1 or not state.ids:
            return False
        key = tuple(state.ids)
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        st = state if owned else copy_state(state)
        nb = state_bytes(st)
        if nb > self.max_bytes:
            self.too_big += 1
            return False
        self.entries[key] = Entry(key, st, nb)
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
