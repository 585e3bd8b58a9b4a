"""The cost of one forward pass of T tokens: a batch of sequences, a speculative pass
(one sequence's token and its drafts), a prefill piece.

A pass reads the trunk layers that are not pinned and the streamed lm_head once,
whatever T is, and, per MoE layer, every distinct routed expert its tokens chose that
the cache does not hold. So what a pass costs beyond one token is its extra distinct
experts, and that depends on how much the tokens' choices overlap:

* tokens of one sequence (a draft) overlap as consecutive tokens of that sequence do;
* tokens of different sequences (a batch) overlap as the layer's popularity makes them.

Both are described by an effective pool: the number of equally likely experts E' that
gives the overlap seen. With k experts per token drawn from E' equally likely ones,
T tokens choose ``E' (1 - (1 - k / E')^T)`` distinct experts on average; groups of
sizes s_i, independent of one another, ``E' (1 - prod (1 - s_i / E'))``. The prior is
uniform routing over the layer's real pool (E' = E), the planner's assumption; a run
replaces it with what it sees (:meth:`PassCost.observe`): E' for a sequence's
consecutive tokens from its speculative passes, E' across sequences from its batched
passes, the fraction of requested experts the cache held, the expert reads' rate and
the seconds of a pass outside its expert reads, per number of tokens (a pass of more
than one token may take another code path than one token's, so its time is not a
straight line from one token's: between two timed sizes it is interpolated, past the
largest it grows by SLOPE_PRIOR of a one-token pass per token). Only decode passes
(each sequence reading its last token and its drafts) time the sizes that price drafts:
a prompt piece runs cold and through other code. A size not timed within the last STALE
decode passes is priced at its lower bound - what a freshly timed smaller pass took -
so that drafts which would pay even there are read, and the size is timed again: the
policy re-prices a pass size by trying it, never from an old or a prefill's time.

The model knows nothing of the math; it sees per pass the tokens per sequence, the
seconds, and the cache's counters (distinct experts requested summed over the MoE
layers, hits, bytes and seconds of expert reads). docs/TUNING.md states it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# Observations weigh like this many passes against the prior, and the running figures
# follow a run's changes (a new topic, a cache warming up) at this rate per pass.
PRIOR_WEIGHT = 4.0
DECAY = 0.9
# Past the largest pass a run has timed, an extra token costs this share of a one-token
# pass outside its expert reads (batch 8 of the small model took ~1.8x one token's time).
SLOPE_PRIOR = 0.1
MAX_TIMED = 64  # passes of more tokens (long prefill pieces) are not kept in the table
# A pass size whose last decode timing is older than this many decode passes is priced
# at its lower bound (what the largest fresh smaller size costs), so a size that would
# pay at that price is read, and so timed again: drafts are never locked out by an old
# or cold timing.
STALE = 16
RECENT = 4  # a pass size's time: the least of its last RECENT decode passes
EXPLORE_GAIN = 0.05  # what a size priced at its lower bound must gain over the best fresh choice to be tried


def distinct(T: float, k: int, pool: float) -> float:
    """Expected distinct experts chosen by T tokens, each choosing k of ``pool`` equally
    likely experts."""
    if T <= 0 or k <= 0:
        return 0.0
    pool = max(float(pool), float(k))
    return pool * (1.0 - (1.0 - k / pool) ** T)


def union(sizes: Sequence[float], pool: float) -> float:
    """Expected size of the union of independent sets of ``sizes`` from ``pool``."""
    pool = float(pool)
    if pool <= 0:
        return 0.0
    miss = 1.0
    for s in sizes:
        miss *= max(0.0, 1.0 - min(s, pool) / pool)
    return pool * (1.0 - miss)


def pool_for(T: int, k: int, seen: float, cap: float) -> float:
    """The effective pool E' in [k, cap] for which T tokens choose ``seen`` distinct
    experts on average (bisection on a monotone function)."""
    if T <= 1:
        return cap
    lo, hi = float(k), float(cap)
    if seen >= distinct(T, k, hi):
        return hi
    if seen <= k:
        return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if distinct(T, k, mid) < seen:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class _Running:
    """A running mean that starts at a prior worth PRIOR_WEIGHT observations and forgets
    old observations at DECAY per observation."""

    def __init__(self, prior: float | None):
        self.sum = (prior or 0.0) * PRIOR_WEIGHT if prior is not None else 0.0
        self.weight = PRIOR_WEIGHT if prior is not None else 0.0
        self.n = 0

    def add(self, x: float) -> None:
        self.sum = self.sum * DECAY + x
        self.weight = self.weight * DECAY + 1.0
        self.n += 1

    @property
    def value(self) -> float | None:
        return self.sum / self.weight if self.weight else None


class _Recent:
    """The least of the last RECENT observations of a pass's time: a pass's time is its
    cost plus whatever else held the cores (another process, a cold first call), so the
    least of a few recent passes of one size tracks its cost, and follows a change
    within RECENT passes."""

    def __init__(self):
        self.last: list[tuple[int, float]] = []  # (decode pass, seconds)

    def add(self, x: float, at: int) -> None:
        self.last = (self.last + [(at, x)])[-RECENT:]

    def since(self, at: int) -> int:
        """How many of the kept passes ran at decode pass ``at`` or later."""
        return sum(1 for a, _ in self.last if a >= at)

    @property
    def value(self) -> float:
        return min(x for _, x in self.last)


@dataclass(frozen=True)
class PassShape:
    """What a pass's cost depends on: the plan's constants."""

    moe_layers: int
    experts: int  # routed experts per MoE layer
    top_k: int
    expert_bytes: int
    cache_slots: int
    streamed_trunk_bytes: int  # trunk bytes re-read every pass (layers not pinned)
    table_bytes: int  # lm_head bytes read per pass when the tables are streamed, else 0

    @property
    def uniform_hit(self) -> float:
        routed = self.moe_layers * self.experts
        return min(1.0, self.cache_slots / routed) if routed else 1.0


def pass_bytes(shape: PassShape, groups: Sequence[int], *, hit: float | None = None, seq_pool: float | None = None,
               batch_pool: float | None = None) -> float:
    """Bytes one pass reads: the streamed trunk and tables once, plus the distinct routed
    experts of ``groups`` (tokens per sequence) the cache misses. Pools and hit default
    to the uniform prior."""
    E, k = shape.experts, shape.top_k
    per_seq = [distinct(n, k, seq_pool or E) for n in groups if n > 0]
    d = union(per_seq, batch_pool or E) if len(per_seq) > 1 else (per_seq[0] if per_seq else 0.0)
    h = shape.uniform_hit if hit is None else hit
    return shape.streamed_trunk_bytes + shape.table_bytes + shape.moe_layers * d * (1.0 - h) * shape.expert_bytes


class PassCost:
    """The pass cost model of one run: the plan's constants, the prior, and what the run
    has seen. ``bytes(groups)`` and ``seconds(groups)`` price a pass of ``groups``
    (tokens per sequence); ``observe`` learns from each pass that ran."""

    def __init__(self, shape: PassShape):
        self.shape = shape
        self.hit = _Running(shape.uniform_hit)
        # pools are averaged as logarithms: one pass that sees a small pool should move a
        # prior of 896 as far as one that sees a large pool
        self._seq_pool = _Running(math.log(shape.experts))
        self._batch_pool = _Running(math.log(shape.experts))
        self.rate = _Running(None)  # expert bytes per second of expert reads
        self.outside: dict[int, _Recent] = {}  # tokens in a decode pass -> its seconds outside expert reads
        self.prefill: dict[int, _Running] = {}  # the same for passes that read prompt pieces (not drafts' prices)
        self.passes = 0
        self.decode_passes = 0

    @property
    def seq_pool(self) -> float:
        """The effective pool of one sequence's consecutive tokens."""
        return math.exp(self._seq_pool.value)

    @property
    def batch_pool(self) -> float:
        """The effective pool of different sequences' tokens."""
        return math.exp(self._batch_pool.value)

    # ------------------------------------------------------------------ predictions
    def distinct(self, groups: Sequence[int]) -> float:
        """Expected distinct experts per MoE layer of a pass of ``groups``."""
        k = self.shape.top_k
        per_seq = [distinct(n, k, self.seq_pool) for n in groups if n > 0]
        if len(per_seq) <= 1:
            return per_seq[0] if per_seq else 0.0
        return union(per_seq, self.batch_pool)

    def expert_bytes(self, groups: Sequence[int]) -> float:
        s = self.shape
        return s.moe_layers * self.distinct(groups) * (1.0 - self.hit.value) * s.expert_bytes

    def bytes(self, groups: Sequence[int]) -> float:
        s = self.shape
        return s.streamed_trunk_bytes + s.table_bytes + self.expert_bytes(groups)

    def bytes_per_token(self, groups: Sequence[int]) -> float:
        n = sum(groups)
        return self.bytes(groups) / n if n else 0.0

    @property
    def timed(self) -> bool:
        """Whether a decode pass has been timed (seconds() predicts nothing before)."""
        return bool(self.outside)

    def fresh(self, T: int) -> bool:
        """Whether decode passes of T tokens were timed twice (a first pass of a size may
        run cold) within the last STALE decode passes."""
        return T in self.outside and self.outside[T].since(self.decode_passes - STALE + 1) >= 2

    def _lower_bound(self, T: int) -> float | None:
        """The least a pass of T tokens can cost outside its expert reads: the most a
        freshly timed pass of no more tokens took (a pass costs no less for more tokens)."""
        below = [self.outside[n].value for n in self.outside if n <= T and self.fresh(n)]
        return max(below) if below else None

    def outside_seconds(self, T: int) -> float | None:
        """A pass of T tokens' seconds outside its expert reads: as timed, else
        interpolated between the nearest timed sizes, else extrapolated from the nearest
        by SLOPE_PRIOR of a one-token pass per token (a batch that never runs one token
        alone estimates that from its smallest pass)."""
        if not self.outside:
            return None
        if T in self.outside:
            return self.outside[T].value
        sizes = sorted(self.outside)
        n0 = sizes[0]
        one = self.outside[1].value if 1 in self.outside else self.outside[n0].value / (1 + SLOPE_PRIOR * (n0 - 1))
        below = [n for n in sizes if n < T]
        above = [n for n in sizes if n > T]
        if below and above:
            lo, hi = below[-1], above[0]
            a, b = self.outside[lo].value, self.outside[hi].value
            return a + (b - a) * (T - lo) / (hi - lo)
        if below:
            return self.outside[below[-1]].value + SLOPE_PRIOR * one * (T - below[-1])
        return max(0.0, self.outside[n0].value - SLOPE_PRIOR * one * (n0 - T))

    def seconds(self, groups: Sequence[int]) -> float | None:
        """Predicted seconds of a pass: its time outside expert reads, plus its expert
        bytes at the reads' rate. A size not timed lately on a decode pass is priced at
        its lower bound (:meth:`_lower_bound`), so the decode loop tries it when it would
        pay even there, and its price is then measured, not guessed."""
        T = max(1, sum(groups))
        base = None if self.fresh(T) else self._lower_bound(T)
        if base is None:
            base = self.outside_seconds(T)
        if base is None:
            return None
        rate = self.rate.value
        return base + (self.expert_bytes(groups) / rate if rate else 0.0)

    # ------------------------------------------------------------------ learning
    def observe(self, groups: Sequence[int], seconds: float, counters: dict, decode: bool = True) -> None:
        """One pass that ran: tokens per sequence, its seconds, and the cache's counter
        deltas over it (``expert_requests`` = distinct experts summed over MoE layers,
        ``expert_hits``, ``expert_bytes_read``, ``expert_read_seconds``). ``decode``: every
        sequence read its last token (and drafts), no prompt piece: only such passes
        price drafts (a prompt piece runs cold, through other code, and would lock drafts
        out for a whole run)."""
        self.passes += 1
        self.decode_passes += bool(decode)
        groups = [n for n in groups if n > 0]
        T = sum(groups)
        if not T:
            return
        req, hits = counters.get("expert_requests", 0), counters.get("expert_hits", 0)
        eb, es = counters.get("expert_bytes_read", 0), counters.get("expert_read_seconds", 0.0)
        s, k = self.shape, self.shape.top_k
        if req:
            self.hit.add(hits / req)
            per_layer = req / s.moe_layers if s.moe_layers else 0.0
            if len(groups) == 1 and 1 < T <= MAX_TIMED:  # one sequence's consecutive tokens
                self._seq_pool.add(math.log(pool_for(T, k, per_layer, s.experts)))
            elif len(groups) > 1 and all(n == 1 for n in groups):  # one token from each sequence
                self._batch_pool.add(math.log(pool_for(T, k, per_layer, s.experts)))
        if eb > 0 and es > 0:
            self.rate.add(eb / es)
        if T <= MAX_TIMED:
            if decode:
                self.outside.setdefault(T, _Recent()).add(max(0.0, seconds - es), self.decode_passes)
            else:
                self.prefill.setdefault(T, _Running(None)).add(max(0.0, seconds - es))

    def as_dict(self) -> dict:
        return {"passes": self.passes, "hit": self.hit.value, "seq_pool": self.seq_pool,
                "batch_pool": self.batch_pool, "expert_read_rate": self.rate.value,
                "seconds_outside_expert_reads": {n: r.value for n, r in sorted(self.outside.items())},
                "prefill_seconds_outside_expert_reads": {n: r.value for n, r in sorted(self.prefill.items())}}


