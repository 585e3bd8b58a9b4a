"""An agent's conversation replayed through `/v1/messages` (issue 53): per turn, what is
prefilled, what comes from the prompt cache, the time to first token and the bytes read.

A coding agent's turn is mostly prefill: a system prompt and tool definitions of
thousands of tokens, then every turn appends the model's answer and a tool result. The
replay: a system prompt plus 16 tool definitions, --turns turns (default 8), each adding
a tool result of 300-3,000 words of text; then the server restarts and a second
conversation with the same system prompt and tools but its own first message runs
--second turns (default 2).

Arms (a fresh `k3 serve` each, interleaved within each rep):

  today   --prefill-chunk 256, no --prompt-cache (the in-memory prefix cache only)
  cache   the plan's prefill piece and --prompt-cache DIR (a fresh folder each rep,
          kept across the restart)

Per turn: prompt tokens, tokens prefilled (k3_prefill_tokens_total), cached tokens
(`usage.cache_read_input_tokens`), time to first token (send -> the first content
event of the stream), GB read (k3_bytes_read_total) and two bounds: GB / --drive-gbps
(the drive's rate: give the probe's, `k3 doctor`) and the prefill's FLOPs (2 x the
active weights x tokens prefilled) / a measured fp32 matmul rate. One TSV row per turn
(benchmarks/results/agent.tsv) with the CPU flags; a table of each arm's totals.

    python benchmarks/bench_agent.py --synth tiny --short                  # seconds: CI's short form
    python benchmarks/bench_agent.py --model /tmp/k3bench/pool896 --serve-flags "--trunk /tmp/k3bench/pool896-trunk \\
        --trunk-gb 2.4" --ceiling-gb 5.5 --drive-gbps 1.0 --reps 2
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RESULTS, Tsv, cpu_flags, table  # noqa: E402
from bench_server import Serve, scrape  # noqa: E402

COLS = ["arm", "rep", "conversation", "turn", "prompt_tokens", "prefilled", "cached", "ttft_s", "gb_read",
        "drive_bound_s", "compute_bound_s", "answer_tokens", "model", "flags"]
WORDS = ("the file function return value error test module import class request response cache token state "
         "layer expert memory read write path line change build check result output input list map key").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tools(rng: random.Random, n: int = 16, size: int = 60) -> list[dict]:
    return [{"name": f"tool_{i}", "description": words(rng, size),
             "input_schema": {"type": "object", "properties": {f"arg_{j}": {"type": "string", "description":
                                                                            words(rng, size // 5)} for j in range(4)},
                              "required": ["arg_0"]}} for i in range(n)]


def send(url: str, body: dict, timeout: float = 7200) -> dict:
    """POST a streamed /v1/messages: (ttft, text, usage of message_start + message_delta)."""
    req = urllib.request.Request(f"{url}/v1/messages", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"/v1/messages answered {e.code}: {e.read().decode(errors='replace')[:600]}") from None
    with r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            ev = json.loads(line[5:].strip())
            kind = ev.get("type")
            if kind == "error":
                raise RuntimeError(f"error event: {ev}")
            if kind == "message_start":
                usage.update(ev["message"]["usage"])
            elif kind in ("content_block_start", "content_block_delta"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(ev.get("delta", {}).get("text", ""))
            elif kind == "message_delta":
                usage.update(ev.get("usage") or {})
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": "".join(text), "usage": usage}


def conversation(url: str, system: str, tool_defs: list, first: str, turns: int, rng: random.Random,
                 result_words: tuple[int, int], max_tokens: int):
    """The turns of one conversation: (turn, response, metrics before, metrics after)."""
    msgs = [{"role": "user", "content": first}]
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as r:
        name = json.loads(r.read())["data"][0]["id"]
    for t in range(turns):
        before = scrape(url)
        r = send(url, {"model": name, "system": system, "tools": tool_defs, "tool_choice": {"type": "none"},
                       "messages": msgs, "max_tokens": max_tokens, "temperature": 0})
        yield t, r, before, scrape(url)
        msgs += [{"role": "assistant", "content": r["text"] or "ok"},
                 {"role": "user", "content": "Tool result:\n" + words(rng, rng.randint(*result_words))}]


def matmul_flops() -> float:
    """fp32 matmul FLOP/s here (the compute bound's rate), best of a second of calls."""
    import torch
    a, b = torch.randn(256, 4096), torch.randn(4096, 4096)
    best, end = 0.0, time.perf_counter() + 1.0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * 256 * 4096 * 4096 / (time.perf_counter() - t0))
    return best


