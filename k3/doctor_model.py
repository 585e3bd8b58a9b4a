"""`k3 doctor MODEL`'s model-folder check (k3.doctor): the config readable, every shard
the index names present with the size its header implies, the tensors the index maps in
their shards, the sizes the estimates use, weights that read as zeros, tokenizer, chat
format and generation defaults, and whether a packed trunk is present and current.

check_model runs the steps in order; each appends its lines and problems to the report
as it goes, so the order of the report's lines is the order of the steps."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .doctor_report import Report
from .errors import K3Error
from .units import human


# ---------------------------------------------------------------- model folder
@dataclass
class ModelFacts:
    ok: bool = False
    cfg: object = None
    total_bytes: int = 0
    trunk_bytes: int = 0
    table_bytes: int = 0
    expert_bytes_per_token: int = 0
    largest_layer: int = 0
    trunk_dir: Path | None = None
    trunk_state: str = "absent"  # absent | current | stale | unchecked
    shard_problems: list = field(default_factory=list)
    sizes: object = None  # planner.ModelSizes, when the checkpoint matches its config


def check_model(rep: Report, model: Path, trunk: Path | None, extra_dirs=()) -> ModelFacts:
    facts = ModelFacts()
    lines = rep.section(f"model {model}")
    if not model.is_dir():
        rep.blocking.append(f"{model} is not a folder. Give the folder that holds config.json and the *.safetensors "
                            "shards.")
        return facts
    cfg = _check_config(rep, lines, facts, model)
    listed = _shard_list(rep, model)
    if listed is None:
        return facts
    weight_map, declared_total, shards = listed
    missing, bad, absent = _check_shards(rep, lines, facts, model, shards, weight_map, declared_total, extra_dirs)
    # sizes for the estimates: the checkpoint seen through the model's tensor graph
    if cfg is not None and not missing and not bad and not absent:
        _check_sizes(rep, lines, facts, cfg, model, extra_dirs)
    _check_tokenizer(rep, lines, model)
    # packed trunk
    facts.trunk_dir = trunk if trunk is not None else model / "trunk"
    if trunk is not None and not trunk.is_dir():
        rep.warnings.append(f"--trunk {trunk}: no such folder.")
    if facts.trunk_dir.is_dir() and (facts.trunk_dir / "trunk.json").is_file():
        facts.trunk_state = _check_trunk(rep, facts.trunk_dir, cfg, model, bad or missing, extra_dirs)
        lines.append(f"packed trunk: {facts.trunk_dir} ({facts.trunk_state})")
    else:
        lines.append(f"packed trunk: none at {facts.trunk_dir}")
    facts.ok = cfg is not None and not missing and not bad and not absent and facts.sizes is not None
    return facts


def _check_config(rep: Report, lines: list, facts: ModelFacts, model: Path):
    """The model's config, or None (a blocking problem) when it cannot be read."""
    from .config import load_config

    # config
    try:
        cfg = load_config(model)
        facts.cfg = cfg
        lines.append(cfg.summary())
    except K3Error as e:
        rep.blocking.append(f"config: {e}")
        cfg = None
    return cfg


def _shard_list(rep: Report, model: Path):
    """(weight_map, declared total_size, shard names), or None (a blocking problem) when
    the index is unreadable or there are no shards at all."""
    from .checkpoint.safetensors import INDEX_NAME, read_index

    # shards named by the index (or all *.safetensors without one)
    index_path = model / INDEX_NAME
    weight_map: dict = {}
    if os.path.lexists(index_path):
        try:
            weight_map, meta = read_index(index_path)
        except K3Error as e:
            rep.blocking.append(str(e))
            return None
        declared_total = (meta or {}).get("total_size")
        shards = sorted(set(weight_map.values()))
    else:
        declared_total = None
        shards = sorted(p.name for p in model.glob("*.safetensors"))
        if not shards:
            rep.blocking.append(f"{model}: no {INDEX_NAME} and no *.safetensors shards; the download is missing.")
            return None
    return weight_map, declared_total, shards


def _read_shards(model: Path, shards: list, extra_dirs) -> tuple[list, list, dict, int]:
    """Each shard's header: (missing names, [(name, why)] bad, tensors, bytes on disk)."""
    from .checkpoint.safetensors import read_shard_header, shard_paths
    from .fsutil import path_problem

    missing, bad, tensors = [], [], {}
    size_total = 0
    where = shard_paths(str(model), shards, [str(d) for d in extra_dirs])
    for name in shards:
        p = Path(where[name])
        why = path_problem(p)
        if why == "does not exist":
            missing.append(name)
            continue
        if why is not None:  # a folder, a broken link, a link loop: say what it is
            bad.append((name, f"{p} {why}; it should be the shard file"))
            continue
        try:
            h = read_shard_header(p)
        except K3Error as e:
            bad.append((name, str(e)))
            continue
        size_total += h.file_size
        tensors.update(h.tensors)
    return missing, bad, tensors, size_total


