"""Model configuration, read strictly from a checkpoint's config.json.

Three shapes are accepted:
  * K3's released nested form: top level `KimiK3ForConditionalGeneration`, the text model
    in `text_config`, KDA settings in `text_config.linear_attn_config`,
    `quantization_config` inside `text_config`;
  * Kimi-Linear's flat form (`KimiLinearForCausalLM`, `linear_attn_config` nested);
  * the flat fixture form of kimi-k3-in-c (`kda_num_heads`, `situ_beta`, ...).

Every field is checked for its JSON type, finiteness (NaN / Infinity, which Python's
json reads, are refused) and range (LIMITS, FLOAT_RANGES) before anything is computed
from it, and a refusal names the field by its place in the file
(`text_config.linear_attn_config.num_heads`). The file itself is read by the one strict
JSON reader of k3's inputs (`read_json_file` / `loads_json`, at the end of this module,
shared with the tokenizer, sampling, checkpoint and state-file readers).

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
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ConfigError, UsageError
from .fsutil import json_kind, key_name, read_json_file, short_repr

ARCH_K3 = "k3"
ARCH_KIMI_LINEAR = "kimi_linear"

# HF builds the MLA q_a/kv_a RMSNorms without an eps argument, so they use the class
# default 1e-6 (docs/MODEL.md §3.1); every other norm uses rms_norm_eps.
MLA_NORM_EPS = 1e-6
KDA_L2_EPS = 1e-6
MAX_TOPK = 64

# Upper bounds on every size a config declares, checked before anything is sized from
# them (the planner, the tensor graph, a state file's shapes). Each is a few times
# (4-10x) Kimi K3's own value (docs/MODEL.md §1; the second number), so the released K3
# and Kimi-Linear configs and any plausible successor pass, while a damaged value (1e12,
# an extra run of zeros) is refused with the limit named instead of sizing a plan from it.
#   canonical field: (largest accepted, K3's value)
LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (65_536, 7168),
    "num_hidden_layers": (512, 93),
    "vocab_size": (1_048_576, 163_840),
    "kda_num_heads": (512, 96),
    "kda_head_dim": (512, 128),
    "short_conv_kernel_size": (16, 4),
    "num_attention_heads": (512, 96),
    "q_lora_rank": (8192, 1536),
    "kv_lora_rank": (4096, 512),
    "qk_nope_head_dim": (512, 128),
    "qk_rope_head_dim": (512, 64),
    "v_head_dim": (512, 128),
    "intermediate_size": (131_072, 33_792),
    "first_k_dense_replace": (512, 1),
    "moe_layer_freq": (512, 1),
    "num_experts": (4096, 896),
    "num_experts_per_token": (MAX_TOPK, 16),
    "num_shared_experts": (16, 2),
    "moe_intermediate_size": (16_384, 3072),
    "routed_expert_hidden_size": (65_536, 3584),
    "attn_res_block_size": (512, 12),
}
# Float fields: finite, and inside these (exclusive-low, inclusive-high) ranges.
#   rms_norm_eps: K3 1e-5 (models use 1e-12 .. 1e-5); routed_scaling_factor: K3 1.0,
#   Kimi-Linear 2.446; gate_lower_bound: K3 -5.0; SiTU betas: K3 4.0 / 25.0.
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 0.1),
    "routed_scaling_factor": (0.0, 100.0),
    "gate_lower_bound": (-1000.0, 0.0),
    "activation_situ_beta": (0.0, 1e4),
    "activation_situ_linear_beta": (0.0, 1e4),
}


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
    """Collects every problem before refusing, so the user fixes them all at once.
    `paths` maps a key of `d` to its dotted place in config.json, for the messages."""

    def __init__(self, d: dict, paths: dict[str, str] | None = None):
        self.d = d
        self.paths = paths or {}
        self.problems: list[str] = []

    def path(self, n: str) -> str:
        return self.paths.get(n, n)

    def _raw(self, names, src=None):
        """(name, value) of the first of `names` holding a value; (name, None) when
        only a null was found; (None, None) when none is present."""
        d = self.d if src is None else src
        null = None
        for n in names:
            if n in d:
                if d[n] is not None:
                    return n, d[n]
                null = null or n
        return null, None

    def _absent(self, names, n, optional: bool, kind: str) -> None:
        if optional:
            return
        if n is None:
            self.problems.append(_missing(names))
        else:
            self.problems.append(f"`{self.path(n)}` is null; it must be {kind}")

    def int(self, *names, min_value=1, optional=False, default=None, src=None, limit: str | None = None):
        n, v = self._raw(names, src)
        if v is None:
            self._absent(names, n, optional, "an integer")
            return default
        p = self.path(n)
        if isinstance(v, bool) or not isinstance(v, int):
            self.problems.append(f"`{p}` must be an integer, got {json_kind(v)}")
            return default
        if v < min_value:
            self.problems.append(f"`{p}` must be >= {min_value}, got {v}")
            return default
        lim = LIMITS.get(limit or names[0])
        if lim is not None and v > lim[0]:
            self.problems.append(
                f"`{p}` is {short_repr(v)}, larger than any plausible model: k3 accepts at most {lim[0]} "
                f"(K3 has {lim[1]})")
            return default
        return v

    def float(self, *names, optional=False, default=None):
        n, v = self._raw(names)
        if v is None:
            self._absent(names, n, optional, "a number")
            return default
        p = self.path(n)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.problems.append(f"`{p}` must be a number, got {json_kind(v)}")
            return default
        try:
            x = float(v)
        except OverflowError:  # an integer literal too large for a float
            x = math.inf
        if not math.isfinite(x):
            spelled = "NaN" if x != x else "Infinity" if x > 0 else "-Infinity"
            self.problems.append(f"`{p}` is {spelled}; it must be a finite number")
            return default
        rng = FLOAT_RANGES.get(names[0])
        if rng is not None and not rng[0] < x <= rng[1]:
            self.problems.append(f"`{p}` must be in ({rng[0]:g}, {rng[1]:g}], got {x:g}")
            return default
        return x

    def bool(self, *names, default):
        n, v = self._raw(names)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.problems.append(f"`{self.path(n)}` must be true or false, got {json_kind(v)}")
            return default
        return v

    def int_list(self, *names, optional=False):
        n, v = self._raw(names)
        if v is None:
            self._absent(names, n, optional, "a list of integers")
            return None
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            self.problems.append(f"`{self.path(n)}` must be a list of integers, got {short_repr(v)}")
            return None
        return v


def _missing(names) -> str:
    return "missing `" + "` (or `".join(names[:2]) + ("`)" if len(names) > 1 else "`")


def _token_id(v):
    if isinstance(v, list):
        v = v[0] if v else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _refuse(source: str, problems: list[str]) -> ConfigError:
    n = len(problems)
    return ConfigError(
        f"{source}: the model config could not be read with confidence ({n} problem{'s' if n != 1 else ''}): "
        + "; ".join(problems) +
        ". k3 never guesses a structural field; fix config.json (compare with the release's) and retry.")


def parse_config(raw: dict, source: str = "<dict>") -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (any of the three shapes).

    Every value is checked for its JSON type, finiteness and range (LIMITS,
    FLOAT_RANGES) before anything is computed from it; every problem is a ConfigError
    naming the field by its place in the file (e.g. `text_config.hidden_size`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: config.json must hold a JSON object, not {json_kind(raw)}.")
    top = raw
    problems: list[str] = []
    tc = raw.get("text_config")
    if tc is not None and not isinstance(tc, dict):
        raise _refuse(source, [f"`text_config` (the text model's settings) must be an object, got {json_kind(tc)}"])
    if isinstance(tc, dict):
        text = dict(tc)
        shape_kind = "nested"
        prefix = "text_config."
    else:
        text = dict(raw)
        shape_kind = "flat"
        prefix = ""
    lac = text.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        problems.append(f"`{prefix}linear_attn_config` must be an object, got {json_kind(lac)}")
    lac = lac if isinstance(lac, dict) else {}
    if "kda_num_heads" in text or "situ_beta" in text:
        shape_kind = "fixture"
    # K3 = the Attention-Residual stack. Anything that declares it (nested K3, fixture
    # configs) is K3; a config without it is Kimi-Linear's plain residual stack.
    model_type = top.get("model_type", "")
    k3_only = ("attn_res_block_size", "routed_expert_hidden_size", "activation_situ_beta", "situ_beta",
               "latent_moe_use_norm", "gate_lower_bound")
    is_k3 = (model_type == "kimi_k3" or text.get("hidden_act") == "situ"
             or any(k in text or k in lac for k in k3_only))
    arch = ARCH_K3 if is_k3 else ARCH_KIMI_LINEAR

    # Lookups try the nested linear_attn_config spelling, then the flat spellings.
    merged = {**text, **lac}
    paths = {k: prefix + k for k in text}
    paths.update({k: f"{prefix}linear_attn_config.{k}" for k in lac})
    f = _Fields(merged, paths)
    f.problems += problems

    hidden = f.int("hidden_size")
    n_layers = f.int("num_hidden_layers")
    vocab = f.int("vocab_size")
    eps = f.float("rms_norm_eps")
    tie = f.bool("tie_word_embeddings", default=False)

    kda_heads = f.int("num_heads", "kda_num_heads", "linear_num_heads", limit="kda_num_heads")
    # A top-level `head_dim` (72 in Kimi-Linear's file) is unused; the KDA one lives in
    # linear_attn_config.
    kda_dim = (f.int("head_dim", src=lac, limit="kda_head_dim") if "head_dim" in lac
               else f.int("kda_head_dim", "linear_head_dim", limit="kda_head_dim"))
    conv_k = f.int("short_conv_kernel_size", "linear_conv_kernel_dim")
    lb = f.float("gate_lower_bound", optional=True)
    if arch == ARCH_K3 and merged.get("gate_lower_bound") is None:  # absent or null (an invalid one is named above)
        f.problems.append(("missing `linear_attn_config.gate_lower_bound`" if "gate_lower_bound" not in merged
                           else f"`{f.path('gate_lower_bound')}` is null") +
                          " (K3 uses -5.0, the sigmoid decay form)")
    if lb is not None and not lb < 0:
        f.problems.append(f"`{f.path('gate_lower_bound')}` must be negative, got {lb}")
    full_rank = f.bool("use_full_rank_gate", default=(arch == ARCH_K3))

    mla_heads = f.int("num_attention_heads")
    q_lora = f.int("q_lora_rank", optional=True)
    kv_lora = f.int("kv_lora_rank")
    nope = f.int("qk_nope_head_dim")
    rope = f.int("qk_rope_head_dim", min_value=0)
    v_dim = f.int("v_head_dim")
    out_gate = f.bool("mla_use_output_gate", default=(arch == ARCH_K3))
    if "mla_use_nope" in merged and merged["mla_use_nope"] is not True:
        f.problems.append(f"`{f.path('mla_use_nope')}` is {short_repr(merged['mla_use_nope'])}: rotary MLA is not "
                          "part of K3/Kimi-Linear and is not supported")

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
        f.problems.append(f"`{f.path('moe_router_activation_func')}` is {short_repr(router_act)}; only the sigmoid "
                          "router is supported")
    ngroups = merged.get("num_expert_group", 1)
    if ngroups is not None and (isinstance(ngroups, bool) or ngroups != 1):
        f.problems.append(f"`{f.path('num_expert_group')}` is {short_repr(ngroups)}; grouped top-k with more than one "
                          "group is not supported")

    act = merged.get("hidden_act")
    if shape_kind == "fixture" and act is None:
        act = "situ"
    if act not in ("situ", "silu"):
        f.problems.append(f"`{f.path('hidden_act')}` must be \"situ\" (K3) or \"silu\" (Kimi-Linear), got "
                          f"{short_repr(act)}")
        act = None
    beta1 = f.float("activation_situ_beta", "situ_beta", optional=True)
    beta2 = f.float("activation_situ_linear_beta", "situ_linear_beta", optional=True)
    if act == "situ" and beta1 is None:
        beta1 = 1.0  # MODEL.md §3.5: an absent activation_situ_beta means 1
    ar_block = f.int("attn_res_block_size", optional=True)
    if arch == ARCH_K3 and ar_block is None:
        f.problems.append("missing `attn_res_block_size` (K3's Attention Residual block size)")

    # ---- structural checks (every size above is known to be in range) -----------
    mla_layers: tuple[int, ...] = ()
    if n_layers and full_attn is not None:
        bad = [x for x in full_attn if not 1 <= x <= n_layers]
        if bad:
            f.problems.append(
                f"`{f.path('full_attn_layers')}` is ONE-based and must lie in 1..{n_layers}; out of range: "
                f"{short_repr(bad)}")
        elif len(set(full_attn)) != len(full_attn):
            f.problems.append(f"`{f.path('full_attn_layers')}` has duplicate entries")
        else:
            mla_layers = tuple(sorted(x - 1 for x in full_attn))
        if kda_layers is not None and not bad:
            badk = [x for x in kda_layers if not 1 <= x <= n_layers]
            if badk:
                f.problems.append(f"`{f.path('kda_layers')}` is ONE-based and must lie in 1..{n_layers}; out of "
                                  f"range: {short_repr(badk)}")
            elif sorted(set(kda_layers) | set(full_attn)) != list(range(1, n_layers + 1)) or set(kda_layers) & set(full_attn):
                f.problems.append("`kda_layers` and `full_attn_layers` must partition 1..num_hidden_layers exactly")
    if topk and n_exp and topk > n_exp:
        f.problems.append(f"`{f.path('num_experts_per_token')}` ({topk}) exceeds `num_experts` ({n_exp})")
    quant = None
    group = 32
    if "quantization_config" in text:
        qc, qc_path = text["quantization_config"], prefix + "quantization_config"
    else:
        qc, qc_path = top.get("quantization_config"), "quantization_config"
    if qc is not None and not isinstance(qc, dict):
        f.problems.append(f"`{qc_path}` must be an object, got {json_kind(qc)}")
    elif isinstance(qc, dict):
        fmt = qc.get("format")
        if fmt is not None and fmt != "mxfp4-pack-quantized":
            f.problems.append(f"`{qc_path}.format` is {short_repr(fmt)}; only \"mxfp4-pack-quantized\" is supported")
        else:
            quant = "mxfp4"
            groups = qc.get("config_groups")
            if groups is not None and not isinstance(groups, dict):
                f.problems.append(f"`{qc_path}.config_groups` must be an object, got {json_kind(groups)}")
                groups = None
            for gname, g in (groups or {}).items():
                gp = f"{qc_path}.config_groups.{key_name(gname)}"
                if g is not None and not isinstance(g, dict):
                    f.problems.append(f"`{gp}` must be an object, got {json_kind(g)}")
                    continue
                w = (g or {}).get("weights")
                if w is not None and not isinstance(w, dict):
                    f.problems.append(f"`{gp}.weights` must be an object, got {json_kind(w)}")
                    continue
                w = w or {}
                if "group_size" in w:
                    gs = w["group_size"]
                    if isinstance(gs, bool) or not isinstance(gs, int):
                        f.problems.append(f"`{gp}.weights.group_size` must be an integer, got {json_kind(gs)}")
                        group = None
                    elif group is not None:
                        group = gs
                    if w.get("num_bits", 4) != 4 or w.get("type", "float") != "float":
                        f.problems.append(f"`{gp}.weights` must be 4-bit float (MXFP4)")
            if group is not None and group != 32:
                f.problems.append(f"MXFP4 group size must be 32, got {short_repr(group)}")
            elif group is not None:
                for name, width in (("moe_intermediate_size", moe_inter),
                                    ("routed_expert_hidden_size / hidden_size", latent or hidden)):
                    if width and width % group:
                        f.problems.append(f"`{name}` ({width}) is not a multiple of the MXFP4 group size {group}")
    if f.problems:
        raise _refuse(source, f.problems)

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
    raw = read_json_file(
        p, what="config.json", error=ConfigError,
        missing=(f"{p}: no config.json here. Point k3 at the model folder that holds config.json, "
                 f"model.safetensors.index.json and the shards."))
    return parse_config(raw, str(p))


def check_layers(cfg: ModelConfig, layers: int | None) -> None:
    """``--layers N`` (run only the first N layers) against the model: 1..num_hidden_layers."""
    if layers is not None and not 1 <= layers <= cfg.num_hidden_layers:
        raise UsageError(f"--layers must be in 1..{cfg.num_hidden_layers} for this model, got {layers}.")
