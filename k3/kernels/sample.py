"""The sampler's filter and pick (k3.sampling) as compiled single-threaded passes: the
temperature weights, the top-k / top-p kept set and the inverse-CDF pick, each sum in
one fixed sequential order (results depend on nothing but the logits, the settings and
the uniform). numpy's full stable sort of a 163,840-token row took ~14 ms a token; here
the tokens are bucketed by weight and only those that can be kept are sorted, as unique
integer keys (numpy's SIMD sort) - docs/TUNING.md, "Seeded sampling".
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .kcache import enter as _cache_enter, leave as _cache_leave

_CACHE_PREV = _cache_enter()   # the kernels are cached in k3.kernels.kcache.folder(), until the end

#: weight buckets: bucket b holds the tokens with (max - logit) / T in [b, b + 1) / PER_NAT
#: (the last one everything lower); only a prefix of the buckets is sorted
PER_NAT = 4
BUCKETS = 256


@njit(cache=True, nogil=True)
def buckets(x, m, t, w, bucket, bmass, bcount):
    """Each token's bucket (x: float32 logits, m their max, t the temperature, w the
    weights exp((x - m) / t)), the buckets' weight and counts; returns the total weight,
    summed in token-id order. A bucket is any non-increasing function of the logit (the
    candidates must be a prefix of the order), so it is computed in float32."""
    for b in range(BUCKETS):
        bmass[b] = 0.0
        bcount[b] = 0
    scale = np.float32(PER_NAT / t)
    mf = np.float32(m)
    top = np.float32(BUCKETS - 1)
    total = 0.0
    for i in range(x.shape[0]):
        d = (mf - x[i]) * scale
        b = BUCKETS - 1
        if d < top:
            b = int(d)
        bucket[i] = b
        bmass[b] += w[i]
        bcount[b] += 1
        total += w[i]
    return total


@njit(cache=True, nogil=True)
def last_bucket(bmass, bcount, k, target):
    """The last bucket the candidates need: the one where the count reaches k (k > 0),
    else the one after the weight reaches target (one more: the order's own sums round
    otherwise)."""
    c = 0
    s = 0.0
    for b in range(BUCKETS):
        c += bcount[b]
        s += bmass[b]
        if k > 0 and c >= k:
            return b
        if k == 0 and s >= target:
            return min(b + 1, BUCKETS - 1)
    return BUCKETS - 1


@njit(cache=True, nogil=True)
def order_keys(bits, bucket, bcount, last):
    """The tokens of buckets <= last as uint64 keys whose ascending order is descending
    logit, ties lower id first (bits: the float32 logits' bits as uint32): the logit
    mapped to an order-preserving integer, inverted, above the id - unique keys, so any
    sort gives that one order."""
    m = 0
    for b in range(last + 1):
        m += bcount[b]
    keys = np.empty(m, np.uint64)
    j = 0
    for i in range(bits.shape[0]):
        if bucket[i] <= last:
            u = np.uint64(bits[i])
            if u == np.uint64(0x80000000):   # -0.0 ties with +0.0
                u = np.uint64(0)
            if u >> np.uint64(31):
                u = ~u & np.uint64(0xFFFFFFFF)
            else:
                u = u | np.uint64(0x80000000)
            keys[j] = ((np.uint64(0xFFFFFFFF) - u) << np.uint64(32)) | np.uint64(i)
            j += 1
    return keys


@njit(cache=True, nogil=True)
def _ascending(order, n):
    """The ids of ``order`` ascending (n: the vocabulary): a sort when they are few, else
    marked and collected in one pass."""
    if order.shape[0] < 4096:
        return np.sort(order)
    mark = np.zeros(n, np.bool_)
    for j in range(order.shape[0]):
        mark[order[j]] = True
    out = np.empty(order.shape[0], np.int64)
    j = 0
    for i in range(n):
        if mark[i]:
            out[j] = i
            j += 1
    return out


@njit(cache=True, nogil=True)
def kept(keys, w, k, top_p, total):
    """(kept ids ascending, reached) from the sorted candidate keys: the first k (k > 0),
    then the shortest prefix whose weight, summed in order, reaches top_p times the mass
    of the top-k set (summed in id order; ``total`` without top-k); reached is False when
    the candidates ran out first (all of them are returned)."""
    n = keys.shape[0]
    if 0 < k < n:
        n = k
    order = np.empty(n, np.int64)
    for j in range(n):
        order[j] = np.int64(keys[j] & np.uint64(0xFFFFFFFF))
    if top_p >= 1.0:
        return _ascending(order, w.shape[0]), True
    mass = total
    if k > 0:
        ids = _ascending(order, w.shape[0])
        mass = 0.0
        for j in range(n):
            mass += w[ids[j]]
    c = 0.0
    for j in range(n):
        c += w[order[j]]
        if c >= top_p * mass:
            return _ascending(order[:j + 1], w.shape[0]), True
    return _ascending(order, w.shape[0]), False


@njit(cache=True, nogil=True)
def pick(ids, w, u):
    """The first of ``ids`` (ascending) whose cumulative weight, summed in that order,
    exceeds u (in [0, 1)) times their whole weight."""
    mass = 0.0
    for j in range(ids.shape[0]):
        mass += w[ids[j]]
    target = u * mass
    c = 0.0
    for j in range(ids.shape[0]):
        c += w[ids[j]]
        if c > target:
            return ids[j]
    for j in range(ids.shape[0] - 1, -1, -1):   # not reached (rounding): the last with weight
        if w[ids[j]] > 0.0:
            return ids[j]
    return ids[0]


@njit(cache=True, nogil=True)
def pick_all(w, total, u):
    """:func:`pick` over every token (nothing filtered), without listing the ids."""
    target = u * total
    c = 0.0
    n = w.shape[0]
    for i in range(n):
        c += w[i]
        if c > target:
            return i
    for i in range(n - 1, -1, -1):
        if w[i] > 0.0:
            return i
    return 0


_cache_leave(_CACHE_PREV)
