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
    a prompt one forward pass reads (a multiple of 32; the plan sizes the activations for
    it); None: the plan chooses it (k3.memory.prefill). ``stage_gb``: the memory this process may plan in (at most what is available).
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
    auto_piece = prefill_chunk is None  # the plan widens the piece (k3.memory.prefill)
    prefill_chunk = check_prefill_chunk(PREFILL_CHUNK if prefill_chunk is None else prefill_chunk)
    shape = dict(tokens=int(max_context) * int(max_batch), incremental=kv_cache,
                 prefill_tokens=max_piece(prefill_chunk) * int(max_batch), spec=spec, kv_latent=kv == "latent",
                 sequences=int(max_batch))
    if pipeline_timeout is not None and not (isinstance(pipeline_timeout, (int, float)) and 0 < pipeline_timeout < 1e7):
        raise UsageError(f"--pipeline-timeout must be a number of seconds > 0, got {pipeline_timeout}.")

    # The memory floor, before anything that could reach it is loaded or compiled: the
    # plan with the kernels' footprint estimated (the interpreter and libraries are
    # measured) must fit, or the run is refused now rather than killed while compiling.
    available = _measured_available(budgets)
    floor = sysmem.baseline_bytes() + warmup.KERNELS_BYTES
    if launch is None:
        planner.plan(cfg, model_sizes(layout, packed), budgets, available=available, baseline=floor,
                     n_layers=layout.layer_ids, pin_order=env.pin_order(), **shape).check()
    elif available and floor > planner.PLAN_FRACTION * available:
        raise K3Error(f"REFUSING TO START: the interpreter, its libraries and k3's kernels need about {human(floor)} "
                      f"and the machine has {human(available)} available.")
    kernels = warmup.ensure(warmup.jobs_for(cfg, layout.layer_ids), available=available,
                            notice=notice or say, progress=compile_progress)
    interrupt.check()  # a signal is acted on between load stages (k3.interrupt)
    available = _measured_available(budgets)  # the compiled kernels now count in the footprint the plan measures
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
        prefill_plan = None
        if stage is None:
            plan, prefill_plan = prefill.widen(plan, cfg, sizes, span=int(max_context), floor_piece=prefill_chunk,
                                               sequences=int(max_batch), auto=auto_piece)
            prefill_chunk = prefill_plan.piece
        _show_and_check(plan, sizes, cfg, stage, say)
        t0 = time.perf_counter()
        faults = _test_faults()
        provider = StreamingWeights(layout, plan, packed, trace=trace, reader=ShardFiles(),
                                    expert_reader=ShardFiles(hook=faults.get("experts")),
                                    trunk_reader=ShardFiles(hook=faults.get("trunk")), progress=_checked(progress),
                                    tables=stage is None or stage.rank == 0)
        tokenizer, tok_error = _open_tokenizer(model_dir, cfg)
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
        eng.prefill_plan = prefill_plan
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


def _checked(progress):
    """``progress`` after each layer loaded, a signal acted on first (k3.interrupt)."""
    def each(i):
        interrupt.check()
        if progress is not None:
            progress(i)
    return each
