"""The engine: a model loaded within a memory plan, and the one decode loop that every
front end (`k3 run`, `k3 chat`, the benchmarks, the Python API) drives.

    import k3
    with k3.load("path/to/model", preset="auto") as eng:
        for step in eng.generate("The capital of France is", max_tokens=16):
            print(step.text, end="", flush=True)

:func:`load` reads the config, checks the checkpoint, sizes the memory plan (and
refuses one that does not fit) before anything large is allocated, then opens the
weights as the plan says. :meth:`Engine.decode` is the loop: prefill, then one token
per step, incremental (KDA state and MLA KV cache carried) or full recompute; it yields
one :class:`Step` per token with its timing and what it read. :meth:`Engine.generate`
adds prompts as text, sampling settings and text pieces; :meth:`Engine.chat` opens a
conversation (:class:`k3.chat.ChatSession`) on the same loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from . import env, warmup
from .config import ModelConfig, check_layers, load_config
from .errors import K3Error, NumericError, UsageError
from .memory import planner, sysmem
from .memory.passcost import PassCost
from .memory.planner import Budgets, Plan
from .model import compiled
from .model.stack import InferenceState, Model, Observer
from .units import human

DEFAULT_MAX_CONTEXT = 4096
#: tokens per prefill piece: a long prompt is read in pieces carrying the state, so the
#: activations never grow with its length (a multiple of KDA's 16-token chunk)
PREFILL_CHUNK = 256


def max_piece(chunk: int = PREFILL_CHUNK) -> int:
    """The most tokens one forward pass reads (the plan sizes the activations for it)."""
    from .model.kda import CHUNK_MIN_T
    return chunk + CHUNK_MIN_T - 1


def check_prefill_chunk(chunk) -> int:
    """A piece must be whole KDA chunks and long enough for the chunked KDA form, so that
    every piece size gives the numbers of one pass."""
    from .model.kda import CHUNK, CHUNK_MIN_T
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not CHUNK_MIN_T <= chunk <= 1 << 16 or chunk % CHUNK:
        raise UsageError(f"--prefill-chunk must be a multiple of {CHUNK} (KDA's chunk) between {CHUNK_MIN_T} and "
                         f"{1 << 16}, got {chunk!r}.")
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


def check_ids(cfg: ModelConfig, ids) -> list[int]:
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(
            f"token id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:5]))} "
            f"{'are' if len(bad) > 1 else 'is'} outside this model's vocabulary (0..{cfg.vocab_size - 1}). "
            "Check the --ids list or the tokenizer it came from.")
    if not ids:
        raise UsageError("the prompt is empty: give at least one token.")
    return ids


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


def _zero_weights(layout, model_dir, allow: bool, say) -> None:
    """Sample the run's weights for zeros (k3.checkpoint.zeros): refuse, or with
    ``allow`` say so and go on."""
    from .checkpoint import zeros
    t0 = time.perf_counter()
    sel = zeros.load_selection(layout)
    found = zeros.scan(sel)
    say(f"zero-weight check: {len(sel)} weights sampled in {1000 * (time.perf_counter() - t0):.0f} ms")
    if found and allow:
        say("note: --allow-zero-weights: " + zeros.describe(found, model_dir))
    elif found:
        zeros.refuse(found, model_dir)


def _test_faults() -> dict:
    """Read failures injected for tests of the failure path, from K3_TEST_FAULT =
    "KIND:TARGET[:after=N]" (KIND eio|eof|short, TARGET experts|trunk). Not for users."""
    spec = env.test_fault()
    if not spec:
        return {}
    from .checkpoint.io import FaultHook
    parts = spec.split(":")
    if len(parts) < 2 or parts[1] not in ("experts", "trunk"):
        raise UsageError(f"K3_TEST_FAULT={spec!r}: expected KIND:experts|trunk[:after=N].")
    after = 0
    for p in parts[2:]:
        if p.startswith("after="):
            after = int(p[len("after="):])
    return {parts[1]: FaultHook(parts[0], after=after)}


class Engine:
    """A loaded model: config, weights (as the plan holds them), the plan, the tokenizer
    when the folder has one. Use :func:`load` to make one; close it (or use ``with``)."""

    def __init__(self, cfg, model: Model, provider, plan: Plan, tokenizer, model_dir, *, max_context: int,
                 load_seconds: float = 0.0, spec: int = 0, max_batch: int = 1, prefill_chunk: int = PREFILL_CHUNK):
        self.cfg = cfg
        self.model = model
        self.provider = provider
        self.plan = plan
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir)
        self.max_context = max_context
        self.load_seconds = load_seconds
        self.spec = spec  # the most drafted tokens per pass the plan holds
        self.max_batch = max_batch  # the most sequences decoded together the plan holds
        self.prefill_chunk = prefill_chunk  # tokens of a prompt one forward pass reads
        self.tokenizer_error = None  # why the folder's tokenizer could not be read, if it could not
        self.pipeline = None  # this process's k3.pipeline.Stage when it is one rank of several
        self.kernels = None  # what k3.warmup.ensure did at load (the jobs, which compiled, how long)
        self.pass_cost = None  # k3.memory.passcost.PassCost: what a pass of T tokens costs, learnt as it runs

    # ------------------------------------------------------------ conveniences
    @property
    def n_layers(self) -> int:
        return self.model.n_layers

    def new_state(self) -> InferenceState:
        """A fresh state whose KV caches have room for max_context positions."""
        return self.model.new_state(self.max_context)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer_error is not None:
            raise self.tokenizer_error
        if self.tokenizer is None:
            raise UsageError(f"{self.model_dir} has no tokenizer (tiktoken.model), so text prompts cannot be "
                             "tokenized; give token ids instead.")
        return self.tokenizer.encode(text)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return check_ids(self.cfg, ids)

    def sampling(self, *, temperature=None, top_p=None, top_k=None, seed=None, greedy=False):
        """Sampling settings (None = greedy) over the model's generation_config.json."""
        from .sampling import resolve
        return resolve(self.model_dir, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, greedy=greedy)

    # ------------------------------------------------------------ the decode loop
    def decode(self, feed: Sequence[int], *, state: InferenceState | None = None, incremental: bool = True,
               max_tokens: int, sampler=None, stop_ids=(), keep_logits: bool = False,
               observer: Observer | None = None, undo_on_interrupt: bool = False, spec: int = 0,
               spec_corpus=None) -> Iterator[Step]:
        """One sequence through the decode loop (a :class:`Batch` of one). ``feed``: the
        tokens to read before the first new one (the prompt; with ``state``, the tokens
        not yet in it). Incremental: ``state`` (a fresh one if None) is extended in place,
        and after the loop the last token is not yet in it (it is fed at the next call).
        Full recompute: the whole sequence is re-read every step. ``sampler``: a
        k3.sampling.Sampler (None = greedy). Stops after ``max_tokens`` or at a token of
        ``stop_ids`` (which is yielded). ``spec`` > 0: exact speculative decoding (see
        :class:`Batch`). A forward pass that fails (a read error, numbers that stop being
        finite: NumericError, naming the step and where) is undone before the error
        propagates, so ``state`` stays usable; with ``undo_on_interrupt``, so is one cut
        short by KeyboardInterrupt."""
        batch = Batch(self, observer=observer, undo_on_interrupt=undo_on_interrupt)
        req = batch.add(feed, state=state, incremental=incremental, max_tokens=max_tokens, sampler=sampler,
                        stop_ids=stop_ids, keep_logits=keep_logits, spec=spec, spec_corpus=spec_corpus)
        return self._steps(batch, req)  # a request refused above raises here, not at the first step

    @staticmethod
    def _steps(batch: "Batch", req: "Request") -> Iterator[Step]:
        while not req.finished:
            for _, steps in batch.step():
                yield from steps

    def batch(self, *, observer: Observer | None = None) -> "Batch":
        """A batch of sequences decoded together: add() them (now or between steps), then
        step() until none is active. One pass over the weights serves every sequence."""
        return Batch(self, observer=observer)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 16, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                 greedy: bool = False, sampling="default", incremental: bool = True,
                 state: InferenceState | None = None, stop_ids: Sequence[int] = (), stream: bool = True,
                 keep_logits: bool = False, observer: Observer | None = None, spec: int = 0,
                 spec_corpus=None):
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text, or token ids).

        Sampling: the arguments over the model's generation_config.json (greedy when it
        does not sample and none is given; ``greedy=True`` forces it), or settings
        already resolved (``sampling``: a SamplingSettings, or None for greedy).
        ``state`` continues an earlier sequence (incremental). ``spec`` drafts up to that
        many tokens per pass (exact speculative decoding, see :meth:`decode`;
        ``spec_corpus``: token ids, or a k3.spec.NgramIndex, to draft from too). With
        ``stream`` (default) this is an iterator of :class:`Step` (``step.text`` is the
        decoded piece); otherwise the whole :class:`Generation`."""
        ids = self.prompt_ids(prompt)
        settings = sampling if sampling != "default" else self.sampling(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, greedy=greedy)
        sampler = settings.sampler() if settings is not None else None
        if spec_corpus is not None and not hasattr(spec_corpus, "continuations"):
            from .spec import NgramIndex
            spec_corpus = NgramIndex(spec_corpus)
        steps = self._with_text(self.decode(ids, state=state, incremental=incremental, max_tokens=max_tokens,
                                            sampler=sampler, stop_ids=stop_ids, keep_logits=keep_logits,
                                            observer=observer, spec=spec, spec_corpus=spec_corpus))
        if stream:
            return steps
        done = list(steps)
        toks = [s.token for s in done]
        return Generation(ids, toks, self.tokenizer.decode(toks) if self.tokenizer is not None else None, done)

    def check_spec(self, spec: int) -> None:
        if spec > self.spec:
            raise UsageError(f"spec={spec} drafts more tokens per pass than the engine's memory plan holds "
                             f"(it was loaded with spec={self.spec}); load it with spec={spec} or more.")

    def check_length(self, prior: int, new: int, max_tokens: int) -> None:
        if max_tokens < 0:
            raise UsageError(f"max_tokens must be >= 0, got {max_tokens}.")
        n = prior + new + max_tokens
        if n > self.max_context:
            raise UsageError(
                f"this generation would hold {n} positions ({prior} earlier + {new} prompt + {max_tokens} new) but "
                f"the engine was loaded for max_context={self.max_context}: its memory plan covers that many. "
                "Load it with a larger max_context, or ask for fewer tokens.")

    def _with_text(self, steps: Iterator[Step]) -> Iterator[Step]:
        if self.tokenizer is None:
            yield from steps
            return
        from .tokenizer import StreamDecoder
        dec = StreamDecoder(self.tokenizer)
        for s in steps:
            s.text = dec.push(s.token)
            if s.finish is not None:
                s.text += dec.flush()
            yield s

    def chat(self, *, system: str | None = None, thinking: bool = True, thinking_effort: str | None = "max",
             fmt: str = "auto", sampling=None, max_tokens: int = 4096, max_context: int | None = None,
             spec: int = 0, spec_corpus=None):
        """A conversation on this engine (:class:`k3.chat.ChatSession`): ``send(text)``
        runs one turn on the same decode loop, carrying the state between turns."""
        from .chat import ChatSession
        from .chat_format import chat_format_for
        if self.tokenizer is None:
            raise UsageError(f"{self.model_dir} has no tokenizer (tiktoken.model): a chat needs one.")
        f = chat_format_for(self.tokenizer, self.cfg, thinking=thinking, thinking_effort=thinking_effort, kind=fmt)
        self.check_spec(spec)
        return ChatSession(self, f, system=system, sampling=sampling, max_tokens=max_tokens,
                           max_context=max_context or self.max_context, spec=spec, spec_corpus=spec_corpus)

    # ------------------------------------------------------------ reports and lifetime
    def stats(self) -> dict:
        """Whole-run statistics: the expert cache's and (when streamed) the trunk's."""
        p = self.provider
        return {"expert_cache": p.cache.stats(), "trunk": p.trunk.stats() if p.trunk is not None else {},
                "table_bytes_read": p.table_bytes()}

    def paths(self) -> dict:
        """Which way each layer runs (k3.model.compiled.describe): the compiled regions or
        the plain forward, which layers have which region, and how often each stage ran."""
        return compiled.describe(self.cfg, range(self.model.n_layers), self.model.fast)

    def counters(self) -> dict:
        """Cumulative I/O counters of the run (the decode loop reports their per-step
        deltas); in a pipeline, every rank's summed, plus the bytes sent between ranks."""
        c = self.provider.counters()
        if self.pipeline is None:
            return c
        c["net_bytes"] = self.pipeline.link.sent
        for rc in self.pipeline.remote.values():
            for k, v in rc.items():
                c[k] = c.get(k, 0) + v
        return c

    def serve_stage(self) -> int:
        """A pipeline rank other than 0: run this rank's layers for rank 0 until it says
        stop (k3.pipeline); returns the exit code."""
        try:
            return self.pipeline.serve(self.model, self.provider)
        finally:
            self.close()

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        self.provider.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    emitted: int = 0
    passes: int = 0
    finish: str | None = None  # "stop" or "length" once finished ("cancelled": taken out by Batch.remove)
    work: InferenceState | None = None  # full recompute: the re-read in progress
    drafts: list = field(default_factory=list)
    withheld: int = 0  # drafts of this pass not read
    tokens: list = field(default_factory=list)  # emitted so far
    carry: dict = field(default_factory=dict)  # time, tokens and I/O of passes that emitted nothing yet

    @property
    def finished(self) -> bool:
        return self.finish is not None


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
    (greedy: its argmax; sampling: exact speculative sampling), plus the model's own next
    token; the state is rolled back exactly to what it keeps. The tokens are those of
    plain decoding; a pass yields one Step per token it emits."""

    def __init__(self, engine: "Engine", *, observer: Observer | None = None, undo_on_interrupt: bool = False):
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
            spec_corpus=None) -> Request:
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
                      max_tokens, sampler, tuple(stop_ids), keep_logits, drafter)
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
        active = self.active
        if not active:
            return []
        eng = self.engine
        segments, blocks = [], []
        for r in active:
            if not r.incremental and not r.reading:  # full recompute: re-read the whole sequence
                r.work, r.reading = eng.model.new_state(len(r.seq)), list(r.seq)
            st = r.state if r.incremental else r.work
            piece = r.reading[:prefill_pieces(len(r.reading), eng.prefill_chunk)[0][1]]
            if self.observer is not None and (len(piece) < len(r.reading) or r.carry.get("fed")):
                done = r.carry.get("fed", 0)  # a prompt read in several passes: where it is
                self.observer.on_prefill(done, done + len(r.reading), len(piece))
            r.drafts, r.withheld = [], 0
            if r.drafter is not None and r.emitted and len(piece) == len(r.reading) == 1:
                r.drafts = r.drafter.propose(r.max_tokens - r.emitted - 1)
            blocks.append(piece)
            segments.append(st)
        self._weigh_drafts(active, blocks)
        for i, r in enumerate(active):
            blocks[i] = blocks[i] + r.drafts
            segments[i] = (blocks[i], segments[i])
        snaps = [st.snapshot() for _, st in segments]
        for r in active:
            if r.drafts:
                r.state.record(True)
        t0 = time.perf_counter()
        try:
            with pass_threads(sum(len(b) for b in blocks)):
                h = eng.model.hidden_batch(segments, self.observer)
                rows, where, at = [], [], 0
                for r, blk in zip(active, blocks):  # the rows whose logits are needed
                    at += len(blk)
                    done_reading = len(blk) - len(r.drafts) == len(r.reading)
                    if done_reading:
                        n = 1 + len(r.drafts)
                        where.append((len(rows), n))
                        rows.extend(range(at - n, at))
                    else:
                        where.append(None)
                logits = eng.model.logits(h[rows]) if rows else None
        except BaseException as e:
            undo = isinstance(e, K3Error) or (isinstance(e, KeyboardInterrupt) and self.undo_on_interrupt)
            for (_, st), snap, r in zip(segments, snaps, active):
                st.record(False)
                if undo:
                    st.restore(snap)
                st.release(snap)
            if isinstance(e, NumericError):
                raise NumericError(f"step {max(r.emitted for r in active)} "
                                   f"({sum(len(b) for b in blocks)} tokens read): {e}") from None
            raise
        out = []
        dt = time.perf_counter() - t0
        now = eng.counters()
        d = {k: now[k] - self._counters[k] for k in now}
        self._counters = now
        if eng.pass_cost is not None:
            eng.pass_cost.observe([len(b) for b in blocks], dt, d)
        for r, blk, w, snap in zip(active, blocks, where, snaps):
            r.reading = r.reading[len(blk) - len(r.drafts):]
            c = r.carry
            c["seconds"] = c.get("seconds", 0.0) + dt
            c["fed"] = c.get("fed", 0) + len(blk)
            for k, v in d.items():
                c[k] = c.get(k, 0) + v
            if w is None:  # still reading its prompt (or its sequence, in full recompute): counted at its next token
                continue
            r.carry = {}
            rr = logits[w[0]:w[0] + w[1]]
            toks, kept = self._pick(r, rr)
            stop = next((j for j, t in enumerate(toks) if t in r.stop_ids), None)
            if stop is not None:
                toks = toks[:stop + 1]  # the stop token is emitted, never fed
            if r.drafts:
                if len(toks) - 1 < len(r.drafts):  # drop what was read past the tokens kept
                    r.state.rollback(snap, len(toks))
                r.state.record(False)
            steps = []
            for j, tok in enumerate(toks):
                first = j == 0
                finish = "stop" if tok in r.stop_ids else "length" if r.emitted == r.max_tokens - 1 else None
                steps.append(Step(
                    r.emitted, tok, c["seconds"] if first else 0.0, fed=c["fed"] if first else 0,
                    bytes_read=(c["expert_bytes_read"] + c["trunk_bytes_read"] + c["table_bytes_read"])
                    if first else 0, expert_requests=c["expert_requests"] if first else 0,
                    expert_hits=c["expert_hits"] if first else 0,
                    expert_bytes_read=c["expert_bytes_read"] if first else 0,
                    trunk_bytes_read=c["trunk_bytes_read"] if first else 0,
                    table_bytes_read=c["table_bytes_read"] if first else 0,
                    net_bytes=c.get("net_bytes", 0) if first else 0,
                    io_seconds=c["expert_read_seconds"] + c["trunk_device_seconds"] if first else 0.0,
                    finish=finish, pass_index=r.passes, drafted=len(r.drafts) if first else 0,
                    accepted=kept if first else 0, withheld=r.withheld if first else 0, batch=len(active),
                    logits=rr[j].clone() if r.keep_logits or r.emitted == 0 else None))
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
            out.append((r, steps))
        for (_, st), snap in zip(segments, snaps):  # the pass is settled: its undo snapshots go
            st.release(snap)
        return out

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

    @staticmethod
    def _pick(r: Request, rows) -> tuple[list[int], int]:
        """The tokens a pass emits, and how many drafts it kept."""
        if not r.drafts:
            return [greedy(rows[-1]) if r.sampler is None else int(r.sampler(rows[-1]))], 0
        if r.sampler is not None:
            return r.sampler.verify(rows, r.drafts)
        kept = 0
        while kept < len(r.drafts) and greedy(rows[kept]) == r.drafts[kept]:
            kept += 1
        return r.drafts[:kept] + [greedy(rows[kept])], kept


def load(model_dir, *, preset: str = "auto", trunk=None, trunk_gb: float | str | None = None,
         cache_gb: float | None = None, trunk_ring: int = 2, ultra_low_memory: bool = False, io_threads: int = 4,
         budgets: Budgets | None = None, layers: int | None = None, threads: int | None = None, config=None,
         max_context: int = DEFAULT_MAX_CONTEXT, max_batch: int = 1, kv_cache: bool = True, trace: bool = False,
         kda_chunked: bool | None = None, spec: int = 0, kv: str = "latent", prefill_chunk: int | None = None,
         stage_gb: float | None = None, pipeline_timeout: float | None = None, log=None, progress=None,
         notice=None, compile_progress=None, allow_zero_weights: bool = False, model_dirs=()) -> Engine:
    """Open the model in ``model_dir`` within a memory plan and return an :class:`Engine`.

    Budgets: ``preset`` (a preset name or ``auto``), ``trunk`` (a packed-trunk folder
    from ``k3 pack-trunk``: stream the trunk), ``trunk_gb`` / ``cache_gb`` (override the
    preset), ``trunk_ring``, ``ultra_low_memory`` (stream the model tables),
    ``io_threads``; or a whole :class:`~k3.memory.planner.Budgets` as ``budgets``.
    ``max_context``: the most positions one sequence holds, ``max_batch``: the most
    sequences decoded together (the plan counts their KV caches and activations). ``kv``:
    the MLA KV cache form, "latent" (576 floats a position and layer for K3) or
    "expanded" (per head, 53x more; see k3.model.mla). ``prefill_chunk``: the tokens of
    a prompt one forward pass reads (a multiple of 16; the plan sizes the activations for
    it). ``stage_gb``: the memory this process may plan in (at most what is available).
    ``notice`` receives what must be shown at once (the kernels compiling, on a first
    run: default ``log``), ``compile_progress(done, total, label, seconds)`` each group
    of kernels compiled. Weights that read as zeros (an unfinished download,
    k3.checkpoint.zeros) are refused (exit 3) unless ``allow_zero_weights``. ``model_dirs``:
    more folders holding shards the index names (one per drive).
    Launched by torchrun as one of several processes, the model is split over them
    (k3.pipeline; ``pipeline_timeout`` seconds bound every wait for another rank): rank
    0 returns the engine to use, every other rank one whose :meth:`Engine.serve_stage`
    serves rank 0. ``layers`` runs only the
    first layers (not the full model). ``threads`` sets the compute threads (default:
    all cores). ``spec``: the most tokens speculative decoding will draft per pass (the
    plan holds what rolling a pass back needs). ``log`` receives progress messages (the
    plan, the choices made).

    The checkpoint is checked against its config, and the plan is printed to ``log`` and
    checked, before anything large is allocated: a plan that does not fit raises
    K3Error with the shortfall and the options."""
    from .checkpoint.io import ShardFiles
    from .checkpoint.layout import CheckpointLayout
    from .memory.streaming import StreamingWeights, model_sizes

    say = log or (lambda msg: None)
    if budgets is None:
        budgets = Budgets(preset=preset, trunk_gb=trunk_gb, cache_gb=cache_gb,
                          trunk=None if trunk is None else str(trunk), trunk_ring=trunk_ring,
                          ultra_low_memory=ultra_low_memory, io_threads=io_threads, stage_gb=stage_gb)
    budgets.check()
    if not Path(model_dir).is_dir():
        raise UsageError(f"{model_dir}: not a folder. Give the model folder (config.json + shards).")
    if threads is not None:
        set_threads(threads)
    sysmem.return_large_blocks()  # before the footprint is measured: RSS stays within the plan
    cfg = load_config(config if config is not None else model_dir)
    check_layers(cfg, layers)
    if int(max_context) < 1:
        raise UsageError(f"max_context must be >= 1, got {max_context}.")
    from .spec import MAX_DRAFT
    if not 0 <= spec <= MAX_DRAFT:
        raise UsageError(f"--spec takes 1..{MAX_DRAFT} drafted tokens per pass, got {spec}.")
    t0 = time.perf_counter()
    launch = env.launch()
    layout = CheckpointLayout.open(cfg, model_dir, layers, validate=launch is None, extra_dirs=tuple(model_dirs))
    say(f"indexed {len(layout.index)} tensors from {len(layout.index.shards())} shards in "
        f"{time.perf_counter() - t0:.2f} s")
    if launch is None:
        _zero_weights(layout, model_dir, allow_zero_weights, say)
    packed = None
    if budgets.trunk is not None:
        from .memory.trunk import PackedTrunk
        packed = PackedTrunk.open(budgets.trunk, cfg, layout.index)
    if int(max_batch) < 1:
        raise UsageError(f"max_batch must be >= 1, got {max_batch}.")
    if kv not in ("latent", "expanded"):
        raise UsageError(f"--kv is latent or expanded, got {kv!r}.")
    prefill_chunk = check_prefill_chunk(PREFILL_CHUNK if prefill_chunk is None else prefill_chunk)
    shape = dict(tokens=int(max_context) * int(max_batch), incremental=kv_cache,
                 prefill_tokens=max_piece(prefill_chunk) * int(max_batch), spec=spec, kv_latent=kv == "latent",
                 sequences=int(max_batch))
    if pipeline_timeout is not None and not (isinstance(pipeline_timeout, (int, float)) and 0 < pipeline_timeout < 1e7):
        raise UsageError(f"--pipeline-timeout must be a number of seconds > 0, got {pipeline_timeout}.")

    def measured_available() -> int:
        a = sysmem.meminfo()["MemAvailable"]
        return a if budgets.stage_gb is None else min(a, int(float(budgets.stage_gb) * 1e9))

    # The memory floor, before anything that could reach it is loaded or compiled: the
    # plan with the kernels' footprint estimated (the interpreter and libraries are
    # measured) must fit, or the run is refused now rather than killed while compiling.
    available = measured_available()
    floor = sysmem.baseline_bytes() + warmup.KERNELS_BYTES
    if launch is None:
        planner.plan(cfg, model_sizes(layout, packed), budgets, available=available, baseline=floor,
                     n_layers=layout.layer_ids, pin_order=env.pin_order(), **shape).check()
    elif available and floor > planner.PLAN_FRACTION * available:
        raise K3Error(f"REFUSING TO START: the interpreter, its libraries and k3's kernels need about {human(floor)} "
                      f"and the machine has {human(available)} available.")
    kernels = warmup.ensure(warmup.jobs_for(cfg, layout.layer_ids), available=available,
                            notice=notice or say, progress=compile_progress)
    available = measured_available()  # the compiled kernels now count in the footprint the plan measures
    baseline = sysmem.baseline_bytes()
    stage = None
    if launch is not None:
        from . import pipeline
        stage = pipeline.join(cfg, layout, packed, budgets, available=available, baseline=baseline, shape=shape,
                              timeout=pipeline.DEFAULT_TIMEOUT if pipeline_timeout is None else float(pipeline_timeout),
                              run={"max_context": int(max_context), "max_batch": int(max_batch), "spec": spec,
                                   "kv": kv, "prefill_chunk": prefill_chunk, "layers": layout.n_layers,
                                   "incremental": bool(kv_cache), "kda_chunked": kda_chunked})
        layout = CheckpointLayout(cfg, layout.index, stage.layers.stop, stage.layers.start)
        layout.validate()
        _zero_weights(layout, model_dir, allow_zero_weights, say)
    try:
        sizes = model_sizes(layout, packed, tables=stage is None or stage.rank == 0)
        plan = planner.plan(cfg, sizes, budgets, available=available, baseline=baseline,
                            n_layers=layout.layer_ids, pin_order=env.pin_order(), **shape)
        for n in plan.notes:
            say(n)
        say(plan.render())
        if stage is None:
            plan.check()
        else:
            try:
                plan.check()
                refusal = None
            except K3Error as e:
                refusal = e
            stage.share_plans(pipeline.plan_info(stage, plan, sizes, refusal))
            say(stage.render(cfg))
        if plan.trunk is not None and plan.trunk.message:
            say(plan.trunk.message)
        t0 = time.perf_counter()
        faults = _test_faults()
        provider = StreamingWeights(layout, plan, packed, trace=trace, reader=ShardFiles(),
                                    expert_reader=ShardFiles(hook=faults.get("experts")),
                                    trunk_reader=ShardFiles(hook=faults.get("trunk")), progress=progress,
                                    tables=stage is None or stage.rank == 0)
        tokenizer = tok_error = None
        if (Path(model_dir) / "tiktoken.model").is_file():
            from .tokenizer import Tokenizer
            try:
                tokenizer = Tokenizer(model_dir)
                if tokenizer.vocab_size > cfg.vocab_size:
                    raise UsageError(
                        f"{Path(model_dir) / 'tiktoken.model'}: the tokenizer has {tokenizer.vocab_size} ids (with its "
                        f"256 specials) but the model's vocab_size is {cfg.vocab_size}; they do not belong together. "
                        "Use the tokenizer files of this checkpoint.")
            except K3Error as e:  # token ids still work; text needs it, and says why not
                tokenizer, tok_error = None, e
        if stage is not None and stage.rank == 0:
            model = pipeline.PipelineModel(stage, provider, kda_chunked=kda_chunked, kv_latent=kv == "latent")
        else:
            model = Model(provider, n_layers=layout.n_layers if stage is not None else layers, kda_chunked=kda_chunked,
                          kv_latent=kv == "latent")
        eng = Engine(cfg, model, provider, plan, tokenizer, model_dir, max_context=int(max_context),
                     load_seconds=time.perf_counter() - t0, spec=spec, max_batch=int(max_batch),
                     prefill_chunk=prefill_chunk)
        eng.tokenizer_error = tok_error
        eng.kernels = kernels
        shape = planner.pass_shape(sizes, plan.trunk, plan.cache_slots, plan.stream_tables)
        if stage is not None:  # the counters it learns from are every rank's: so are the MoE layers
            n = layers or cfg.num_hidden_layers
            shape = dataclasses.replace(shape, moe_layers=sum(1 for i in range(n) if cfg.is_moe(i)))
        eng.pass_cost = PassCost(shape)
        if stage is not None:
            eng.pipeline = stage
            if stage.rank == 0:
                stage.start_heartbeat()
        say(compiled.summary(eng.paths()))
        if provider.trunk is not None:
            say(f"trunk streaming from {budgets.trunk}: {plan.trunk.describe()}")
        else:
            say(f"resident trunk: {human(provider.resident_trunk_bytes)} in RAM (as stored: BF16/F32)")
    except BaseException:
        if stage is not None:  # the other ranks stop too, not at their timeout
            stage.close()
        raise
    return eng
