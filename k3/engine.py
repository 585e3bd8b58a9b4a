"""Generation over a Model: prefill, one-token decode, the greedy loop.

One generator (`generate`) serves every front end: it yields one StepResult per
produced token. Two modes: full recompute (the whole prefix re-run every step, the
C engine's default) and incremental (KDA/conv state and MLA KV carried).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .config import ModelConfig, load_config
from .errors import UsageError
from .memory.resident import ResidentWeights
from .model.stack import InferenceState, Model


def load_model(model_dir, config_path=None, n_layers: int | None = None, progress=None,
               kda_chunked: bool | None = None) -> Model:
    """Read config + checkpoint (resident) and return the Model over it."""
    cfg = load_config(config_path if config_path is not None else Path(model_dir))
    if n_layers is not None and not 1 <= n_layers <= cfg.num_hidden_layers:
        raise UsageError(f"--layers must be in 1..{cfg.num_hidden_layers} for this model, got {n_layers}.")
    provider = ResidentWeights(cfg, model_dir, n_layers=n_layers, progress=progress)
    return Model(provider, n_layers=n_layers, kda_chunked=kda_chunked)


def check_ids(cfg: ModelConfig, ids) -> list[int]:
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(
            f"token id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:5]))} "
            f"{'are' if len(bad) > 1 else 'is'} outside this model's vocabulary (0..{cfg.vocab_size - 1}). "
            "Check the --ids list or the tokenizer it came from.")
    if not ids:
        raise UsageError("the prompt is empty: give at least one token.")
    return ids


@dataclass
class StepResult:
    step: int
    token: int
    seconds: float
    logits: torch.Tensor | None = None
    info: dict = field(default_factory=dict)


def greedy(logits: torch.Tensor) -> int:
    """First index of the maximum (the C engine's argmax rule)."""
    return int(torch.argmax(logits.reshape(-1)))


def generate(model: Model, prompt_ids, n_gen: int, incremental: bool = False,
             state: InferenceState | None = None, keep_logits: bool = False,
             stop_ids=(), sampler=None) -> Iterator[StepResult]:
    """Generate up to n_gen tokens (greedy unless `sampler`, a callable logits[vocab] ->
    token id, is given). Step 0 includes the prefill. With `incremental`, `state` (if
    given) is extended in place, so a caller can keep it for the next turn; the last
    sampled token is then not yet in the state (it is fed at the next call)."""
    ids = list(prompt_ids)
    if incremental and state is None:
        state = model.new_state()
    pending = ids
    for step in range(n_gen):
        t0 = time.perf_counter()
        if incremental:
            logits = model.forward(pending, state)
        else:
            logits = model.forward(ids, None)
        tok = greedy(logits) if sampler is None else int(sampler(logits.reshape(-1)))
        dt = time.perf_counter() - t0
        ids.append(tok)
        pending = [tok]
        yield StepResult(step, tok, dt, logits.reshape(-1).clone() if keep_logits or step == 0 else None)
        if tok in stop_ids:
            return
