"""KDA's carried state and the pool its recurrent matrices are recycled through.

A state's matrix S is replaced every step (the math never writes the S it was given:
snapshots keep references to it). The replaced one goes back to a pool per shape, from
which the next layer's step takes its output buffer (``pool_take``): without it every
step of every KDA layer maps, faults in and zeroes a fresh multi-MB block (large blocks
are returned to the system when freed, k3.memory.sysmem.return_large_blocks). Only a
matrix the math made for that state, that the state still holds and that no snapshot
took since, is recycled; anything else (a loaded state file, a restored snapshot's S)
is left alone. docs/ARCHITECTURE.md, "KDA: two forms".
"""

from __future__ import annotations

import threading
import weakref

import torch

_POOL: dict = {}  # shape -> spare matrices
_POOL_LOCK = threading.Lock()


def pool_take(shape) -> torch.Tensor | None:
    with _POOL_LOCK:
        spare = _POOL.get(tuple(shape))
        return spare.pop() if spare else None


def pool_give(t: torch.Tensor) -> None:
    with _POOL_LOCK:
        _POOL.setdefault(tuple(t.shape), []).append(t)


class KDAState:
    """Carried per-layer state: conv histories for q/k/v and the recurrent matrix.
    ``record`` (a dict, when set) receives the last pass's recurrence inputs, so that the
    state can later be rolled back to any position inside that pass (speculative
    decoding keeps only the accepted tokens): see :func:`rollback`.

    ``S`` is replaced by each step and the replaced matrix reused: a caller that keeps a
    reference to ``S`` across steps must take a snapshot (InferenceState.snapshot, which
    calls :meth:`pin`) or copy it. A matrix replaced while pinned is parked; when the
    last snapshot pinning it is released (:meth:`unpin`, the decode loop's per-pass undo
    snapshot) it goes to the pool. A snapshot that is never released keeps its matrices
    out of the pool for good."""

    __slots__ = ("conv_q", "conv_k", "conv_v", "S", "record", "_mine", "_pins", "_parked")

    def __init__(self):
        self.conv_q = self.conv_k = self.conv_v = None
        self.S = None
        self.record = None
        self._mine = None       # weak reference: the current S when this module made it
        self._pins = {}         # id(matrix) -> [weak reference, snapshots holding it]
        self._parked = []       # weak references: matrices this module made, replaced while pinned

    def _pin_entry(self, S):
        e = self._pins.get(id(S))
        return e if e is not None and e[0]() is S else None

    def pin(self) -> None:
        """A snapshot now references S: it is not reused while the snapshot may need it."""
        S = self.S
        if S is None:
            return
        e = self._pin_entry(S)
        if e is None:
            k, pins = id(S), self._pins
            e = pins[k] = [weakref.ref(S, lambda _r, k=k, pins=pins: pins.pop(k, None)), 0]
        e[1] += 1

    def unpin(self, S) -> None:
        """A snapshot that pinned S is released: once nothing pins S and the state has
        moved past it, S goes to the pool."""
        e = self._pin_entry(S) if S is not None else None
        if e is None:
            return
        e[1] -= 1
        if e[1] > 0:
            return
        del self._pins[id(S)]
        if S is not self.S and any(r() is S for r in self._parked):
            self._parked = [r for r in self._parked if r() is not None and r() is not S]
            pool_give(S)

    def advance(self, S: torch.Tensor) -> None:
        """S becomes the state's matrix (made by this module for it); the one it replaces
        goes back to the pool if nothing else can hold it (parked while pinned)."""
        old = self.S
        self.S = S
        if old is not None and self._mine is not None and self._mine() is old:
            if self._pin_entry(old) is None:
                pool_give(old)
            else:
                self._parked = [r for r in self._parked if r() is not None] + [weakref.ref(old)]
        self._mine = weakref.ref(S)
