"""Writing a synthetic checkpoint: the folder check, the shards (drawn in pieces, by
worker processes for big checkpoints, each piece written at its offset), the tokenizer
and config files, and the index, written last (`synthesize`). Memory stays bounded: one shard is
generated, written and dropped at a time."""

from __future__ import annotations

import os
import re
import shutil
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.safetensors import INDEX_NAME
from ..checkpoint.writer import safetensors_layout
from ..errors import EXIT_RUNTIME, K3Error, UsageError
from ..fsutil import atomic_write
from ..units import human
from .bpe import _tokenizer_files
from .plan import SynthPlan, _Expert, make_plan
from .presets import _json_bytes
from .values import _expert_values, _value

_OURS = re.compile(
    r"^(model-\d+-of-\d+\.safetensors|\.model-\d+-of-\d+\.safetensors\.tmp-\d+|"
    r"model\.safetensors\.index\.json|\.model\.safetensors\.index\.json\.tmp-\d+|config\.json|"
    r"tiktoken\.model|tokenizer_config\.json|generation_config\.json|k3_synth\.json)$")


def _prepare_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"synth: {out} exists and is not a directory.")
    out.mkdir(parents=True, exist_ok=True)
    names = os.listdir(out)
    foreign = sorted(n for n in names if not _OURS.match(n))
    if foreign and not force:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UsageError(
            f"synth: {out} already holds files that a synthetic checkpoint does not write ({shown}). "
            "Choose an empty or new directory, or pass --force to write beside them.")
    # The index goes first, so an interrupted regeneration never looks complete; then
    # every earlier shard set (the new one may have a different shard count).
    for n in sorted(names, key=lambda n: n != INDEX_NAME):
        if _OURS.match(n) and (n == INDEX_NAME or n.endswith(".safetensors") or ".tmp-" in n):
            (out / n).unlink()


# A shard is drawn in pieces of about this many bytes; with workers, each piece is drawn
# and written (pwrite at its offset) by one worker process.
_PIECE = 128 << 20
# Below this many bytes in all, one process draws everything (spawning workers costs
# more than it saves).
PARALLEL_FROM = 1 << 30
WORKER_BYTES = 1 << 30

_WORKER_PLAN: SynthPlan | None = None


def _worker_init(args: tuple) -> None:
    global _WORKER_PLAN
    torch.set_num_threads(1)
    _WORKER_PLAN = make_plan(*args)


def _items_values(plan: SynthPlan, k: int, lo: int, hi: int) -> list[tuple[str, torch.Tensor]]:
    out = []
    for it in plan.shards[k][lo:hi]:
        out += _expert_values(plan, it) if isinstance(it, _Expert) else [(it.name, _value(plan, it))]
    return out


def _write_piece(path: str, k: int, lo: int, hi: int, offsets: dict[str, int], plan: SynthPlan | None = None) -> int:
    """Draw items [lo, hi) of shard k and write each tensor at its file offset."""
    plan = plan or _WORKER_PLAN
    fd = os.open(path, os.O_WRONLY)
    n = 0
    try:
        for name, t in _items_values(plan, k, lo, hi):
            mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            off = offsets[name]
            while len(mv):
                w = os.pwrite(fd, mv, off)
                mv, off, n = mv[w:], off + w, n + w
    finally:
        os.close(fd)
    return n


def _pieces(items: list) -> list[tuple[int, int]]:
    out, lo, acc = [], 0, 0
    for i, it in enumerate(items):
        acc += it.nbytes
        if acc >= _PIECE:
            out.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < len(items):
        out.append((lo, len(items)))
    return out


def _write_shard(path: Path, plan: SynthPlan, k: int, pool, fsync: bool) -> None:
    """One shard: the header from the plan, then every piece drawn and written at its
    offset (by the pool's workers when there is a pool), into a temporary file renamed
    into place once complete."""
    tensors = list(plan.shards[k])
    flat = [t for it in tensors for t in (it.tensors if isinstance(it, _Expert) else (it,))]
    header, offsets = safetensors_layout([(t.name, t.dtype, t.shape) for t in flat])
    start = len(header)
    where = {name: start + off for name, off in offsets.items()}

    def body(f) -> None:
        f.write(header)
        f.flush()
        os.ftruncate(f.fileno(), start + plan.shard_bytes(k))
        parts = _pieces(tensors)
        if pool is None or len(parts) < 2:
            n = sum(_write_piece(f.name, k, lo, hi, where, plan) for lo, hi in parts)
        else:
            n = sum(fut.result() for fut in [pool.submit(_write_piece, f.name, k, lo, hi, where) for lo, hi in parts])
        if n != plan.shard_bytes(k):  # the drawn tensors are not the planned layout: a bug, never a silent gap
            raise AssertionError(f"{path.name}: wrote {n} bytes of tensors, the plan has {plan.shard_bytes(k)}")

    atomic_write(path, body, what="the shard", fsync=fsync)


