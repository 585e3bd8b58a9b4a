"""Weights that read as zeros: an unfinished or preallocated download.

safetensors carry no checksums, and a shard whose bytes were never written has the
right size and a valid header: it decodes without an error, into garbage (a zeroed
lm_head gives token 0 forever). But a trained model's weight matrix is never all zeros,
and never holds a megabyte of zero bytes. So a few aligned 4 KiB blocks of each weight
are read and looked at:

* a weight all of whose samples are zero is named;
* a large weight (>= ``WINDOW``) with a zero sample is named when the ``WINDOW`` of
  bytes around that block is all zeros too (a zero run that long is a hole, not a
  value: no trained weight has one).

``k3 doctor MODEL`` samples every weight (:func:`doctor_selection`); a run samples the
trunk, the tables and a spread of each shard's experts (:func:`load_selection`, a few
thousand small reads) and refuses (exit 3) unless told ``--allow-zero-weights``.
Only weight matrices and packed expert bytes are looked at: biases, norm gains and
scales may legitimately hold zeros.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import CheckpointError, K3Error
from .io import ShardFiles
from .safetensors import TensorInfo

BLOCK = 4096
#: the zero run that names a large weight (and the size from which a weight is large)
WINDOW = 1 << 20
#: samples a weight gets (first, last and evenly between)
SAMPLES = 3
#: expert weights a run samples per shard (doctor: all of them)
EXPERTS_PER_SHARD = 8


@dataclass
class Finding:
    """A weight that reads as zeros: ``whole`` when every sample was zero; ``offsets``:
    the file offsets of the zero blocks (or the start of each zero window)."""

    tensor: str
    shard: str
    whole: bool
    offsets: list[int] = field(default_factory=list)
    samples: int = 0


def _is_weight(name: str) -> bool:
    return name.endswith(".weight") or name.endswith(".weight_packed")


def sample_ranges(info: TensorInfo, n: int = SAMPLES) -> list[tuple[int, int]]:
    """(offset, length) of up to ``n`` aligned 4 KiB blocks inside the tensor's bytes:
    the first and the last whole block and evenly between; a tensor too small to hold
    two whole blocks is read whole."""
    a0 = -(-info.offset // BLOCK) * BLOCK
    a1 = (info.end // BLOCK) * BLOCK - BLOCK
    if a1 <= a0:
        return [(info.offset, info.nbytes)] if info.nbytes else []
    n = max(2, n)
    steps = (a1 - a0) // BLOCK
    picks = sorted({a0 + (steps * j // (n - 1)) * BLOCK for j in range(n)})
    return [(p, BLOCK) for p in picks]


def _zero(reader: ShardFiles, path: str, off: int, n: int) -> bool:
    return not reader.read_bytes((path, off, n)).any()


def _check(reader: ShardFiles, info: TensorInfo, n: int) -> Finding | None:
    ranges = sample_ranges(info, n)
    zeros = [off for off, length in ranges if _zero(reader, info.file, off, length)]
    if not zeros:
        return None
    if len(zeros) == len(ranges):
        return Finding(info.name, info.file, True, zeros, len(ranges))
    if info.nbytes < WINDOW:
        return None
    holes = []
    for off in zeros:  # the window around the zero block, inside the tensor
        start = min(max(info.offset, off - WINDOW // 2), info.end - WINDOW)
        if _zero(reader, info.file, start, WINDOW):
            holes.append(start)
    return Finding(info.name, info.file, False, holes, len(ranges)) if holes else None


def scan(infos: list[TensorInfo], samples: int = SAMPLES, threads: int = 8) -> list[Finding]:
    """Sample each tensor of ``infos``; the findings, in the order given. Read errors
    are not findings (the reads that matter report them)."""
    by_file: dict[str, list[TensorInfo]] = {}
    for t in infos:
        by_file.setdefault(t.file, []).append(t)

    def one_file(path: str) -> list[tuple[int, Finding]]:
        out = []
        for t in sorted(by_file[path], key=lambda t: t.offset):
            try:
                f = _check(reader, t, samples)
            except (K3Error, OSError):
                f = None
            if f is not None:
                out.append((order[t.name], f))
        return out

    order = {t.name: i for i, t in enumerate(infos)}
    if not by_file:
        return []
    with ShardFiles(use_direct=False) as reader, \
            ThreadPoolExecutor(max_workers=max(1, min(threads, len(by_file)))) as pool:
        found = [f for part in pool.map(one_file, list(by_file)) for f in part]
    return [f for _, f in sorted(found, key=lambda x: x[0])]


def _layer_of(name: str) -> int | None:
    i = name.find("layers.")
    if i < 0:
        return None
    j = name.find(".", i + 7)
    s = name[i + 7:j]
    return int(s) if s.isdigit() else None


def load_selection(layout, experts_per_shard: int = EXPERTS_PER_SHARD) -> list[TensorInfo]:
    """What a run samples: every weight matrix of the trunk (its layers) and the model
    tables, and of the routed experts' weights, ``experts_per_shard`` per shard spread
    over the shard's bytes (a zeroed shard is found whichever experts it holds)."""
    from ..schema import global_specs, layer_specs

    cfg = layout.cfg
    out = [layout.info(rel) for rel, sp in global_specs(cfg).items() if sp.kind == "matrix"]
    for i in layout.layer_ids:
        out += [layout.info(f"layers.{i}.{rel}") for rel, sp in layer_specs(cfg, i).items() if sp.kind == "matrix"]
    layers = set(layout.layer_ids)
    per_shard: dict[str, list[TensorInfo]] = {}
    for name, info in layout.index.items():
        if ".experts." in name and _is_weight(name) and _layer_of(name) in layers:
            per_shard.setdefault(info.file, []).append(info)
    for infos in per_shard.values():
        infos.sort(key=lambda t: t.offset)
        n = min(experts_per_shard, len(infos))
        out += [infos[(len(infos) - 1) * j // max(1, n - 1)] for j in range(n)] if n > 1 else infos[:1]
    return out


def doctor_selection(index) -> list[TensorInfo]:
    """What the doctor samples: every weight matrix and packed expert of the checkpoint."""
    return [info for name, info in index.items() if _is_weight(name)]


def describe(findings: list[Finding], model_dir, shown: int = 6) -> str:
    """One paragraph naming the shards and tensors that read as zeros."""
    by_shard: dict[str, list[Finding]] = {}
    for f in findings:
        by_shard.setdefault(f.shard, []).append(f)
    parts = []
    for shard, fs in list(by_shard.items())[:shown]:
        names = []
        for f in fs[:3]:
            offs = ", ".join(str(o) for o in f.offsets[:4]) + (", ..." if len(f.offsets) > 4 else "")
            what = (f"reads as zeros at offsets {offs} (all {f.samples} samples)" if f.whole else
                    f"has {WINDOW >> 20} MiB of zero bytes at offset {offs}")
            names.append(f"tensor {f.tensor} {what}")
        more = f" and {len(fs) - 3} more tensors" if len(fs) > 3 else ""
        ex = sum(".experts." in f.tensor for f in fs)
        if ex:
            more += f" ({ex} of the {len(fs)} are routed experts' weights)"
        parts.append(f"shard {os.path.basename(shard)} looks unfinished: {'; '.join(names)}{more}")
    rest = f"; and {len(by_shard) - shown} more shards" if len(by_shard) > shown else ""
    return (f"{model_dir}: {'; '.join(parts)}{rest}. A trained model's weights never read as zeros: this is an "
            "unfinished or preallocated download. Re-download the shard(s) named.")


def refuse(findings: list[Finding], model_dir) -> None:
    """CheckpointError (exit 3) naming the findings, with the flag that runs anyway."""
    if findings:
        raise CheckpointError(describe(findings, model_dir) + " (--allow-zero-weights runs it anyway: the output "
                              "will be garbage where those weights are used.)")
