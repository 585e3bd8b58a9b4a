"""The engine: a model loaded within a memory plan (:func:`k3.loader.load` makes one),
the facade every front end (`k3 run`, `k3 chat`, the benchmarks, the Python API) drives.

    import k3
    with k3.load("path/to/model", preset="auto") as eng:
        for step in eng.generate("The capital of France is", max_tokens=16):
            print(step.text, end="", flush=True)

:meth:`Engine.decode` runs one sequence through the decode loop (:class:`k3.decode.Batch`):
prefill, then one token per step, incremental (KDA state and MLA KV cache carried) or
full recompute; it yields one :class:`k3.decode.Step` per token with its timing and
what it read. :meth:`Engine.generate` adds prompts as text, sampling settings and text
pieces; :meth:`Engine.chat` opens a conversation (:class:`k3.chat.ChatSession`) on the
same loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from .config import ModelConfig
from .decode import PREFILL_CHUNK, Batch, Generation, Request, Step
from .errors import UsageError
from .memory.planner import Plan
from .model import compiled
from .model.stack import InferenceState, Model, Observer


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


class Engine:
    """A loaded model: config, weights (as the plan holds them), the plan, the tokenizer
    when the folder has one. Use :func:`k3.loader.load` to make one; close it (or use ``with``)."""

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
        self.prefill_plan = None  # k3.memory.prefill.PrefillPlan: the piece the plan chose, what a prompt reads
        self.prompt_cache = None  # k3.prompt_cache.PromptCache: decode() continues prompts from it (open_prompt_cache)

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
        short by KeyboardInterrupt. With a prompt cache (:meth:`open_prompt_cache`), a new
        sequence (no ``state``, or an empty one, which then holds what it continues from)
        starts from the longest kept prefix of ``feed``, and its prefill leaves snapshots
        (at its message boundaries where ``feed`` is a k3.prompt_cache.Prompt, else at its end)."""
        batch = Batch(self, observer=observer, undo_on_interrupt=undo_on_interrupt)
        cache, hit = self.prompt_cache, None
        if cache is not None and incremental and (state is None or not state.ids):   # a new sequence
            self.check_length(0, len(feed), max_tokens)
            hit = cache.lookup(feed, self.max_context)
            if hit is not None:   # continued from the longest kept prefix (a caller's empty state now holds it)
                if state is None:
                    state = hit.state
                else:
                    state.layers, state.ids = hit.state.layers, hit.state.ids
        req = batch.add(feed[hit.cached:] if hit else feed, state=state, incremental=incremental,
                        max_tokens=max_tokens, sampler=sampler, stop_ids=stop_ids, keep_logits=keep_logits, spec=spec,
                        spec_corpus=spec_corpus)
        if cache is not None:  # a prompt without message boundaries: its end is one (the next one may extend it)
            cache.attach(req, hit, getattr(feed, "boundaries", ()) or (len(feed),))
        return self._steps(batch, req)  # a request refused above raises here, not at the first step

    def open_prompt_cache(self, folder=None, *, max_bytes: int = 0, memory_entries: int = 0, memory_bytes: int = 0,
                          warn=None):
        """The engine's prompt cache (k3.prompt_cache): a memory tier of ``memory_entries``
        states within ``memory_bytes``, and with ``folder`` a disk tier within
        ``max_bytes`` (``warn``: prints its one-line warnings). decode() then continues
        every new sequence from it; returns it."""
        from .model.kda import CHUNK, CHUNK_MIN_T
        from .prompt_cache import SNAPSHOT_EVERY, SNAPSHOT_GRID, MemoryTier, PromptCache
        from .prompt_cache.disk import DiskTier, checkpoint_identity
        if self.pipeline is not None and folder is not None:
            raise UsageError("--prompt-cache is for one process: under torchrun each rank holds only its layers' "
                             "part of the state. Run without torchrun to use a prompt cache.")
        disk, warn = None, warn or (lambda msg: None)
        if folder is not None:
            ident = checkpoint_identity(self.model_dir, self.cfg, self.n_layers, self.model.kv_latent)
            disk = DiskTier(folder, ident, self.cfg, self.n_layers, self.model.kv_latent, max_bytes, warn)
        memory = MemoryTier(memory_entries, memory_bytes) if memory_entries > 0 else None
        assert SNAPSHOT_GRID % CHUNK == 0
        # a snapshot every pass of a long span: each point cuts a pass, and a pass at K3's
        # ratio reads nearly the whole pool, so the points between message ends fall where
        # the plan's pieces end anyway
        every = max(SNAPSHOT_EVERY, -(-self.prefill_chunk // SNAPSHOT_GRID) * SNAPSHOT_GRID)
        self.prompt_cache = PromptCache(memory, disk, grid=SNAPSHOT_GRID, min_rest=CHUNK_MIN_T, every=every,
                                        warn=warn)
        return self.prompt_cache

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
        return compiled.describe(self.cfg, range(self.model.n_layers), self.model.fast, self.model.plain_because)

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
