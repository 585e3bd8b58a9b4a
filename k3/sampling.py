"""Token sampling: temperature, top-k, top-p (nucleus), seeded.

Reproducibility contract: for a given seed, the token sampled at a position depends only
on that position's logits, the settings, the seed, the sequence's stream and the
position itself - not on what was sampled before, on how many tokens one pass emitted,
or on which drafts speculative decoding read. The logits are identical at every memory
budget and thread count (the engine's exactness property), and the sampler is computed
in a fixed, thread-independent order on the CPU (k3.kernels.sample, one thread):

  1. the fp32 logits are widened to float64; weights w = exp((logit - max) / T);
  2. token order: descending logit (ties: lower id first); top-k keeps the first k;
  3. top-p keeps the shortest prefix of that order whose cumulative weight (summed in
     that order) reaches top_p times the mass of the top-k set (summed in id order),
     or the whole set where rounding leaves it short;
  4. the uniform u for position p (the number of tokens before the one sampled:
     prompt, earlier turns and generated tokens) is counter-based: the top 53 bits / 2**53
     of ``np.random.Philox(key=K, counter=[p, 0, 0, 0]).random_raw()`` (Philox4x64-10),
     K = the first two uint64 words of ``SeedSequence([seed, stream])``;
  5. the token is the first kept one, in id order, whose cumulative weight (summed in
     that order) exceeds u times the kept weight (one uniform a position, not Gumbel
     noise per token: the same property for one draw instead of one per vocabulary entry).

So a seeded run gives the same tokens run to run, alone or in a batch (each sequence's
own seed and stream), at every memory budget, and with or without --spec: a drafted
token (a deterministic guess) is kept exactly when it is the token step 5 picks at its
position, and at the first one that is not, that pick is emitted (:meth:`Sampler.verify`);
each emitted token has plain sampling's distribution because it *is* plain sampling's
token. Streams: `k3 run` and the server use stream 0 (a --batch job its own "seed"),
the chat one per turn.

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
    """Callable (logits[vocab], position) -> token id; the module docstring's contract."""

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
        self.key = np.random.SeedSequence([self.seed, self.stream]).generate_state(2, np.uint64)
        self._scratch = None

    def uniform(self, position: int) -> float:
        """The uniform in [0, 1) of ``position``: a function of (seed, stream, position)
        alone (counter-based), so it is the same whichever pass samples that position."""
        if not (_integer(position) and 0 <= position < 1 << 64):
            raise ValueError(f"position must be an integer in [0, 2**64), got {position!r}")
        raw = np.random.Philox(key=self.key, counter=np.array([position, 0, 0, 0], np.uint64)).random_raw()
        return (int(raw) >> 11) * (1.0 / (1 << 53))

    def _weigh(self, logits):
        """(weights, total weight, kept ids ascending or None for every token)."""
        from . import env
        from .kernels import sample as K
        if not env.fused():
            return self._weigh_plain(logits)
        x = _as_float32(logits)
        n = x.shape[0]
        m = float(x.max())   # NaN when any is
        if not math.isfinite(m):
            raise K3Error("the logits contain NaN or no finite value, so no token can be sampled; the forward pass "
                          "is broken (check the checkpoint with `k3 doctor MODEL`).")
        if self._scratch is None or self._scratch[0].shape[0] != n:   # kept: fresh pages of a large vocabulary cost
            self._scratch = (np.empty(n, np.float64), np.empty(n, np.int32), np.empty(K.BUCKETS, np.float64),
                             np.empty(K.BUCKETS, np.int64))
        w, bucket, bmass, bcount = self._scratch
        np.subtract(x, m, out=w, dtype=np.float64)
        if self.temperature != 1.0:
            w /= self.temperature
        np.exp(w, out=w)
        total = K.buckets(x, m, self.temperature, w, bucket, bmass, bcount)
        k = self.top_k if 0 < self.top_k < n else 0
        if k == 0 and self.top_p >= 1.0:
            return w, total, None
        last = K.last_bucket(bmass, bcount, k, self.top_p * total)
        while True:
            keys = K.order_keys(x.view(np.uint32), bucket, bcount, last)
            keys.sort()   # unique keys: one order whatever the sort
            ids, reached = K.kept(keys, w, k, self.top_p, total)
            if reached or k or last >= K.BUCKETS - 1:
                return w, total, ids
            last += 1   # the prefix ends past these candidates: one bucket more

    def _weigh_plain(self, logits):
        """The contract computed the plain way, K3_FUSED=0: a full stable sort of the
        vocabulary (13-17 ms a token at K3's), the same kept set and weights."""
        x = _as_float64(logits)
        w = np.exp((x - x.max()) / self.temperature) if self.temperature != 1.0 else np.exp(x - x.max())
        if not 0 < self.top_k < len(x) and self.top_p >= 1.0:
            return w, float(np.cumsum(w)[-1]), None   # nothing filtered
        order = np.argsort(-x, kind="stable")
        if self.top_k:
            order = order[:self.top_k]
        kept = np.sort(order)
        total = float(np.cumsum(w[kept])[-1])   # id order, one after another
        if self.top_p >= 1.0:
            return w, total, kept
        c = np.cumsum(w[order])
        hit = np.flatnonzero(c >= self.top_p * total)
        return w, total, np.sort(order[:hit[0] + 1 if len(hit) else len(order)])

    def probabilities(self, logits) -> dict[int, float]:
        """{token id: probability} of the tokens kept at these logits (the distribution
        each position's token is drawn from)."""
        w, total, ids = self._weigh(logits)
        if ids is None:
            return {i: float(w[i] / total) for i in np.flatnonzero(w)}
        mass = float(np.sum(w[ids]))
        return {int(i): float(w[i] / mass) for i in ids}

    def __call__(self, logits, position: int) -> int:
        """The token at ``position`` (the number of tokens before it in the sequence)."""
        if self.temperature == 0.0:
            return _argmax(logits)
        from . import env
        from .kernels import sample as K
        w, total, ids = self._weigh(logits)
        u = self.uniform(position)
        if not env.fused():   # the inverse CDF over the kept ids in id order, the plain way
            ids = np.arange(len(w)) if ids is None else ids
            c = np.cumsum(w[ids])
            j = int(np.searchsorted(c, u * c[-1], side="right"))
            return int(ids[j] if j < len(ids) else ids[np.flatnonzero(w[ids] > 0.0)[-1]])
        return int(K.pick_all(w, total, u) if ids is None else K.pick(ids, w, u))

    def verify(self, rows, drafts, position: int) -> tuple[list[int], int]:
        """Speculative verification over the logits ``rows`` of [last token + drafts],
        the last token's row sampling ``position``: a drafted token (a deterministic
        guess) is kept exactly when it is the token plain sampling picks at its position
        (greedy: the argmax); at the first that is not, that pick is emitted; when every
        draft is kept, the last row's pick too. The tokens are plain decoding's, so each
        has its distribution. Returns (tokens, drafts kept)."""
        for i, x in enumerate(drafts):
            t = self(rows[i], position + i)
            if t != x:
                return list(drafts[:i]) + [t], i
        return list(drafts) + [self(rows[len(drafts)], position + len(drafts))], len(drafts)

    def describe(self) -> str:
        return SamplingSettings(self.temperature, self.top_p, self.top_k, self.seed, self.source).describe()


def _as_float32(logits) -> np.ndarray:
    try:
        import torch

        if isinstance(logits, torch.Tensor):
            logits = logits.detach().to("cpu", torch.float32).reshape(-1).numpy()
    except ImportError:  # pragma: no cover
        pass
    x = np.ascontiguousarray(np.asarray(logits, dtype=np.float32).reshape(-1))
    if x.size == 0:
        raise K3Error("the model returned no logits to sample from.")
    return x


def _argmax(logits) -> int:
    """Greedy: the first index of the maximum (NaN-free logits, as sampling checks)."""
    x = _as_float64(logits)
    return int(np.argmax(x))


def _as_float64(logits) -> np.ndarray:
    """The logits widened to float64, refused where no token can be picked."""
    x = _as_float32(logits).astype(np.float64)
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
