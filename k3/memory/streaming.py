"""The weight provider every run uses: the trunk held in RAM or streamed from a packed
trunk (pinned layers + a ring filled by reader threads), routed experts through a
fixed-size LRU cache, the model tables held or streamed (ultra-low-memory) - each as
the memory plan says.

It implements k3.model.weights.WeightProvider; the math cannot tell how the weights are
held, and the tests check that the logits are bit-identical at every plan.
"""

from __future__ import annotations

import time

import torch

from .. import env
from ..checkpoint.io import ShardFiles, load_tensor, load_tensors
from ..checkpoint.layout import CheckpointLayout
from ..schema import global_specs, layer_specs
from .expert_cache import ExpertCache, expert_slot_bytes
from .planner import ModelSizes, Plan
from .tables import StreamedEmbedding, StreamedRows


def read_weight(layout: CheckpointLayout, reader: ShardFiles, rel: str, kind: str) -> torch.Tensor:
    """One tensor as stored (O_DIRECT for large ones); small vectors widened to fp32."""
    t = load_tensor(layout.info(rel), reader, direct=True)
    return t.to(torch.float32) if kind in ("vector", "alog") else t


def model_sizes(layout: CheckpointLayout, packed=None, tables: bool = True) -> ModelSizes:
    """The sizes the planner needs, from the checkpoint (and the packed trunk, whose
    4096-rounded layer runs are what streaming allocates), for the layout's layers;
    without the model tables when ``tables`` is False (a pipeline stage other than the
    first holds none)."""
    cfg = layout.cfg
    ids = layout.layer_ids
    layer_bytes = (packed.layer_bytes[ids.start:ids.stop] if packed is not None
                   else [layout.layer_nbytes(i) for i in ids])
    tables = layout.table_nbytes() if tables else {}
    moe = [i for i in ids if cfg.is_moe(i)]
    return ModelSizes(
        layer_bytes=tuple(layer_bytes), table_bytes=sum(tables.values()),
        head_bytes=tables.get("lm_head.weight", tables.get("embed_tokens.weight", 0)),
        slot_bytes=expert_slot_bytes(layout) if moe else 0,
        expert_bytes=layout.expert_nbytes(moe[0], 0) if moe else 0,
        moe_layers=len(moe), experts=cfg.num_experts, top_k=cfg.num_experts_per_token)


class StreamingWeights:
    """The WeightProvider of a run, built from a memory plan.

    ``packed``: an opened PackedTrunk when the plan streams the trunk (``plan.trunk``);
    ``reader`` reads the tables and the resident trunk, ``trunk_reader`` and
    ``expert_reader`` the streamed trunk and the experts (separate so that tests can
    inject read faults into one of them)."""

    def __init__(self, layout: CheckpointLayout, plan: Plan, packed=None, *, trace: bool = False,
                 reader: ShardFiles | None = None, trunk_reader: ShardFiles | None = None,
                 expert_reader: ShardFiles | None = None, progress=None, tables: bool = True):
        cfg = self.config = layout.cfg
        self.layout = layout
        self.n_layers = layout.n_layers
        self.first = layout.first  # a pipeline stage holds layers first .. n_layers - 1 only
        self.reader = reader if reader is not None else ShardFiles()
        self.ultra = plan.stream_tables and tables
        self.bytes_read = 0  # bytes read at load time (tables, resident trunk)
        t0 = time.perf_counter()

        # model tables
        self._globals = {}
        for rel, sp in global_specs(cfg).items():
            if (rel in ("embed_tokens.weight", "lm_head.weight") and self.ultra) or not tables:
                continue
            self._globals[rel] = self._load(rel, sp.kind)
        if not tables:
            self._embed = None
        elif self.ultra:
            self._embed = StreamedEmbedding(layout.info("embed_tokens.weight"), self.reader)
            head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            self._globals["lm_head.weight"] = self._head = StreamedRows(layout.info(head), self.reader)
        else:
            self._embed = None
            if cfg.tie_word_embeddings:
                self._globals["lm_head.weight"] = self._globals["embed_tokens.weight"]

        # trunk
        self.trunk = None
        self._layers = None
        if plan.trunk is not None:
            from .trunk import TrunkStreamer
            packed = packed.slice(self.first, self.n_layers)  # the layers this provider holds
            self.trunk = TrunkStreamer(packed, plan.trunk, io_threads=plan.budgets.io_threads, reader=trunk_reader)
        else:
            self._layers = []
            for i in layout.layer_ids:
                self._layers.append(self._load_layer(i))
                if progress is not None:
                    progress(i)

        # experts
        self.cache = ExpertCache(layout, plan.cache_slots, reader=expert_reader or self.reader,
                                 io_threads=plan.budgets.io_threads, trace=trace)
        self.load_seconds = time.perf_counter() - t0

    def _load_layer(self, i) -> dict:
        """Layer i's tensors for a resident trunk: its matrices in one huge-page buffer
        (``load_tensors``: the kernels stream them), its small vectors widened to fp32."""
        specs = layer_specs(self.config, i)
        mats = [rel for rel, sp in specs.items() if sp.kind == "matrix"]
        infos = [self.layout.info(f"layers.{i}.{rel}") for rel in mats]
        self.bytes_read += sum(info.nbytes for info in infos)
        got = dict(zip(mats, load_tensors(infos, self.reader)))
        return {rel: got[rel] if rel in got else self._load(f"layers.{i}.{rel}", sp.kind) for rel, sp in specs.items()}

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
            return self.trunk.layer(i - self.first)
        return self._layers[i - self.first]

    def release_layer(self, i):
        if self.trunk is not None:
            self.trunk.release_layer(i - self.first)

    def expert_groups(self, i, ids):
        # each missing expert's math starts when its read completes (K3_EXPERT_STREAM=0: after all)
        return self.cache.groups(i, ids, stream=env.expert_stream())

    def resident_experts(self, i):
        return self.cache.resident_layer(i)

    def used_experts(self, i, ids):
        self.cache.note_hits(i, ids)

    # ---- reporting ----
    @property
    def resident_trunk_bytes(self) -> int:
        if self._layers is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in self._layers for t in layer.values())

    def table_bytes(self) -> int:
        """Bytes read from the streamed model tables so far (0 when they are held)."""
        if self.ultra:
            return self._embed.bytes_read + self._head.bytes_read
        return 0

    def counters(self) -> dict:
        """Cumulative I/O counters of the run (the engine reports their per-step deltas)."""
        cs = self.cache.stats()
        ts = self.trunk.stats() if self.trunk is not None else {}
        return {"expert_requests": cs["requests"], "expert_hits": cs["hits"], "expert_bytes_read": cs["bytes_read"],
                "expert_read_seconds": cs["read_seconds"], "trunk_bytes_read": ts.get("bytes_read", 0),
                "trunk_device_seconds": ts.get("device_seconds", 0.0), "table_bytes_read": self.table_bytes()}

    def close(self):
        if self.trunk is not None:
            self.trunk.close()
        self.cache.close()
