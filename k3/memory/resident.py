"""Resident weight provider: the whole trunk read into RAM from the shards, routed
experts read on first use and kept.

Before anything is read the checkpoint is checked against the model's tensor graph
(k3.model.schema): every tensor present, shapes and dtypes right, so a partial download
or a mismatched config is refused up front with the layers and tensors named.
Matrices stay as stored (BF16/F32, MXFP4 packed bytes); small vectors are widened to
fp32 once.
"""

from __future__ import annotations

import threading
import time

import torch

from ..checkpoint.io import ShardFiles, load_tensor
from ..checkpoint.safetensors import CheckpointIndex
from ..errors import CheckpointError
from ..model.schema import alog_ok, expert_specs, global_specs, layer_specs
from ..model.weights import ExpertWeights, Mxfp4Weight

FLOAT_DTYPES = ("BF16", "F32", "F16")


def detect_prefix(index) -> tuple[str, str]:
    """(layer/global prefix, lm_head name) used by this checkpoint."""
    for model_p, head in (("language_model.model.", "language_model.lm_head.weight"),
                          ("model.", "lm_head.weight"), ("", "lm_head.weight")):
        if model_p + "embed_tokens.weight" in index:
            return model_p, head
    raise CheckpointError(
        f"{index.model_dir}: no embedding tensor found (looked for "
        "`language_model.model.embed_tokens.weight` and `model.embed_tokens.weight`). "
        "This does not look like a K3 or Kimi-Linear checkpoint, or the shard holding "
        "the embedding is missing.")


class CheckpointLayout:
    """Maps relative tensor names to the checkpoint's TensorInfo and validates them."""

    def __init__(self, cfg, index, n_layers: int | None = None):
        self.cfg = cfg
        self.index = index
        self.n_layers = cfg.num_hidden_layers if n_layers is None else n_layers
        self.prefix, self.head = detect_prefix(index)

    def full(self, rel: str) -> str:
        if rel == "lm_head.weight":
            return self.head
        name = self.prefix + rel
        if ".mlp." in rel and name not in self.index:
            # transformers' save_pretrained writes the dense layer as block_sparse_moe.*
            alias = name.replace(".mlp.", ".block_sparse_moe.")
            if alias in self.index:
                return alias
        return name

    def info(self, rel: str):
        return self.index.get(self.full(rel))

    def expert_quantized(self, layer: int, e: int) -> dict[str, bool]:
        """Which of the expert's matrices are stored packed (MXFP4)."""
        p = self.full(f"layers.{layer}.block_sparse_moe.experts.{e}.")
        return {w: p + w + ".weight_packed" in self.index for w in ("w1", "w2", "w3")}

    def expert_tensors(self, layer: int, e: int) -> dict:
        """The routed expert's TensorInfos by relative name (`w1.weight_packed`,
        `w1.weight_scale`, ... or `w1.weight` for an unpacked matrix), in release order.
        A missing tensor is a CheckpointError. (The seam k3.memory.expert_cache uses.)"""
        p = f"layers.{layer}.block_sparse_moe.experts.{e}."
        return {rel: self.index.get(self.full(p + rel))
                for rel in expert_specs(self.cfg, self.expert_quantized(layer, e))}

    def validate(self) -> None:
        cfg, problems, missing_layers = self.cfg, [], set()

        def check(rel, shape, kind, layer=None):
            name = self.full(rel)
            if name not in self.index:
                problems.append(f"missing `{name}`")
                if layer is not None:
                    missing_layers.add(layer)
                return
            ti = self.index.get(name)
            if kind == "alog":
                ok_shape = alog_ok(ti.shape, cfg.kda_num_heads)
            else:
                ok_shape = tuple(ti.shape) == tuple(shape)
            if not ok_shape:
                problems.append(f"`{name}` has shape {list(ti.shape)}, the config implies {list(shape)}")
            if kind == "U8" and ti.dtype != "U8":
                problems.append(f"`{name}` is {ti.dtype}, expected U8 (packed MXFP4)")
            if kind in ("matrix", "vector", "alog", "float") and ti.dtype not in FLOAT_DTYPES:
                problems.append(f"`{name}` is {ti.dtype}, expected BF16 or F32")

        for rel, sp in global_specs(cfg).items():
            check(rel, sp.shape, sp.kind)
        for i in range(self.n_layers):
            for rel, sp in layer_specs(cfg, i).items():
                check(f"layers.{i}.{rel}", sp.shape, sp.kind, i)
            if cfg.is_moe(i):
                for e in range(cfg.num_experts):
                    q = self.expert_quantized(i, e)
                    for rel, (shape, kind) in expert_specs(cfg, q).items():
                        check(f"layers.{i}.block_sparse_moe.experts.{e}.{rel}", shape, kind, i)
        if problems:
            head = ""
            if missing_layers:
                head = (f"{len(missing_layers)} of {self.n_layers} layers are missing tensors in this shard "
                        "set; a partial download cannot run the model. ")
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise CheckpointError(
                f"{self.index.model_dir}: the checkpoint does not match its config ({len(problems)} problem"
                f"{'s' if len(problems) != 1 else ''}). {head}{shown}. Re-download the missing or damaged "
                "shards, or point --config at the config this checkpoint was written with.")


