"""Where a routed expert's bytes are in the checkpoint and where they land in a slot of
the expert cache (:mod:`k3.memory.expert_cache`), and how large a slot must be.

A slot holds the largest expert's six tensors (three for an unpacked BF16 expert) as
the ONE contiguous run they form in the shard, widened outward to 4096-byte boundaries
so the run is one O_DIRECT read, rounded up to 4096 bytes. An expert whose tensors are
not one gap-free run in one file (not the release layout) is read tensor by tensor
into its slot instead. Nothing here reads tensor data: only header information
(:class:`~k3.checkpoint.safetensors.TensorInfo`) is used.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..checkpoint.io import direct_span
from ..checkpoint.safetensors import TensorInfo
from ..errors import CheckpointError, K3Error
from ..units import align_up

__all__ = [
    "PART_ALIGN",
    "ExpertLocation",
    "ExpertSource",
    "expert_slot_bytes",
    "locate_expert",
]

#: placement of tensors inside a slot when an expert is read tensor by tensor
PART_ALIGN = 64
_WEIGHTS = ("w1", "w2", "w3")


class ExpertSource(Protocol):
    """What the cache needs from the checkpoint (CheckpointLayout satisfies it)."""

    cfg: object  # .num_experts, .num_experts_per_token, .is_moe(i)
    n_layers: int

    def expert_tensors(self, layer: int, e: int) -> dict[str, TensorInfo]:
        ...


# --------------------------------------------------------------------- locations
class _Part(NamedTuple):
    rel: str  # `w1.weight_packed`, ...
    file: str
    file_offset: int
    nbytes: int
    dtype: str
    shape: tuple
    slot_offset: int  # where the tensor's bytes sit in the slot


@dataclass(frozen=True, slots=True)
class ExpertLocation:
    """Where one expert's bytes are and where they land in a slot.

    ``contiguous``: the tensors form one gap-free run ``[offset, offset+nbytes)`` of
    ``file``, read with one O_DIRECT read of the widened span (``span`` bytes at the
    start of the slot). Otherwise each part is read on its own (``span`` = the bytes
    of the slot used)."""

    layer: int
    expert: int
    file: str
    offset: int
    nbytes: int
    contiguous: bool
    span: int
    parts: tuple


def _span_of(tensors: dict) -> int:
    """Slot bytes an expert needs (same result as locate_expert(...).span, faster)."""
    infos = sorted(tensors.values(), key=lambda ti: (ti.file, ti.offset))
    first = infos[0]
    pos = first.offset
    for ti in infos:
        if ti.file != first.file or ti.offset != pos or ti.offset % ti.itemsize:
            break
        pos = ti.end
    else:
        return direct_span(first.offset, pos - first.offset)[1]
    pos = 0
    for ti in infos:
        pos += ti.nbytes
        pos += (-pos) % PART_ALIGN
    return pos


def locate_expert(layout: ExpertSource, layer: int, e: int) -> ExpertLocation:
    """Find expert ``e`` of ``layer`` and plan its slot placement (reads nothing)."""
    tensors = layout.expert_tensors(layer, e)
    _check_complete(tensors, layer, e)
    return _locate(tensors, layer, e)


def _check_complete(tensors: dict, layer: int, e: int) -> None:
    for w in _WEIGHTS:
        if not ((f"{w}.weight_packed" in tensors and f"{w}.weight_scale" in tensors)
                or f"{w}.weight" in tensors):
            raise CheckpointError(
                f"Routed expert {e} of layer {layer} has no complete `{w}` matrix (neither "
                f"weight_packed + weight_scale nor weight); found {sorted(tensors)}. The "
                f"checkpoint is incomplete or not a K3/Kimi-Linear release; re-download it.")


def _locate(tensors: dict, layer: int, e: int) -> ExpertLocation:
    infos = sorted(tensors.items(), key=lambda kv: (kv[1].file, kv[1].offset))
    first = infos[0][1]
    total = sum(ti.nbytes for _, ti in infos)
    contiguous = all(ti.file == first.file for _, ti in infos)
    if contiguous:
        pos = first.offset
        for _, ti in infos:
            # gap-free, and every tensor naturally aligned (torch views need it)
            if ti.offset != pos or ti.offset % ti.itemsize:
                contiguous = False
                break
            pos = ti.end
    if contiguous:
        start, length, _lead = direct_span(first.offset, total)
        parts = tuple(_Part(rel, ti.file, ti.offset, ti.nbytes, ti.dtype, tuple(ti.shape), ti.offset - start)
                      for rel, ti in infos)
        return ExpertLocation(layer, e, first.file, first.offset, total, True, length, parts)
    parts, pos = [], 0
    for rel, ti in infos:
        parts.append(_Part(rel, ti.file, ti.offset, ti.nbytes, ti.dtype, tuple(ti.shape), pos))
        pos += ti.nbytes
        pos += (-pos) % PART_ALIGN
    return ExpertLocation(layer, e, first.file, first.offset, total, False, pos, tuple(parts))


_SLOT_MEMO: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def expert_slot_bytes(layout: ExpertSource) -> int:
    """Bytes of one cache slot: the largest expert's slot span, rounded up to 4096.

    Scans every routed expert of every MoE layer once (header data only, for K3's 82,432 about
    a second); the result is remembered per layout object."""
    try:
        return _SLOT_MEMO[layout]
    except (KeyError, TypeError):
        pass
    cfg = layout.cfg
    best = 0
    for i in getattr(layout, "layer_ids", range(layout.n_layers)):
        if not cfg.is_moe(i):
            continue
        for e in range(cfg.num_experts):
            tensors = layout.expert_tensors(i, e)
            _check_complete(tensors, i, e)
            span = _span_of(tensors)
            if span > best:
                best = span
    if best == 0:
        raise K3Error("this model has no routed experts (no MoE layer in the layers run), so "
                      "there is nothing for an expert cache to hold.")
    slot = align_up(best)
    try:
        _SLOT_MEMO[layout] = slot
    except TypeError:
        pass
    return slot
