"""Opening a model: :func:`load` reads the config, checks the checkpoint, sizes the
memory plan (and refuses one that does not fit) before anything large is allocated,
then opens the weights as the plan says and returns a :class:`k3.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from . import env, interrupt, warmup
from .config import check_layers, load_config
from .decode import PREFILL_CHUNK, check_prefill_chunk, max_piece, set_threads
from .engine import Engine
from .errors import K3Error, UsageError
from .memory import planner, prefill, sysmem
from .memory.passcost import PassCost
from .memory.planner import Budgets
from .model import compiled
from .model.stack import Model
from .units import human

DEFAULT_MAX_CONTEXT = 4096


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


def _measured_available(budgets: Budgets) -> int:
    """The memory this process may plan in: what the machine has available now, at most
    ``stage_gb``."""
    a = sysmem.meminfo()["MemAvailable"]
    return a if budgets.stage_gb is None else min(a, int(float(budgets.stage_gb) * 1e9))


def _show_and_check(plan, sizes, cfg, stage, say) -> None:
    """Print the plan to ``say``, then refuse it (K3Error) if it does not fit. In a
    pipeline the ranks share their plans first, so that a plan refused on any rank
    stops every rank, naming it; then the pipeline's table is printed."""
    for n in plan.notes:
        say(n)
    say(plan.render())
    if stage is None:
        plan.check()
    else:
        from . import pipeline
        try:
            plan.check()
            refusal = None
        except K3Error as e:
            refusal = e
        stage.share_plans(pipeline.plan_info(stage, plan, sizes, refusal))
        say(stage.render(cfg))
    if plan.trunk is not None and plan.trunk.message:
        say(plan.trunk.message)


