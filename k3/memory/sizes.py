"""What a model needs in memory, from its config and its checkpoint: the layers a plan
covers, the recurrent state, the KV cache per position, the activation buffers, a
speculative pass's rollback records, the streamed model tables, and
:class:`ModelSizes` (what the memory planner, :mod:`k3.memory.planner`, needs to know
of a model's checkpoint). GB here are decimal (1e9 bytes). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: streamed model tables (ultra-low-memory): one lm_head chunk buffer, plus room for the
#: embedding rows and the small global vectors
TABLE_CHUNK_BYTES = 64 * 1024 * 1024
TABLE_STREAM_BYTES = TABLE_CHUNK_BYTES + 64 * 1024 * 1024


def stream_table_bytes(sizes: "ModelSizes") -> int:
    """What streamed model tables hold: one lm_head chunk buffer and the embedding rows,
    never more than the tables themselves (a small model's lm_head is one chunk)."""
    return min(TABLE_STREAM_BYTES, sizes.table_bytes)


# ====================================================================== model-derived sizes
def layer_ids(cfg, layers=None) -> range:
    """The layers a plan covers: all (None), the first ``layers`` (an int, ``--layers``),
    or a range (one stage of a pipeline, k3.pipeline)."""
    if layers is None:
        return range(cfg.num_hidden_layers)
    return layers if isinstance(layers, range) else range(int(layers))


def recurrent_state_bytes(cfg, n_layers: int | range | None = None) -> int:
    """One sequence's KDA state: per KDA layer the conv histories and the recurrent
    matrix twice - a pass replaces every layer's matrix while the decode loop's undo
    snapshot keeps the one before until the pass is settled; then those go to the pool
    (k3.model.kda) that the next pass's steps write into."""
    kda = sum(1 for i in layer_ids(cfg, n_layers) if not cfg.is_mla(i))
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    return (2 * H * D * D + 3 * H * D * (cfg.conv_kernel - 1)) * 4 * kda


def kv_bytes_per_position(cfg, n_layers: int | range | None = None, latent: bool = True) -> int:
    """Bytes of the MLA KV cache per position, fp32: the latent form holds the normalised
    latent and the shared rope key per MLA layer, the expanded form every head's key and
    value (k3.model.mla)."""
    mla = sum(1 for i in layer_ids(cfg, n_layers) if cfg.is_mla(i))
    if latent:
        return mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    return mla * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 4


#: attention's score tiles (k3.model.mla.SCORE_TILE_BYTES) and their temporaries
ATTENTION_TILE_BYTES = 4 * (16 << 20)


def activation_bytes(cfg, tokens: int, rows: int = 1) -> int:
    """Upper bound of the working set of one forward over `tokens` tokens: the AttnRes
    bank and partial sums, the widest projections of a layer (several live at once),
    fp64 norm statistics, the router's scores and sort, the MoE contributions, the
    chunked-KDA pairwise-decay scratch (a step's new KDA matrices are in the recurrent
    state row, ``recurrent_state_bytes``), attention's tiles
    (bounded whatever the length), the logits of ``rows`` positions (a pass computes
    them only where a sequence is done reading: k3.decode.Batch._logit_rows; a
    speculative pass's drafts are counted by :func:`spec_bytes`)."""
    d = cfg.hidden_size
    banks = (cfg.num_hidden_layers // cfg.attn_res_block_size + 2) if cfg.attn_res_block_size else 1
    kda = cfg.kda_num_heads * cfg.kda_head_dim
    mla = cfg.mla_num_heads * (cfg.qk_head_dim + cfg.qk_head_dim + cfg.v_head_dim)
    # grouped experts (k3.model.moe.routed_experts, k3.kernels.moe.expert_ffn): per (token,
    # expert) pair its contribution (e_in); per tile of at most PAIR_TILE pairs, by phase:
    # the tile's inputs and outputs (2 e_in), the gate | up call, gate | up (2 e_mid) and
    # the input split into even / odd halves and (AVX2, few tokens per expert) those
    # permuted (2 e_in); the GLU, in place in gate | up and its output (3 e_mid); the down
    # call, the GLU output, its split (2 e_mid) and the down output (e_in)
    from ..model.moe import PAIR_TILE
    e_in, e_mid = cfg.expert_in, cfg.moe_intermediate_size
    k = cfg.num_experts_per_token
    widest = max(6 * kda, 2 * mla, 3 * cfg.intermediate_size, 3 * cfg.shared_width, k * e_in)
    tile = 4 * min(int(tokens) * k, PAIR_TILE) * max(4 * e_in + 2 * e_mid, 2 * e_in + 3 * e_mid, 3 * e_in + 3 * e_mid)
    per_token = 4 * ((banks + 16) * d + widest) + 24 * cfg.num_experts
    chunk = 16
    kda_scratch = 4 * cfg.kda_num_heads * chunk * chunk * cfg.kda_head_dim * 4
    logits = 4 * min(int(tokens), max(1, int(rows))) * cfg.vocab_size
    return tokens * per_token + tile + kda_scratch + ATTENTION_TILE_BYTES + logits


def spec_bytes(cfg, n_layers: int | range, spec: int, logits: bool = True) -> int:
    """What a speculative pass of 1 + spec tokens keeps to roll back: per KDA layer its
    pre-conv q/k/v and the recurrence's k, v, g (6 x [T, heads x head_dim] fp32) and beta,
    plus the logits of every position."""
    if not spec:
        return 0
    T = spec + 1
    kda = sum(1 for i in layer_ids(cfg, n_layers) if not cfg.is_mla(i))
    return kda * T * (6 * cfg.kda_num_heads * cfg.kda_head_dim + cfg.kda_num_heads) * 4 + logits * T * cfg.vocab_size * 4


@dataclass(frozen=True)
class ModelSizes:
    """What the planner needs to know about a model, measured from its checkpoint.

    ``layer_bytes``: what the trunk allocates per layer (the packed, 4096-rounded runs
    when streaming from a packed trunk; the tensors as stored when resident);
    ``table_bytes``: embedding + lm_head as stored; ``head_bytes``: lm_head (read once per
    token when the tables are streamed); ``slot_bytes``: one expert-cache slot;
    ``expert_bytes``: one routed expert's payload; ``moe_layers`` and ``experts``: MoE
    layers run and routed experts per layer; ``top_k``."""

    layer_bytes: tuple[int, ...]
    table_bytes: int
    head_bytes: int
    slot_bytes: int
    expert_bytes: int
    moe_layers: int
    experts: int
    top_k: int

    @property
    def trunk_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def routed_experts(self) -> int:
        return self.moe_layers * self.experts
