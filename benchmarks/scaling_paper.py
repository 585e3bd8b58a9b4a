"""On paper: the full K3 on N machines of M GB each, as k3's pipeline would plan it
(docs/SCALING.md "On paper").

Pure arithmetic: no model files, no kernels, no timing. K3's per-tensor shapes come from
the synth preset "realdims" at 93 layers and 896 experts (k3.synth.make_plan describes
every tensor without writing any data), with the release's embedding and lm_head added
(163,840 x 7168 BF16 each, untied; the synth vocabulary is 2304). For each (N, M) the
script does what `torchrun ... -m k3 run MODEL --trunk DIR` does before it loads a byte:

* every rank's capacity (k3.memory.planner.trunk_room: M GB x PLAN_FRACTION, less the baseline,
  the fixed rows of the plan with the per-layer ones shared by N, the tables on rank 0
  and the expert cache's floor), then the layer ranges (k3.pipeline.assign_layers);
* each rank's own memory plan (k3.memory.planner.plan, `--preset auto` with a packed
  trunk: 2 ring slots, largest-first pinning, the expert cache gets what is left), and
  its refusal when it does not fit (plan.check);
* bytes read per token by the planner's cost model (planner.bytes_per_token: unpinned
  trunk, expert-cache misses at a hit rate of slots / routed experts) and the carry
  sent around the ring (k3.pipeline.carry_bytes, as Stage.net_bytes_per_token).

The time model (one sequence; the stages run one after another):

    s/token = sum over ranks of max(compute_r, disk_r) + sum over hops of (carry_h / link + latency)
    compute_r = max(trunk_r / bf16 + active experts_r / mxfp4 + layers_r x per-layer cost
                    (+ lm_head / bf16 on rank 0),  everything it touches / memory bandwidth)
    disk_r    = streamed trunk_r / sequential rate + expert misses_r / random rate
                (+ lm_head / sequential rate on rank 0 if the tables are streamed)

Every rate is an option whose default is this project's measured figure (the doc section
named beside it).

    python benchmarks/scaling_paper.py [--ranks 1,2,4,8] [--mem-gb 32,64,128] [--context 4096]
        [--tables resident|auto] [--link-gbs 1.25] [--hop-us 100] ...

(--help lists every rate with the doc section its default comes from.)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from k3 import pipeline
from k3.decode import max_piece
from k3.doctor import K3_SLOT_BYTES, K3_TRUNK_BYTES
from k3.errors import K3Error
from k3.memory import planner
from k3.probe import K3_EXPERT_BYTES
from k3.synth import _Expert, make_plan
from k3.units import GB, align_up

VOCAB = 163_840  # the release's vocabulary (spec kimi-k3-model.md: vocab_size 163840, untied lm_head)
PIECE = max_piece()  # the most tokens one pass reads with the default prefill chunk


# ---------------------------------------------------------------------- the model
@dataclass
class K3:
    cfg: object
    layer_bytes: list  # packed-trunk layer runs (4096-rounded), 93 of them
    raw_trunk: int  # the same without the rounding
    expert_bytes: int
    table_bytes: int
    head_bytes: int
    slot_bytes: int


def k3_model() -> K3:
    p = make_plan("realdims", "k3", layers=93, experts=896)
    cfg = replace(p.cfg, vocab_size=VOCAB)
    per_layer = [0] * cfg.num_hidden_layers
    expert = None
    for shard in p.shards:
        for it in shard:
            if isinstance(it, _Expert):
                expert = it.nbytes if expert is None else expert
                if it.nbytes != expert:
                    raise SystemExit("experts of several sizes: this script assumes one size")
            elif it.rel is not None and it.rel.startswith("layers."):
                per_layer[int(it.rel.split(".")[1])] += it.nbytes
    table = VOCAB * cfg.hidden_size * 2  # BF16
    return K3(cfg, [align_up(b) for b in per_layer], sum(per_layer), expert, 2 * table, table, K3_SLOT_BYTES)


def rank_sizes(m: K3, layers: range, tables: bool) -> planner.ModelSizes:
    """What k3.memory.streaming.model_sizes gives a rank holding ``layers``."""
    moe = sum(1 for i in layers if m.cfg.is_moe(i))
    return planner.ModelSizes(
        layer_bytes=tuple(m.layer_bytes[layers.start:layers.stop]), table_bytes=m.table_bytes if tables else 0,
        head_bytes=m.head_bytes if tables else 0, slot_bytes=m.slot_bytes if moe else 0,
        expert_bytes=m.expert_bytes if moe else 0, moe_layers=moe, experts=m.cfg.num_experts,
        top_k=m.cfg.num_experts_per_token)


class ResidentTables(planner.Budgets):
    """``--preset auto`` with the model tables held in RAM (auto alone may stream them)."""

    @property
    def stream_tables(self):
        return False


# ---------------------------------------------------------------------- the plans
@dataclass
class Rank:
    layers: range
    sizes: planner.ModelSizes
    plan: planner.Plan | None
    refusal: str | None
    capacity: int

    @property
    def trunk(self) -> int:
        return self.sizes.trunk_bytes

    @property
    def pinned(self) -> int:
        tp = self.plan.trunk
        return tp.pinned_bytes if tp is not None else self.trunk

    @property
    def streamed(self) -> int:
        tp = self.plan.trunk
        return tp.streamed_bytes if tp is not None else 0


def plan_pipeline(m: K3, n: int, available: int, a, sequences: int = 1) -> list[Rank]:
    """Every rank's layers and memory plan, as k3.loader.load does under torchrun."""
    cfg = m.cfg
    budgets = (planner.Budgets if a.tables == "auto" else ResidentTables)(preset="auto", trunk="(packed)")
    shape = {"tokens": a.context * sequences, "incremental": True, "prefill_tokens": PIECE * sequences, "spec": 0,
             "kv_latent": True, "sequences": sequences}
    whole = range(cfg.num_hidden_layers)
    caps = [planner.trunk_room(cfg, rank_sizes(m, whole, r == 0), budgets, available=available, baseline=a.baseline,
                               n_layers=whole, share=n, tables=r == 0, **shape) for r in range(n)]
    ranges = pipeline.assign_layers(m.layer_bytes, caps) if n > 1 else [whole]
    out = []
    for r, layers in enumerate(ranges):
        sizes = rank_sizes(m, layers, r == 0)
        try:
            p = planner.plan(cfg, sizes, budgets, available=available, baseline=a.baseline, n_layers=layers,
                             pin_order="largest", **shape)
        except K3Error as e:
            out.append(Rank(layers, sizes, None, str(e).splitlines()[0], caps[r]))
            continue
        try:
            p.check()
            refusal = None
        except K3Error:
            refusal = f"short by {(p.total - planner.PLAN_FRACTION * p.available) / GB:.2f} GB"
        out.append(Rank(layers, sizes, p, refusal, caps[r]))
    return out


