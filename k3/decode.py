"""The decode loop: sequences read and generate together, one forward pass over the
weights per :meth:`Batch.step` (a prefill piece, or the last token with the drafts of
speculative decoding), each emitting :class:`Step` objects. :class:`k3.engine.Engine`
drives it for every front end; the server drives a :class:`Batch` itself.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import env, interrupt
from .errors import K3Error, NumericError, UsageError
from .model.stack import InferenceState, Observer

#: tokens per prefill piece: a long prompt is read in pieces carrying the state, so the
#: activations never grow with its length (a multiple of KDA's 16-token chunk)
PREFILL_CHUNK = 256


def max_piece(chunk: int = PREFILL_CHUNK) -> int:
    """The most tokens one forward pass reads (the plan sizes the activations for it)."""
    from .model.kda import CHUNK_MIN_T
    return chunk + CHUNK_MIN_T - 1


#: prefill pieces are whole multiples of this: whole KDA chunks (16), and where a piece
#: ends also decides how attention's softmax sums group the keys (torch's vectorised sum
#: takes 32 at a time on AVX-512): pieces of 48 or 80 tokens moved logits by ~1e-6
PIECE_GRID = 32


def check_prefill_chunk(chunk) -> int:
    """A piece must be whole grid steps (``PIECE_GRID``) and long enough for the chunked
    KDA form, so that every piece size gives the numbers of one pass."""
    from .model.kda import CHUNK_MIN_T
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not CHUNK_MIN_T <= chunk <= 1 << 16 \
            or chunk % PIECE_GRID:
        raise UsageError(f"--prefill-chunk must be a multiple of {PIECE_GRID} between {CHUNK_MIN_T} and "
                         f"{1 << 16}, got {chunk!r} (where pieces end must not move the numbers: whole KDA "
                         "chunks, and attention's sums grouped alike).")
    return chunk


def prefill_pieces(n: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """[a, b) pieces of a prefill of n tokens: ``chunk`` each, and a tail shorter than
    the chunked-KDA threshold joins the piece before it, so that every piece takes the
    KDA form, and the chunk boundaries, that one pass over all n tokens would."""
    from .model.kda import CHUNK_MIN_T
    cuts = list(range(0, n, chunk)) + [n]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < CHUNK_MIN_T:
        del cuts[-2]
    return list(zip(cuts, cuts[1:]))


def pieces_with_snapshots(n: int, chunk: int, points: Sequence[int] = ()) -> list[tuple[int, int]]:
    """prefill_pieces of n tokens, also cut at ``points`` (offsets into the n tokens where
    a snapshot of the state is wanted, k3.prompt_cache). A point is kept only where the
    pieces on both sides of it stay long enough for the chunked KDA form (CHUNK_MIN_T);
    between kept points the pieces are those of prefill_pieces. With points on the prompt
    cache's grid (k3.prompt_cache.SNAPSHOT_GRID, from a start on it), every piece takes
    the KDA form and chunk boundaries of one pass, and ends where one pass's attention
    sums give the same bits: the logits do not change (tests/test_prompt_cache.py)."""
    from .model.kda import CHUNK_MIN_T
    kept, prev = [], 0
    for p in sorted(points):
        if p - prev >= CHUNK_MIN_T and n - p >= CHUNK_MIN_T:
            kept.append(p)
            prev = p
    out = []
    for a, b in zip([0] + kept, kept + [n]):
        out += [(a + x, a + y) for x, y in prefill_pieces(b - a, chunk)]
    return out



def greedy(logits: torch.Tensor) -> int:
    """First index of the maximum (the C engine's argmax rule)."""
    return int(torch.argmax(logits.reshape(-1)))


@dataclass
class Step:
    """One generated token. Step 0 includes the prefill (``fed`` tokens read)."""

    step: int
    token: int
    seconds: float
    fed: int = 1
    text: str = ""  # the text this token completes ("" without a tokenizer, or mid-character)
    bytes_read: int = 0  # trunk + experts + streamed tables, this step
    expert_requests: int = 0
    expert_hits: int = 0
    expert_bytes_read: int = 0
    trunk_bytes_read: int = 0
    table_bytes_read: int = 0
    net_bytes: int = 0  # activations sent between the ranks of a pipeline (k3.pipeline), this step
    cached: int = 0  # on step 0: prompt tokens continued from a kept state (k3.prompt_cache), not read
    io_seconds: float = 0.0  # device time of the reads (they overlap compute)
    finish: str | None = None  # on the last step: "stop" (a stop token) or "length"
    pass_index: int = 0  # the weight pass that produced it (one pass emits several tokens with --spec)
    drafted: int = 0  # speculative decoding, on a pass's first token: tokens drafted and accepted in that pass
    accepted: int = 0
    withheld: int = 0  # drafts found but not read: the pass cost model said they would not pay
    batch: int = 1  # sequences that shared the pass (its seconds and bytes are theirs together)
    logits: torch.Tensor | None = None  # step 0 always; every step with keep_logits

    @property
    def expert_hit_rate(self) -> float:
        return self.expert_hits / self.expert_requests if self.expert_requests else 0.0


@dataclass
class Generation:
    """A whole generation (``generate(..., stream=False)``)."""

    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    steps: list[Step] = field(default_factory=list)

    @property
    def prefill_seconds(self) -> float:
        return self.steps[0].seconds if self.steps else 0.0

    @property
    def seconds_per_token(self) -> float:
        return sum(s.seconds for s in self.steps) / len(self.steps) if self.steps else 0.0


def set_threads(n: int | None) -> int:
    """Compute threads for torch and the numba kernels (default: every usable core)."""
    import os

    from .kernels import max_threads, set_num_threads
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n < 1:
        raise UsageError(f"--threads must be >= 1, got {n}.")
    n = min(int(n), max_threads())
    torch.set_num_threads(n)
    set_num_threads(n)
    return n


#: a forward pass over at most this many tokens runs torch's ops on one thread (the
#: numba kernels keep every thread): its torch ops are small, and a second OpenMP pool
#: woken beside the kernels' own costs more than it gives (docs/PERFORMANCE.md)
SMALL_PASS = 64


@contextlib.contextmanager
def pass_threads(tokens: int):
    """Torch threads for one forward pass of ``tokens`` tokens (results do not depend
    on the thread count: docs/ARCHITECTURE.md)."""
    n = torch.get_num_threads()
    if n == 1 or tokens > SMALL_PASS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class Request:
    """One sequence in a :class:`Batch`: what it still has to read, its state, its limits."""

    id: int
    state: InferenceState | None  # None in full recompute (a fresh one per re-read)
    incremental: bool
    seq: list  # the whole sequence: every token read, or still to read
    reading: list  # tokens to read before its next token is picked
    max_tokens: int
    sampler: object = None
    stop_ids: tuple = ()
    keep_logits: bool = False
    drafter: object = None
    constraint: object = None  # k3.constrain.Constraint: a grammar its tokens must follow
    bias: tuple | None = None  # (token ids, values) added to its logits before each pick
    emitted: int = 0
    passes: int = 0
    finish: str | None = None  # "stop" or "length" once finished ("cancelled": taken out by Batch.remove)
    work: InferenceState | None = None  # full recompute: the re-read in progress
    drafts: list = field(default_factory=list)
    withheld: int = 0  # drafts of this pass not read
    tokens: list = field(default_factory=list)  # emitted so far
    carry: dict = field(default_factory=dict)  # time, tokens and I/O of passes that emitted nothing yet
    cached: int = 0  # prompt tokens continued from a kept state (k3.prompt_cache), not read: Step 0 says so
    snap_at: list = field(default_factory=list)  # positions of its prefill where on_snap takes the state
    on_snap: object = None  # called with the state when it holds exactly snap_at[0] tokens

    @property
    def finished(self) -> bool:
        return self.finish is not None


def _carry(c: dict, seconds: float, fed: int, io: dict) -> None:
    """Add a pass's time, tokens read and I/O to a sequence's carry: the first Step it
    emits reports them (a prompt read in several passes reports them all there)."""
    c["seconds"] = c.get("seconds", 0.0) + seconds
    c["fed"] = c.get("fed", 0) + fed
    for k, v in io.items():
        c[k] = c.get(k, 0) + v


def _pass_report(c: dict, drafted: int, accepted: int, withheld: int) -> dict:
    """The fields of a pass's first Step: the carry ``c`` (see :func:`_carry`) and the
    pass's drafts. The pass's other Steps report none of it (:data:`_NO_REPORT`)."""
    return {"seconds": c["seconds"], "fed": c["fed"],
            "bytes_read": c["expert_bytes_read"] + c["trunk_bytes_read"] + c["table_bytes_read"],
            "expert_requests": c["expert_requests"], "expert_hits": c["expert_hits"],
            "expert_bytes_read": c["expert_bytes_read"], "trunk_bytes_read": c["trunk_bytes_read"],
            "table_bytes_read": c["table_bytes_read"], "net_bytes": c.get("net_bytes", 0),
            "io_seconds": c["expert_read_seconds"] + c["trunk_device_seconds"],
            "drafted": drafted, "accepted": accepted, "withheld": withheld}


#: a pass's Steps after its first: no time, no tokens read (the other report fields
#: keep Step's defaults, zero)
_NO_REPORT = {"seconds": 0.0, "fed": 0}


class Batch:
    """THE decode loop: sequences (:class:`Request`) read and generate together, one
    forward pass per :meth:`step`. A pass reads, for each active sequence, its next
    prefill piece (a long prompt takes several passes, so activations stay bounded), or
    its last token - plus, with ``spec``, the tokens drafted after it - and emits its
    next tokens once its reading is done. Sequences may join (:meth:`add`) and finish
    between steps. Every op but the mixers works on each token alone, so a sequence's
    tokens and logits are those it gets alone.

    Speculative decoding (``spec`` > 0, incremental only): each pass after the prefill
    reads [last token + up to ``spec`` drafted tokens] (k3.spec: the sequence's own
    n-grams, then ``spec_corpus``'s) and keeps the longest prefix the model agrees with
    (greedy: its argmax; sampling: the token plain sampling picks at that position), plus the model's own next
    token; the state is rolled back exactly to what it keeps. The tokens are those of
    plain decoding; a pass yields one Step per token it emits."""

    # engine: the k3.engine.Engine whose model, plan limits and counters the batch uses
    # (not annotated: k3.engine imports this module, so this one cannot import it)
    def __init__(self, engine, *, observer: Observer | None = None, undo_on_interrupt: bool = False):
        self.engine = engine
        self.observer = observer
        self.undo_on_interrupt = undo_on_interrupt
        self.requests: list[Request] = []
        self._next_id = 0
        self._counters = engine.counters()

    @property
    def active(self) -> list[Request]:
        return [r for r in self.requests if not r.finished]

    def add(self, feed: Sequence[int], *, state: InferenceState | None = None, incremental: bool = True,
            max_tokens: int, sampler=None, stop_ids=(), keep_logits: bool = False, spec: int = 0,
            spec_corpus=None, constraint=None, bias=None) -> Request:
        """A sequence joins the batch (read from the next step on). ``constraint``: a
        grammar its tokens must follow (k3.constrain: the tokens it does not allow are
        masked before each pick, drafts included: a draft the grammar rejects is not read).
        ``bias``: (token ids, values) added to its logits before each pick (and before the
        grammar's mask), greedy or sampled, drafts verified against the biased logits."""
        feed = list(feed)
        if spec and not incremental:
            raise UsageError("--spec drafts tokens and rolls the carried state back to the ones kept: it needs "
                             "incremental decoding (drop --full-recompute).")
        if len(self.active) >= self.engine.max_batch:
            raise UsageError(f"the batch already holds {len(self.active)} sequences, the most the engine's memory "
                             f"plan holds (max_batch={self.engine.max_batch}).")
        self.engine.check_spec(spec)
        self.engine.check_length(len(state.ids) if state is not None else 0, len(feed), max_tokens)
        if incremental and state is None:
            state = self.engine.new_state()
        seq = (list(state.ids) if state is not None else []) + feed
        drafter = None
        if spec:
            from .spec import Drafter
            drafter = Drafter(seq, spec, spec_corpus)
        req = Request(self._next_id, state if incremental else None, incremental, seq, feed if incremental else [],
                      max_tokens, sampler, tuple(stop_ids), keep_logits, drafter, constraint=constraint, bias=bias)
        self._next_id += 1
        if max_tokens <= 0:
            req.finish = "length"
        self.requests.append(req)
        return req

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the batch between steps (its client went away, or it is
        done and need not be kept): it is read no more and its slot is free for the next
        add(). An unfinished request ends as "cancelled"; its state stays as the last
        step left it (every token in ``state.ids`` read, the rest never)."""
        self.requests = [r for r in self.requests if r is not req]
        if req.finish is None:
            req.finish = "cancelled"

    def step(self) -> list[tuple[Request, list[Step]]]:
        """One forward pass over every active sequence; returns the Steps each emitted."""
        interrupt.check()  # a Ctrl-C / SIGTERM recorded since the last pass (k3.interrupt)
        active = self.active
        if not active:
            return []
        eng = self.engine
        pieces = [self._next_piece(r) for r in active]
        self._draft(active, pieces)
        blocks = [p + r.drafts for r, p in zip(active, pieces)]
        states = [r.state if r.incremental else r.work for r in active]
        snaps = self._snapshot(active, states)
        rows, where = self._logit_rows(active, blocks)
        t0 = time.perf_counter()
        logits = self._forward(active, blocks, states, snaps, rows)
        dt = time.perf_counter() - t0
        d = self._io_delta()
        if eng.pass_cost is not None:
            decode = all(r.emitted and len(p) == 1 and len(r.reading) == 1 for r, p in zip(active, pieces))
            eng.pass_cost.observe([len(b) for b in blocks], dt, d, decode=decode)
        out = []
        for r, blk, w, snap in zip(active, blocks, where, snaps):
            r.reading = r.reading[len(blk) - len(r.drafts):]
            _carry(r.carry, dt, len(blk), d)
            if w is not None:  # else still reading its prompt (or its sequence, in full recompute): carried
                out.append((r, self._emit(r, logits[w], snap, len(active))))
        for st, snap in zip(states, snaps):  # the pass is settled: its undo snapshots go
            st.release(snap)
        self._snapshots_due(active)
        return out

    # ------------------------------------------------------------ the parts of a pass, in step()'s order
    def _next_piece(self, r: Request) -> list:
        """What ``r`` reads this pass before any drafts: its next prefill piece (in full
        recompute, the whole sequence again once the last re-read is done), or its last
        token."""
        if not r.incremental and not r.reading:  # full recompute: re-read the whole sequence
            r.work, r.reading = self.engine.model.new_state(len(r.seq)), list(r.seq)
        piece = r.reading[:self._piece_end(r)]
        if self.observer is not None and (len(piece) < len(r.reading) or r.carry.get("fed")):
            done = r.carry.get("fed", 0)  # a prompt read in several passes: where it is
            self.observer.on_prefill(done, done + len(r.reading), len(piece))
        return piece

    def _piece_end(self, r: Request) -> int:
        """How many of ``r``'s tokens to read this pass: its next prefill piece, cut at its
        next snapshot point (pieces_with_snapshots)."""
        at = r.state.position if r.incremental and r.state is not None else 0
        points = [p - at for p in r.snap_at if at < p < at + len(r.reading)] if r.on_snap is not None else []
        return pieces_with_snapshots(len(r.reading), self.engine.prefill_chunk, points)[0][1]

    def _snapshots_due(self, active: list[Request]) -> None:
        """After a pass: each sequence whose state now holds exactly its next snapshot
        point's tokens hands it to on_snap (points it went past are dropped)."""
        for r in active:
            if r.on_snap is None or not r.snap_at or not r.incremental:
                continue
            n = r.state.position
            while r.snap_at and r.snap_at[0] < n:
                r.snap_at.pop(0)
            if r.snap_at and r.snap_at[0] == n:
                r.snap_at.pop(0)
                r.on_snap(r.state)

    @staticmethod
    def _snapshot(active: list[Request], states: list) -> list:
        """Undo snapshots of the states the pass extends (a failed pass goes back to them,
        a drafted one rolls back within them); a drafted sequence's state also records
        what rolling back needs."""
        snaps = [st.snapshot() for st in states]
        for r in active:
            if r.drafts:
                r.state.record(True)
        return snaps

    @staticmethod
    def _logit_rows(active: list[Request], blocks: list[list]) -> tuple[list[int], list]:
        """The rows of the pass whose logits are needed - of each sequence done reading,
        its last token's and its drafts' - and where each sequence's lie among them (a
        slice; None while it is still reading)."""
        rows, where, at = [], [], 0
        for r, blk in zip(active, blocks):
            at += len(blk)
            if len(blk) - len(r.drafts) == len(r.reading):
                n = 1 + len(r.drafts)
                where.append(slice(len(rows), len(rows) + n))
                rows.extend(range(at - n, at))
            else:
                where.append(None)
        return rows, where

    def _forward(self, active: list[Request], blocks: list[list], states: list, snaps: list, rows: list[int]):
        """The forward pass of every block on its state, and the logits of ``rows`` (None
        if none). A pass that fails is undone (:meth:`_undo`) before the error propagates;
        a NumericError is raised again naming the step and the tokens read."""
        model = self.engine.model
        try:
            with pass_threads(sum(len(b) for b in blocks)):
                h = model.hidden_batch(list(zip(blocks, states)), self.observer)
                return model.logits(h[rows]) if rows else None
        except BaseException as e:
            self._undo(e, states, snaps)
            if isinstance(e, NumericError):
                raise NumericError(f"step {max(r.emitted for r in active)} "
                                   f"({sum(len(b) for b in blocks)} tokens read): {e}") from None
            raise

    def _undo(self, e: BaseException, states: list, snaps: list) -> None:
        """After a failed pass: the states stop recording and their snapshots go; after a
        K3Error (or an interrupt, with undo_on_interrupt) they are first restored to them,
        so they stay usable."""
        undo = isinstance(e, K3Error) or (isinstance(e, KeyboardInterrupt) and self.undo_on_interrupt)
        for st, snap in zip(states, snaps):
            st.record(False)
            if undo:
                st.restore(snap)
            st.release(snap)

    def _io_delta(self) -> dict:
        """The run's I/O counters since the last pass."""
        now = self.engine.counters()
        d = {k: now[k] - self._counters[k] for k in now}
        self._counters = now
        return d

    def _emit(self, r: Request, rows, snap, batch: int) -> list[Step]:
        """The Steps ``r`` emits from its ``rows`` of logits (its last token's, then its
        drafts'), the first carrying what was read since its last token; ``r`` moves past
        them (``batch``: the sequences in the pass)."""
        c, r.carry = r.carry, {}
        toks, kept = self._accept(r, rows, snap)
        report = _pass_report(c, len(r.drafts), kept, r.withheld)
        steps = []
        for j, tok in enumerate(toks):
            finish = "stop" if tok in r.stop_ids else "length" if r.emitted == r.max_tokens - 1 else None
            steps.append(Step(r.emitted, tok, finish=finish, pass_index=r.passes, batch=batch,
                              logits=rows[j].clone() if r.keep_logits or r.emitted == 0 else None,
                              cached=r.cached if r.emitted == 0 else 0,
                              **(report if j == 0 else _NO_REPORT)))
            r.emitted += 1
            r.tokens.append(tok)
            if finish is not None:
                r.finish = finish
                break
        emitted = [s.token for s in steps]
        r.seq += emitted
        if r.drafter is not None:
            r.drafter.extend(emitted)
        if r.incremental:
            r.reading = emitted[-1:]
        r.passes += 1
        return steps

    # ------------------------------------------------------------ speculative decoding
    def _draft(self, active: list[Request], pieces: list[list]) -> None:
        """Each sequence's drafts for this pass: proposed by its drafter when it reads its
        last token alone (its prompt read, a token emitted), then cut to what is expected
        to pay (:meth:`_weigh_drafts`)."""
        for r, piece in zip(active, pieces):
            r.drafts, r.withheld = [], 0
            if r.drafter is not None and r.emitted and len(piece) == len(r.reading) == 1:
                r.drafts = r.drafter.propose(r.max_tokens - r.emitted - 1)
                if r.constraint is not None:   # a draft the grammar rejects cannot be kept: not read
                    r.drafts = r.drafts[:r.constraint.valid_prefix(r.drafts)]
        self._weigh_drafts(active, pieces)

    def _weigh_drafts(self, active: list[Request], pieces: list[list]) -> None:
        """Cut each sequence's drafts to what is expected to pay: the number that gives
        the pass the most expected tokens per predicted second, by the pass cost model
        and the drafter's running acceptance (k3.memory.passcost.drafts_to_read)."""
        cost = self.engine.pass_cost
        if cost is None or env.spec_every_draft() or not any(r.drafts for r in active):
            return
        from .memory.passcost import drafts_to_read, expected_emitted

        groups = [len(p) for p in pieces]
        expect = [1.0 if len(p) == len(r.reading) else 0.0 for r, p in zip(active, pieces)]
        for i, r in enumerate(active):
            if not r.drafts:
                continue
            rates = r.drafter.acceptance.rates
            others = groups[:i] + groups[i + 1:]
            j = drafts_to_read(cost, others, sum(expect) - expect[i], len(r.drafts), rates)
            r.withheld = len(r.drafts) - j
            r.drafts = r.drafts[:j]
            groups[i] += j
            expect[i] = expected_emitted(rates, j)

    def _accept(self, r: Request, rows, snap) -> tuple[list[int], int]:
        """The tokens the pass emits for ``r`` (its drafts verified: :meth:`_pick`) up to a
        stop token, and how many drafts it kept; what was read past the tokens kept is
        rolled back out of the state."""
        toks, kept = self._pick(r, rows)
        stop = next((j for j, t in enumerate(toks) if t in r.stop_ids), None)
        if stop is not None:
            toks = toks[:stop + 1]  # the stop token is emitted, never fed
        if r.drafts:
            if len(toks) - 1 < len(r.drafts):  # drop what was read past the tokens kept
                r.state.rollback(snap, len(toks))
            r.state.record(False)
        return toks, kept

    @staticmethod
    def _pick(r: Request, rows) -> tuple[list[int], int]:
        """The tokens a pass emits, and how many drafts it kept."""
        if r.bias is not None:
            ids, values = r.bias
            rows = [row.to(torch.float32, copy=True).index_add_(0, ids, values) for row in rows]
        if r.constraint is not None:   # every row masked for the grammar where its token stands
            rows = r.constraint.masked_rows(rows, r.drafts)
        toks, kept = Batch._verify(r, rows)
        if r.constraint is not None:
            for t in toks:
                r.constraint.accept(t)
        return toks, kept

    @staticmethod
    def _verify(r: Request, rows) -> tuple[list[int], int]:
        # a sampled token's noise is keyed by its position in the sequence (k3.sampling),
        # so a pass with drafts picks the tokens plain passes would
        if not r.drafts:
            return [greedy(rows[-1]) if r.sampler is None else int(r.sampler(rows[-1], len(r.seq)))], 0
        if r.sampler is not None:
            return r.sampler.verify(rows, r.drafts, len(r.seq))
        kept = 0
        while kept < len(r.drafts) and greedy(rows[kept]) == r.drafts[kept]:
            kept += 1
        return r.drafts[:kept] + [greedy(rows[kept])], kept
