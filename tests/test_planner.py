"""The memory plan's auto choice (the fewest bytes read per token among the plans that
fit), explicit budgets, the refusal of a plan that cannot fit, and the presets table.

The model is K3-like: 93 trunk layers of 1.17 GB (108.81 GB, K3's trunk), model tables
of 4.70 GB (lm_head 2.35 GB), 92 MoE layers of 896 routed experts, top-k 16, 17.56 MB
expert-cache slots. Every expectation below is computed by hand from the rules in
docs/TUNING.md ("How auto chooses"): a plan may use 95% of the available memory, less
the fixed rows (recurrent state, the KV cache of the sequence, activation buffers, the
measured baseline); pinning trunk saves one byte read per byte of memory, a cache
slot saves top-k x expert bytes / experts per layer (~313 KB) per 17.56 MB, and
streaming the tables frees 4.70 GB - 128 MiB for lm_head's 2.35 GB read every token.
"""

from __future__ import annotations

import math

import pytest

from k3 import synth
from k3.config import parse_config
from k3.errors import K3Error
from k3.memory import planner
from k3.memory.planner import Budgets, ModelSizes
from k3.units import human

L = 285_645 * 4096  # 1_170_001_920: one trunk layer (4096-aligned, as packed)
N = 93
T = N * L  # 108_810_178_560: the whole trunk
S = 4288 * 4096  # 17_563_648: one expert-cache slot
E = 17_547_264  # one routed expert's payload
TABLES = 4_700_000_000  # embedding + lm_head
HEAD = 2_350_000_000  # lm_head
MOE, EXPERTS, TOPK = 92, 896, 16
ROUTED = MOE * EXPERTS  # 82_432
PER_TOKEN = MOE * TOPK * E  # expert bytes one token routes to
FLOOR = (TOPK + 1) * S  # the expert cache's floor: top-k + 1 slots
STREAMED_TABLES = planner.TABLE_STREAM_BYTES  # 128 MiB: one lm_head chunk + the embedding rows
TOKENS = 16
BASE = 10**9  # the measured baseline (interpreter + libs)
TRUNK_DIR = "/packed/trunk"  # any path: the planner only needs to know the trunk is streamed

SIZES = ModelSizes(layer_bytes=(L,) * N, table_bytes=TABLES, head_bytes=HEAD, slot_bytes=S, expert_bytes=E,
                   moe_layers=MOE, experts=EXPERTS, top_k=TOPK)


@pytest.fixture(scope="module")
def cfg():
    """K3's real shapes with 93 layers and 896 experts (the fixed rows come from these)."""
    c = parse_config(synth.build_config("realdims", layers=N, experts=EXPERTS))
    assert (c.num_hidden_layers, c.num_experts, c.num_experts_per_token) == (N, EXPERTS, TOPK)
    return c


def fixed_bytes(cfg) -> int:
    return (planner.recurrent_state_bytes(cfg) + TOKENS * planner.kv_bytes_per_position(cfg)
            + planner.activation_bytes(cfg, TOKENS) + BASE)


def room_of(cfg, avail: int) -> int:
    """What the plan may spend on tables + trunk + expert cache: 95% of avail less the fixed rows."""
    return int(0.95 * avail) - fixed_bytes(cfg)


def avail_for(cfg, room: int) -> int:
    """The smallest available memory that leaves at least `room` for tables + trunk + cache."""
    a = math.ceil((room + fixed_bytes(cfg)) / 0.95)
    while room_of(cfg, a) < room:
        a += 1
    return a


def misses(slots: int) -> float:
    """Expert bytes read per token with `slots` cache slots (hit rate slots / routed experts)."""
    return PER_TOKEN * (1.0 - min(1.0, slots / ROUTED))


def make_plan(cfg, avail: int, **budgets):
    return planner.plan(cfg, SIZES, Budgets(**budgets), tokens=TOKENS, incremental=False, available=avail,
                        baseline=BASE)


def rows(p) -> dict:
    return {name: n for name, n, _ in p.rows}


def check_fits(cfg, p, avail):
    r = rows(p)
    assert r["recurrent state"] == planner.recurrent_state_bytes(cfg)
    assert r["buffers"] == planner.activation_bytes(cfg, TOKENS)
    assert r["interpreter + libs"] == BASE
    assert r["KV cache"] == TOKENS * planner.kv_bytes_per_position(cfg)  # rebuilt by every full-recompute step
    assert p.total == sum(r.values()) <= 0.95 * avail
    p.check()  # no refusal


