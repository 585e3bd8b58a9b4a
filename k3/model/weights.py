"""The one small interface between the model math and wherever weights come from.

The math asks a WeightProvider for a layer's tensors by their checkpoint names
(without the `language_model.model.layers.{i}.` prefix), for one layer's routed experts
by id (handed out in whatever groups the provider's memory allows), and for the global
tensors. It never opens a file and never asks how the weights are held. A resident provider (read
everything once), a streaming provider (trunk ring + expert cache) and a dict provider
(tests) all implement this.

Weights are handed over exactly as stored: torch.bfloat16 / torch.float32 tensors, or
Mxfp4Weight for packed experts. Small vectors may be widened to fp32 by the provider.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol, Sequence

import torch


@dataclass(frozen=True)
class Mxfp4Weight:
    """A packed MXFP4 matrix of logical shape [rows, cols]: packed uint8 [rows, cols/2],
    scale uint8 [rows, cols/32] (E8M0)."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel()


class RowChunks(Protocol):
    """A matrix [rows, cols] handed over in row chunks (e.g. lm_head streamed from disk
    in ultra-low-memory mode). `chunks()` yields tensors as stored, top to bottom; the
    math multiplies each and concatenates, which gives the same numbers as the whole
    matrix because every output row is computed on its own."""

    shape: tuple[int, int]

    def chunks(self): ...


Weight = "torch.Tensor | Mxfp4Weight | RowChunks"


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: w1 (gate) [inter, in], w3 (up) [inter, in], w2 (down) [in, inter]."""

    w1: object
    w2: object
    w3: object


class ExpertSet(collections.abc.Sequence):
    """Every routed expert of a layer, by id, as a provider holds them (``resident_experts``):
    an immutable sequence of ExpertWeights that can be weakly referenced, so what the
    math derives from it (kernel descriptors) can be kept for exactly as long as the set
    lives, and never keeps the experts' memory alive after the provider dropped it."""

    __slots__ = ("_items", "__weakref__")

    def __init__(self, items):
        self._items = tuple(items)

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)


class WeightProvider(Protocol):
    config: object

    def global_weight(self, name: str):
        """`embed_tokens.weight`, `norm.weight`, `output_attn_res_norm.weight`,
        `output_attn_res_proj.weight`, `lm_head.weight`."""

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 [T, hidden] embedding rows for the ids."""

    def layer(self, i: int) -> Mapping[str, object]:
        """Layer i's non-expert tensors, keyed by name relative to the layer prefix,
        e.g. `self_attn.q_proj.weight`."""

    def expert_groups(self, i: int, ids: Sequence[int]) -> Iterator[Mapping[int, ExpertWeights]]:
        """The routed experts `ids` (distinct) of layer i, in groups: every id appears in
        exactly one group, and a group's weights are valid until the next group is asked
        for (a bounded cache may reuse their memory)."""

    def release_layer(self, i: int) -> None:
        """The math is done with layer i for this step (a streaming provider may reuse it)."""

    # Optional (k3.model.compiled looks them up once, when it is built): a provider that
    # can say when it holds every routed expert of a layer lets a decode step run the
    # layer's MoE block inside the mixer's compiled region, with no fetch between the
    # router and the experts.
    def resident_experts(self, i: int) -> ExpertSet | None:
        """Every routed expert of layer i (by id) when all are held, else None; the same
        object while none of them moves, valid until the next expert_groups call."""

    def used_experts(self, i: int, ids: Sequence[int]) -> None:
        """Experts ``ids`` of layer i were used from resident_experts (statistics, LRU)."""


class DictWeights:
    """A provider over a plain dict of tensors keyed by normalised checkpoint names
    (`layers.{i}.self_attn.q_proj.weight`, `embed_tokens.weight`, `lm_head.weight`,
    `layers.{i}.block_sparse_moe.experts.{e}.w1.weight` or `.w1.weight_packed/_scale`)."""

    def __init__(self, config, tensors: Mapping[str, torch.Tensor]):
        self.config = config
        self.t = dict(tensors)
        self._layers: dict[int, dict] = {}

    def global_weight(self, name):
        return self.t[name]

    def embed(self, ids):
        w = self.t["embed_tokens.weight"]
        return w[torch.as_tensor(list(ids), dtype=torch.long)].to(torch.float32)

    def layer(self, i):
        if i not in self._layers:
            p = f"layers.{i}."
            self._layers[i] = {k[len(p):]: v for k, v in self.t.items()
                               if k.startswith(p) and ".experts." not in k}
        return self._layers[i]

    def expert_groups(self, i, ids):
        out = {}
        for e in ids:
            p = f"layers.{i}.block_sparse_moe.experts.{e}."
            ws = []
            for w in ("w1", "w2", "w3"):
                if p + w + ".weight_packed" in self.t:
                    ws.append(Mxfp4Weight(self.t[p + w + ".weight_packed"], self.t[p + w + ".weight_scale"]))
                else:
                    ws.append(self.t[p + w + ".weight"])
            out[e] = ExpertWeights(*ws)
        yield out

    def release_layer(self, i):
        pass