def _check_shards(rep: Report, lines: list, facts: ModelFacts, model: Path, shards: list, weight_map: dict,
                  declared_total, extra_dirs) -> tuple[list, list, list]:
    """Reports missing and damaged shards and tensors the index maps that no shard holds;
    returns (missing, bad, absent)."""
    missing, bad, tensors, size_total = _read_shards(model, shards, extra_dirs)
    text_missing = [n for n in missing if any(v == n and not k.startswith(("vision_tower.", "mm_projector."))
                                              for k, v in weight_map.items())] if weight_map else missing
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        (rep.blocking if text_missing else rep.warnings).append(
            f"{len(missing)} of {len(shards)} shards the index names are missing: {shown}. A partial download cannot "
            "run the model; download them again.")
    for name, msg in bad:
        rep.blocking.append(f"shard {name}: {msg}")
    facts.shard_problems = missing + [n for n, _ in bad]
    present = len(shards) - len(missing) - len(bad)
    lines.append(f"shards: {present} of {len(shards)} present and consistent with their headers "
                 f"({human(size_total)})")
    data_total = sum(t.nbytes for t in tensors.values())
    if declared_total is not None and not missing and not bad and declared_total != data_total:
        rep.warnings.append(f"the index says total_size {declared_total} bytes but the shards hold {data_total} "
                            "bytes of tensors; the index and shards may come from different revisions.")
    absent = [k for k, v in weight_map.items() if v not in missing and v not in dict(bad) and k not in tensors]
    if absent:
        rep.blocking.append(f"{len(absent)} tensors the index maps are not in their shard (e.g. {absent[0]}); "
                            "a shard is from another revision. Download it again.")
    facts.total_bytes = size_total
    return missing, bad, absent


def _check_sizes(rep: Report, lines: list, facts: ModelFacts, cfg, model: Path, extra_dirs) -> None:
    """The bytes the estimates use (facts.sizes and the per-token line), then the sampled
    scan for weights that read as zeros."""
    try:
        from .checkpoint.layout import CheckpointLayout
        from .memory.streaming import model_sizes
        from .schema import global_specs
        layout = CheckpointLayout.open(cfg, model, extra_dirs=tuple(extra_dirs))
        sizes = facts.sizes = model_sizes(layout)
    except K3Error as e:
        rep.blocking.append(str(e))
    else:
        facts.trunk_bytes = sizes.trunk_bytes
        facts.table_bytes = sum(ti.nbytes for ti in (layout.info(rel) for rel in global_specs(cfg)))
        facts.largest_layer = max(sizes.layer_bytes)
        facts.expert_bytes_per_token = sizes.moe_layers * sizes.top_k * sizes.expert_bytes
        lines.append(f"per token: trunk {human(facts.trunk_bytes)} + routed experts "
                     f"{human(facts.expert_bytes_per_token)} ({sizes.moe_layers} MoE layers x top-{sizes.top_k} x "
                     f"{human(sizes.expert_bytes)}); model tables {human(facts.table_bytes)}")
        from .checkpoint import zeros
        t0 = time.perf_counter()
        sel = zeros.doctor_selection(layout.index)
        found = zeros.scan(sel)
        rep.data["zero_weights"] = [{"tensor": f.tensor, "shard": f.shard, "offsets": f.offsets,
                                     "all_samples": f.whole} for f in found]
        lines.append(f"weights read as zeros: {len(found) or 'none'} of {len(sel)} sampled "
                     f"({zeros.SAMPLES} aligned 4 KiB blocks each, {time.perf_counter() - t0:.1f} s)")
        if found:
            rep.warnings.append(zeros.describe(found, model) + " `k3 run` refuses this checkpoint (exit 3) "
                                "unless given --allow-zero-weights.")


def _check_tokenizer(rep: Report, lines: list, model: Path) -> None:
    """The tokenizer and chat format, and generation_config.json's defaults."""
    # tokenizer and chat format
    try:
        from .tokenizer import Tokenizer
        tok = Tokenizer(model)
        fmt = "K3 XTML" if tok.has_special("<|open|>") and tok.has_special("<|end_of_msg|>") else None
        tmpl = tok.chat_template()
        chat = fmt or ("Jinja chat template" if tmpl else "none (k3 chat needs chat_template.jinja)")
        lines.append(f"tokenizer: {tok.n_base} ranks + 256 specials; chat format: {chat}")
        if fmt is None and tmpl is None:
            rep.warnings.append("the folder has no chat template and no K3 XTML tokens: `k3 chat` cannot format "
                                "a conversation (k3 run with a raw prompt works).")
    except K3Error as e:
        rep.warnings.append(f"tokenizer: {e} Text prompts and `k3 chat` need it; `k3 run --ids` does not.")
    try:
        from .sampling import generation_defaults
        gen = generation_defaults(model)
        lines.append("generation_config.json: " + (", ".join(f"{k} {v}" for k, v in gen.items()) if gen
                                                  else "none (greedy decoding by default)"))
    except K3Error as e:
        rep.warnings.append(str(e))


def _check_trunk(rep: Report, tdir: Path, cfg, model: Path, shards_broken, extra_dirs=()) -> str:
    if cfg is None or shards_broken:
        return "unchecked (the model folder has problems)"
    try:
        from .checkpoint.safetensors import CheckpointIndex
        from .memory.trunk import PackedTrunk
    except ImportError:  # pragma: no cover - a build without trunk streaming
        return "unchecked (no trunk support in this build)"
    try:
        PackedTrunk.open(tdir, cfg, CheckpointIndex.open(model, extra_dirs))
        return "current"
    except K3Error as e:
        rep.warnings.append(f"the packed trunk in {tdir} is stale: {e}")
        return "stale"