# ---------------------------------------------------------------------------- auto
def test_cost_model_by_hand():
    tp = planner.plan_trunk([L] * N, 50 * L, 2)
    assert len(tp.pinned) == 48 and tp.streamed_bytes == 45 * L
    assert planner.bytes_per_token(SIZES, tp, 17, False) == int(45 * L + PER_TOKEN * (1 - 17 / ROUTED))
    assert planner.bytes_per_token(SIZES, tp, 17, True) == int(45 * L + PER_TOKEN * (1 - 17 / ROUTED) + HEAD)
    assert planner.bytes_per_token(SIZES, None, ROUTED, False) == 0  # trunk in RAM, every expert cached
    assert planner.bytes_per_token(SIZES, None, 10 * ROUTED, False) == 0  # the hit rate is capped at 1


def test_everything_pinned_when_it_fits(cfg):
    # 200 GB: the whole trunk is pinned (no ring); the rest is expert cache; streaming the
    # tables would only add ~260 cache slots (~81 MB a token) for lm_head's 2.35 GB: resident
    avail = 200 * 10**9
    room = room_of(cfg, avail)
    p = make_plan(cfg, avail, trunk=TRUNK_DIR)
    slots = (room - TABLES - T) // S
    assert 4000 < slots < ROUTED
    assert p.preset == "auto" and p.stream_tables is False
    assert p.trunk.pinned == list(range(N)) and p.trunk.ring_slots == 0 and p.trunk.arena_bytes == 0
    assert p.trunk_budget == T and p.trunk.used_bytes == T
    assert p.cache_slots == slots and rows(p)["expert cache"] == slots * S
    assert rows(p)["embed + lm_head"] == TABLES and rows(p)["trunk (STREAMED)"] == T
    assert p.read_per_token == pytest.approx(misses(slots), abs=1)
    check_fits(cfg, p, avail)
    assert any(n.startswith("auto: model tables resident; trunk 108.81 GB (93/93 layers pinned)") for n in p.notes)


def test_everything_pinned_and_cached_on_a_big_machine(cfg):
    # 2 TB: trunk pinned, every routed expert has a slot (capped there), tables resident: nothing is read
    avail = 2000 * 10**9
    p = make_plan(cfg, avail, trunk=TRUNK_DIR)
    assert p.stream_tables is False and p.trunk.pinned == list(range(N)) and p.trunk.ring_slots == 0
    assert p.cache_slots == ROUTED and rows(p)["expert cache"] == ROUTED * S
    assert p.read_per_token == 0
    check_fits(cfg, p, avail)


def test_tables_streamed_when_the_memory_they_free_pins_more_trunk_than_lm_head_costs(cfg):
    # Streamed tables leave 50 layers + half a slot beside the cache floor: 48 pinned + a 2-slot
    # ring, 17 cache slots. Resident tables leave 4.57 GB less: 46.1 layers, so 44 pinned. The
    # 4 more pinned layers (4.68 GB a token) are worth more than reading lm_head (2.35 GB).
    room = STREAMED_TABLES + FLOOR + 50 * L + S // 2
    avail = avail_for(cfg, room)
    room = room_of(cfg, avail)
    assert 0 <= room - (STREAMED_TABLES + FLOOR + 50 * L) < S  # less than one more slot beside the floor
    assert (room - TABLES - FLOOR) // L == 46  # resident tables: 44 pinned + 2 ring slots
    p = make_plan(cfg, avail, trunk=TRUNK_DIR)
    assert p.preset == "auto" and p.stream_tables is True
    assert len(p.trunk.pinned) == 48 and p.trunk.ring_slots == 2 and p.trunk.slot_bytes == L
    assert p.trunk.streamed_bytes == 45 * L
    assert p.cache_slots == TOPK + 1
    assert rows(p)["embed + lm_head"] == STREAMED_TABLES
    want = 45 * L + PER_TOKEN * (1 - 17 / ROUTED) + HEAD
    assert p.read_per_token == pytest.approx(want, abs=1)
    # the resident-tables plan this beat: 44 pinned, 49 layers read a token, no lm_head
    resident = 49 * L + PER_TOKEN * (1 - 17 / ROUTED)
    assert p.read_per_token < resident
    check_fits(cfg, p, avail)
    assert any(n.startswith("auto: model tables STREAMED") for n in p.notes)