def active_weights(model: str) -> float:
    """Weights one token multiplies: every stored tensor but the routed experts, plus top-k
    experts per MoE layer (from the checkpoint's index and config)."""
    from k3.config import load_config
    from k3.checkpoint.layout import CheckpointLayout
    cfg = load_config(model)
    lay = CheckpointLayout.open(cfg, model, None, validate=False)
    dense = expert = 0
    for name, info in lay.index.items():
        n = info.nbytes
        if ".experts." in name and "shared" not in name:
            expert += n
        elif "embed_tokens" not in name:
            dense += n
    moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    per_expert = expert / max(1, moe * cfg.num_experts)
    # bytes as stored -> weights: BF16 2 bytes, MXFP4 ~0.53 bytes a weight
    return dense / 2 + moe * cfg.num_experts_per_token * per_expert / 0.53125


def run_arm(a, arm: str, rep: int, tsv: Tsv, flops: float, weights: float, model: str) -> list[dict]:
    rows = []
    rng = random.Random(a.seed)
    system = "You are a coding agent. " + words(rng, a.system_words)
    tool_defs = tools(rng, a.tools, size=a.tool_words)
    folder = Path(tempfile.mkdtemp(prefix="k3agent-"))
    flags = shlex.split(a.serve_flags) + ["--max-context", str(a.max_context)]
    flags += ["--prompt-cache", str(folder)] if arm == "cache" else ["--prefill-chunk", "256"]
    plan = [("A", "Fix the failing test in " + words(rng, 8), a.turns), ("B", "Add a flag to " + words(rng, 8),
                                                                          a.second)]
    for conv, first, turns in plan:  # a fresh server for each: the second after a restart
        srv = Serve(model, flags, ceiling_gb=a.ceiling_gb, log_path=folder.parent / f"{folder.name}-{conv}.log")
        try:
            for t, r, m0, m1 in conversation(srv.url, system, tool_defs, first, turns, random.Random(a.seed + ord(conv)),
                                             a.result_words, a.max_tokens):
                u = r["usage"]
                prefilled = m1.get("k3_prefill_tokens_total", 0) - m0.get("k3_prefill_tokens_total", 0)
                gb = (m1.get("k3_bytes_read_total", 0) - m0.get("k3_bytes_read_total", 0)) / 1e9
                row = {"arm": arm, "rep": rep, "conversation": conv, "turn": t,
                       "prompt_tokens": u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0),
                       "prefilled": int(prefilled), "cached": u.get("cache_read_input_tokens", 0),
                       "ttft_s": r["ttft"], "gb_read": gb, "drive_bound_s": gb / a.drive_gbps,
                       "compute_bound_s": 2 * weights * prefilled / flops, "answer_tokens": u.get("output_tokens"),
                       "model": model, "flags": cpu_flags()}
                tsv.add(**row)
                rows.append(row)
                print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                               if k not in ("model", "flags")), flush=True)
        finally:
            srv.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--synth", choices=("tiny", "small", "pool"), help="a synthetic model made here instead")
    ap.add_argument("--serve-flags", default="")
    ap.add_argument("--ceiling-gb", type=float)
    ap.add_argument("--drive-gbps", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--second", type=int, default=2)
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--result-words", default="300,3000")
    ap.add_argument("--tools", type=int, default=16)
    ap.add_argument("--tool-words", type=int, default=60, help="words of each tool's description")
    ap.add_argument("--arms", default="today,cache")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--short", action="store_true", help="CI's form: 3 turns, 1 after the restart, short texts")
    ap.add_argument("--tsv", default=str(RESULTS / "agent.tsv"))
    ap.add_argument("--json", help="also write the per-turn rows here")
    a = ap.parse_args(argv)
    if a.short:
        a.turns, a.second, a.system_words, a.result_words, a.max_tokens = 3, 1, 60, "20,60", 4
        a.tool_words, a.max_context = 5, min(a.max_context, 8192)
    a.result_words = tuple(int(x) for x in a.result_words.split(","))
    model = a.model
    if model is None:
        from k3.synth import synthesize
        model = str(synthesize(Path(tempfile.mkdtemp(prefix="k3agent-model-")) / "m", preset=a.synth or "tiny"))
    tsv = Tsv(Path(a.tsv), COLS)
    flops, weights = matmul_flops(), active_weights(model)
    rows = []
    for rep in range(a.reps):
        arms = a.arms.split(",")
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            rows += run_arm(a, arm, rep, tsv, flops, weights, model)
    totals = []
    for arm in a.arms.split(","):
        rs = [r for r in rows if r["arm"] == arm]
        totals.append([arm, sum(r["prompt_tokens"] for r in rs), sum(r["prefilled"] for r in rs),
                       sum(r["cached"] for r in rs), round(sum(r["ttft_s"] for r in rs), 3),
                       round(sum(r["gb_read"] for r in rs), 3)])
    print(table(totals, ["arm", "prompt_tokens", "prefilled", "cached", "ttft_s", "gb_read"]))
    if a.json:
        Path(a.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
