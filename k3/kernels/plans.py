"""A region's step table, made once per layer and kept under weak references to the
weights it points into (``layer_plan``), so a streamed or evicted weight never leaves
a stale address behind.
"""

from __future__ import annotations

import weakref
from collections import namedtuple

import torch
from numba import types

from . import region

_f32p = region.address_intrinsic(types.float32)

#: a region's BF16 steps: the input x, the output y, the step table (region.T_* columns),
#: where its groups end (rows 0 .. p0-1, p0 .. p1-1, then the rest), the workspace the
#: table's offsets point into, the pieces' flags
RegionSteps = namedtuple("RegionSteps", "x y tab p0 p1 work fl")


def _bf16_2d(w) -> bool:
    return isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous()


class _Plan:
    """What a region keeps per layer (``_layer_plan``): its step table (``tab`` None:
    these weights are not for the region) and what its fill adds (layout numbers, the
    weights' kernel forms), with weak references to the weight objects it was made for
    (it holds none of them)."""


def _layer_plan(plans: dict, mats, params: tuple, fill) -> _Plan | None:
    """The plan of a layer's weights ``mats`` (None for an absent one) and ``params``:
    ``fill(plan, mats, *params)`` once per live set of weight objects, kept in ``plans``
    under the last one (whose end drops the entry); None where the region does not take
    them."""
    last = mats[-1]
    key = id(last)
    p = plans.get(key)
    if not (p is not None and p.params == params and len(p.refs) == len(mats)
            and all(r() is m for r, m in zip(p.refs, mats))):
        p = _Plan()
        try:
            p.refs = tuple(weakref.ref(m, (lambda _r, k=key, plans=plans: plans.pop(k, None)) if m is last
                                       else None) if m is not None else _NONE_REF for m in mats)
        except TypeError:   # objects without weak references: nothing kept
            return None
        p.params = params
        fill(p, mats, *params)
        plans[key] = p
    return p if p.tab is not None else None


def _none() -> None:
    return None


_NONE_REF = _none   # stands for an absent weight (g_b of a full-rank gate): calling it gives None
