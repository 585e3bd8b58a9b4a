"""A constrained token's cost at a model's vocabulary: the grammar engine's mask, the pick
and the grammar step, against a plain argmax, per engine (llguidance, k3's; xgrammar when
it is importable), on random logits, the same JSON schema for all.

Per rep and engine: build the tables (a one-off a server pays at start), compile the
schema, then decode ``--tokens`` tokens greedily under the grammar; the median seconds of
one token's mask + pick + step. Reps alternate the engines' order. One TSV row per (rep,
engine) in benchmarks/results/constrain.tsv with the CPU flags.

    python benchmarks/bench_constrain.py MODEL_DIR [--reps 3] [--tokens 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from benchlib import Tsv, cpu_flags  # noqa: E402
from k3.config import load_config  # noqa: E402
from k3.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "ok", "n"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 40}, "ok": {"type": "boolean"},
                         "n": {"type": "integer"}}}


def run_llguidance(tok, vocab, tokens, seed):
    from k3 import constrain
    constrain._LL.pop(tok, None)   # the tables again, as a fresh server builds them
    t0 = time.perf_counter()
    constrain.prepare(tok, vocab, [tok.eos_id])
    t1 = time.perf_counter()
    c = constrain.json_constraint(tok, SCHEMA, [tok.eos_id], vocab)
    t2 = time.perf_counter()
    g, ts = torch.Generator().manual_seed(seed), []
    for _ in range(tokens):
        lg = torch.randn(vocab, generator=g)
        a = time.perf_counter()
        t = int(torch.argmax(c.mask(lg)))
        c.accept(t)
        ts.append(time.perf_counter() - a)
        if t == tok.eos_id:
            break
    return t1 - t0, t2 - t1, ts


def run_xgrammar(tok, vocab, tokens, seed):
    import xgrammar as xgr
    t0 = time.perf_counter()
    raw = []
    for i in range(vocab):
        try:
            raw.append(tok.enc.decode_single_token_bytes(i))
        except KeyError:
            raw.append(b"")
    comp = xgr.GrammarCompiler(xgr.TokenizerInfo(raw, vocab_type=xgr.VocabType.RAW, vocab_size=vocab,
                                                 stop_token_ids=[tok.eos_id]))
    t1 = time.perf_counter()
    m = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(SCHEMA)))
    bm = xgr.allocate_token_bitmask(1, vocab)
    t2 = time.perf_counter()
    g, ts = torch.Generator().manual_seed(seed), []
    for _ in range(tokens):
        lg = torch.randn(1, vocab, generator=g)
        a = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        xgr.apply_token_bitmask_inplace(lg, bm)
        t = int(lg.argmax())
        m.accept_token(t)
        ts.append(time.perf_counter() - a)
        if m.is_terminated():
            break
    return t1 - t0, t2 - t1, ts


def run_argmax(tok, vocab, tokens, seed):
    g, ts = torch.Generator().manual_seed(seed), []
    for _ in range(tokens):
        lg = torch.randn(vocab, generator=g)
        a = time.perf_counter()
        int(torch.argmax(lg))
        ts.append(time.perf_counter() - a)
    return 0.0, 0.0, ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model folder with its tokenizer (tiktoken.model)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "constrain.tsv"))
    a = ap.parse_args()
    tok, vocab = Tokenizer(a.model), load_config(a.model).vocab_size
    engines = {"argmax": run_argmax, "llguidance": run_llguidance}
    try:
        import xgrammar  # noqa: F401
        engines["xgrammar"] = run_xgrammar
    except ImportError:
        print("xgrammar not importable: measuring llguidance only", file=sys.stderr)
    flags = cpu_flags()
    tsv = Tsv(Path(a.tsv), ["engine", "rep", "vocab", "tokens", "tables_s", "compile_s", "token_median_s",
                            "token_p90_s", "cpu"])
    res = {e: [] for e in engines}
    for rep in range(a.reps):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for e in order:
            tables, comp, ts = engines[e](tok, vocab, a.tokens, rep)
            s = sorted(ts)
            med, p90 = statistics.median(s), s[int(0.9 * (len(s) - 1))]
            res[e].append(med)
            tsv.add(engine=e, rep=rep, vocab=vocab, tokens=len(ts), tables_s=tables, compile_s=comp,
                    token_median_s=med, token_p90_s=p90, cpu=flags)
            print(f"rep {rep} {e:10} tables {tables:.2f} s, compile {comp:.3f} s, {len(ts)} tokens, "
                  f"median {med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us", file=sys.stderr)
    for e, v in res.items():
        print(f"{e:10} median of rep medians {statistics.median(v) * 1e6:.0f} us "
              f"({' / '.join(f'{x * 1e6:.0f}' for x in v)})", file=sys.stderr)
    print(f"wrote {a.tsv} (run {tsv.run}); {flags}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