def _open_tokenizer(model_dir, cfg) -> tuple:
    """The folder's tokenizer (None without tiktoken.model), and the K3Error that kept
    it from opening, if one did: token ids still work then; text needs it, and says why
    not."""
    if not (Path(model_dir) / "tiktoken.model").is_file():
        return None, None
    from .tokenizer import Tokenizer
    try:
        tokenizer = Tokenizer(model_dir)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise UsageError(
                f"{Path(model_dir) / 'tiktoken.model'}: the tokenizer has {tokenizer.vocab_size} ids (with its "
                f"256 specials) but the model's vocab_size is {cfg.vocab_size}; they do not belong together. "
                "Use the tokenizer files of this checkpoint.")
    except K3Error as e:
        return None, e
    return tokenizer, None


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


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What :func:`load` takes besides the folder and the callbacks.

    The memory plan: ``preset`` (a preset name or ``auto``), ``trunk`` (a packed-trunk
    folder from ``k3 pack-trunk``: stream the trunk), ``trunk_gb`` / ``cache_gb``
    (override the preset), ``trunk_ring``, ``ultra_low_memory`` (stream the model
    tables), ``io_threads``, ``stage_gb`` (the memory this process may plan in, at most
    what is available); or a whole :class:`~k3.memory.planner.Budgets` as ``budgets``.

    What the plan holds: ``max_context``, the most positions one sequence holds;
    ``max_batch``, the most sequences decoded together (the plan counts their KV caches
    and activations); ``kv_cache`` (False: every step recomputes the whole sequence);
    ``kv``, the MLA KV cache form, "latent" (576 floats a position and layer for K3) or
    "expanded" (per head, 53x more; see k3.model.mla); ``prefill_chunk``, the tokens of a
    prompt one forward pass reads (a multiple of 32; None: the plan chooses it,
    k3.memory.prefill); ``spec``, the most tokens speculative decoding drafts per pass
    (the plan holds what rolling a pass back needs).

    The model: ``config`` (a config other than the folder's), ``layers`` (only the
    first layers: not the full model), ``model_dirs`` (more folders holding shards the
    index names, one per drive), ``allow_zero_weights`` (weights that read as zeros, an
    unfinished download, are refused with exit 3 unless this is set),
    ``kda_chunked``.

    The run: ``threads`` (the compute threads; default all cores), ``trace`` (record
    the expert cache's trace), ``pipeline_timeout`` (seconds that bound every wait for
    another rank when launched by torchrun)."""

    preset: str = "auto"
    trunk: object = None
    trunk_gb: float | str | None = None
    cache_gb: float | None = None
    trunk_ring: int = 2
    ultra_low_memory: bool = False
    io_threads: int = 4
    stage_gb: float | None = None
    budgets: Budgets | None = None
    max_context: int = DEFAULT_MAX_CONTEXT
    max_batch: int = 1
    kv_cache: bool = True
    kv: str = "latent"
    prefill_chunk: int | None = None
    spec: int = 0
    config: object = None
    layers: int | None = None
    model_dirs: tuple = ()
    allow_zero_weights: bool = False
    kda_chunked: bool | None = None
    threads: int | None = None
    trace: bool = False
    pipeline_timeout: float | None = None

    def plan_budgets(self) -> Budgets:
        """``budgets``, else the Budgets the preset and overrides make."""
        if self.budgets is not None:
            return self.budgets
        return Budgets(preset=self.preset, trunk_gb=self.trunk_gb, cache_gb=self.cache_gb,
                       trunk=None if self.trunk is None else str(self.trunk), trunk_ring=self.trunk_ring,
                       ultra_low_memory=self.ultra_low_memory, io_threads=self.io_threads, stage_gb=self.stage_gb)


@dataclasses.dataclass
class _Opening:
    """What the steps of :func:`load` hand on to one another."""
    model_dir: object
    opts: LoadOptions
    budgets: Budgets
    cfg: object
    say: object
    layout: object = None
    packed: object = None
    prefill_chunk: int = 0
    auto_piece: bool = True
    shape: dict | None = None
    kernels: dict | None = None
    available: int = 0  # measured once the kernels are loaded: they count in the footprint
    baseline: int = 0
    stage: object = None


def load(model_dir, options: LoadOptions | None = None, *, log=None, progress=None, notice=None,
         compile_progress=None, **fields) -> Engine:
    """Open the model in ``model_dir`` within a memory plan and return an :class:`Engine`.

    ``options``: a :class:`LoadOptions` (the budgets, the context, the speculation, the
    threads); its fields may also be given as keywords (``load(d, max_context=64)``),
    which override ``options``'. ``log`` receives progress messages (the plan, the
    choices made); ``notice`` what must be shown at once (the kernels compiling, on a
    first run: default ``log``); ``compile_progress(done, total, label, seconds)`` each
    group of kernels compiled; ``progress(i)`` each layer loaded.

    The checkpoint is checked against its config, and the plan is printed to ``log`` and
    checked, before anything large is allocated: a plan that does not fit raises
    K3Error with the shortfall and the options. Launched by torchrun as one of several
    processes, the model is split over them (k3.pipeline): rank 0 returns the engine to
    use, every other rank one whose :meth:`Engine.serve_stage` serves rank 0."""
    opts = dataclasses.replace(options or LoadOptions(), **fields)
    say = log or (lambda msg: None)
    o = _checked_options(model_dir, opts, say)
    _open_layout(o)
    _kernels_ready(o, notice or say, compile_progress)
    try:
        _join_pipeline(o)
        return _open_engine(o, progress)
    except BaseException:
        if o.stage is not None:  # the other ranks stop too, not at their timeout
            o.stage.close()
        raise


def _checked_options(model_dir, opts: LoadOptions, say) -> _Opening:
    """The options checked (the budgets, the folder, the layers, the context, the
    speculation), the threads set, the config read."""
    budgets = opts.plan_budgets()
    budgets.check()
    if not Path(model_dir).is_dir():
        raise UsageError(f"{model_dir}: not a folder. Give the model folder (config.json + shards).")
    if opts.threads is not None:
        set_threads(opts.threads)
    sysmem.return_large_blocks()  # before the footprint is measured: RSS stays within the plan
    cfg = load_config(opts.config if opts.config is not None else model_dir)
    check_layers(cfg, opts.layers)
    if int(opts.max_context) < 1:
        raise UsageError(f"max_context must be >= 1, got {opts.max_context}.")
    from .spec import MAX_DRAFT
    if not 0 <= opts.spec <= MAX_DRAFT:
        raise UsageError(f"--spec takes 1..{MAX_DRAFT} drafted tokens per pass, got {opts.spec}.")
    return _Opening(model_dir, opts, budgets, cfg, say)


def _open_layout(o: _Opening) -> None:
    """The checkpoint's index checked against the config (and its weights sampled for
    zeros), the packed trunk opened, the plan's shape of the run."""
    from .checkpoint.layout import CheckpointLayout
    opts = o.opts
    t0 = time.perf_counter()
    launch = env.launch()
    o.layout = CheckpointLayout.open(o.cfg, o.model_dir, opts.layers, validate=launch is None,
                                     extra_dirs=tuple(opts.model_dirs))
    o.say(f"indexed {len(o.layout.index)} tensors from {len(o.layout.index.shards())} shards in "
          f"{time.perf_counter() - t0:.2f} s")
    if launch is None:
        _zero_weights(o.layout, o.model_dir, opts.allow_zero_weights, o.say)
    if o.budgets.trunk is not None:
        from .memory.trunk import PackedTrunk
        o.packed = PackedTrunk.open(o.budgets.trunk, o.cfg, o.layout.index)
    if int(opts.max_batch) < 1:
        raise UsageError(f"max_batch must be >= 1, got {opts.max_batch}.")
    if opts.kv not in ("latent", "expanded"):
        raise UsageError(f"--kv is latent or expanded, got {opts.kv!r}.")
    o.auto_piece = opts.prefill_chunk is None  # the plan widens the piece (k3.memory.prefill)
    o.prefill_chunk = check_prefill_chunk(PREFILL_CHUNK if opts.prefill_chunk is None else opts.prefill_chunk)
    o.shape = dict(tokens=int(opts.max_context) * int(opts.max_batch), incremental=opts.kv_cache,
                   prefill_tokens=max_piece(o.prefill_chunk) * int(opts.max_batch), spec=opts.spec,
                   kv_latent=opts.kv == "latent", sequences=int(opts.max_batch))
    pt = opts.pipeline_timeout
    if pt is not None and not (isinstance(pt, (int, float)) and 0 < pt < 1e7):
        raise UsageError(f"--pipeline-timeout must be a number of seconds > 0, got {pt}.")


