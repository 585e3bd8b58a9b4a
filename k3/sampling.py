"""Token sampling: temperature, top-k, top-p (nucleus), seeded.

Reproducibility contract: for a given seed, the sampled tokens depend only on the
logits. The logits are identical at every memory budget and thread count (the
engine's exactness property), and the sampler itself is computed in a fixed,
thread-independent order on the CPU:

  1. the fp32 logits are widened to float64;
  2. token order: a stable sort by descending logit (ties: lower id first);
  3. top-k keeps the first k of that order;
  4. weights exp((logit - max) / T) in float64, cumulative sums in order;
  5. top-p keeps the shortest prefix whose mass reaches top_p of the total;
  6. exactly one uniform draw per step from a dedicated numpy PCG64 generator,
     seeded once (SeedSequence([seed, stream])), picks the token from the kept
     cumulative mass.

Temperature 0 (or --greedy) is greedy: the first index of the maximum logit, the C
engine's argmax rule.

Defaults come from the model folder's `generation_config.json` when it asks for
sampling (`do_sample: true`, as K3's does: temperature 1.0, top-p 0.95); without one,
or with `do_sample` false, decoding is greedy unless a sampling flag is given.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import K3Error, UsageError
from .fsutil import read_json_object

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    source: str = ""  # where the defaults came from, for the banner

    def describe(self) -> str:
        parts = [f"temperature {self.temperature:g}"]
        if self.top_p < 1.0:
            parts.append(f"top-p {self.top_p:g}")
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        parts.append(f"seed {self.seed}")
        return "sampling: " + ", ".join(parts) + (f" ({self.source})" if self.source else "")

    def sampler(self, stream: int = 0) -> "Sampler":
        return Sampler(self.temperature, self.top_p, self.top_k, self.seed, stream, source=self.source)


def check_settings(temperature: float, top_p: float, top_k: int) -> None:
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise UsageError(f"--temperature must be a number >= 0 (0 = greedy), got {temperature}.")
    if not (0.0 < top_p <= 1.0):
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}.")
    if top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = no limit), got {top_k}.")


class Sampler:
    """Callable logits[vocab] -> token id. One uniform draw per call."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 stream: int = 0, source: str = ""):
        check_settings(temperature, top_p, top_k)
        if seed < 0 or stream < 0:
            raise UsageError(f"--seed must be >= 0, got {seed}.")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.seed = int(seed)
        self.stream = int(stream)
        self.source = source
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.stream])))
        self.draws = 0

    def __call__(self, logits) -> int:
        x = _as_float64(logits)
        if self.temperature == 0.0:
            return int(np.argmax(x))
        order = np.argsort(-x, kind="stable")
        if self.top_k:
            order = order[: self.top_k]
        z = x[order]
        w = np.exp((z - z[0]) / self.temperature)
        c = np.cumsum(w)
        n = len(c)
        if self.top_p < 1.0:
            n = min(n, int(np.searchsorted(c, self.top_p * c[-1], side="left")) + 1)
        u = self.rng.random()
        self.draws += 1
        i = int(np.searchsorted(c[:n], u * c[n - 1], side="right"))
        return int(order[min(i, n - 1)])

    def describe(self) -> str:
        return SamplingSettings(self.temperature, self.top_p, self.top_k, self.seed, self.source).describe()


def _as_float64(logits) -> np.ndarray:
    try:
        import torch

        if isinstance(logits, torch.Tensor):
            logits = logits.detach().to("cpu", torch.float32).reshape(-1).numpy()
    except ImportError:  # pragma: no cover
        pass
    x = np.asarray(logits, dtype=np.float32).reshape(-1).astype(np.float64)
    if x.size == 0:
        raise K3Error("the model returned no logits to sample from.")
    m = x.max()
    if not np.isfinite(m) or np.isnan(x).any():
        raise K3Error("the logits contain NaN or no finite value, so no token can be sampled; the forward pass "
                      "is broken (check the checkpoint with `k3 doctor MODEL`).")
    return x


# ---------------------------------------------------------------- generation_config.json
def generation_defaults(model_dir) -> dict:
    """{do_sample, temperature, top_p, top_k} found in MODEL/generation_config.json
    (only the keys present); {} when there is no such file."""
    if model_dir is None:
        return {}
    p = Path(model_dir) / GENERATION_CONFIG
    if not p.is_file():
        return {}
    raw = read_json_object(p, "Fix or remove it, or pass the sampling flags.")
    out = {}
    for k, typ in (("do_sample", bool), ("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int)):
        v = raw.get(k)
        if v is not None and isinstance(v, typ) and not (typ is int and isinstance(v, bool)):
            out[k] = v
    return out


def resolve(model_dir=None, *, temperature: float | None = None, top_p: float | None = None,
            top_k: int | None = None, seed: int | None = None, greedy: bool = False) -> SamplingSettings | None:
    """The sampling settings asked for (None = greedy): the given values over the model
    folder's generation_config.json (when it samples), a fresh seed when none is given."""
    t, p, k = temperature, top_p, top_k
    if greedy:
        if t not in (None, 0) or p is not None or k is not None:
            raise UsageError("--greedy cannot be combined with --temperature/--top-p/--top-k.")
        return None
    given = t is not None or p is not None or k is not None
    gen = generation_defaults(model_dir)
    if not given and not gen.get("do_sample", False):
        return None
    source = "from flags" if given else f"from {GENERATION_CONFIG}"
    if given and gen.get("do_sample", False):
        source = f"flags over {GENERATION_CONFIG}"
    temperature = float(t if t is not None else gen.get("temperature", 1.0) if gen.get("do_sample") else 1.0)
    top_p = float(p if p is not None else gen.get("top_p", 1.0) if gen.get("do_sample") else 1.0)
    top_k = int(k if k is not None else gen.get("top_k", 0) if gen.get("do_sample") else 0)
    check_settings(temperature, top_p, top_k)
    if temperature == 0.0:
        return None
    if seed is None:
        seed = secrets.randbits(31)
        source += "; fresh seed, pass --seed to repeat"
    if seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}.")
    return SamplingSettings(temperature, top_p, top_k, int(seed), source)
