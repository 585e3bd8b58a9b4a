"""The server's counters and their Prometheus text exposition (GET /metrics).

The scheduler's thread updates the engine figures after every pass; the HTTP side counts
requests by endpoint and status. One lock guards both.
"""

from __future__ import annotations

import threading
import time
from collections import deque

WINDOW = 64  # passes in the moving figures (seconds per token, batch size)


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, int], int] = {}
        self.c = {k: 0 for k in (
            "prompt_tokens", "prompt_tokens_cached", "prefill_tokens", "completion_tokens", "passes",
            "batch_sequences", "expert_requests", "expert_hits", "expert_bytes_read", "trunk_bytes_read",
            "table_bytes_read", "trunk_reads", "finished", "cancelled", "failed", "prefix_hits", "prefix_misses",
            "drafted", "accepted")}
        self.pass_seconds = 0.0
        self.recent: deque = deque(maxlen=WINDOW)  # (seconds, tokens emitted, sequences) per pass
        self.gauges = {"batch_size": 0, "queue_depth": 0, "prefix_entries": 0, "prefix_bytes": 0, "draining": 0,
                       "max_batch": 0, "max_queue": 0, "max_context": 0, "prompt_cache_disk_reads": 0,
                       "prompt_cache_disk_writes": 0, "prompt_cache_disk_damaged": 0}

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            k = (endpoint, int(status))
            self.requests[k] = self.requests.get(k, 0) + 1

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                self.c[k] += v

    def set(self, **kw) -> None:
        with self.lock:
            self.gauges.update(kw)

    def on_pass(self, seconds: float, tokens: int, sequences: int, delta: dict, trunk_reads: int) -> None:
        with self.lock:
            self.c["passes"] += 1
            self.c["batch_sequences"] += sequences
            self.c["completion_tokens"] += tokens
            self.pass_seconds += seconds
            for k in ("expert_requests", "expert_hits", "expert_bytes_read", "trunk_bytes_read", "table_bytes_read"):
                self.c[k] += int(delta.get(k, 0))
            self.c["trunk_reads"] = trunk_reads
            self.recent.append((seconds, tokens, sequences))

    def snapshot(self) -> dict:
        with self.lock:
            return {"requests": dict(self.requests), "c": dict(self.c), "pass_seconds": self.pass_seconds,
                    "recent": list(self.recent), "gauges": dict(self.gauges)}

    def render(self, model: str) -> str:
        s = self.snapshot()
        c, g = s["c"], s["gauges"]
        lab = f'model="{_esc(model)}"'
        out: list[str] = []

        def metric(name, kind, help, samples):
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                out.append(f"{name}{{{','.join(x for x in (lab, labels) if x)}}} {_num(v)}")

        metric("k3_requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [(f'endpoint="{_esc(e)}",code="{code}"', n) for (e, code), n in sorted(s["requests"].items())])
        metric("k3_generations_total", "counter", "Generations ended, by how: finished (stop token, stop string or "
               "max_tokens), cancelled (the client went away), failed (the forward pass failed).",
               [(f'outcome="{k}"', c[k]) for k in ("finished", "cancelled", "failed")])
        metric("k3_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", c["prompt_tokens"])])
        metric("k3_prompt_tokens_cached_total", "counter",
               "Prompt tokens not read again: continued from a kept state (prefix reuse).",
               [("", c["prompt_tokens_cached"])])
        metric("k3_prefill_tokens_total", "counter", "Prompt tokens read by the model (prompt minus cached).",
               [("", c["prefill_tokens"])])
        metric("k3_completion_tokens_total", "counter", "Tokens generated.", [("", c["completion_tokens"])])
        metric("k3_draft_tokens_total", "counter", "Speculative decoding (--spec): tokens drafted and read, and those "
               "accepted.", [('kind="drafted"', c["drafted"]), ('kind="accepted"', c["accepted"])])
        metric("k3_passes_total", "counter", "Forward passes over the weights (one serves the whole batch).",
               [("", c["passes"])])
        metric("k3_pass_seconds_total", "counter", "Wall seconds spent in forward passes.", [("", s["pass_seconds"])])
        rec = s["recent"]
        secs, toks = sum(r[0] for r in rec), sum(r[1] for r in rec)
        metric("k3_seconds_per_token", "gauge", f"Pass seconds per generated token over the last {WINDOW} passes "
               "(all sequences together: the inverse of aggregate throughput).", [("", secs / toks if toks else 0.0)])
        metric("k3_tokens_per_second", "gauge", f"Generated tokens per pass second over the last {WINDOW} passes.",
               [("", toks / secs if secs else 0.0)])
        metric("k3_batch_size", "gauge", "Sequences in the batch now.", [("", g["batch_size"])])
        metric("k3_batch_size_mean", "gauge", f"Mean sequences per pass over the last {WINDOW} passes.",
               [("", sum(r[2] for r in rec) / len(rec) if rec else 0.0)])
        metric("k3_batch_sequences_total", "counter", "Sum over passes of the sequences in the pass.",
               [("", c["batch_sequences"])])
        metric("k3_max_batch", "gauge", "Most sequences decoded together (--max-batch).", [("", g["max_batch"])])
        metric("k3_queue_depth", "gauge", "Requests waiting for a slot.", [("", g["queue_depth"])])
        metric("k3_max_queue", "gauge", "Most requests that may wait (--max-queue); more are answered 429.",
               [("", g["max_queue"])])
        metric("k3_bytes_read_total", "counter", "Weight bytes read from storage, by kind.",
               [(f'kind="{k}"', c[f"{k}_bytes_read"]) for k in ("trunk", "expert", "table")])
        metric("k3_expert_requests_total", "counter", "Routed-expert lookups in the expert cache.",
               [("", c["expert_requests"])])
        metric("k3_expert_hits_total", "counter", "Routed-expert lookups served from the cache.",
               [("", c["expert_hits"])])
        metric("k3_expert_hit_rate", "gauge", "Expert cache hits / lookups since start.",
               [("", c["expert_hits"] / c["expert_requests"] if c["expert_requests"] else 0.0)])
        metric("k3_trunk_reads_total", "counter", "Streamed trunk layer reads (0 when the trunk is resident).",
               [("", c["trunk_reads"])])
        metric("k3_prefix_cache_entries", "gauge", "States kept for prefix reuse.", [("", g["prefix_entries"])])
        metric("k3_prefix_cache_bytes", "gauge", "Bytes held by the kept states.", [("", g["prefix_bytes"])])
        metric("k3_prefix_cache_lookups_total", "counter", "Prefix lookups, by result.",
               [('result="hit"', c["prefix_hits"]), ('result="miss"', c["prefix_misses"])])
        metric("k3_prompt_cache_disk_total", "counter", "Prompt cache disk tier (--prompt-cache): snapshots read, "
               "written, and damaged entries removed.",
               [(f'op="{k}"', g[f"prompt_cache_disk_{k}"]) for k in ("reads", "writes", "damaged")])
        metric("k3_draining", "gauge", "1 while the server drains (after Ctrl-C/SIGTERM).", [("", g["draining"])])
        metric("k3_uptime_seconds", "gauge", "Seconds since the server started.", [("", time.time() - self.started)])
        return "\n".join(out) + "\n"


def _esc(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
