"""A checkpoint seen through the model's tensor graph (:mod:`k3.schema`): relative
tensor names mapped to the index's TensorInfo, checked before anything is read.

Every tensor present, shapes and dtypes right, so a partial download or a mismatched
config is refused up front with the layers and tensors named. The loader, the packer,
the expert cache and the doctor all look at a checkpoint through this one class.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..schema import alog_ok, expert_specs, global_specs, layer_specs
from .safetensors import CheckpointIndex, TensorInfo

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
    """Maps relative tensor names to the checkpoint's TensorInfo and validates them.
    ``n_layers`` limits it to the first layers (``--layers``); ``first`` starts it at a
    later layer (one stage of a pipeline over several processes, k3.pipeline): it then
    covers layers ``first .. n_layers - 1`` (``layer_ids``), indexed as in the model."""

    def __init__(self, cfg, index: CheckpointIndex, n_layers: int | None = None, first: int = 0):
        self.cfg = cfg
        self.index = index
        self.n_layers = cfg.num_hidden_layers if n_layers is None else n_layers
        if not 0 <= first < self.n_layers:
            raise ValueError(f"first layer {first} outside 0..{self.n_layers - 1}")
        self.first = first
        self.prefix, self.head = detect_prefix(index)

    @property
    def layer_ids(self) -> range:
        """The layers this layout covers (model indices)."""
        return range(self.first, self.n_layers)

    @classmethod
    def open(cls, cfg, model_dir, n_layers: int | None = None, *, validate: bool = True,
             first: int = 0, extra_dirs=()) -> "CheckpointLayout":
        layout = cls(cfg, CheckpointIndex.open(model_dir, extra_dirs), n_layers, first)
        if validate:
            layout.validate()
        return layout

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

    def info(self, rel: str) -> TensorInfo:
        return self.index.get(self.full(rel))

    # ---- the trunk
    def layer_infos(self, i: int) -> dict[str, TensorInfo]:
        """Layer i's non-expert tensors by relative name, in schema order."""
        return {rel: self.info(f"layers.{i}.{rel}") for rel in layer_specs(self.cfg, i)}

    def layer_nbytes(self, i: int) -> int:
        return sum(ti.nbytes for ti in self.layer_infos(i).values())

    def table_nbytes(self) -> dict[str, int]:
        """Bytes of the model tables (embedding, lm_head; one entry when tied)."""
        out = {"embed_tokens.weight": self.info("embed_tokens.weight").nbytes}
        if not self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.info("lm_head.weight").nbytes
        return out

    # ---- routed experts
    def expert_quantized(self, layer: int, e: int) -> dict[str, bool]:
        """Which of the expert's matrices are stored packed (MXFP4)."""
        p = self.full(f"layers.{layer}.block_sparse_moe.experts.{e}.")
        return {w: p + w + ".weight_packed" in self.index for w in ("w1", "w2", "w3")}

    def expert_tensors(self, layer: int, e: int) -> dict[str, TensorInfo]:
        """The routed expert's TensorInfos by relative name (`w1.weight_packed`,
        `w1.weight_scale`, ... or `w1.weight` for an unpacked matrix), in release order.
        A missing tensor is a CheckpointError."""
        p = f"layers.{layer}.block_sparse_moe.experts.{e}."
        return {rel: self.index.get(self.full(p + rel))
                for rel in expert_specs(self.cfg, self.expert_quantized(layer, e))}

    def expert_nbytes(self, layer: int, e: int) -> int:
        return sum(ti.nbytes for ti in self.expert_tensors(layer, e).values())

    # ---- checks
    def validate(self, experts: bool = True) -> None:
        """Refuse (CheckpointError, exit 3) a checkpoint that does not match its config:
        every global and layer tensor (and, with ``experts``, every routed expert)
        present with the shape and dtype the config implies."""
        cfg, problems, missing_layers = self.cfg, [], set()

        def check(rel, shape, kind, layer=None):
            name = self.full(rel)
            if name not in self.index:
                problems.append(f"missing `{name}`")
                if layer is not None:
                    missing_layers.add(layer)
                return
            ti = self.index.get(name)
            ok_shape = alog_ok(ti.shape, cfg.kda_num_heads) if kind == "alog" else tuple(ti.shape) == tuple(shape)
            if not ok_shape:
                problems.append(f"`{name}` has shape {list(ti.shape)}, the config implies {list(shape)}")
            if kind == "U8" and ti.dtype != "U8":
                problems.append(f"`{name}` is {ti.dtype}, expected U8 (packed MXFP4)")
            if kind in ("matrix", "vector", "alog", "float") and ti.dtype not in FLOAT_DTYPES:
                problems.append(f"`{name}` is {ti.dtype}, expected BF16 or F32")

        for rel, sp in global_specs(cfg).items():
            check(rel, sp.shape, sp.kind)
        for i in self.layer_ids:
            for rel, sp in layer_specs(cfg, i).items():
                check(f"layers.{i}.{rel}", sp.shape, sp.kind, i)
            if experts and cfg.is_moe(i):
                for e in range(cfg.num_experts):
                    q = self.expert_quantized(i, e)
                    for rel, (shape, kind) in expert_specs(cfg, q).items():
                        check(f"layers.{i}.block_sparse_moe.experts.{e}.{rel}", shape, kind, i)
        if problems:
            head = ""
            if missing_layers:
                head = (f"{len(missing_layers)} of {len(self.layer_ids)} layers are missing tensors in this shard "
                        "set; a partial download cannot run the model. ")
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise CheckpointError(
                f"{self.index.model_dir}: the checkpoint does not match its config ({len(problems)} problem"
                f"{'s' if len(problems) != 1 else ''}). {head}{shown}. Re-download the missing or damaged "
                "shards, or point --config at the config this checkpoint was written with.")