# ---------------------------------------------------------------------- the time model
def distinct(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of a layer over ``tokens`` tokens, uniform routing."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass
class Stage:
    compute: float
    disk: float
    read: float  # bytes from storage
    hop_bytes: int  # carry this rank sends on (0 for a single process)

    @property
    def time(self) -> float:
        return max(self.compute, self.disk)


def stage(m: K3, rk: Rank, n: int, a, tokens: int = 1) -> Stage:
    """One rank's work for a pass of ``tokens`` tokens (one per sequence)."""
    s, p = rk.sizes, rk.plan
    hit = min(1.0, p.cache_slots / s.routed_experts) if s.routed_experts else 1.0
    active = s.moe_layers * distinct(s.experts, s.top_k, tokens) * s.expert_bytes if s.moe_layers else 0.0
    head = s.head_bytes  # rank 0 only (the others hold no tables)
    touched = rk.trunk + active + head
    compute = (rk.trunk + head) / (a.bf16_gbs * GB) + active / (a.mxfp4_gbs * GB)
    compute += tokens * len(rk.layers) * a.layer_ms / 1e3
    compute = max(compute, touched / (a.mem_gbs * GB))
    miss = active * (1.0 - hit)
    streamed_head = head if p.stream_tables else 0
    disk = (rk.streamed + streamed_head) / (a.disk_seq_gbs * GB) + miss / (a.disk_rand_gbs * GB)
    hop = pipeline.carry_bytes(m.cfg, rk.layers.stop, tokens) if n > 1 else 0
    return Stage(compute, disk, rk.streamed + streamed_head + miss, hop)


def hop_seconds(nbytes: float, link_gbs: float, hop_us: float) -> float:
    return nbytes / (link_gbs * GB) + hop_us / 1e6


# ---------------------------------------------------------------------- output
def gbs(x: float) -> str:
    return f"{x / GB:.1f}"


def fmt_ranges(ranks) -> str:
    return " / ".join(f"{r.layers.start}-{r.layers.stop - 1}" for r in ranks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4,8", help="machines in the pipeline (N), comma-separated")
    ap.add_argument("--mem-gb", default="32,64,128",
                    help="memory each machine lets k3 plan in (M, GB = 1e9 bytes), comma-separated")
    ap.add_argument("--baseline-gb", type=float, default=0.5,
                    help="the interpreter's own footprint per rank (k3 measures it at start; ~0.5 GB)")
    ap.add_argument("--context", type=int, default=4096, help="KV positions each sequence may hold (--max-context)")
    ap.add_argument("--tables", choices=("resident", "auto"), default="resident",
                    help="rank 0's embedding + lm_head: held in RAM, or as --preset auto chooses (it may stream them)")
    # Rates measured on the 2-vCPU dev VM of docs/PERFORMANCE.md (an AMD EPYC Zen 4 guest, shared), in GB/s unless named otherwise.
    ap.add_argument("--bf16-gbs", type=float, default=21.0,
                    help="BF16 trunk matmuls, weight bytes/s in a decode step: docs/PERFORMANCE.md 'Decode with "
                         "everything resident' (5.75 GB in 0.275 s = 21 GB/s; bf16_linear T = 1 in 'Kernels': "
                         "21.5-21.9 GB/s)")
    ap.add_argument("--mxfp4-gbs", type=float, default=7.5,
                    help="MXFP4 expert matmuls, packed bytes/s in a decode step: docs/PERFORMANCE.md 'Decode with "
                         "everything resident' (0.84 GB in 0.112 s = 7.5 GB/s; mxfp4_linear T = 1 in 'Kernels': "
                         "7.1-7.5 GB/s)")
    ap.add_argument("--layer-ms", type=float, default=9.0,
                    help="per layer and token, everything but the matmuls (attention, norms, routing, AttnRes, "
                         "Python): docs/PERFORMANCE.md 'Decode with everything resident', decode row, attention "
                         "0.013 s + other 0.023 s over 4 layers = 9 ms")
    ap.add_argument("--mem-gbs", type=float, default=26.7,
                    help="memory read bandwidth, a floor under compute: docs/PERFORMANCE.md 'Per-token overhead' "
                         "(best of 5 torch.sum over 1 GiB: 26.7 / 26.3 GB/s)")
    ap.add_argument("--disk-seq-gbs", type=float, default=2.85,
                    help="O_DIRECT sequential reads (streamed trunk, streamed lm_head): docs/BENCHMARKS.md 'Bars', "
                         "bar a probe, seq QD1 64 MiB: 2.80 2.85 2.85 before the runs, 2.97 after (median 2.85)")
    ap.add_argument("--disk-rand-gbs", type=float, default=2.43,
                    help="O_DIRECT random 17.5 MB reads at QD4 (expert misses, 4 I/O threads): docs/BENCHMARKS.md "
                         "'Bars', bar a probe: 2.44 1.96 2.42 before, 2.43 after (median 2.43)")
    # The network: assumptions, not measurements.
    ap.add_argument("--link-gbs", type=float, default=1.25, help="link rate between neighbours (10 GbE = 1.25 GB/s)")
    ap.add_argument("--slow-link-gbs", type=float, default=0.125, help="the second link shown (1 GbE = 0.125 GB/s)")
    ap.add_argument("--hop-us", type=float, default=100.0,
                    help="fixed cost per hop in microseconds (TCP round of gloo's sends; assumed)")
    a = ap.parse_args(argv)
    a.baseline = int(a.baseline_gb * GB)
    ranks = [int(x) for x in a.ranks.split(",")]
    mems = [float(x) for x in a.mem_gb.split(",")]

    m = k3_model()
    cfg = m.cfg
    trunk = sum(m.layer_bytes)
    moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    k = cfg.num_experts_per_token
    if m.expert_bytes != K3_EXPERT_BYTES:
        print(f"warning: synth expert {m.expert_bytes} B, release {K3_EXPERT_BYTES} B", file=sys.stderr)

    print("### Inputs")
    print()
    print(f"* K3 from the synth preset realdims at {cfg.num_hidden_layers} layers ({moe} MoE, "
          f"{sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_mla(i))} MLA), {cfg.num_experts} experts, "
          f"top-{k}, hidden {cfg.hidden_size}, AttnRes blocks of {cfg.attn_res_block_size} layers.")
    print(f"* Trunk (every layer's non-expert tensors): {m.raw_trunk / GB:.4f} GB as stored, {trunk / GB:.4f} GB "
          f"as packed-trunk runs (rounded to 4096 each); the spec's dense trunk: {K3_TRUNK_BYTES / GB:.2f} GB "
          f"(k3/doctor.py K3_TRUNK_BYTES). Largest layer {max(m.layer_bytes) / GB:.2f} GB (layer 0, dense MLP).")
    print(f"* Tables, not inside the trunk figure: embedding + lm_head {m.table_bytes / GB:.2f} GB "
          f"({VOCAB:,} x {cfg.hidden_size} BF16 each, untied); the final norm and output AttnRes vectors "
          f"{3 * cfg.hidden_size * 2 / 1e3:.0f} KB.")
    print(f"* Routed expert {m.expert_bytes:,} B (MXFP4), cache slot {m.slot_bytes:,} B (the release's, "
          f"k3/doctor.py K3_SLOT_BYTES); per token {moe} x {k} x {m.expert_bytes / 1e6:.2f} MB = "
          f"{moe * k * m.expert_bytes / GB:.2f} GB of experts; {moe * cfg.num_experts:,} routed experts in all.")
    print(f"* Per rank: available = M GB (what k3 may plan in: MemAvailable or --stage-budget), baseline "
          f"{a.baseline_gb} GB, one sequence of {a.context} positions (latent KV "
          f"{planner.kv_bytes_per_position(cfg) * a.context / GB:.2f} GB, recurrent state "
          f"{planner.recurrent_state_bytes(cfg) / GB:.2f} GB for the whole stack, each rank holding its layers' "
          f"part), activations of a {PIECE}-token piece, tables {a.tables} on rank 0.")
    print(f"* Rates (GB/s): BF16 {a.bf16_gbs}, MXFP4 {a.mxfp4_gbs}, memory {a.mem_gbs}, disk sequential "
          f"{a.disk_seq_gbs}, disk random {a.disk_rand_gbs}; {a.layer_ms} ms per layer and token besides the "
          f"matmuls. Link {a.link_gbs} GB/s (and {a.slow_link_gbs}), {a.hop_us:.0f} us per hop.")
    bf16_s = (trunk + m.head_bytes) / (a.bf16_gbs * GB)
    mx_s = moe * k * m.expert_bytes / (a.mxfp4_gbs * GB)
    other_s = cfg.num_hidden_layers * a.layer_ms / 1e3
    print(f"* Touched per token: {(trunk + m.head_bytes + moe * k * m.expert_bytes) / GB:.2f} GB (trunk, lm_head, "
          f"active experts). Compute per token, whatever N: BF16 {bf16_s:.2f} s + MXFP4 {mx_s:.2f} s + other "
          f"{other_s:.2f} s = {bf16_s + mx_s + other_s:.2f} s.")
    print()

    print("### One sequence")
    print()
    head = ["N", "M GB", "layers per rank", "trunk GB per rank", "pinned per rank", "pinned", "cache slots per rank",
            "disk GB/token", "net KB/token", "compute s", "disk s", "s/token (10 GbE)", "s/token (1 GbE)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if h in ("layers per rank", "trunk GB per rank", "pinned per rank",
                                          "cache slots per rank") else "---:" for h in head) + "|")

    def row(*cells):
        cells = [str(c) for c in cells]
        print("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")

    plans = {}
    for n in ranks:
        for mem in mems:
            avail = int(mem * GB)
            try:
                rks = plan_pipeline(m, n, avail, a)
            except K3Error as e:
                row(n, f"{mem:g}", f"does not fit: {str(e).splitlines()[0]}")
                continue
            plans[n, mem] = rks
            bad = [(r, rk) for r, rk in enumerate(rks) if rk.refusal]
            if bad:
                row(n, f"{mem:g}", fmt_ranges(rks), " / ".join(gbs(rk.trunk) for rk in rks),
                    "does not fit: " + "; ".join(f"rank {r} {rk.refusal}" for r, rk in bad))
                continue
            sts = [stage(m, rk, n, a) for rk in rks]
            hops = [st.hop_bytes for st in sts] if n > 1 else []
            work = sum(st.time for st in sts)
            t_fast = work + sum(hop_seconds(h, a.link_gbs, a.hop_us) for h in hops)
            t_slow = work + sum(hop_seconds(h, a.slow_link_gbs, a.hop_us) for h in hops)
            slots = " / ".join(str(rk.plan.cache_slots) for rk in rks)
            if rks[0].plan.stream_tables:
                slots += " (rank 0 streams the tables)"
            row(n, f"{mem:g}", fmt_ranges(rks), " / ".join(gbs(rk.trunk) for rk in rks),
                " / ".join(f"{100 * rk.pinned / rk.trunk:.0f}" for rk in rks) + " %",
                f"{100 * sum(rk.pinned for rk in rks) / trunk:.0f} %", slots,
                f"{sum(st.read for st in sts) / GB:.2f}", f"{sum(hops) / 1e3:.0f}",
                f"{sum(st.compute for st in sts):.2f}", f"{sum(st.disk for st in sts):.2f}",
                f"{t_fast:.2f}", f"{t_slow:.2f}")
    print()
    print("pinned: of each rank's trunk, then of the whole trunk. compute s, disk s: each summed over the ranks "
          "(a rank's share of the s/token is the larger of its two). net: the carry around the ring, tensor "
          "bytes only.")
    print()

    # cross-check: the trunk the planner chose against plan_trunk at the rank's capacity
    odd = []
    for (n, mem), rks in plans.items():
        for r, rk in enumerate(rks):
            if rk.plan is None or rk.plan.trunk is None:
                continue
            try:
                tp = planner.plan_trunk(list(rk.sizes.layer_bytes), rk.capacity, 2, "largest")
            except K3Error:
                odd.append(f"N={n} M={mem:g} rank {r}: no ring slot fits its capacity")
                continue
            if tp.pinned_bytes != rk.pinned:
                odd.append(f"N={n} M={mem:g} rank {r}: plan pins {rk.pinned / GB:.2f} GB, plan_trunk at its "
                           f"capacity {rk.capacity / GB:.2f} GB pins {tp.pinned_bytes / GB:.2f} GB")
    print("Cross-check, planner.plan against planner.plan_trunk(capacity, 2 slots, largest first): "
          + ("the same pinned bytes on every rank." if not odd else "; ".join(odd) + "."))
    print()

    # the model against two measured runs (pure arithmetic on the docs' byte counts)
    rd4 = 5.75e9 / (a.bf16_gbs * GB) + 0.84e9 / (a.mxfp4_gbs * GB) + 4 * a.layer_ms / 1e3
    rd10c = 12.37e9 / (a.bf16_gbs * GB) + 2.53e9 / (a.mxfp4_gbs * GB) + 10 * a.layer_ms / 1e3
    rd10d = 12.37e9 / (a.disk_seq_gbs * GB) + 2.53e9 / (a.disk_rand_gbs * GB)
    rd10e = 9.19e9 / (a.disk_seq_gbs * GB) + 2.53e9 / (a.disk_rand_gbs * GB)
    print("### The time model against this machine's measured runs")
    print()
    print("| run | measured s/token | model s/token |")
    print("|---|---:|---:|")
    print(f"| rd4 resident, 5.75 GB trunk + 0.84 GB experts (PERFORMANCE.md 'Decode with everything resident', "
          f"median) | 0.424 | {rd4:.3f} |")
    print(f"| rd10 streamed, 12.37 GB trunk + 2.53 GB experts read (BENCHMARKS.md 'Memory ladder, with the ring "
          f"arena', 10 GiB) | 5.44 | {max(rd10c, rd10d):.2f} |")
    print(f"| rd10 streamed, 9.19 GB trunk + 2.53 GB experts read (BENCHMARKS.md 'Fixed-budget split, with the "
          f"ring arena', share 0.95) | 4.14 | {max(rd10c, rd10e):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
