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

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from . import env
from .config import ModelConfig, load_config
from .errors import K3Error, NumericError, UsageError
from .memory import planner, sysmem
from .memory.planner import Budgets, Plan
from .model.stack import InferenceState, Model, Observer
from .units import human

DEFAULT_MAX_CONTEXT = 4096
#: tokens per prefill piece: a long prompt is read in pieces carrying the state, so the
#: activations never grow with its length (a multiple of KDA's 16-token chunk)
PREFILL_CHUNK = 256


def max_piece() -> int:
    """The most tokens one forward pass reads (the plan sizes the activations for it)."""
    from .model.kda import CHUNK_MIN_T
    return PREFILL_CHUNK + CHUNK_MIN_T - 1


def prefill_pieces(n: int) -> list[tuple[int, int]]:
    """[a, b) pieces of a prefill of n tokens: PREFILL_CHUNK each, and a tail shorter than
    the chunked-KDA threshold joins the piece before it, so that every piece takes the
    KDA form, and the chunk boundaries, that one pass over all n tokens would."""
    from .model.kda import CHUNK_MIN_T
    cuts = list(range(0, n, PREFILL_CHUNK)) + [n]
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
    io_seconds: float = 0.0  # device time of the reads (they overlap compute)
    finish: str | None = None  # on the last step: "stop" (a stop token) or "length"
    pass_index: int = 0  # the weight pass that produced it (one pass emits several tokens with --spec)
    drafted: int = 0  # speculative decoding, on a pass's first token: tokens drafted and accepted in that pass
    accepted: int = 0
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

    from .quant import max_threads, set_num_threads
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n < 1:
        raise UsageError(f"--threads must be >= 1, got {n}.")
    n = min(int(n), max_threads())
    torch.set_num_threads(n)
    set_num_threads(n)
    return n