def _default_workers(need: int) -> int:
    """How many processes draw a checkpoint of `need` bytes when --workers is not given."""
    workers = (os.cpu_count() or 1) if need >= PARALLEL_FROM else 1
    from ..memory.sysmem import meminfo
    try:
        avail = meminfo()["MemAvailable"]
    except K3Error:  # no /proc/meminfo: as many workers as cores
        avail = None
    if avail:  # a worker holds torch and a few pieces: about WORKER_BYTES
        workers = max(1, min(workers, avail // WORKER_BYTES))
    return workers


def _start_pool(workers: int, plan_args: tuple):
    """The worker processes (each makes the plan from `plan_args` once), or None for one."""
    if workers <= 1:
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent has torch's thread pools up
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init, initargs=(plan_args,))


def synthesize(out_dir, preset: str = "tiny", arch: str = "k3", seed: int = 0, layers: int | None = None,
               experts: int | None = None, *, vocab: int | None = None, workers: int | None = None,
               force: bool = False, progress: Callable[[str], None] | None = None, fsync: bool = False) -> Path:
    """Write a synthetic checkpoint folder; returns its path. See the package docstring (k3.synth).

    `layers` / `experts` / `vocab` override the preset (layers >= 2: layer 0 dense, the
    last layer MLA; experts >= the preset's top-k). `workers` processes draw the shards'
    pieces in parallel (default: one per core for checkpoints of PARALLEL_FROM bytes or
    more, else one); the bytes do not depend on it. Refuses a directory holding other
    files unless `force`. `progress` receives one line per written shard. The index is
    written last."""
    t_start = time.perf_counter()
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise UsageError(f"synth: --workers must be a positive integer, got {workers!r}.")
    plan = make_plan(preset, arch, seed, layers, experts, vocab)
    out = Path(out_dir)
    _prepare_dir(out, force)
    need = plan.total_bytes
    free = shutil.disk_usage(out).free
    if need > free:
        raise UsageError(
            f"synth: the {preset}/{arch} checkpoint needs {human(need)} but {out} has only "
            f"{human(free)} free. Free space, choose another directory, or use fewer --layers/--experts.")
    say = progress or (lambda msg: None)
    say(f"synth {preset}/{arch} seed {seed}: {plan.cfg.num_hidden_layers} layers, "
        f"{plan.cfg.num_experts} experts (top-{plan.cfg.num_experts_per_token}), "
        f"{len(plan.shards)} shards, {need / 1e6:.1f} MB -> {out}")

    (out / "config.json").write_bytes(_json_bytes(plan.raw_config))
    for fname, data in _tokenizer_files(plan.raw_config, arch).items():
        atomic_write(out / fname, data, fsync=fsync)

    # A shard's pieces are drawn and written at their offsets (the header comes from the
    # plan), so memory holds a few pieces, never a shard, and workers draw in parallel.
    if workers is None:
        workers = _default_workers(need)
    pool = _start_pool(workers, (preset, arch, seed, layers, experts, vocab))
    weight_map: dict[str, str] = {}
    written = 0
    try:
        for k, fname in enumerate(plan.shard_names):
            t0 = time.perf_counter()
            try:
                _write_shard(out / fname, plan, k, pool, fsync)
            except BrokenProcessPool:
                raise K3Error(f"synth: a worker process drawing {fname} died (out of memory?); nothing of that shard "
                              f"was kept. Run again with --workers 1, or with fewer workers.", EXIT_RUNTIME) from None
            nb = plan.shard_bytes(k)
            written += nb
            for it in plan.shards[k]:
                for t in (it.tensors if isinstance(it, _Expert) else (it,)):
                    weight_map[t.name] = fname
            dt = time.perf_counter() - t0
            say(f"  [{k + 1}/{len(plan.shard_names)}] {fname}: {nb / 1e6:9.1f} MB in {dt:6.2f} s "
                f"({nb / 1e6 / max(dt, 1e-9):.0f} MB/s; {written / 1e6:.1f} of {need / 1e6:.1f} MB)")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)

    elapsed = time.perf_counter() - t_start
    meta = {
        "generator": "k3.synth", "format_version": 1, "preset": preset, "arch": arch, "seed": seed,
        "num_hidden_layers": plan.cfg.num_hidden_layers, "num_experts": plan.cfg.num_experts,
        "expert_encoding": plan.expert_mode, "total_size": written, "shards": len(plan.shard_names),
        "vocab_size": plan.cfg.vocab_size,
    }  # no timings: the folder is byte-for-byte a function of (preset, arch, seed, layers, experts, vocab)
    (out / "k3_synth.json").write_bytes(_json_bytes(meta))
    index = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(out / INDEX_NAME, _json_bytes(index), fsync=fsync)
    say(f"synth: wrote {written / 1e6:.1f} MB in {elapsed:.1f} s ({written / 1e6 / max(elapsed, 1e-9):.0f} MB/s)")
    return out
