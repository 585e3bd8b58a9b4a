"""The budgeted weight provider: the trunk resident or streamed (pinned layers + a ring
filled by reader threads), routed experts through a fixed-size LRU cache, the model
tables resident or (ultra-low-memory) streamed.

It implements k3.model.weights.WeightProvider; the math cannot tell it from the
resident provider, and the tests check that the logits are bit-identical.
"""

from __future__ import annotations

import time

import torch

from ..checkpoint.io import ShardFiles
from ..checkpoint.safetensors import CheckpointIndex
from ..model.schema import global_specs
from .expert_cache import ExpertCache
from .resident import CheckpointLayout, read_trunk_layers, read_weight, tensor_bytes
from .tables import StreamedEmbedding, StreamedRows


class StreamingWeights:
    """`trunk_dir`: a packed-trunk folder or an opened PackedTrunk (None: trunk held in
    RAM, read from the shards); `cache_budget`: bytes for the expert arena."""

    def __init__(self, cfg, model_dir, *, cache_budget: int, trunk_dir=None, trunk_budget: int | None = None,
                 ring: int = 2, pin_order: str = "largest", ultra: bool = False, n_layers: int | None = None,
                 io_threads: int = 4, trace: bool = False, layout: CheckpointLayout | None = None,
                 reader: ShardFiles | None = None, trunk_reader: ShardFiles | None = None,
                 expert_reader: ShardFiles | None = None, progress=None):
        self.config = cfg
        if layout is None:  # the runner passes the layout it already validated
            layout = CheckpointLayout(cfg, CheckpointIndex.open(model_dir), n_layers)
            layout.validate()
        self.layout = layout
        self.index = layout.index
        self.n_layers = self.layout.n_layers
        self.reader = reader if reader is not None else ShardFiles()
        self.ultra = ultra
        self.bytes_read = 0
        t0 = time.perf_counter()

        # model tables
        self._globals = {}
        for rel, sp in global_specs(cfg).items():
            if rel in ("embed_tokens.weight", "lm_head.weight") and ultra:
                continue
            self._globals[rel] = self._load(rel, sp.kind)
        if ultra:
            self._embed = StreamedEmbedding(self.layout.info("embed_tokens.weight"), self.reader)
            head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            self._globals["lm_head.weight"] = self._head = StreamedRows(self.layout.info(head), self.reader)
        else:
            self._embed = None
            if cfg.tie_word_embeddings:
                self._globals["lm_head.weight"] = self._globals["embed_tokens.weight"]

        # trunk
        self.trunk = None
        self._layers = None
        if trunk_dir is not None:
            from .trunk import PackedTrunk, TrunkStreamer
            packed = trunk_dir if isinstance(trunk_dir, PackedTrunk) else PackedTrunk.open(trunk_dir, cfg, self.index)
            self.trunk = TrunkStreamer(packed, trunk_budget, ring=ring, order=pin_order, io_threads=io_threads,
                                       reader=trunk_reader, n_layers=self.n_layers)
        else:
            self._layers = read_trunk_layers(self.layout, self.reader, progress)
            self.bytes_read += self.resident_trunk_bytes

        # experts
        self.cache = ExpertCache(self.layout, cache_budget, reader=expert_reader or self.reader,
                                 io_threads=io_threads, trace=trace)
        self.max_experts_per_call = self.cache.max_experts_per_call
        self.load_seconds = time.perf_counter() - t0

    def _load(self, rel, kind):
        self.bytes_read += self.layout.info(rel).nbytes
        return read_weight(self.layout, self.reader, rel, kind)

    # ---- WeightProvider ----
    def global_weight(self, name):
        return self._globals[name]

    def embed(self, ids):
        if self._embed is not None:
            return self._embed.rows_for(list(ids))
        return self._globals["embed_tokens.weight"][torch.as_tensor(list(ids), dtype=torch.long)].to(torch.float32)

    def layer(self, i):
        if self.trunk is not None:
            return self.trunk.layer(i)
        return self._layers[i]

    def release_layer(self, i):
        if self.trunk is not None:
            self.trunk.release_layer(i)

    def experts(self, i, ids):
        return self.cache.experts(i, ids)

    # ---- reporting ----
    @property
    def resident_trunk_bytes(self) -> int:
        if self._layers is None:
            return 0
        return tensor_bytes(t for layer in self._layers for t in layer.values())

    def table_bytes(self) -> int:
        if self.ultra:
            return self._embed.bytes_read + self._head.bytes_read
        return 0

    def close(self):
        if self.trunk is not None:
            self.trunk.close()
