"""Seeded random draws for the synthetic weights.

Weights are deterministic for a seed: every tensor has its own PCG64 stream keyed by
(seed, full tensor name), so the values do not depend on the layout, on which other
tensors exist or on `--layers` (a layer present in two runs is the same). Gaussians
are drawn by inverse-CDF table lookup (65,536 quantiles of N(mean, std), rounded to
bf16) from 16 random bits per element, which is ~5x faster than torch.randn and keeps
the realdims preset (several GB) in the tens of seconds.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

_CHUNK = 1 << 24  # elements per random-draw chunk (bounds temporaries to ~100 MB)
_QUANTILES: torch.Tensor | None = None
_TABLES: dict = {}


def _quantiles() -> torch.Tensor:
    """The 65,536 midpoint quantiles of N(0, 1), float64."""
    global _QUANTILES
    if _QUANTILES is None:
        u = (torch.arange(65536, dtype=torch.float64) + 0.5) / 65536
        _QUANTILES = torch.special.ndtri(u)
    return _QUANTILES


def _table(kind: str, mean: float, std: float) -> np.ndarray:
    key = (kind, mean, std)
    t = _TABLES.get(key)
    if t is None:
        v = mean + std * _quantiles()
        if kind == "bf16":
            t = v.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
        else:
            t = v.to(torch.float32).numpy().copy()
        _TABLES[key] = t
    return t


def _stream(seed: int, name: str) -> np.random.PCG64:
    """The random stream of one tensor (or one expert): PCG64 keyed by (seed, name)."""
    h = hashlib.sha256(name.encode("utf-8")).digest()
    words = [int.from_bytes(h[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.PCG64(np.random.SeedSequence([int(seed), *words]))


def _u16(bg: np.random.PCG64, n: int) -> np.ndarray:
    return bg.random_raw((n + 3) // 4).view(np.uint16)[:n]


def _lookup(bg: np.random.PCG64, n: int, table: np.ndarray) -> np.ndarray:
    """n draws from `table` indexed by 16 random bits each, in fixed-size chunks."""
    out = np.empty(n, dtype=table.dtype)
    for a in range(0, n, _CHUNK):
        m = min(_CHUNK, n - a)
        out[a:a + m] = table[_u16(bg, m)]
    return out


def _gauss(bg, shape, mean: float, std: float, dtype: str) -> torch.Tensor:
    n = math.prod(shape)
    if dtype == "BF16":
        bits = _lookup(bg, n, _table("bf16", mean, std))
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(_lookup(bg, n, _table("f32", mean, std))).reshape(shape)


# Direct MXFP4 sampling (no float weights), used for the bigger presets: each group's
# scale byte is base-1, base or base+1 with probabilities 1/2, 3/8, 1/8 (E[4^j] = 1, so
# the spread leaves the variance alone; K3's real experts show bytes 112..122), and the
# nibbles are N(0, sigma) in units of the base scale rounded to E2M1, with sigma in
# [1.7, 3.4) chosen so the matrix has std 1/sqrt(fan_in).
_PACKED_TABLES: dict[float, np.ndarray] = {}
_JITTER = np.array([-1, -1, -1, -1, 0, 0, 0, 1], dtype=np.int16)


def _packed_table(sigma: float) -> np.ndarray:
    """uint16 random index -> one packed byte (two independent nibbles, 8 bits each)."""
    t = _PACKED_TABLES.get(sigma)
    if t is None:
        from ..kernels.mxfp4 import _e2m1_codes  # numba-backed module: imported only when writing

        u = (torch.arange(256, dtype=torch.float64) + 0.5) / 256
        t8 = _e2m1_codes(sigma * torch.special.ndtri(u))
        v = np.arange(65536)
        t = _PACKED_TABLES[sigma] = (t8[v & 255] | (t8[v >> 8] << 4)).astype(np.uint8)
    return t


def _sample_mxfp4(bg, rows: int, cols: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    std = 1.0 / math.sqrt(cols)
    e = round(math.log2(std / 2.4))
    sigma = round(std / 2.0 ** e, 3)
    packed = _lookup(bg, rows * cols // 2, _packed_table(sigma)).reshape(rows, cols // 2)
    n = rows * cols // group
    raw = bg.random_raw((n + 7) // 8).view(np.uint8)[:n]
    scale = (127 + e + _JITTER[raw & 7]).astype(np.uint8).reshape(rows, cols // group)
    return torch.from_numpy(packed), torch.from_numpy(scale)
