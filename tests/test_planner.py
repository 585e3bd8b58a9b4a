"""The auto budget (trunk first) and the presets table."""

from __future__ import annotations

import pytest

from k3.errors import K3Error
from k3.memory import planner
from k3.memory.planner import GB, auto_budget

EMBED = int(4.70 * GB)  # K3's embedding + lm_head


def reserve(avail):
    return int(2 * GB + 0.02 * avail + EMBED + 1.7 * GB)


def test_everything_pinned_when_the_trunk_fits():
    avail = int(200 * GB)
    t, c, msg = auto_budget(avail, int(228 * GB), int(108.81 * GB), EMBED, int(2.34 * GB), int(0.5 * GB))
    assert t == int(108.81 * GB) and c == avail - reserve(avail) - t
    assert "trunk 108.81 GB" in msg


def test_cache_floor_and_cap_otherwise():
    avail, total = int(60 * GB), int(64 * GB)
    t, c, _ = auto_budget(avail, total, int(108.81 * GB), EMBED, int(2.34 * GB), int(0.5 * GB))
    assert c == int(0.5 * GB)
    assert t == int(0.55 * total) - reserve(avail) - int(0.5 * GB)  # the reclaim cap
    assert t + c <= avail - reserve(avail)


def test_second_ring_slot_beats_the_cap_when_it_fits():
    # 20 GB machine: the cap leaves ~1.6 GB (one 2.34 GB slot); a second slot needs 4.69 GB
    avail, total = int(19 * GB), int(20 * GB)
    t1, _, _ = auto_budget(avail, total, int(108.81 * GB), EMBED, int(2.34 * GB), int(0.5 * GB))
    assert t1 == int(2.34 * GB)
    t2, c2, _ = auto_budget(avail, total, int(108.81 * GB), EMBED, int(2.34 * GB), int(0.5 * GB),
                            overlap_min=int(4.69 * GB))
    assert t2 == int(4.69 * GB) and c2 == int(0.5 * GB)
    # not when the usable memory cannot pay for it
    t3, _, _ = auto_budget(int(12 * GB), int(13 * GB), int(108.81 * GB), EMBED, int(2.34 * GB),
                           int(0.5 * GB), overlap_min=int(4.69 * GB))
    assert t3 == int(2.34 * GB)


def test_refused_below_the_floor_with_numbers():
    with pytest.raises(K3Error) as e:
        auto_budget(int(10 * GB), int(12 * GB), int(108.81 * GB), EMBED, int(2.34 * GB), int(0.5 * GB))
    assert "floor" in str(e.value) and "--preset ultra" in str(e.value)


def test_presets_table_lists_every_preset():
    t = planner.presets_table()
    for name in ("laptop", "desktop", "workstation", "server", "max", "ultra", "auto"):
        assert name in t
    assert "3.00 / 1.00" in t and "110.00 / 109.00" in t
