"""Model configuration, read strictly from a checkpoint's config.json.

Three shapes are accepted:
  * K3's released nested form: top level `KimiK3ForConditionalGeneration`, the text model
    in `text_config`, KDA settings in `text_config.linear_attn_config`,
    `quantization_config` inside `text_config`;
  * Kimi-Linear's flat form (`KimiLinearForCausalLM`, `linear_attn_config` nested);
  * the flat fixture form of kimi-k3-in-c (`kda_num_heads`, `situ_beta`, ...).

Invariant: a structural field is never defaulted. Every missing or invalid field is
collected and the load is refused with all of them named. Only the three booleans the
C engine also defaults (`mla_use_output_gate`, `moe_renormalize`,
`latent_moe_use_norm`, all true on K3) and fields whose absence has a defined meaning
in the released configs (`q_lora_rank` null = plain q_proj, no `attn_res_block_size` =
plain residual, no `routed_expert_hidden_size` = experts in hidden space) have one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ConfigError

ARCH_K3 = "k3"
ARCH_KIMI_LINEAR = "kimi_linear"

# HF builds the MLA q_a/kv_a RMSNorms without an eps argument, so they use the class
# default 1e-6 (docs/MODEL.md §3.1); every other norm uses rms_norm_eps.
MLA_NORM_EPS = 1e-6
KDA_L2_EPS = 1e-6
MAX_TOPK = 64


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None  # set: sigmoid decay form (K3); None: softplus (Kimi-Linear)
    kda_full_rank_gate: bool  # K3: one g_proj; Kimi-Linear: g_a_proj/g_b_proj
    # MLA
    mla_num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    mla_layers: tuple[int, ...]  # 0-based
    # FFN / MoE
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    latent_size: int | None  # routed_expert_hidden_size; None = experts in hidden space
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    hidden_act: str  # "situ" or "silu"
    situ_beta: float
    situ_linear_beta: float | None
    attn_res_block_size: int | None  # None = plain pre-norm residual
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    expert_quant: str | None = None  # "mxfp4" when experts are packed
    expert_group_size: int = 32
    source: str = ""
    shape_kind: str = ""  # nested | flat | fixture
    mla_norm_eps: float = MLA_NORM_EPS
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived layer map -------------------------------------------------
    def is_mla(self, i: int) -> bool:
        return i in self.mla_layers

    def is_moe(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def n_mla(self) -> int:
        return len(self.mla_layers)

    @property
    def n_kda(self) -> int:
        return self.num_hidden_layers - self.n_mla

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_in(self) -> int:
        return self.latent_size if self.latent_size is not None else self.hidden_size

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    def fingerprint(self) -> str:
        """Stable hash of the structural fields (state files refuse a foreign model)."""
        d = asdict(self)
        for k in ("source", "shape_kind", "extra", "bos_token_id", "eos_token_id", "pad_token_id"):
            d.pop(k, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def summary(self) -> str:
        lat = f" | latent={self.latent_size}" if self.latent_size else ""
        return (
            f"config: {self.source} ({self.shape_kind} shape) | hidden={self.hidden_size} "
            f"layers={self.num_hidden_layers} vocab={self.vocab_size} | {self.n_mla} MLA + "
            f"{self.n_kda} KDA | experts {self.num_experts} topK {self.num_experts_per_token} "
            f"shared{self.num_shared_experts}{lat}"
        )


class _Fields:
    """Collects every problem before refusing, so the user fixes them all at once."""

    def __init__(self, d: dict, where: str):
        self.d = d
        self.where = where
        self.problems: list[str] = []

    def _raw(self, names):
        for n in names:
            if n in self.d and self.d[n] is not None:
                return n, self.d[n]
        return None, None

    def int(self, *names, min_value=1, optional=False, default=None):
        n, v = self._raw(names)
        if n is None:
            if not optional:
                self.problems.append(_missing(names))
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            self.problems.append(f"`{n}` must be an integer, got {v!r}")
            return default
        if v < min_value:
            self.problems.append(f"`{n}` must be >= {min_value}, got {v}")
            return default
        return v

    def float(self, *names, optional=False, default=None, positive=False):
        n, v = self._raw(names)
        if n is None:
            if not optional:
                self.problems.append(_missing(names))
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.problems.append(f"`{n}` must be a number, got {v!r}")
            return default
        if positive and not v > 0:
            self.problems.append(f"`{n}` must be > 0, got {v}")
            return default
        return float(v)

    def bool(self, *names, default):
        n, v = self._raw(names)
        if n is None:
            return default
        if not isinstance(v, bool):
            self.problems.append(f"`{n}` must be true or false, got {v!r}")
            return default
        return v

    def int_list(self, *names, optional=False):
        n, v = self._raw(names)
        if n is None:
            if not optional:
                self.problems.append(_missing(names))
            return None
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            self.problems.append(f"`{n}` must be a list of integers, got {v!r}")
            return None
        return v


def _missing(names) -> str:
    return "missing `" + "` (or `".join(names[:2]) + ("`)" if len(names) > 1 else "`")


def _token_id(v):
    if isinstance(v, list):
        v = v[0] if v else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_config(raw: dict, source: str = "<dict>") -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (any of the three shapes)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: config.json must hold a JSON object.")
    top = raw
    if isinstance(raw.get("text_config"), dict):
        text = dict(raw["text_config"])
        shape_kind = "nested"
    else:
        text = dict(raw)
        shape_kind = "flat"
    lac = text.get("linear_attn_config")
    lac = lac if isinstance(lac, dict) else {}
    if "kda_num_heads" in text or "situ_beta" in text:
        shape_kind = "fixture"
    # K3 = the Attention-Residual stack. Anything that declares it (nested K3, fixture
    # configs) is K3; a config without it is Kimi-Linear's plain residual stack.
    model_type = str(top.get("model_type", ""))
    k3_only = ("attn_res_block_size", "routed_expert_hidden_size", "activation_situ_beta", "situ_beta",
               "latent_moe_use_norm", "gate_lower_bound")
    is_k3 = (model_type == "kimi_k3" or text.get("hidden_act") == "situ"
             or any(k in text or k in lac for k in k3_only))
    arch = ARCH_K3 if is_k3 else ARCH_KIMI_LINEAR

    # Lookups try the nested linear_attn_config spelling, then the flat spellings.
    merged = {**text, **lac}
    f = _Fields(merged, source)

    hidden = f.int("hidden_size")
    n_layers = f.int("num_hidden_layers")
    vocab = f.int("vocab_size")
    eps = f.float("rms_norm_eps", positive=True)
    tie = f.bool("tie_word_embeddings", default=False)

    kda_heads = f.int("num_heads", "kda_num_heads", "linear_num_heads")
    # A top-level `head_dim` (72 in Kimi-Linear's file) is unused; the KDA one lives in
    # linear_attn_config.
    kda_dim = (_Fields(lac, source).int("head_dim") if "head_dim" in lac
               else f.int("kda_head_dim", "linear_head_dim"))
    conv_k = f.int("short_conv_kernel_size", "linear_conv_kernel_dim")
    lb = f.float("gate_lower_bound", optional=True)
    if arch == ARCH_K3 and lb is None:
        f.problems.append("missing `linear_attn_config.gate_lower_bound` (K3 uses -5.0, the sigmoid decay form)")
    if lb is not None and not lb < 0:
        f.problems.append(f"`gate_lower_bound` must be negative, got {lb}")
    full_rank = f.bool("use_full_rank_gate", default=(arch == ARCH_K3))

    mla_heads = f.int("num_attention_heads")
    q_lora = f.int("q_lora_rank", optional=True)
    kv_lora = f.int("kv_lora_rank")
    nope = f.int("qk_nope_head_dim")
    rope = f.int("qk_rope_head_dim", min_value=0)
    v_dim = f.int("v_head_dim")
    out_gate = f.bool("mla_use_output_gate", default=(arch == ARCH_K3))
    if "mla_use_nope" in merged and merged["mla_use_nope"] is not True:
        f.problems.append("`mla_use_nope` is false: rotary MLA is not part of K3/Kimi-Linear and is not supported")

    full_attn = f.int_list("full_attn_layers")
    kda_layers = f.int_list("kda_layers", optional=True)

    inter = f.int("intermediate_size")
    first_dense = f.int("first_k_dense_replace", min_value=0)
    freq = f.int("moe_layer_freq", optional=True, default=1)
    n_exp = f.int("num_experts", "n_routed_experts", "num_local_experts")
    topk = f.int("num_experts_per_token", "num_experts_per_tok")
    n_shared = f.int("num_shared_experts", "n_shared_experts", min_value=0)
    moe_inter = f.int("moe_intermediate_size")
    latent = f.int("routed_expert_hidden_size", optional=True)
    latent_norm = f.bool("latent_moe_use_norm", default=True)
    scale = f.float("routed_scaling_factor")
    renorm = f.bool("moe_renormalize", "norm_topk_prob", default=True)
    router_act = merged.get("moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        f.problems.append(f"`moe_router_activation_func` is {router_act!r}; only the sigmoid router is supported")
    ngroups = merged.get("num_expert_group", 1)
    if ngroups not in (None, 1):
        f.problems.append(f"`num_expert_group` is {ngroups}; grouped top-k with more than one group is not supported")

    act = merged.get("hidden_act")
    if shape_kind == "fixture" and act is None:
        act = "situ"
    if act not in ("situ", "silu"):
        f.problems.append(f"`hidden_act` must be \"situ\" (K3) or \"silu\" (Kimi-Linear), got {act!r}")
    beta1 = f.float("activation_situ_beta", "situ_beta", optional=True)
    beta2 = f.float("activation_situ_linear_beta", "situ_linear_beta", optional=True)
    if act == "situ" and beta1 is None:
        beta1 = 1.0  # MODEL.md §3.5: an absent activation_situ_beta means 1
    ar_block = f.int("attn_res_block_size", optional=True)
    if arch == ARCH_K3 and ar_block is None:
        f.problems.append("missing `attn_res_block_size` (K3's Attention Residual block size)")

    # ---- structural checks ----------------------------------------------------
    mla_layers: tuple[int, ...] = ()
    if n_layers and full_attn is not None:
        bad = [x for x in full_attn if not 1 <= x <= n_layers]
        if bad:
            f.problems.append(
                f"`full_attn_layers` is ONE-based and must lie in 1..{n_layers}; out of range: {bad}")
        elif len(set(full_attn)) != len(full_attn):
            f.problems.append("`full_attn_layers` has duplicate entries")
        else:
            mla_layers = tuple(sorted(x - 1 for x in full_attn))
        if kda_layers is not None and not bad:
            badk = [x for x in kda_layers if not 1 <= x <= n_layers]
            if badk:
                f.problems.append(f"`kda_layers` is ONE-based and must lie in 1..{n_layers}; out of range: {badk}")
            elif sorted(set(kda_layers) | set(full_attn)) != list(range(1, n_layers + 1)) or set(kda_layers) & set(full_attn):
                f.problems.append("`kda_layers` and `full_attn_layers` must partition 1..num_hidden_layers exactly")
    if topk and n_exp:
        if topk > n_exp:
            f.problems.append(f"`num_experts_per_token` ({topk}) exceeds `num_experts` ({n_exp})")
        if topk > MAX_TOPK:
            f.problems.append(f"`num_experts_per_token` ({topk}) exceeds the supported maximum {MAX_TOPK}")
    quant = None
    group = 32
    qc = text.get("quantization_config", top.get("quantization_config"))
    if isinstance(qc, dict):
        fmt = qc.get("format")
        if fmt is not None and fmt != "mxfp4-pack-quantized":
            f.problems.append(f"`quantization_config.format` is {fmt!r}; only \"mxfp4-pack-quantized\" is supported")
        else:
            quant = "mxfp4"
            for g in (qc.get("config_groups") or {}).values():
                w = (g or {}).get("weights") or {}
                if "group_size" in w:
                    group = w["group_size"]
                    if w.get("num_bits", 4) != 4 or w.get("type", "float") != "float":
                        f.problems.append("`quantization_config` weights must be 4-bit float (MXFP4)")
            if group != 32:
                f.problems.append(f"MXFP4 group size must be 32, got {group}")
            for name, width in (("moe_intermediate_size", moe_inter), ("routed_expert_hidden_size / hidden_size", latent or hidden)):
                if width and width % group:
                    f.problems.append(f"`{name}` ({width}) is not a multiple of the MXFP4 group size {group}")
    if f.problems:
        raise ConfigError(
            f"{source}: the model config could not be read with confidence ({len(f.problems)} problem"
            f"{'s' if len(f.problems) != 1 else ''}): " + "; ".join(f.problems) +
            ". k3 never guesses a structural field; fix config.json (compare with the release's) and retry.")

    return ModelConfig(
        arch=arch, hidden_size=hidden, num_hidden_layers=n_layers, vocab_size=vocab, rms_norm_eps=eps,
        tie_word_embeddings=tie, kda_num_heads=kda_heads, kda_head_dim=kda_dim, conv_kernel=conv_k,
        gate_lower_bound=lb, kda_full_rank_gate=full_rank, mla_num_heads=mla_heads, q_lora_rank=q_lora,
        kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
        mla_use_output_gate=out_gate, mla_layers=mla_layers, intermediate_size=inter,
        first_k_dense_replace=first_dense, moe_layer_freq=freq, num_experts=n_exp,
        num_experts_per_token=topk, num_shared_experts=n_shared, moe_intermediate_size=moe_inter,
        latent_size=latent, latent_moe_use_norm=latent_norm, routed_scaling_factor=scale,
        moe_renormalize=renorm, hidden_act=act, situ_beta=beta1 if beta1 is not None else 1.0,
        situ_linear_beta=beta2, attn_res_block_size=ar_block,
        bos_token_id=_token_id(top.get("bos_token_id", text.get("bos_token_id"))),
        eos_token_id=_token_id(top.get("eos_token_id", text.get("eos_token_id"))),
        pad_token_id=_token_id(top.get("pad_token_id", text.get("pad_token_id"))),
        expert_quant=quant, expert_group_size=group, source=source, shape_kind=shape_kind,
    )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read config.json (or a model folder containing one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{p}: no config.json here. Point k3 at the model folder that holds config.json, "
            f"model.safetensors.index.json and the shards.") from None
    except OSError as e:
        raise ConfigError(f"{p}: config.json could not be read ({e.strerror}).") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: config.json is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).") from None
    return parse_config(raw, str(p))