def _kernels_ready(o: _Opening, notice, compile_progress) -> None:
    """The memory floor checked before anything that could reach it is loaded or
    compiled (the plan with the kernels' footprint estimated; the interpreter and
    libraries are measured): a run is refused now rather than killed while compiling.
    Then the kernels the model needs, compiled on a first run (k3.warmup)."""
    from .memory.streaming import model_sizes
    available = _measured_available(o.budgets)
    floor = sysmem.baseline_bytes() + warmup.KERNELS_BYTES
    if env.launch() is None:
        planner.plan(o.cfg, model_sizes(o.layout, o.packed), o.budgets, available=available, baseline=floor,
                     n_layers=o.layout.layer_ids, pin_order=env.pin_order(), **o.shape).check()
    elif available and floor > planner.PLAN_FRACTION * available:
        raise K3Error(f"REFUSING TO START: the interpreter, its libraries and k3's kernels need about {human(floor)} "
                      f"and the machine has {human(available)} available.")
    o.kernels = warmup.ensure(warmup.jobs_for(o.cfg, o.layout.layer_ids), available=available,
                              notice=notice, progress=compile_progress)
    interrupt.check()  # a signal is acted on between load stages (k3.interrupt)
    o.available = _measured_available(o.budgets)
    o.baseline = sysmem.baseline_bytes()


def _join_pipeline(o: _Opening) -> None:
    """Under torchrun: this rank's stage of the pipeline, and the layers it holds."""
    from .checkpoint.layout import CheckpointLayout
    if env.launch() is None:
        return
    from . import pipeline
    opts = o.opts
    o.stage = pipeline.join(o.cfg, o.layout, o.packed, o.budgets, available=o.available, baseline=o.baseline,
                            shape=o.shape,
                            timeout=pipeline.DEFAULT_TIMEOUT if opts.pipeline_timeout is None
                            else float(opts.pipeline_timeout),
                            run={"max_context": int(opts.max_context), "max_batch": int(opts.max_batch),
                                 "spec": opts.spec, "kv": opts.kv, "prefill_chunk": o.prefill_chunk,
                                 "layers": o.layout.n_layers, "incremental": bool(opts.kv_cache),
                                 "kda_chunked": opts.kda_chunked})
    o.layout = CheckpointLayout(o.cfg, o.layout.index, o.stage.layers.stop, o.stage.layers.start)
    o.layout.validate()
    _zero_weights(o.layout, o.model_dir, opts.allow_zero_weights, o.say)