def read_weight(layout, reader, rel: str, kind: str) -> torch.Tensor:
    """One tensor as stored (O_DIRECT for large ones); small vectors widened to fp32."""
    t = load_tensor(layout.info(rel), reader, direct=True)
    return t.to(torch.float32) if kind in ("vector", "alog") else t


def read_trunk_layers(layout, reader, progress=None) -> list[dict]:
    """Every layer's non-expert tensors, in RAM, keyed by relative name."""
    layers = []
    for i in range(layout.n_layers):
        layers.append({rel: read_weight(layout, reader, f"layers.{i}.{rel}", sp.kind)
                       for rel, sp in layer_specs(layout.cfg, i).items()})
        if progress is not None:
            progress(i)
    return layers


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ResidentWeights:
    """WeightProvider that holds every trunk tensor in RAM (read once at load)."""

    def __init__(self, cfg, model_dir, n_layers: int | None = None, reader: ShardFiles | None = None,
                 index: CheckpointIndex | None = None, progress=None):
        self.config = cfg
        self.index = index if index is not None else CheckpointIndex.open(model_dir)
        self.layout = CheckpointLayout(cfg, self.index, n_layers)
        self.layout.validate()
        self.reader = reader if reader is not None else ShardFiles()
        self.n_layers = self.layout.n_layers
        self._lock = threading.Lock()
        self.bytes_read = 0
        t0 = time.perf_counter()
        self._globals = {rel: self._load(rel, sp.kind) for rel, sp in global_specs(cfg).items()}
        if cfg.tie_word_embeddings:
            self._globals["lm_head.weight"] = self._globals["embed_tokens.weight"]
        self._layers = read_trunk_layers(self.layout, self.reader, progress)
        self.bytes_read += tensor_bytes(t for layer in self._layers for t in layer.values())
        self._experts: dict[tuple[int, int], ExpertWeights] = {}
        self.load_seconds = time.perf_counter() - t0

    def _load(self, rel: str, kind: str) -> torch.Tensor:
        t = read_weight(self.layout, self.reader, rel, kind)
        self.bytes_read += self.layout.info(rel).nbytes
        return t

    # ---- WeightProvider ----
    def global_weight(self, name):
        return self._globals[name]

    def embed(self, ids):
        return self._globals["embed_tokens.weight"][torch.as_tensor(list(ids), dtype=torch.long)].to(torch.float32)

    def layer(self, i):
        return self._layers[i]

    def release_layer(self, i):
        pass

    def experts(self, i, ids):
        out = {}
        for e in ids:
            key = (i, e)
            ew = self._experts.get(key)
            if ew is None:
                ew = self._load_expert(i, e)
                with self._lock:
                    self._experts[key] = ew
            out[e] = ew
        return out

    def _load_expert(self, i, e) -> ExpertWeights:
        p = f"layers.{i}.block_sparse_moe.experts.{e}."
        q = self.layout.expert_quantized(i, e)
        ws = [Mxfp4Weight(self._load(p + f"{w}.weight_packed", "U8"), self._load(p + f"{w}.weight_scale", "U8"))
              if q[w] else self._load(p + f"{w}.weight", "matrix") for w in ("w1", "w2", "w3")]
        return ExpertWeights(*ws)

    @property
    def resident_bytes(self) -> int:
        return tensor_bytes(list(self._globals.values()) + [t for layer in self._layers for t in layer.values()])