def test_tables_resident_when_streaming_them_cannot_pin_more_trunk(cfg):
    avail = 64 * 10**9
    room = room_of(cfg, avail)
    # an explicit trunk budget: the freed memory could only go to the expert cache
    # (~260 slots, ~81 MB a token), far less than lm_head's 2.35 GB a token
    p = make_plan(cfg, avail, trunk=TRUNK_DIR, trunk_gb=40)
    assert p.preset == "custom" and p.stream_tables is False
    assert p.trunk_budget == 40 * 10**9 and p.trunk.used_bytes == 40 * 10**9
    assert len(p.trunk.pinned) == 40 * 10**9 // L - 2 == 32 and p.trunk.ring_slots == 2
    slots = (room - TABLES - 40 * 10**9) // S
    assert p.cache_slots == slots
    assert p.read_per_token == pytest.approx((N - 32) * L + misses(slots), abs=1)
    check_fits(cfg, p, avail)
    # no packed trunk (held in RAM): the same, on a machine that holds it
    avail = 200 * 10**9
    room = room_of(cfg, avail)
    p = make_plan(cfg, avail)
    assert p.trunk is None and p.trunk_budget is None and p.stream_tables is False
    assert rows(p)["trunk (resident)"] == T and rows(p)["embed + lm_head"] == TABLES
    slots = (room - TABLES - T) // S
    assert p.cache_slots == slots
    assert p.read_per_token == pytest.approx(misses(slots), abs=1)
    check_fits(cfg, p, avail)


def test_tables_streamed_when_only_that_fits(cfg):
    # trunk in RAM: 108.81 GB + 4.70 GB tables + the cache floor do not fit; with the tables
    # streamed there is room for the floor and 1 GB more of cache
    room = T + STREAMED_TABLES + FLOOR + 10**9
    avail = avail_for(cfg, room)
    room = room_of(cfg, avail)
    assert room < T + TABLES + FLOOR
    p = make_plan(cfg, avail)
    assert p.trunk is None and p.stream_tables is True
    assert p.cache_slots == (room - T - STREAMED_TABLES) // S
    check_fits(cfg, p, avail)


def test_tables_streamed_when_only_that_fits_with_the_cache_fixed(cfg):
    # the same machine with the expert cache fixed by the user (--cache-gb 1): the tables
    # are still the planner's choice (auto preset), and only the streamed plan fits
    room = T + STREAMED_TABLES + FLOOR + 10**9
    avail = avail_for(cfg, room)
    assert 10**9 // S * S + T + TABLES > room_of(cfg, avail) >= 10**9 // S * S + T + STREAMED_TABLES
    p = make_plan(cfg, avail, cache_gb=1.0)
    assert p.trunk is None and p.stream_tables is True
    assert p.cache_budget == 10**9 and p.cache_slots == 10**9 // S
    check_fits(cfg, p, avail)


def test_trunk_budget_beyond_the_ring_goes_to_the_expert_cache(cfg):
    # docs/TUNING.md: the candidates include, for each trunk budget, the smallest budget
    # that pins the same layers, the rest going to the cache. At 64 GB streamed tables
    # leave room for 47 pinned layers + 2 ring slots + some spare bytes: as cache slots
    # beyond the floor they save expert reads every token; as ring read-ahead, nothing.
    avail = 64 * 10**9
    room = room_of(cfg, avail)
    left = room - STREAMED_TABLES
    pinned = (left - FLOOR) // L - 2
    assert pinned == 47
    spare = left - (pinned + 2) * L
    slots = spare // S
    assert slots > TOPK + 1  # more than the floor: the spare bytes are worth slots
    p = make_plan(cfg, avail, trunk=TRUNK_DIR)
    assert p.stream_tables is True
    assert len(p.trunk.pinned) == pinned and p.trunk.ring_slots == 2
    assert p.cache_slots == slots
    assert p.trunk_budget == (pinned + 2) * L and p.trunk.arena_bytes == 2 * L
    assert p.read_per_token == pytest.approx((N - pinned) * L + misses(slots) + HEAD, abs=1)
    check_fits(cfg, p, avail)


