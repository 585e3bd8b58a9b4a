"""`k3 doctor --project --prompt-tokens N,...`: the time to first token of a prompt of N
tokens at each projected memory size (k3.projection's plans and rates).

The plan for a prompt holds N positions and a few more, and widens its prefill piece as
a run's does (k3.memory.prefill.widen, span N): the prompt is read in passes of P
tokens. A pass takes the longer of

  the drive  its bytes at the drive's rates, as a decoding pass's (k3.projection._times):
             streamed trunk / sequential + the distinct experts of P tokens the cache
             misses / random (divided over --model-dirs' drives) + streamed lm_head /
             sequential
  the chain  prefill compute: 2 x P x the weights a token multiplies (every trunk weight,
             and its k experts': not the distinct experts' bytes) / the measured many-row
             FLOP rates, BF16 for the trunk and MXFP4 (or BF16) for the experts; plus the
             missed experts' reads the math waits for, the streamed lm_head's read, and
             ONE row of lm_head (a prefill needs the last position's logits only)

and the prompt the sum of its passes. Attention's own work (the scores of N positions,
which grow with N) is not counted: the bound is the weights'.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from .units import GB

MARGIN = 16  # positions a prompt's plan holds beyond the prompt (its first tokens out)
BF16_ROWS = 256  # rows of the calibration's trunk block: a floor prefill piece
EXPERT_ROWS = 24  # rows per expert of the calibration's expert group (a prefill pass at 896 experts)


@dataclass
class PromptTime:
    ram_gb: float
    tokens: int
    fits: bool
    piece: int = 0
    passes: int = 0
    gb_read: float = 0.0
    seconds: float = 0.0
    bound: str = ""  # "drive" or "compute": the larger of the two sums
    drive_s: float = 0.0
    compute_chain_s: float = 0.0
    note: str = ""


def calibrate_prefill(seconds: float = 2.0) -> tuple[float, float]:
    """FLOP/s of k3's many-row kernels here: the BF16 linear on a block of
    ``BF16_ROWS`` rows (a prefill's trunk linears), and the grouped MXFP4 expert FFN
    (k3.kernels.moe.expert_ffn, as a prefill's routed experts run) with ``EXPERT_ROWS``
    rows per expert at K3's expert shape. Best of a few calls each."""
    import torch

    from .kernels import bf16_linear
    from .kernels.moe import expert_descriptors, expert_ffn

    w = torch.ones(2048, 7168, dtype=torch.bfloat16)  # 29 MiB, 7.5 GFLOP a call
    x = torch.ones(BF16_ROWS, 7168)
    d, inter, G = 3584, 3072, 8  # K3's stored expert shape; 8 distinct experts, 140 MB
    mats = []
    for _ in range(G):
        for r, c in ((inter, d), (inter, d), (d, inter)):  # w1, w3, w2
            mats.append((torch.full((r, c // 2), 0x22, dtype=torch.uint8),
                         torch.full((r, c // 32), 120, dtype=torch.uint8)))
    descs = expert_descriptors("mxfp4", mats).reshape(G, 3, -1)
    xe = torch.ones(G * EXPERT_ROWS, d)
    rows = [(g * EXPERT_ROWS, (g + 1) * EXPERT_ROWS) for g in range(G)]
    w1s, w3s, w2s = mats[0::3], mats[1::3], mats[2::3]
    runs = ((lambda: bf16_linear(x, w), 2.0 * BF16_ROWS * w.numel()),
            (lambda: expert_ffn("mxfp4", xe, w1s, w3s, w2s, rows, None, descs), 2.0 * G * EXPERT_ROWS * 3 * d * inter))
    out = []
    for fn, flops in runs:
        fn()
        best, n, t_end = 0.0, 0, time.perf_counter() + seconds / 2
        while n < 2 or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            best, n = max(best, flops / (time.perf_counter() - t0)), n + 1
        out.append(best)
    return out[0], out[1]


def weight_params(cfg, sizes) -> tuple[float, float]:
    """(trunk weights, one routed expert's weights) as stored: the trunk in BF16, the
    experts in MXFP4 (17 bytes a 32 weights) or BF16."""
    per_byte = 32 / 17 if getattr(cfg, "expert_quant", None) == "mxfp4" else 0.5
    return sizes.trunk_bytes / 2, sizes.expert_bytes * per_byte


def pass_seconds(shape, cfg, sizes, rates, P: int) -> tuple[float, float, float]:
    """(bytes, drive seconds, compute chain seconds) of one prefill pass of P tokens."""
    from .memory.passcost import distinct, pass_bytes

    d = distinct(P, sizes.top_k, sizes.experts)
    miss = shape.moe_layers * d * (1 - shape.uniform_hit) * shape.expert_bytes
    expert_read = miss / rates.random / max(1, rates.drives)
    ring_read = shape.streamed_trunk_bytes / rates.seq
    head_read = shape.table_bytes / rates.seq
    drive = ring_read + expert_read + head_read
    trunk_w, expert_w = weight_params(cfg, sizes)
    mx = getattr(cfg, "expert_quant", None) == "mxfp4"
    expert_rate = rates.mxfp4_flops if mx else rates.bf16_flops
    math_s = 2.0 * P * trunk_w / rates.bf16_flops + 2.0 * P * sizes.moe_layers * sizes.top_k * expert_w / expert_rate
    chain = math_s + expert_read + head_read + sizes.head_bytes / rates.bf16  # one row of lm_head
    return pass_bytes(shape, [P]), drive, chain


def prompt_plan(cfg, sizes, ram: float, tokens: int, *, baseline: int, trunk_gb=None, cache_gb=None,
                context: int = 0):
    """(plan widened for a ``tokens``-token prompt, its PrefillPlan) at ``ram`` GB; the
    planner's K3Error where none fits."""
    from .decode import PREFILL_CHUNK
    from .memory import planner, prefill
    from .projection import SPEC_DRAFTS

    b = planner.Budgets(preset="auto", trunk="(packed)", trunk_gb=trunk_gb, cache_gb=cache_gb)
    p = planner.plan(cfg, sizes, b, tokens=max(context, tokens + MARGIN), incremental=True, available=int(ram * GB),
                     baseline=baseline, sequences=1, spec=SPEC_DRAFTS, prefill_tokens=PREFILL_CHUNK)
    p.check()
    return prefill.widen(p, cfg, sizes, span=tokens, floor_piece=PREFILL_CHUNK)


def prompt_time(cfg, sizes, rates, ram: float, tokens: int, *, baseline: int, trunk_gb=None, cache_gb=None,
                context: int = 0) -> PromptTime:
    """The time to first token of a ``tokens``-token prompt at ``ram`` GB (module docstring)."""
    from .decode import prefill_pieces
    from .errors import K3Error
    from .memory import planner

    row = PromptTime(ram_gb=ram, tokens=tokens, fits=False)
    try:
        plan, pp = prompt_plan(cfg, sizes, ram, tokens, baseline=baseline, trunk_gb=trunk_gb, cache_gb=cache_gb,
                               context=context)
    except K3Error as e:
        row.note = str(e).splitlines()[0]
        return row
    shape = planner.pass_shape(sizes, plan.trunk, plan.cache_slots, plan.stream_tables)
    total = drive_sum = chain_sum = seconds = 0.0
    for a, b in prefill_pieces(tokens, pp.piece):
        nbytes, drive, chain = pass_seconds(shape, cfg, sizes, rates, b - a)
        total += nbytes
        drive_sum += drive
        chain_sum += chain
        seconds += max(drive, chain)
    row.fits, row.piece, row.passes, row.gb_read, row.seconds = True, pp.piece, pp.passes, total / GB, seconds
    row.drive_s, row.compute_chain_s = drive_sum, chain_sum
    row.bound = "drive" if drive_sum >= chain_sum else "compute"
    return row


def project_prompts(cfg, sizes, rates, ram_gb, prompt_tokens, *, baseline: int, trunk_gb=None, cache_gb=None,
                    context: int = 0) -> list[PromptTime]:
    """prompt_time at every memory size and prompt size (memory-major)."""
    if not (rates.bf16_flops > 0 and rates.mxfp4_flops > 0):
        raise ValueError("prefill FLOP rates not measured: set Rates.bf16_flops and .mxfp4_flops "
                         "(calibrate_prefill)")
    return [prompt_time(cfg, sizes, rates, ram, n, baseline=baseline, trunk_gb=trunk_gb, cache_gb=cache_gb,
                        context=context)
            for ram in ram_gb for n in prompt_tokens]


def report(lines: list, data: dict, cfg, sizes, rates, opts: dict, baseline: int) -> None:
    """The doctor's time-to-first-token table (appended to ``lines``) and its --json
    rows and prefill rates (into ``data``, the projection's report)."""
    rows = project_prompts(cfg, sizes, rates, opts["ram"], opts["prompt_tokens"], baseline=baseline,
                           trunk_gb=opts.get("trunk_gb"), cache_gb=opts.get("cache_gb"),
                           context=opts.get("context") or 0)
    lines.extend(render(rows, opts["prompt_tokens"]))
    data["rates"].update(bf16_prefill_flops=rates.bf16_flops, mxfp4_prefill_flops=rates.mxfp4_flops)
    data["time_to_first_token"] = as_dicts(rows)


def render(rows: list[PromptTime], prompt_tokens) -> list[str]:
    """The "time to first token" table: a row per memory size, per prompt size its
    seconds, GB read and bound (d: the drive, c: compute)."""
    lines = ["time to first token (one-drive bound and measured prefill compute; d: drive-bound, c: compute-bound)",
             f"{'memory':>8} " + " ".join(f"{f'{n} tokens':>28}" for n in prompt_tokens)]
    by_ram: dict[float, list[PromptTime]] = {}
    for r in rows:
        by_ram.setdefault(r.ram_gb, []).append(r)
    for ram, rs in by_ram.items():
        cells = [f"{f'{r.seconds:.1f} s {r.gb_read:.0f} GB {r.bound[0]} /{r.passes}':>28}" if r.fits
                 else f"{'(does not fit)':>28}" for r in rs]
        lines.append(f"{ram:>6g} GB " + " ".join(cells))
    lines.append("(s: seconds to the first token; GB: read; /n: prefill passes)")
    return lines


def as_dicts(rows: list[PromptTime]) -> list[dict]:
    return [asdict(r) for r in rows]
