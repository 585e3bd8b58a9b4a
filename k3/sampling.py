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
or with `do_sample` false, decoding is greedy unless a sampling flag is given. A value
in that file of the wrong type or out of range is refused naming the file and the
field; only a bad flag is reported as a flag.
"""

from __future__ import annotations

import math
import numbers
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .fsutil import json_kind, read_json_file, short_repr
from .errors import K3Error, UsageError

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


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# The one statement of what each sampling setting accepts: (test, wording). Used for the
# flags (check_settings) and for generation_config.json (generation_defaults), each with
# its own naming of where the value came from.
_RULES = {
    "temperature": (lambda v: _number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_p": (lambda v: _number(v) and 0.0 < v <= 1.0, "a number in (0, 1]"),
    "top_k": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0 = no limit)"),
}


def check_settings(temperature: float, top_p: float, top_k: int) -> None:
    """Refuse bad values given as flags (or to the Python API), in flag wording."""
    for flag, key, v in (("--temperature", "temperature", temperature), ("--top-p", "top_p", top_p),
                         ("--top-k", "top_k", top_k)):
        ok, wording = _RULES[key]
        if not ok(v):
            raise UsageError(f"{flag} must be {wording}, got {short_repr(v)}.")


class Sampler:
    """Callable logits[vocab] -> token id. One uniform draw per call."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 stream: int = 0, source: str = ""):
        check_settings(temperature, top_p, top_k)
        if not (_integer(seed) and _integer(stream) and seed >= 0 and stream >= 0):
            raise UsageError(f"--seed must be an integer >= 0, got {short_repr(seed)}.")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.seed = int(seed)
        self.stream = int(stream)
        self.source = source
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.stream])))
        self.draws = 0

    def _dist(self, logits):
        """(kept token ids, their unnormalised weights, cumulative weights): the tokens
        left after top-k and top-p, in descending order of logit."""
        x = _as_float64(logits)
        order = np.argsort(-x, kind="stable")
        if self.top_k:
            order = order[: self.top_k]
        z = x[order]
        w = np.exp((z - z[0]) / self.temperature)
        c = np.cumsum(w)
        n = len(c)
        if self.top_p < 1.0:
            n = min(n, int(np.searchsorted(c, self.top_p * c[-1], side="left")) + 1)
        return order[:n], w[:n], c[:n]

    def _draw(self) -> float:
        self.draws += 1
        return self.rng.random()

    def __call__(self, logits) -> int:
        if self.temperature == 0.0:
            return int(np.argmax(_as_float64(logits)))
        order, _, c = self._dist(logits)
        i = int(np.searchsorted(c, self._draw() * c[-1], side="right"))
        return int(order[min(i, len(c) - 1)])

    def verify(self, rows, drafts) -> tuple[list[int], int]:
        """Exact speculative sampling over the logits ``rows`` of [last token + drafts]:
        drafted token x (a deterministic guess) is kept with probability p(x); at the
        first one not kept, the token is drawn from p without x, renormalised; when every
        draft is kept, one more token is drawn from the last row. Each emitted token has
        the distribution plain sampling gives it. Returns (tokens, drafts kept)."""
        if self.temperature == 0.0:
            kept = 0
            while kept < len(drafts) and int(np.argmax(_as_float64(rows[kept]))) == drafts[kept]:
                kept += 1
            return list(drafts[:kept]) + [int(np.argmax(_as_float64(rows[kept])))], kept
        for i, x in enumerate(drafts):
            order, w, c = self._dist(rows[i])
            at = np.flatnonzero(order == x)
            px = w[at[0]] / c[-1] if len(at) else 0.0
            if self._draw() < px:
                continue
            if len(at):  # x was not kept: draw from the rest
                w = w.copy()
                w[at[0]] = 0.0
                c = np.cumsum(w)
            j = int(np.searchsorted(c, self._draw() * c[-1], side="right"))
            return list(drafts[:i]) + [int(order[min(j, len(c) - 1)])], i
        return list(drafts) + [self(rows[len(drafts)])], len(drafts)

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
    (only the keys present; null counts as absent); {} when there is no such file.
    A value of the wrong type or out of range is a UsageError naming the file and the
    field (never the command-line flag, and never silently ignored)."""
    if model_dir is None:
        return {}
    p = Path(model_dir) / GENERATION_CONFIG
    if not os.path.lexists(p):
        return {}
    hint = "Fix or remove it, or pass the sampling flags."
    raw = read_json_file(p, error=UsageError, hint=hint)
    if not isinstance(raw, dict):
        raise UsageError(f"{p}: {GENERATION_CONFIG} must hold a JSON object, not {json_kind(raw)}. {hint}")
    out = {}
    problems = []
    v = raw.get("do_sample")
    if v is not None:
        if isinstance(v, bool):
            out["do_sample"] = v
        else:
            problems.append(f"`do_sample` must be true or false, got {json_kind(v)}")
    for k, (ok, wording) in _RULES.items():
        v = raw.get(k)
        if v is None:
            continue
        if ok(v):
            out[k] = v
        elif isinstance(v, float) and not math.isfinite(v):
            problems.append(f"`{k}` is {'NaN' if v != v else 'Infinity' if v > 0 else '-Infinity'}; it must be "
                            f"{wording}")
        else:
            problems.append(f"`{k}` must be {wording}, got {json_kind(v)}")
    if problems:
        raise UsageError(f"{p}: " + "; ".join(problems) + f". {hint}")
    return out


def resolve(model_dir=None, *, temperature: float | None = None, top_p: float | None = None,
            top_k: int | None = None, seed: int | None = None, greedy: bool = False) -> SamplingSettings | None:
    """The sampling settings asked for (None = greedy): the given values over the model
    folder's generation_config.json (when it samples), a fresh seed when none is given."""
    t, p, k = temperature, top_p, top_k
    # flags first, in flag wording (the file's values are checked, in its own wording, when read)
    check_settings(1.0 if t is None else t, 1.0 if p is None else p, 0 if k is None else k)
    if seed is not None and not (_integer(seed) and seed >= 0):
        raise UsageError(f"--seed must be an integer >= 0, got {short_repr(seed)}.")
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
    return SamplingSettings(temperature, top_p, top_k, int(seed), source)