def _open_engine(o: _Opening, progress) -> Engine:
    """The plan (in the memory measured once the kernels were loaded), printed and
    checked; then the weights opened as it says, the model, the engine."""
    from .checkpoint.io import ShardFiles
    from .memory.streaming import StreamingWeights, model_sizes
    opts, stage, cfg = o.opts, o.stage, o.cfg
    sizes = model_sizes(o.layout, o.packed, tables=stage is None or stage.rank == 0)
    plan = planner.plan(cfg, sizes, o.budgets, available=o.available, baseline=o.baseline,
                        n_layers=o.layout.layer_ids, pin_order=env.pin_order(), **o.shape)
    prefill_plan, prefill_chunk = None, o.prefill_chunk
    if stage is None:
        plan, prefill_plan = prefill.widen(plan, cfg, sizes, span=int(opts.max_context), floor_piece=prefill_chunk,
                                           sequences=int(opts.max_batch), auto=o.auto_piece)
        prefill_chunk = prefill_plan.piece
    _show_and_check(plan, sizes, cfg, stage, o.say)
    t0 = time.perf_counter()
    faults = _test_faults()
    provider = StreamingWeights(o.layout, plan, o.packed, trace=opts.trace, reader=ShardFiles(),
                                expert_reader=ShardFiles(hook=faults.get("experts")),
                                trunk_reader=ShardFiles(hook=faults.get("trunk")), progress=_checked(progress),
                                tables=stage is None or stage.rank == 0)
    tokenizer, tok_error = _open_tokenizer(o.model_dir, cfg)
    kv_latent = opts.kv == "latent"
    if stage is not None and stage.rank == 0:
        from . import pipeline
        model = pipeline.PipelineModel(stage, provider, kda_chunked=opts.kda_chunked, kv_latent=kv_latent)
    else:
        model = Model(provider, n_layers=o.layout.n_layers if stage is not None else opts.layers,
                      kda_chunked=opts.kda_chunked, kv_latent=kv_latent)
    eng = Engine(cfg, model, provider, plan, tokenizer, o.model_dir, max_context=int(opts.max_context),
                 load_seconds=time.perf_counter() - t0, spec=opts.spec, max_batch=int(opts.max_batch),
                 prefill_chunk=prefill_chunk)
    eng.tokenizer_error, eng.kernels, eng.prefill_plan = tok_error, o.kernels, prefill_plan
    eng.pass_cost = _pass_cost(cfg, sizes, plan, stage, opts.layers)
    if stage is not None:
        eng.pipeline = stage
        if stage.rank == 0:
            stage.start_heartbeat()
    o.say(compiled.summary(eng.paths()))
    if provider.trunk is not None:
        o.say(f"trunk streaming from {o.budgets.trunk}: {plan.trunk.describe()}")
    else:
        o.say(f"resident trunk: {human(provider.resident_trunk_bytes)} in RAM (as stored: BF16/F32)")
    return eng


def _pass_cost(cfg, sizes, plan, stage, layers) -> PassCost:
    """The run's pass cost model; in a pipeline the counters it learns from are every
    rank's, and so are the MoE layers."""
    shape = planner.pass_shape(sizes, plan.trunk, plan.cache_slots, plan.stream_tables)
    if stage is not None:
        n = layers or cfg.num_hidden_layers
        shape = dataclasses.replace(shape, moe_layers=sum(1 for i in range(n) if cfg.is_moe(i)))
    return PassCost(shape)


def _checked(progress):
    """``progress`` after each layer loaded, a signal acted on first (k3.interrupt)."""
    def each(i):
        interrupt.check()
        if progress is not None:
            progress(i)
    return each
