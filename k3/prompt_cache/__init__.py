"""The prompt cache: a later prompt continues from the longest kept state of a prefix of
itself, whichever request or process read it, and reads only the rest.

One :class:`PromptCache`, two tiers:

* memory (:class:`~k3.prompt_cache.memory.MemoryTier`, the server's ``--prefix-cache``):
  an LRU of states: the prefill snapshots below, and (the server) the state after a
  prompt was read or an answer finished, so that a chat's next turn extends the last;
* disk (:class:`~k3.prompt_cache.disk.DiskTier`, ``--prompt-cache DIR``): the prefill
  snapshots only, kept across runs, processes and restarts, within ``--prompt-cache-gb``.

Snapshots. A prefill that starts at position 0 (or at a snapshot) takes a snapshot of
its state at each *snapshot point*: every :data:`SNAPSHOT_EVERY` tokens (or the plan's
prefill piece, where longer), and at the largest grid position at or before the first
and the last two message boundaries of a rendered chat in the span read (:class:`Prompt`). The grid (:data:`SNAPSHOT_GRID` positions from position 0) is made
of whole KDA chunks where the attention's sums stop as in one pass: the decode
loop cuts its prefill pieces there as well (k3.decode.pieces_with_snapshots), so the
snapshot holds the bits a one-pass prefill has at that position, and a prompt that
continues from it (with at least ``min_rest`` tokens left, so that the rest is read in
the chunked KDA form as one pass would) gets the tokens and logits of a fresh prefill,
bit for bit. The state after decoded tokens (fed one at a time) is not that of a
prefill of them: the disk tier never keeps one; a chat's next turn re-reads the answer
from the last snapshot (at most one snapshot interval more than its new tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .memory import MemoryTier, copy_state, state_bytes  # noqa: F401 - the memory tier's helpers live there

#: snapshot points lie on multiples of this many positions from position 0. KDA's chunk
#: (16) is not enough: a prefill piece's end is also where the softmax denominators of
#: its queries stop (``p.sum(-1)`` over keys 0..piece end, k3.model.mla._online_softmax,
#: zeros past each query), and torch's vectorized sum groups terms by their offset in
#: blocks (32 measured on an AVX-512 Xeon): a piece ending at an odd multiple of 16 gave
#: other bits than one pass. 256 (PREFILL_CHUNK) leaves a margin for wider blocks, and
#: puts the snapshots where a default prefill cuts anyway.
SNAPSHOT_GRID = 256
#: a snapshot every this many prefill tokens (a multiple of SNAPSHOT_GRID). Each costs
#: a write of the KDA state (K3: about 100 MB) and of the MLA latent KV since the last
#: one; 1024 keeps that small beside the prefill of 1024 tokens on K3
SNAPSHOT_EVERY = 1024


class Prompt(list):
    """Token ids, with the offsets where its messages end (``boundaries``): the front
    ends of a chat give them, so that the snapshots fall where conversations part."""

    def __init__(self, ids: Sequence[int] = (), boundaries: Sequence[int] = ()):
        super().__init__(ids)
        self.boundaries = tuple(int(b) for b in boundaries)


@dataclass
class Hit:
    cached: int  # prompt tokens the state holds
    state: object
    exact: bool  # a prefill snapshot on the grid (continuing from it: a fresh prefill's bits)
    chain: object = None  # its KV segments on disk, when known


class PromptCache:
    """The memory and disk tiers behind one lookup; ``grid``: where snapshots may lie
    (:data:`SNAPSHOT_GRID`), ``min_rest``: the chunked KDA form's least length (the
    engine gives it: this module does not know the model's math)."""

    def __init__(self, memory: MemoryTier | None = None, disk=None, *, grid: int = SNAPSHOT_GRID, min_rest: int = 32,
                 every: int = SNAPSHOT_EVERY, warn=None):
        if every % grid:
            raise ValueError(f"the snapshot interval {every} is not a multiple of the grid {grid}")
        self.memory, self.disk = memory, disk
        self.warn = warn or (lambda msg: None)
        self.broken = False  # a snapshot failed unexpectedly: no more are taken
        self.grid, self.min_rest, self.every = grid, min_rest, every
        self.lookups = self.hits = self.cached_tokens = self.snapshots = 0

    @property
    def enabled(self) -> bool:
        return self.memory is not None or self.disk is not None

    def lookup(self, prompt: Sequence[int], capacity: int) -> Hit | None:
        """The longest kept prefix of ``prompt`` (at least one token left to read), from
        either tier; None. ``capacity``: the KV positions a state read from disk gets."""
        self.lookups += 1
        hit = None
        if self.memory is not None:
            got = self.memory.lookup(prompt, self.min_rest)
            if got is not None:
                e, st = got
                hit = Hit(len(e.key), st, e.exact, e.chain)
        if self.disk is not None:
            lo = hit.cached if hit is not None else 0
            points = [p for p in range(self.grid, len(prompt) - self.min_rest + 1, self.grid)
                      if p > lo and p >= self.min_rest]
            try:
                got = self.disk.lookup(prompt, points, capacity) if points else None
            except Exception as e:  # noqa: BLE001 - a cache that cannot be read is a miss, never a failed request
                got = None
                self.disk.warn_once("lookup", f"warning: the prompt cache folder {self.disk.root} could not be read "
                                              f"({type(e).__name__}: {e}): this prompt is read whole.")
            if got is not None:
                hit = Hit(got[0], got[1], True, got[2])
        if hit is not None:
            self.hits += 1
            self.cached_tokens += hit.cached
        return hit

    def points(self, start: int, end: int, boundaries: Sequence[int] = ()) -> list[int]:
        """The snapshot points of a prefill of positions start..end-1 that starts on the
        grid: every ``every`` tokens from the start (where the plan's pieces end) and the
        grid position at or before the first and the last two message boundaries in the
        span (where conversations that share a system prompt part, and where the next turn
        continues: the last message may be one the next turn does not repeat, such as a
        tool-choice instruction; each point between pieces costs a pass), leaving at least
        ``min_rest`` tokens on both sides (k3.decode.pieces_with_snapshots keeps the ones
        the pieces allow)."""
        if start % self.grid:
            return []
        inside = sorted({b - b % self.grid for b in boundaries if start < b - b % self.grid < end})
        pts = set(range(start + self.every, end, self.every)) | set(inside[:1] + inside[-2:])
        return sorted(p for p in pts if start + self.min_rest <= p <= end - self.min_rest)

    def attach(self, req, hit: Hit | None, boundaries: Sequence[int] = ()) -> None:
        """Set a decode-loop request (k3.decode.Request, just added) up: the tokens it
        continues from the cache, and - when it starts from position 0 or from a
        snapshot - its snapshot points and what is done there."""
        req.cached = hit.cached if hit is not None else 0
        st = req.state
        if not self.enabled or st is None or not req.incremental:
            return
        start = st.position
        if not (hit.exact if hit is not None else start == 0):
            return   # continued from decoded tokens: not a prefill's bits, no snapshot of it
        req.snap_at = self.points(start, start + len(req.reading), boundaries)
        if req.snap_at:
            req.on_snap = self._snapper(hit.chain if hit is not None else None)

    def _snapper(self, chain):
        """What a request does at its snapshot points: the state goes to both tiers (the
        disk's KV segments continue ``chain``)."""
        def on_snap(state):
            nonlocal chain
            if self.broken:
                return
            try:
                if self.disk is not None:
                    chain = self.disk.save(state, chain)
                if self.memory is not None:
                    self.memory.put(state, exact=True, chain=chain)
                self.snapshots += 1
            except Exception as e:  # noqa: BLE001 - a snapshot is never worth a failed request
                self.broken = True
                self.warn(f"warning: the prompt cache could not keep a snapshot ({type(e).__name__}: {e}): "
                          "decoding goes on without taking more.")
        return on_snap

    def put(self, state, *, owned: bool = False) -> bool:
        """Keep a state that is not a prefill snapshot (after a prompt, or an answer) in
        the memory tier: a next request extending it continues as one incremental decode
        would."""
        return self.memory.put(state, owned=owned) if self.memory is not None else False

    def stats(self) -> dict:
        d = self.disk
        return {"lookups": self.lookups, "hits": self.hits, "cached_tokens": self.cached_tokens,
                "snapshots": self.snapshots, "disk_reads": d.reads if d else 0, "disk_writes": d.writes if d else 0,
                "disk_damaged": d.damaged if d else 0, "disk_evicted": d.evicted if d else 0}
