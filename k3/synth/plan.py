"""The plan of a synthetic checkpoint: its config and the exact shard layout (every
tensor's name, shape and dtype, in on-disk order), decided before any data is drawn.

Layout invariants (the release's, and what readers are tested against):
* each layer's non-expert tensors form ONE gap-free run inside one shard;
* each routed expert's tensors form one contiguous run in the release order
  (w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale);
* experts are not in id order inside a shard (seeded permutation), the layer's trunk
  run sits between experts, and the last few experts of a layer spill into the next
  layer's shard (harder than the release, on purpose: readers must use the index);
* embedding/norm/lm_head in a shard of their own; K3 adds a last shard holding two
  small vision tensors (`vision_tower.*`, `mm_projector.*`) that the text reader ignores.

Dtypes: K3 stores `A_log`, `dt_bias`, `e_score_correction_bias`, `{q,k,v}_conv1d.weight`
and `o_norm.weight` as F32, packed experts as U8, everything else BF16; K3's `A_log` is
zero-padded to a multiple of 128. Kimi-Linear is all BF16 (`A_log` [1, 1, H, 1]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig, parse_config
from ..errors import UsageError
from ..schema import expert_specs, global_specs, layer_specs
from .draw import _stream
from .presets import _resolve, build_config

_F32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias", "_conv1d.weight", "o_norm.weight")


@dataclass(frozen=True)
class _T:
    """One tensor to write: full name, name relative to the model prefix (None for
    vision), shape, safetensors dtype."""

    name: str
    rel: str | None
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (4 if self.dtype == "F32" else 1 if self.dtype == "U8" else 2)


@dataclass(frozen=True)
class _Expert:
    layer: int
    expert: int
    tensors: tuple[_T, ...]  # in on-disk order

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class SynthPlan:
    """What `synthesize` writes, decided before any data is drawn."""

    preset: str
    arch: str
    seed: int
    raw_config: dict
    cfg: ModelConfig
    prefix: str
    head_name: str
    expert_mode: str  # "encode" | "packed" | "bf16"
    shard_names: list[str]
    shards: list[list]  # per shard: ordered _T / _Expert items

    @property
    def total_bytes(self) -> int:
        return sum(it.nbytes for sh in self.shards for it in sh)

    def shard_bytes(self, k: int) -> int:
        return sum(it.nbytes for it in self.shards[k])

    def tensors(self):
        for sh in self.shards:
            for it in sh:
                yield from (it.tensors if isinstance(it, _Expert) else (it,))


def _pad128(n: int) -> int:
    return (n + 127) // 128 * 128


def make_plan(preset: str = "tiny", arch: str = "k3", seed: int = 0, layers: int | None = None,
              experts: int | None = None, vocab: int | None = None) -> SynthPlan:
    """The config and the exact shard layout for a preset (no tensor data)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"synth: --seed must be a non-negative integer, got {seed!r}.")
    p = _resolve(preset, arch, layers, experts, vocab)
    raw = build_config(preset, arch, layers, experts, vocab)
    cfg = parse_config(raw, source=f"<synth {preset}/{arch}>")
    k3 = arch == "k3"
    prefix, head = ("language_model.model.", "language_model.lm_head.weight") if k3 else ("model.", "lm_head.weight")

    def full(rel: str) -> str:
        return head if rel == "lm_head.weight" else prefix + rel

    def dtype(rel: str) -> str:
        return "F32" if k3 and rel.endswith(_F32_SUFFIXES) else "BF16"

    def tensor(rel: str, shape) -> _T:
        if rel.endswith("A_log"):
            H = cfg.kda_num_heads
            shape = (_pad128(H),) if k3 else (1, 1, H, 1)
        return _T(full(rel), rel, tuple(shape), dtype(rel))

    quantized = cfg.expert_quant == "mxfp4"
    expert_mode = p.get("expert_mode", "bf16") if quantized else "bf16"
    especs = expert_specs(cfg, quantized)

    def expert(i: int, e: int) -> _Expert:
        ts = []
        for rel, (shape, kind) in especs.items():
            r = f"layers.{i}.block_sparse_moe.experts.{e}.{rel}"
            ts.append(_T(full(r), r, tuple(shape), "U8" if kind == "U8" else "BF16"))
        return _Expert(i, e, tuple(ts))

    shards: list[list] = []
    carry: list[_Expert] = []
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    E = cfg.num_experts
    for i in range(cfg.num_hidden_layers):
        trunk = [tensor(f"layers.{i}.{rel}", sp.shape) for rel, sp in layer_specs(cfg, i).items()]
        if not cfg.is_moe(i):
            shards.append(carry + trunk)
            carry = []
            continue
        perm = np.random.Generator(_stream(seed, f"expert-order/{i}")).permutation(E).tolist()
        if perm == sorted(perm) and E > 1:
            perm[0], perm[1] = perm[1], perm[0]
        ex = [expert(i, e) for e in perm]
        spill = max(1, E // 8) if (i != moe_layers[-1] and E >= 4) else 0
        head_n = E // 3
        shards.append(carry + ex[:head_n] + trunk + ex[head_n:E - spill])
        carry = ex[E - spill:]
    if carry:  # pragma: no cover - the last MoE layer never spills
        shards[-1].extend(carry)
    shards.append([tensor(rel, sp.shape) for rel, sp in global_specs(cfg).items()])
    if k3:
        vt = raw["vision_config"]["vt_hidden_size"]
        shards.append([
            _T("vision_tower.patch_embed.proj.weight", None, (vt, 3, 14, 14), "BF16"),
            _T("mm_projector.post_norm.weight", None, (cfg.hidden_size,), "BF16"),
        ])
    n = len(shards)
    fmt = "model-{i:05d}-of-{n:06d}.safetensors" if k3 else "model-{i:05d}-of-{n:05d}.safetensors"
    names = [fmt.format(i=k + 1, n=n) for k in range(n)]
    return SynthPlan(preset, arch, seed, raw, cfg, prefix, head, expert_mode, names, shards)


def describe_plan(preset: str = "tiny", arch: str = "k3", seed: int = 0, layers: int | None = None,
                  experts: int | None = None, vocab: int | None = None) -> list[str]:
    """What `synthesize` would write (`k3 synth --dry-run`): one line per shard."""
    plan = make_plan(preset, arch, seed, layers, experts, vocab)
    out = [plan.cfg.summary().replace("<synth", "synth").replace(">", "")]
    for name, sh in zip(plan.shard_names, plan.shards):
        n = sum(len(it.tensors) if isinstance(it, _Expert) else 1 for it in sh)
        out.append(f"  {name}: {n} tensors, {sum(it.nbytes for it in sh) / 1e6:.1f} MB")
    out.append(f"total {plan.total_bytes / 1e6:.1f} MB in {len(plan.shards)} shards")
    return out
