"""How well would a next-layer routing hint predict the experts a layer reads?

The hint (issue 45): apply the next MoE layer's router to the current MoE layer's router
input, and issue the predicted experts' reads a layer early (routing itself unchanged).
This measures its precision and recall (both are overlap / top-k, since the predicted
and the true sets have k experts each) per token and MoE layer pair, on a synthetic
checkpoint at K3's ratio (default: the `pool` preset, 896 experts, top-16, three MoE
layers), against random choice (k / experts). Nothing is prefetched: the routing of one
prompt's forward pass is recorded (every call of k3.model.moe.route, in order) and the
hint computed beside it.

    python benchmarks/hint_probe.py [--model DIR] [--tokens 128] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import k3  # noqa: E402
from k3.checkpoint.safetensors import CheckpointIndex  # noqa: E402
from k3.model import moe  # noqa: E402


def tensor(index, name) -> torch.Tensor:
    info = index.get(name)
    dt = {"BF16": torch.bfloat16, "F32": torch.float32}[info.dtype]
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        raw = bytearray(f.read(info.nbytes))
    return torch.frombuffer(raw, dtype=dt).reshape(info.shape).float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seeds", default="0,1,2")
    a = ap.parse_args(argv)
    model = a.model
    if model is None:
        from k3.synth import synthesize
        model = str(synthesize(Path(tempfile.mkdtemp(prefix="k3hint-")) / "pool", preset="pool"))
    calls = []
    plain_route = moe.route

    def recording(cfg, x, gate_w, bias, logits=None):
        ids, w = plain_route(cfg, x, gate_w, bias, logits)
        calls.append((x.detach().float().clone(), ids.clone()))
        return ids, w

    moe.route = recording
    rows = []
    with k3.load(model, max_context=a.tokens + 8) as eng:
        cfg = eng.cfg
        index = CheckpointIndex.open(model)
        prefix = "language_model.model." if any(n.startswith("language_model.") for n in index.names()) else "model."
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
        gates = {i: (tensor(index, f"{prefix}layers.{i}.block_sparse_moe.gate.weight"),
                     tensor(index, f"{prefix}layers.{i}.block_sparse_moe.gate.e_score_correction_bias"))
                 for i in moe_layers}
        k, E = cfg.num_experts_per_token, cfg.num_experts
        for seed in [int(s) for s in a.seeds.split(",")]:
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(300, cfg.vocab_size - 256, (a.tokens,), generator=g).tolist()
            calls.clear()
            eng.model.forward(ids, eng.new_state(), last_only=True)
            if len(calls) != len(moe_layers):
                raise SystemExit(f"recorded {len(calls)} router calls for {len(moe_layers)} MoE layers: the "
                                 "prefill did not route in Python (a fused path); run with another prompt length")
            for (x, _), (_, true_next), nxt in zip(calls, calls[1:], moe_layers[1:]):
                w, b = gates[nxt]
                hint, _ = plain_route(cfg, x, w.to(torch.bfloat16), b)
                overlap = [len(set(h.tolist()) & set(t.tolist())) for h, t in zip(hint, true_next)]
                rows.append(sum(overlap) / (len(overlap) * k))
    moe.route = plain_route
    mean = sum(rows) / len(rows)
    print(f"next-layer hint on {model}: precision = recall = {mean:.3f} over {len(rows)} layer pairs x "
          f"{a.tokens} tokens (random choice: {k / E:.3f}); CPU {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
