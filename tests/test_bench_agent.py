"""benchmarks/bench_agent.py in its short form (issue 53): an agent's conversation
through /v1/messages with --prompt-cache, a server restart, and a second conversation
with the same system prompt and tools."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_agents_turns_prefill_only_their_new_tokens_across_a_restart(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_agent.py"), "--synth", "tiny", "--short",
                        "--arms", "cache", "--tools", "4", "--tsv", str(tmp_path / "agent.tsv"), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(x["conversation"], x["turn"]): x for x in json.loads(out.read_text())}
    first = rows[("A", 0)]
    assert first["cached"] == 0 and first["prefilled"] == first["prompt_tokens"]
    for t in (1, 2):
        # what the turns share is cached up to its last snapshot (a 256-token grid): the
        # previous prompt's last message (tool_choice's instruction) and its generation
        # prompt, under 128 tokens here, are not in this one
        now, before = rows[("A", t)], rows[("A", t - 1)]
        assert now["cached"] + now["prefilled"] == now["prompt_tokens"]
        assert now["prefilled"] < now["prompt_tokens"] - before["prompt_tokens"] + 128 + 256
    # after the restart: the system prompt and tools come from the folder
    b = rows[("B", 0)]
    assert b["cached"] >= 256 and b["prefilled"] < b["prompt_tokens"] - 256