# ------------------------------------------------------------------------ explicit
def test_explicit_budgets_are_honoured(cfg):
    avail = 64 * 10**9
    room = room_of(cfg, avail)
    # a named preset: its trunk / cache budgets, tables resident
    p = make_plan(cfg, avail, preset="desktop", trunk=TRUNK_DIR)
    assert p.preset == "desktop" and p.stream_tables is False
    assert p.trunk_budget == 16 * 10**9 and p.cache_budget == 10 * 10**9
    assert len(p.trunk.pinned) == 16 * 10**9 // L - 2 == 11 and p.trunk.ring_slots == 2
    assert p.trunk.used_bytes == 16 * 10**9
    assert p.cache_slots == 10 * 10**9 // S == 569 and rows(p)["expert cache"] == 569 * S
    check_fits(cfg, p, avail)
    # --trunk-gb / --cache-gb override it
    p = make_plan(cfg, avail, preset="desktop", trunk=TRUNK_DIR, trunk_gb=20, cache_gb=3)
    assert p.preset == "custom" and p.stream_tables is False
    assert p.trunk_budget == 20 * 10**9 and p.cache_budget == 3 * 10**9
    assert len(p.trunk.pinned) == 20 * 10**9 // L - 2 == 15
    assert p.cache_slots == 3 * 10**9 // S == 170
    assert p.read_per_token == pytest.approx((N - 15) * L + misses(170), abs=1)
    check_fits(cfg, p, avail)
    # --trunk-gb auto: the trunk gets what the fixed cache and the tables leave
    p = make_plan(cfg, avail, preset="laptop", trunk=TRUNK_DIR, trunk_gb="auto", cache_gb=3)
    top = room - TABLES - 3 * 10**9
    assert p.preset == "custom" and p.stream_tables is False
    assert top - 4096 < p.trunk_budget <= top and p.trunk.used_bytes == top // 4096 * 4096
    assert len(p.trunk.pinned) == top // L - 2 and p.trunk.ring_slots == 2
    assert p.cache_budget == 3 * 10**9 and p.cache_slots == 170
    check_fits(cfg, p, avail)
    # --ultra-low-memory fixes the tables: streamed even where auto would not choose it
    p = make_plan(cfg, 200 * 10**9, trunk=TRUNK_DIR, ultra_low_memory=True)
    assert p.stream_tables is True and rows(p)["embed + lm_head"] == STREAMED_TABLES
    assert p.trunk.pinned == list(range(N))


def test_explicit_cache_below_the_floor_is_refused(cfg):
    with pytest.raises(K3Error) as ei:
        make_plan(cfg, 64 * 10**9, trunk=TRUNK_DIR, cache_gb=0.25)
    assert ei.value.exit_code == 1
    msg = str(ei.value)
    assert f"holds {250_000_000 // S} slots" in msg and "top-k + 1 = 17 slots" in msg
    assert "Raise --cache-gb to at least 0.299 GB" in msg  # 17 x 17.56 MB = 0.29859 GB, rounded up
    assert planner.expert_cache_slots(SIZES, int(0.299 * 10**9)) == 17


# ------------------------------------------------------------------------- refusal
def test_a_plan_that_cannot_fit_is_refused_with_the_shortfall(cfg):
    # the trunk in RAM (no --trunk) on a 64 GB machine: nothing fits; the plan shown is the
    # smallest asked for (tables streamed, the cache at its floor) and check() refuses it
    avail = 64 * 10**9
    p = make_plan(cfg, avail)
    assert p.trunk is None and p.stream_tables is True and p.cache_slots == TOPK + 1
    total = T + STREAMED_TABLES + FLOOR + fixed_bytes(cfg)
    assert p.total == total
    with pytest.raises(K3Error) as ei:
        p.check()
    assert ei.value.exit_code == 1
    msg = str(ei.value)
    assert msg.startswith(f"REFUSING TO START: this needs {human(total)} and the machine has {human(avail)}")
    assert f"a shortfall of {human(total - 0.95 * avail)}" in msg
    assert "--preset" in msg and "--ultra-low-memory" in msg
    assert "memory plan" in msg and "trunk (resident)" in msg  # every row shown
    # explicit budgets too large for the machine are refused the same way
    p = make_plan(cfg, avail, preset="laptop", trunk=TRUNK_DIR, trunk_gb=80, cache_gb=10)
    with pytest.raises(K3Error) as ei:
        p.check()
    total = 80 * 10**9 + TABLES + 569 * S + fixed_bytes(cfg)
    assert p.total == total
    assert f"a shortfall of {human(total - 0.95 * avail)}" in str(ei.value)