def expected_emitted(accept: Sequence[float], j: int) -> float:
    """Tokens a pass emits on average with j drafts, where ``accept[i]`` is the chance
    that draft i+1 is kept given that the drafts before it were: 1 + sum of the
    products (the model's own token, plus each kept draft)."""
    e, p = 1.0, 1.0
    for i in range(min(j, len(accept))):
        p *= accept[i]
        e += p
    return e


def drafts_to_read(cost: PassCost, others: Sequence[int], emitted_others: float, offered: int,
                   accept: Sequence[float]) -> int:
    """How many of ``offered`` drafts one sequence should have read in a pass whose other
    sequences read ``others`` tokens and are expected to emit ``emitted_others``: the j
    that maximises the pass's expected tokens per predicted second; 0 (draft nothing)
    while no pass has been timed or where no draft pays for itself."""
    if offered <= 0 or not cost.timed:
        return 0
    best_j, best = 0, None
    for j in range(offered + 1):
        groups = list(others) + [1 + j]
        t = cost.seconds(groups)
        if not t or t <= 0:
            return 0
        rate = (emitted_others + expected_emitted(accept, j)) / t
        # a size priced at its lower bound is tried only for a clear gain: drafts that are
        # nearly always wrong are not read just because their price is not known yet
        margin = 1e-9 if cost.fresh(sum(groups)) else EXPLORE_GAIN
        if best is None or rate > best * (1.0 + margin):
            best_j, best = j, rate
    return best_j


def plan_groups(sequences: int) -> list[int]:
    """The pass a plan for ``sequences`` sequences prices: one token each."""
    return [1] * max(1, int(sequences))
