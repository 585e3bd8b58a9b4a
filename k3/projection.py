"""`k3 doctor --project`: what k3 would read and how fast it would run the released K3
(or the model given) at several memory sizes, on this machine's storage and cores.

For each memory size the planner makes the plan auto would choose (a packed trunk;
priced for one sequence, and for the batch when batch 8 is projected), and the pass
cost model (k3.memory.passcost, uniform routing) gives the bytes of a pass. Seconds
come from rates measured here, or given:

  storage   sequential rate (the streamed trunk and lm_head) and random expert-sized
            reads (the missed experts), from the doctor's probe or --disk-gbps
  compute   k3's own BF16 one-token kernel and MXFP4 expert kernel on this machine's
            cores (a calibration of a few seconds), GB of weights a second

A pass of T tokens takes the longer of

  the drive  every byte the pass reads at the drive's rates: streamed trunk and lm_head
             / sequential rate + missed experts / random rate (one drive, one rate: reads
             that share a drive share its rate; experts' shards spread over several drives
             with --model-dirs divide their share, the packed trunk and lm_head stay on one)
  the chain  what the math waits for: trunk bytes / BF16 rate + missed experts / random
             rate + distinct experts' bytes / MXFP4 rate (a layer's experts are known once
             it has routed, read, then multiplied) + streamed lm_head / sequential rate +
             lm_head bytes x T / BF16 rate (a chunk is read, then multiplied)

and a token T times less: only the ring's reads overlap compute. A projected plan holds a 4,096-position context and reads prompts
in pieces of 64 tokens a sequence. Speculation is projected at a stated acceptance per draft,
reading the drafts that give the most tokens per second (as the decode loop does).
Nothing here allocates the model; the released K3's shapes come from the synthetic
generator's plan of it (k3.synth: K3's real shapes, 93 layers, 896 experts, 163,840 ids).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from .units import GB

DEFAULT_RAM_GB = (8, 16, 32, 64, 128, 224)
DEFAULT_ACCEPTANCE = 0.7
SPEC_DRAFTS = 4
BATCH = 8
CONTEXT = 4096  # positions the projected plans hold
PIECE = 64  # prompt tokens a projected pass reads per sequence (the projection is of decoding)


@dataclass
class Rates:
    """Bytes per second: storage (sequential, random expert-sized reads) and compute
    (k3's BF16 one-token kernel, the MXFP4 expert kernel); FLOP/s of the many-row
    kernels a prefill runs (k3.projection_ttft.calibrate_prefill; 0: not measured)."""

    seq: float
    random: float
    bf16: float
    mxfp4: float
    source: str = ""
    drives: int = 1  # drives the experts' shards are spread over evenly (--model-dirs), each at these rates
    bf16_flops: float = 0.0  # BF16 linear, a block of 256 rows
    mxfp4_flops: float = 0.0  # grouped MXFP4 expert FFN, ~24 rows an expert


@dataclass
class Projection:
    ram_gb: float
    fits: bool
    plan: str = ""
    pinned_gb: float = 0.0
    cache_slots: int = 0
    tables_streamed: bool = False
    plain_gb_per_token: float = 0.0
    plain_s_per_token: float = 0.0
    batch_gb_per_token: float = 0.0
    batch_s_per_token: float = 0.0
    spec_drafts: int = 0
    spec_gb_per_token: float = 0.0
    spec_s_per_token: float = 0.0
    note: str = ""
    parts: dict = field(default_factory=dict)


def release_model():
    """(ModelConfig, planner.ModelSizes) of the released K3, from k3.synth's plan of it."""
    from . import synth
    from .memory.planner import ModelSizes
    from .units import align_up

    plan = synth.make_plan("realdims", "k3", 0, 93, 896, synth.K3_BASE + synth.NUM_SPECIAL)
    cfg = plan.cfg
    layer = [0] * cfg.num_hidden_layers
    tables = head = 0
    expert = None
    for sh in plan.shards:
        for it in sh:
            if isinstance(it, synth._Expert):
                expert = expert or it
            elif it.rel and it.rel.startswith("layers."):
                layer[int(it.rel.split(".")[1])] += it.nbytes
            elif it.rel in ("embed_tokens.weight", "lm_head.weight"):
                tables += it.nbytes
                head += it.nbytes if it.rel == "lm_head.weight" else 0
    moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    sizes = ModelSizes(layer_bytes=tuple(align_up(b) for b in layer), table_bytes=tables, head_bytes=head,
                       slot_bytes=align_up(expert.nbytes), expert_bytes=expert.nbytes, moe_layers=moe,
                       experts=cfg.num_experts, top_k=cfg.num_experts_per_token)
    return cfg, sizes


def calibrate(seconds: float = 3.0) -> tuple[float, float]:
    """k3's BF16 one-token kernel and MXFP4 expert kernel here, best GB/s of weights
    over a few calls each on matrices larger than the caches."""
    import torch

    from .kernels import bf16_linear, mxfp4_linear

    out = []
    w = torch.ones(8192, 16384, dtype=torch.bfloat16)  # 256 MiB
    x = torch.ones(1, 16384)
    rows, cols = 65536, 2048  # 64 MiB of packed nibbles, an expert's matrices many times over
    pk = torch.full((rows, cols // 2), 0x22, dtype=torch.uint8)
    sc = torch.full((rows, cols // 32), 127, dtype=torch.uint8)
    xm = torch.ones(1, cols)
    for fn, nbytes in ((lambda: bf16_linear(x, w), w.numel() * 2), (lambda: mxfp4_linear(xm, pk, sc),
                                                                     pk.numel() + sc.numel())):
        fn()
        best, t_end = 0.0, time.perf_counter() + seconds / 2
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            best = max(best, nbytes / (time.perf_counter() - t0))
        out.append(best)
    return out[0], out[1]


def _times(shape, sizes, rates: Rates, groups, hit: float | None = None) -> tuple[float, float, dict]:
    """(bytes, seconds, parts) of one pass of ``groups`` under a plan's PassShape.

    One drive, one rate: every read of a pass - the ring's, the missed experts', the
    streamed lm_head's - shares the drive (or the ``rates.drives`` drives the shards are
    spread over), so a pass takes at least its bytes at the drive's rates. Only compute
    overlaps reads: the ring reads ahead while the math runs; a layer's missed experts
    are known only once it has routed, so the math waits for them; a streamed lm_head
    chunk is read, then multiplied (one buffer)."""
    from .memory.passcost import pass_bytes, union, distinct

    T = sum(groups)
    per_seq = [distinct(n, sizes.top_k, sizes.experts) for n in groups]
    d = union(per_seq, sizes.experts) if len(per_seq) > 1 else per_seq[0]
    h = shape.uniform_hit if hit is None else hit
    drives = max(1, rates.drives)
    miss = shape.moe_layers * d * (1 - h) * shape.expert_bytes
    # the packed trunk is one file and lm_head one tensor: they stay on one drive; the
    # experts' shards spread evenly over the drives (--model-dirs), read side by side
    ring_read = shape.streamed_trunk_bytes / rates.seq
    expert_read = miss / rates.random / drives
    head_read = shape.table_bytes / rates.seq
    drive_s = ring_read + expert_read + head_read  # the busiest drive: the trunk's and lm_head's
    math_s = sizes.trunk_bytes / rates.bf16
    expert_math = shape.moe_layers * d * shape.expert_bytes / rates.mxfp4
    head_math = sizes.head_bytes * T / rates.bf16
    chain = math_s + expert_read + expert_math + head_read + head_math
    b = pass_bytes(shape, groups, hit=hit)
    return b, max(drive_s, chain), {"drive_s": drive_s, "compute_chain_s": chain, "ring_s": ring_read,
                                     "trunk_math_s": math_s, "expert_read_s": expert_read,
                                     "expert_math_s": expert_math, "tables_read_s": head_read,
                                     "tables_math_s": head_math, "expert_read_bytes": miss}


def project(cfg, sizes, rates: Rates, ram_gb, *, baseline: int, acceptance: float = DEFAULT_ACCEPTANCE,
            trunk_gb=None, cache_gb=None, context: int = CONTEXT, piece: int = PIECE) -> list[Projection]:
    from .errors import K3Error
    from .memory import planner
    from .memory.passcost import expected_emitted

    out = []
    for ram in ram_gb:
        avail = int(ram * GB)
        pr = Projection(ram_gb=ram, fits=False)
        plans = {}
        for seqs in (1, BATCH):
            b = planner.Budgets(preset="auto", trunk="(packed)", trunk_gb=trunk_gb, cache_gb=cache_gb)
            try:
                p = planner.plan(cfg, sizes, b, tokens=context, incremental=True, available=avail, baseline=baseline,
                                 sequences=seqs, spec=SPEC_DRAFTS if seqs == 1 else 0, prefill_tokens=piece * seqs)
                p.check()
                plans[seqs] = p
            except K3Error as e:
                if seqs == 1:
                    pr.note = str(e).splitlines()[0]
        if 1 not in plans:
            out.append(pr)
            continue
        p = plans[1]
        shape = planner.pass_shape(sizes, p.trunk, p.cache_slots, p.stream_tables)
        pr.fits, pr.plan = True, p.summary()
        pr.pinned_gb = (p.trunk.pinned_bytes if p.trunk else sizes.trunk_bytes) / GB
        pr.cache_slots, pr.tables_streamed = p.cache_slots, p.stream_tables
        b1, s1, parts = _times(shape, sizes, rates, [1])
        pr.plain_gb_per_token, pr.plain_s_per_token, pr.parts = b1 / GB, s1, parts
        if BATCH in plans:
            pb = plans[BATCH]
            sb = planner.pass_shape(sizes, pb.trunk, pb.cache_slots, pb.stream_tables)
            bb, tb, _ = _times(sb, sizes, rates, [1] * BATCH)
            pr.batch_gb_per_token, pr.batch_s_per_token = bb / GB / BATCH, tb / BATCH
        best = None
        for j in range(SPEC_DRAFTS + 1):
            bj, tj, _ = _times(shape, sizes, rates, [1 + j])
            e = expected_emitted([acceptance] * SPEC_DRAFTS, j)
            if best is None or e / tj > best[0] * (1 + 1e-9):
                best = (e / tj, j, bj / e, tj / e)
        _, pr.spec_drafts, sb_, st_ = best
        pr.spec_gb_per_token, pr.spec_s_per_token = sb_ / GB, st_
        out.append(pr)
    return out


def render(rows: list[Projection], what: str, rates: Rates, acceptance: float) -> list[str]:
    lines = [f"{what}; storage {rates.seq / 1e9:.2f} GB/s sequential, {rates.random / 1e9:.2f} GB/s random "
             f"expert-sized reads; compute {rates.bf16 / 1e9:.1f} GB/s BF16, {rates.mxfp4 / 1e9:.1f} GB/s MXFP4"
             + (f"; prefill {rates.bf16_flops / 1e9:.0f} GFLOP/s BF16, {rates.mxfp4_flops / 1e9:.0f} GFLOP/s MXFP4"
                if rates.bf16_flops else "") + f" ({rates.source})",
             f"{'memory':>8} {'pinned':>8} {'slots':>6} {'plain GB/tok':>13} {'s/tok':>8} {'batch 8 GB/tok':>15} "
             f"{'s/tok':>8} {f'spec {acceptance:.0%} GB/tok':>16} {'s/tok':>8}"]
    for r in rows:
        if not r.fits:
            lines.append(f"{r.ram_gb:>6g} GB  does not fit: {r.note}")
            continue
        batch = (f"{r.batch_gb_per_token:>15.2f} {r.batch_s_per_token:>8.2f}" if r.batch_s_per_token
                 else f"{'(does not fit)':>24}")
        lines.append(f"{r.ram_gb:>6g} GB {r.pinned_gb:>7.1f}G {r.cache_slots:>6} {r.plain_gb_per_token:>13.2f} "
                     f"{r.plain_s_per_token:>8.2f} {batch} {r.spec_gb_per_token:>16.2f} {r.spec_s_per_token:>8.2f}")
    return lines


def as_dicts(rows: list[Projection]) -> list[dict]:
    return [asdict(r) for r in rows]