# ------------------------------------------------------------------------- presets
def test_presets_table_lists_every_preset():
    t = planner.presets_table()
    for name in ("laptop", "desktop", "workstation", "server", "max", "ultra", "auto"):
        assert name in t
    assert "3.00 / 1.00" in t and "110.00 / 109.00" in t


def test_sequences_decoded_together_each_hold_their_recurrent_state_and_rollback_records(cfg):
    # a batch of B sequences carries B recurrent states (and B sets of speculation
    # records); the KV rows were already sized by the caller as B x max_context positions
    one = rows(planner.plan(cfg, SIZES, Budgets(), tokens=TOKENS, incremental=True, available=10**13,
                            baseline=BASE, spec=4))
    eight = rows(planner.plan(cfg, SIZES, Budgets(), tokens=TOKENS, incremental=True, available=10**13,
                              baseline=BASE, spec=4, sequences=8))
    assert one["recurrent state"] == planner.recurrent_state_bytes(cfg) > 0
    assert eight["recurrent state"] == 8 * one["recurrent state"]
    assert eight["speculation"] == 8 * one["speculation"] > 0


def _fits(cfg, sizes, avail, **budgets) -> bool:
    try:
        planner.plan(cfg, sizes, Budgets(**budgets), tokens=TOKENS, incremental=False, available=avail,
                     baseline=BASE).check()
        return True
    except K3Error:
        return False


def test_ultra_is_never_refused_where_auto_fits(cfg):
    """The issue's case: a 10 GB realdims checkpoint (4 K3 layers, 32 experts) with a
    packed trunk in a 4 GiB cap. ultra's budgets (2.5 GB trunk, 0.31 GB cache) are
    ceilings that shrink, as auto sizes them, to what fits: where any plan fits ultra
    does, it streams the tables, and it never plans more than its ceilings."""
    small = ModelSizes(layer_bytes=(L,) * 4, table_bytes=TABLES, head_bytes=HEAD, slot_bytes=S, expert_bytes=E,
                       moe_layers=3, experts=32, top_k=TOPK)
    avail = 4 * 1024**3 - 12 * 1024**2  # 4.02 GB available, as in the issue
    old_ultra = dict(trunk=TRUNK_DIR, trunk_gb=2.5, cache_gb=0.31, ultra_low_memory=True)  # the fixed budgets
    assert not _fits(cfg, small, avail, **old_ultra)
    assert _fits(cfg, small, avail, trunk=TRUNK_DIR)
    p = planner.plan(cfg, small, Budgets(preset="ultra", trunk=TRUNK_DIR), tokens=TOKENS, incremental=False,
                     available=avail, baseline=BASE)
    p.check()
    assert p.stream_tables and p.trunk.used_bytes <= 2.5e9 and p.cache_slots * S <= max(0.31e9, FLOOR)
    assert any(n.startswith("ultra: ") and "ceilings" in n for n in p.notes)
    # with plenty of memory ultra stays at its ceilings (~3 GB), well below auto's plan
    big = planner.plan(cfg, small, Budgets(preset="ultra", trunk=TRUNK_DIR), tokens=TOKENS, incremental=False,
                       available=64 * 10**9, baseline=BASE)
    assert big.trunk.used_bytes <= 2.5e9 and big.cache_slots * S <= 0.31e9
    assert big.total < make_plan(cfg, 64 * 10**9, trunk=TRUNK_DIR).total
    # over a sweep of caps, both with a packed trunk and with the trunk held in RAM
    for trunk in (TRUNK_DIR, None):
        for mib in range(1500, 14000, 250):
            a = mib * 1024**2
            if _fits(cfg, small, a, trunk=trunk):
                assert _fits(cfg, small, a, preset="ultra", trunk=trunk), (trunk, mib)


def test_streamed_tables_never_plan_more_than_the_tables():
    tiny = ModelSizes(layer_bytes=(10**6,) * 2, table_bytes=3 * 10**6, head_bytes=10**6, slot_bytes=4096,
                      expert_bytes=4000, moe_layers=1, experts=16, top_k=4)
    assert planner.stream_table_bytes(tiny) == 3 * 10**6
    assert planner.stream_table_bytes(SIZES) == planner.TABLE_STREAM_BYTES