def warm_kernels() -> None:
    """Run each numba kernel once on tiny inputs (loads it from the cache, or compiles it
    on a fresh install): their code then counts in the RSS the plan measures."""
    from .quant import bf16_linear, mxfp4_linear
    w = torch.zeros(2, 64, dtype=torch.bfloat16)
    p, sc = torch.zeros(2, 32, dtype=torch.uint8), torch.full((2, 2), 127, dtype=torch.uint8)
    for t in (1, 3):
        x = torch.zeros(t, 64)
        bf16_linear(x, w)
        mxfp4_linear(x, p, sc)


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
                 load_seconds: float = 0.0, spec: int = 0):
        self.cfg = cfg
        self.model = model
        self.provider = provider
        self.plan = plan
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir)
        self.max_context = max_context
        self.load_seconds = load_seconds
        self.spec = spec  # the most drafted tokens per pass the plan holds
        self.tokenizer_error = None  # why the folder's tokenizer could not be read, if it could not

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
        """THE decode loop. ``feed``: the tokens to read before the first new one (the
        prompt; with ``state``, the tokens not yet in it). Incremental: ``state`` (a fresh
        one if None) is extended in place, and after the loop the last token is not yet in
        it (it is fed at the next call). Full recompute: the whole sequence (``state``'s
        ids + ``feed``) is re-read every step. ``sampler``: a k3.sampling.Sampler (None =
        greedy). Stops after ``max_tokens`` or at a token of ``stop_ids`` (which is
        yielded). A forward pass that fails (a read error, numbers that stop being finite:
        NumericError, naming the step and where) is undone before the error propagates,
        so ``state`` stays usable; with ``undo_on_interrupt``, so is one cut short by
        KeyboardInterrupt.

        ``spec`` > 0: exact speculative decoding (incremental only). Each pass after the
        prefill reads [last token + up to ``spec`` drafted tokens] (k3.spec: the sequence's
        own n-grams, then ``spec_corpus``'s) and keeps the longest prefix the model agrees
        with (greedy: its argmax; sampling: exact speculative sampling), plus the model's
        own next token; the state is rolled back exactly to what it keeps. The tokens are
        those of plain greedy decoding; each pass yields one Step per token it emits."""
        feed = list(feed)
        if spec and not incremental:
            raise UsageError("--spec drafts tokens and rolls the carried state back to the ones kept: it needs "
                             "incremental decoding (drop --full-recompute).")
        if incremental and state is None:
            state = self.new_state()
        seq = (list(state.ids) if state is not None else []) + feed
        pending = feed
        counters = self.provider.counters()
        drafter = None
        if spec:
            from .spec import Drafter
            drafter = Drafter(seq, spec, spec_corpus)
        n = 0  # tokens emitted
        npass = 0
        while n < max_tokens:
            drafts = drafter.draft()[:max_tokens - n - 1] if drafter is not None and n else []
            block = pending + drafts
            t0 = time.perf_counter()
            snap0 = state.snapshot() if incremental else None
            snap = snap0 if undo_on_interrupt else None
            if drafts:  # verification reads every position; the KDA inputs are kept for the rollback
                state.record(True)
            try:
                if drafts:
                    logits = self.model.forward(block, state, last_only=False, observer=observer)
                elif incremental:
                    logits = self._forward(block, state, observer)
                else:  # the whole sequence from nothing (its KV cache lives for this step only)
                    logits = self._forward(seq, self.model.new_state(len(seq)), observer)
            except KeyboardInterrupt:
                if snap is not None:
                    state.restore(snap)
                if drafts:
                    state.record(False)
                raise
            except K3Error as e:  # a failed read or non-finite numbers: the pass is undone, nothing yielded
                if incremental:
                    state.restore(snap0)
                    state.record(False)
                if isinstance(e, NumericError):
                    raise NumericError(f"step {n} ({len(block) if incremental else len(seq)} tokens read): "
                                       f"{e}") from None
                raise
            rows = logits.reshape(-1, logits.shape[-1]) if drafts else logits.reshape(1, -1)
            if not drafts:
                toks, kept = [greedy(rows[0]) if sampler is None else int(sampler(rows[0]))], 0
            elif sampler is None:
                kept = 0
                while kept < len(drafts) and greedy(rows[kept]) == drafts[kept]:
                    kept += 1
                toks = drafts[:kept] + [greedy(rows[kept])]
            else:
                toks, kept = sampler.verify(rows, drafts)
            stop = next((j for j, t in enumerate(toks) if t in stop_ids), None)
            if stop is not None:
                toks = toks[:stop + 1]  # the stop token is emitted, never fed
            if drafts:
                if len(toks) - 1 < len(drafts):  # drop what was read past the tokens kept
                    state.rollback(snap0, len(toks))
                state.record(False)
            dt = time.perf_counter() - t0
            now = self.provider.counters()
            d = {k: now[k] - counters[k] for k in now}
            counters = now
            fed = len(block) if incremental else len(seq)
            for j, tok in enumerate(toks):
                first = j == 0
                finish = "stop" if tok in stop_ids else "length" if n == max_tokens - 1 else None
                yield Step(n, tok, dt if first else 0.0, fed=fed if first else 0,
                           bytes_read=(d["expert_bytes_read"] + d["trunk_bytes_read"] + d["table_bytes_read"])
                           if first else 0,
                           expert_requests=d["expert_requests"] if first else 0,
                           expert_hits=d["expert_hits"] if first else 0,
                           expert_bytes_read=d["expert_bytes_read"] if first else 0,
                           trunk_bytes_read=d["trunk_bytes_read"] if first else 0,
                           table_bytes_read=d["table_bytes_read"] if first else 0,
                           io_seconds=d["expert_read_seconds"] + d["trunk_device_seconds"] if first else 0.0,
                           finish=finish, pass_index=npass, drafted=len(drafts) if first else 0,
                           accepted=kept if first else 0,
                           logits=rows[j].clone() if keep_logits or n == 0 else None)
                n += 1
                if finish is not None:
                    return
            seq += toks
            pending = toks[-1:]
            if drafter is not None:
                drafter.extend(toks)
            npass += 1

    def _forward(self, ids: list[int], state: InferenceState, observer) -> torch.Tensor:
        """The last token's logits after reading ids into state, in prefill pieces."""
        pieces = prefill_pieces(len(ids))
        for a, b in pieces[:-1]:
            self.model.hidden(ids[a:b], state, observer)
        a, b = pieces[-1]
        return self.model.forward(ids[a:b], state, observer=observer)

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
        self.check_length(len(state.ids) if state is not None else 0, len(ids), max_tokens)
        if spec_corpus is not None and not hasattr(spec_corpus, "continuations"):
            from .spec import NgramIndex
            spec_corpus = NgramIndex(spec_corpus)
        self.check_spec(spec)
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
             fmt: str = "auto", sampling=None, max_tokens: int = 4096, max_context: int | None = None):
        """A conversation on this engine (:class:`k3.chat.ChatSession`): ``send(text)``
        runs one turn on the same decode loop, carrying the state between turns."""
        from .chat import ChatSession
        from .chat_format import chat_format_for
        if self.tokenizer is None:
            raise UsageError(f"{self.model_dir} has no tokenizer (tiktoken.model): a chat needs one.")
        f = chat_format_for(self.tokenizer, self.cfg, thinking=thinking, thinking_effort=thinking_effort, kind=fmt)
        return ChatSession(self, f, system=system, sampling=sampling, max_tokens=max_tokens,
                           max_context=max_context or self.max_context)

    # ------------------------------------------------------------ reports and lifetime
    def stats(self) -> dict:
        """Whole-run statistics: the expert cache's and (when streamed) the trunk's."""
        p = self.provider
        return {"expert_cache": p.cache.stats(), "trunk": p.trunk.stats() if p.trunk is not None else {},
                "table_bytes_read": p.table_bytes()}

    def close(self) -> None:
        self.provider.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(model_dir, *, preset: str = "auto", trunk=None, trunk_gb: float | str | None = None,
         cache_gb: float | None = None, trunk_ring: int = 2, ultra_low_memory: bool = False, io_threads: int = 4,
         budgets: Budgets | None = None, layers: int | None = None, threads: int | None = None, config=None,
         max_context: int = DEFAULT_MAX_CONTEXT, kv_cache: bool = True, trace: bool = False,
         kda_chunked: bool | None = None, spec: int = 0, log=None, progress=None) -> Engine:
    """Open the model in ``model_dir`` within a memory plan and return an :class:`Engine`.

    Budgets: ``preset`` (a preset name or ``auto``), ``trunk`` (a packed-trunk folder
    from ``k3 pack-trunk``: stream the trunk), ``trunk_gb`` / ``cache_gb`` (override the
    preset), ``trunk_ring``, ``ultra_low_memory`` (stream the model tables),
    ``io_threads``; or a whole :class:`~k3.memory.planner.Budgets` as ``budgets``.
    ``max_context``: the most positions one sequence holds (the plan counts its KV
    cache, unless ``kv_cache`` is False: full recompute only). ``layers`` runs only the
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
                          ultra_low_memory=ultra_low_memory, io_threads=io_threads)
    budgets.check()
    if not Path(model_dir).is_dir():
        raise UsageError(f"{model_dir}: not a folder. Give the model folder (config.json + shards).")
    if threads is not None:
        set_threads(threads)
    cfg = load_config(config if config is not None else model_dir)
    if layers is not None and not 1 <= layers <= cfg.num_hidden_layers:
        raise UsageError(f"--layers must be in 1..{cfg.num_hidden_layers} for this model, got {layers}.")
    if int(max_context) < 1:
        raise UsageError(f"max_context must be >= 1, got {max_context}.")
    from .spec import MAX_DRAFT
    if not 0 <= spec <= MAX_DRAFT:
        raise UsageError(f"--spec takes 1..{MAX_DRAFT} drafted tokens per pass, got {spec}.")
    t0 = time.perf_counter()
    layout = CheckpointLayout.open(cfg, model_dir, layers)
    say(f"indexed {len(layout.index)} tensors from {len(layout.index.shards())} shards in "
        f"{time.perf_counter() - t0:.2f} s")
    packed = None
    if budgets.trunk is not None:
        from .memory.trunk import PackedTrunk
        packed = PackedTrunk.open(budgets.trunk, cfg, layout.index)
    sizes = model_sizes(layout, packed)
    warm_kernels()  # the compiled kernels then count in the footprint the plan measures
    plan = planner.plan(cfg, sizes, budgets, tokens=int(max_context), incremental=kv_cache,
                        available=sysmem.meminfo()["MemAvailable"], baseline=sysmem.baseline_bytes(),
                        n_layers=layout.n_layers, pin_order=env.pin_order(), prefill_tokens=max_piece(), spec=spec)
    for n in plan.notes:
        say(n)
    say(plan.render())
    plan.check()
    if plan.trunk is not None and plan.trunk.message:
        say(plan.trunk.message)
    t0 = time.perf_counter()
    faults = _test_faults()
    provider = StreamingWeights(layout, plan, packed, trace=trace, reader=ShardFiles(),
                                expert_reader=ShardFiles(hook=faults.get("experts")),
                                trunk_reader=ShardFiles(hook=faults.get("trunk")), progress=progress)
    tokenizer = tok_error = None
    if (Path(model_dir) / "tiktoken.model").is_file():
        from .tokenizer import Tokenizer
        try:
            tokenizer = Tokenizer(model_dir)
        except K3Error as e:  # token ids still work; text needs it, and says why not
            tok_error = e
    model = Model(provider, n_layers=layers, kda_chunked=kda_chunked)
    eng = Engine(cfg, model, provider, plan, tokenizer, model_dir, max_context=int(max_context),
                 load_seconds=time.perf_counter() - t0, spec=spec)
    eng.tokenizer_error = tok_error
    if provider.trunk is not None:
        say(f"trunk streaming from {budgets.trunk}: {plan.trunk.describe()}")
    else:
        say(f"resident trunk: {human(provider.resident_trunk_bytes)} in RAM (as stored: BF16/F32)")
    return eng
