"""The decoder stack: embedding -> layers -> head, for K3 and Kimi-Linear.

K3 replaces the residual stream with Attention Residuals (docs/MODEL.md): a per-token bank
of block summaries R and a running partial block sum P, mixed by a learned
pseudo-query before each sublayer. Kimi-Linear uses the plain pre-norm residual.
All of it is fp32; the bank is per forward and never carried between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import interrupt
from ..errors import NumericError
from ..kernels.norms import add_norm, all_finite
from . import compiled
from .kda import kda_layer
from .kda import rollback as kda_rollback
from .kda_state import KDAState
from .mla import MLAState, mla_layer
from .moe import dense_mlp, moe_block
from .ops import attn_res, linear, rms_norm


@dataclass
class InferenceState:
    """Everything carried across decode steps: KDA conv/recurrent state, MLA KV cache,
    and the ids seen so far."""

    layers: list = field(default_factory=list)
    ids: list = field(default_factory=list)

    @classmethod
    def fresh(cls, cfg, n_layers: int | None = None, capacity: int = 0, latent: bool = True):
        """A state at position 0; its KV caches (latent form unless ``latent`` is False,
        see k3.model.mla) reserve room for ``capacity`` positions."""
        n = cfg.num_hidden_layers if n_layers is None else n_layers
        return cls([MLAState(capacity, latent) if cfg.is_mla(i) else KDAState() for i in range(n)], [])

    @property
    def position(self) -> int:
        return len(self.ids)

    def snapshot(self) -> "Snapshot":
        """A cheap snapshot: references to the KDA tensors (the math replaces them, it
        never writes into them, and a pinned matrix is never reused) and the MLA cache
        lengths."""
        layers = []
        for ls in self.layers:
            if isinstance(ls, KDAState):
                ls.pin()
                layers.append((ls.conv_q, ls.conv_k, ls.conv_v, ls.S))
            else:
                layers.append(ls.length)
        return Snapshot(len(self.ids), layers)

    def release(self, snap: "Snapshot") -> None:
        """``snap`` will not be restored: the KDA matrices it alone held may be reused
        (the decode loop's per-pass undo snapshot, once the pass is settled)."""
        for ls, s in zip(self.layers, snap.layers):
            if isinstance(ls, KDAState):
                ls.unpin(s[3])

    def restore(self, snap: "Snapshot") -> None:
        """Back to `snap` (after a forward pass was cut short, or to undo tokens)."""
        del self.ids[snap.n_ids:]
        for ls, s in zip(self.layers, snap.layers):
            if isinstance(ls, KDAState):
                ls.conv_q, ls.conv_k, ls.conv_v, ls.S = s
            else:  # appends after the snapshot went past position s: cut them off
                ls.truncate(s)


    def record(self, on: bool) -> None:
        """Start (or stop) recording each KDA layer's next pass, so that rollback() can keep
        any prefix of it."""
        for ls in self.layers:
            if isinstance(ls, KDAState):
                ls.record = {} if on else None

    def rollback(self, snap: "Snapshot", keep: int) -> None:
        """Keep only the first ``keep`` tokens of the recorded pass that started at
        ``snap``: exactly the state reading just those tokens would have given."""
        del self.ids[snap.n_ids + keep:]
        for ls, s in zip(self.layers, snap.layers):
            if isinstance(ls, KDAState):
                kda_rollback(ls, s[:3], s[3], keep)
            else:
                ls.truncate(s + keep)


@dataclass
class Snapshot:
    n_ids: int
    layers: list


class Observer:
    """What a caller may watch during a forward pass (progress, interrupts, routing
    statistics). Subclass and override; the defaults do nothing."""

    def on_layer(self, i: int) -> None:
        """Layer i is done (a good place to raise KeyboardInterrupt: nothing is held)."""

    def on_route(self, layer: int, ids) -> None:
        """The router of `layer` chose `ids` [T, top-k] (long) for this pass."""

    def on_prefill(self, done: int, total: int, piece: int) -> None:
        """A pass is about to read tokens done .. done + piece of a prompt of `total`
        tokens that takes several passes (called by the decode loop, per sequence)."""


def _finite(x: torch.Tensor, where: str) -> torch.Tensor:
    """x, or NumericError naming where the hidden state first stopped being finite. One
    pass over a [T, d] activation per layer: nothing next to the layer's matmuls."""
    if not all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
        raise NumericError(
            f"the numbers stopped being finite after {where}: {bad} of {x.numel()} values are NaN or inf, so "
            "the logits would be garbage and no token is produced. A weight of that layer (or the config's "
            "numbers) is damaged: check the checkpoint (`k3 doctor MODEL`, the shard sizes against the "
            "published ones) and re-download the shard holding it.")
    return x


class Model:
    """Pure math over a WeightProvider. `forward` processes new tokens, extending
    `state` if given (incremental) or starting from nothing (full recompute).

    ``fused``: run each layer's compiled regions where a step allows (k3.model.compiled;
    None: unless K3_FUSED=0). The choice is made here, once, per layer; both ways give
    the same bits."""

    def __init__(self, provider, n_layers: int | None = None, kda_chunked: bool | None = None,
                 kv_latent: bool = True, fused: bool | None = None):
        self.provider = provider
        self.cfg = provider.config
        self.n_layers = self.cfg.num_hidden_layers if n_layers is None else n_layers
        self.kda_chunked = kda_chunked
        self.kv_latent = kv_latent  # the MLA KV cache form of the states it makes
        self.plain_because = compiled.why_plain(fused)   # the one decision: regions, or the plain forward
        self.fast = compiled.Compiled(self.cfg, provider, kda_chunked) if self.plain_because is None else None

    def new_state(self, capacity: int = 0) -> InferenceState:
        return InferenceState.fresh(self.cfg, self.n_layers, capacity, self.kv_latent)

    def mixer(self, i, w, x, states, cuts):
        """Layer i's KDA or MLA mixer, run on each sequence's rows with its own state (the
        only part of a layer that mixes tokens); ``cuts`` are the row boundaries."""
        def one(xs, st):
            y = None if self.fast is None else self.fast.mixer(i, w, xs, st)
            return self.plain_mixer(i, w, xs, st) if y is None else y
        if len(states) == 1:
            return one(x, states[0].layers[i])
        return torch.cat([one(x[a:b], st.layers[i]) for st, a, b in zip(states, cuts, cuts[1:])])

    def plain_mixer(self, i, w, x, st):
        """Layer i's KDA or MLA mixer on one sequence's rows, the plain forward."""
        if self.cfg.is_mla(i):
            return mla_layer(self.cfg, w, x, st)
        return kda_layer(self.cfg, w, x, st, self.kda_chunked)

    def ffn(self, i, w, x, base, obs):
        """base + the layer's FFN of x."""
        if self.cfg.is_moe(i):
            return moe_block(self.cfg, w, x, i, self.provider, obs, base)
        return dense_mlp(self.cfg, w, x, base)

    def plain_layer(self, i, w, h, states, cuts, obs=None):
        """One Kimi-Linear layer: pre-norm residual around the mixer and the FFN."""
        eps = self.cfg.rms_norm_eps
        a = self.mixer(i, w, rms_norm(h, w["input_layernorm.weight"], eps), states, cuts)
        h, y = add_norm(h, a, w["post_attention_layernorm.weight"], eps)   # the residual add and the next pre-norm
        return self.ffn(i, w, y, h, obs)

    def attn_res_layer(self, i, w, bank: list, P, states, cuts, obs=None):
        """One K3 layer (docs/MODEL.md §3.2). `bank` is extended in place on block boundaries;
        returns the new partial block sum P."""
        eps = self.cfg.rms_norm_eps
        # each mix and the pre-norm of the sublayer it feeds: one call
        ln = w["input_layernorm.weight"]
        xn = attn_res(bank + [P], w["self_attention_res_norm.weight"], w["self_attention_res_proj.weight"], eps,
                      post_norm=ln) if bank else rms_norm(P, ln, eps)
        if i % self.cfg.attn_res_block_size == 0:
            bank.append(P)
            P = None
        a = self.mixer(i, w, xn, states, cuts)
        P = a if P is None else P + a
        yn = attn_res(bank + [P], w["mlp_res_norm.weight"], w["mlp_res_proj.weight"], eps,
                      post_norm=w["post_attention_layernorm.weight"])
        return self.ffn(i, w, yn, P, obs)

    def hidden(self, ids, state: InferenceState | None = None, observer: Observer | None = None) -> torch.Tensor:
        """Final hidden states (after the last mix, before the final norm) [T, d]."""
        if state is None:
            state = self.new_state()
        return self.hidden_batch([(ids, state)], observer)

    def hidden_batch(self, batch, observer: Observer | None = None) -> torch.Tensor:
        """hidden() for several sequences at once: `batch` is [(ids, state)], the result
        their final hidden states stacked in that order. Every op but the mixers works on
        each token alone, so it runs once over all the rows (a layer's weights and its
        routed experts are read once for the whole batch); the mixers run per sequence.
        Each sequence's numbers are those it would get alone."""
        all_ids = [t for ids, _ in batch for t in ids]
        carry = self.run_layers(range(self.n_layers), self.embed_carry(all_ids), batch, observer)
        return self.finish(carry)

    # The pass in three parts, so that a pipeline (k3.pipeline) can run the layers of
    # one stage per process: the carry is everything one layer hands the next - the
    # hidden state (Kimi-Linear), or K3's Attention Residuals bank and partial sum.
    def embed_carry(self, all_ids) -> tuple:
        """The carry entering layer 0: (bank, x), bank None without Attention Residuals."""
        h = _finite(self.provider.embed(all_ids), "the embedding rows of the input tokens")
        return (None if self.cfg.attn_res_block_size is None else [], h)

    def run_layers(self, layers: range, carry: tuple, batch, observer: Observer | None = None) -> tuple:
        """Layers ``layers`` over the carry; each sequence's state (its layers among
        these) extended. The states' ids are extended when ``layers`` ends the stack."""
        states = [st for _, st in batch]
        cuts = [0]
        for ids, _ in batch:
            cuts.append(cuts[-1] + len(ids))
        bank, x = carry
        for i in layers:
            w = self.provider.layer(i)
            try:
                # one token of one sequence (decode): the layer's compiled regions where chosen
                y = self.fast.decode_layer(self, i, w, bank, x, states[0].layers[i], observer) \
                    if self.fast is not None and len(states) == 1 and x.shape[0] == 1 else None
                if y is None and bank is None:  # Kimi-Linear: plain pre-norm residual
                    y = self.plain_layer(i, w, x, states, cuts, observer)
                elif y is None:
                    y = self.attn_res_layer(i, w, bank, x, states, cuts, observer)
                x = _finite(y, f"layer {i}")
            finally:  # also on a failed read or an interrupt: a streamer must not keep it held
                self.provider.release_layer(i)
            if observer is not None:
                observer.on_layer(i)
            interrupt.check()  # Ctrl-C / SIGTERM acted on between layers, never inside one (k3.interrupt)
        if layers.stop == self.n_layers:
            for ids, st in batch:
                st.ids.extend(int(t) for t in ids)
        return bank, x

    def finish(self, carry: tuple) -> torch.Tensor:
        """The final hidden states from the carry leaving the last layer."""
        bank, x = carry
        if bank is None:
            return x
        g = self.provider.global_weight
        return _finite(attn_res(bank + [x], g("output_attn_res_norm.weight"), g("output_attn_res_proj.weight"),
                                self.cfg.rms_norm_eps), "the final Attention Residuals mix (output_attn_res)")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        g = self.provider.global_weight
        x = _finite(rms_norm(h, g("norm.weight"), self.cfg.rms_norm_eps), "the final norm (norm.weight)")
        return _finite(linear(x, g("lm_head.weight")), "lm_head")

    def forward(self, ids, state: InferenceState | None = None, last_only: bool = True,
                observer: Observer | None = None) -> torch.Tensor:
        """Logits for the new tokens `ids` (the last one only unless `last_only` is
        False), extending `state` if given (incremental) or from nothing (full recompute)."""
        h = self.hidden(ids, state, observer)
        return self.logits(h[-1:] if last_only else h)
