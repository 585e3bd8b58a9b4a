"""A constrained token's cost at a model's vocabulary: the grammar engine's mask, the pick
and the grammar step, against a plain argmax, per engine (llguidance, k3's; xgrammar when
it is importable), on random logits, the same JSON schema for all; and llguidance under
the grammar of a whole K3 answer with 16 agent tools (tool_choice auto, free think text:
``llguidance-answer``; its compile_s is that grammar's).

Per rep and engine: build the tables (a one-off a server pays at start), compile the
schema, then decode ``--tokens`` tokens greedily under the grammar; the median seconds of
one token's mask + pick + step. Reps alternate the engines' order. One TSV row per (rep,
engine) in benchmarks/results/constrain.tsv with the CPU flags.

    python benchmarks/bench_constrain.py MODEL_DIR [--reps 3] [--tokens 60]

``--decode N``: instead, the share of a decode step spent in the grammar where it
counts: N sequences of MODEL_DIR's model decode greedily in one batch, each under the
answer grammar of a chat request with 6 agent tools (tool_choice auto, thinking on),
and the step's time and the time inside ``Constraint.mask`` / ``accept`` are taken per
step (medians over the steps after the first few; one TSV row per rep in
benchmarks/results/constrain-decode.tsv).

    python benchmarks/bench_constrain.py MODEL_DIR --decode 8 --reps 3 --tokens 60
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


def _llguidance(tok, vocab, tokens, seed, ends, make):
    """(tables seconds, compile seconds, per-token seconds) of the constraint ``make()``
    builds, with the tables for ``ends`` built again first, as a fresh server builds
    them; decoded greedily on random logits until an end token or ``tokens``."""
    from k3 import constrain
    constrain._LL.pop(tok, None)
    constrain._COMPILED.pop(tok, None)   # and its grammars compiled again
    t0 = time.perf_counter()
    constrain.prepare(tok, vocab, ends)
    t1 = time.perf_counter()
    c = make()
    t2 = time.perf_counter()
    g, ts = torch.Generator().manual_seed(seed), []
    for _ in range(tokens):
        lg = torch.randn(vocab, generator=g)
        a = time.perf_counter()
        t = int(torch.argmax(c.mask(lg)))
        c.accept(t)
        ts.append(time.perf_counter() - a)
        if t in ends:
            break
    return t1 - t0, t2 - t1, ts


def run_llguidance(tok, vocab, tokens, seed):
    from k3 import constrain
    return _llguidance(tok, vocab, tokens, seed, [tok.eos_id],
                       lambda: constrain.json_constraint(tok, SCHEMA, [tok.eos_id], vocab))


def run_llguidance_answer(tok, vocab, tokens, seed):
    """A whole K3 answer under tool_choice auto with 16 agent tools (k3.answer_grammar):
    the random logits keep it in the free think text, where an agent's answer spends
    most of its tokens."""
    from bench_server import agent_tools
    from k3 import constrain
    from k3.answer_grammar import answer_grammar
    from k3.chat_format import END_OF_MSG
    end = [tok.token_id(END_OF_MSG)]
    tools = [(t["function"]["name"], t["function"]["parameters"]) for t in agent_tools(16)]
    return _llguidance(tok, vocab, tokens, seed, end, lambda: constrain.lark_constraint(
        tok, answer_grammar(tok, thinking=True, tools=tools, calls="auto"), end, vocab, "bench"))


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


def decode_share(model, n, tokens, reps, tsv_path):
    """Per rep: (median step seconds, median seconds inside the constraint per step)."""
    import k3
    from bench_server import agent_tools
    from k3 import constrain
    from k3.answer_grammar import answer_grammar
    from k3.chat_format import K3Format, render_k3
    inside = [0.0]
    for name in ("mask", "accept"):
        f = getattr(constrain.Constraint, name)

        def timed(self, *a, _f=f):
            t = time.perf_counter()
            try:
                return _f(self, *a)
            finally:
                inside[0] += time.perf_counter() - t
        setattr(constrain.Constraint, name, timed)
    eng = k3.load(model, max_batch=n)
    tok, tools = eng.tokenizer, agent_tools()
    fmt = K3Format(tok, True, "max", tools)
    prompt = tok.encode_segments(render_k3([{"role": "user", "content": "Fix the failing test."}], tools))
    grammar = answer_grammar(tok, thinking=True, calls="auto",
                             tools=[(t["function"]["name"], t["function"]["parameters"]) for t in tools])
    flags = cpu_flags()
    tsv = Tsv(Path(tsv_path), ["sequences", "rep", "vocab", "steps", "step_median_s", "constraint_median_s",
                               "share", "cpu"])
    for rep in range(reps):
        b = eng.batch()
        for _ in range(n):
            c = constrain.lark_constraint(tok, grammar, fmt.stop_ids, eng.cfg.vocab_size, "bench")
            b.add(prompt, max_tokens=tokens, stop_ids=fmt.stop_ids, constraint=c)
        steps, spent = [], []
        while b.active:
            inside[0] = 0.0
            t = time.perf_counter()
            list(b.step())
            steps.append(time.perf_counter() - t)
            spent.append(inside[0])
        steps, spent = steps[5:], spent[5:]   # past the prompt's passes
        st, ct = statistics.median(steps), statistics.median(spent)
        tsv.add(sequences=n, rep=rep, vocab=eng.cfg.vocab_size, steps=len(steps), step_median_s=st,
                constraint_median_s=ct, share=ct / st, cpu=flags)
        print(f"rep {rep}: {n} sequence(s), step {st * 1e3:.2f} ms, in the grammar {ct * 1e3:.3f} ms "
              f"({100 * ct / st:.1f} %)", file=sys.stderr)
    print(f"wrote {tsv_path} (run {tsv.run}); {flags}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model folder with its tokenizer (tiktoken.model)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks" / "results" / "constrain.tsv"))
    ap.add_argument("--decode", type=int, metavar="N", help="the grammar's share of a decode step of N sequences "
                    "(see above)")
    a = ap.parse_args()
    if a.decode:
        tsv = a.tsv if a.tsv != ap.get_default("tsv") else str(ROOT / "benchmarks" / "results" /
                                                                 "constrain-decode.tsv")
        decode_share(a.model, a.decode, a.tokens, a.reps, tsv)
        return 0
    tok, vocab = Tokenizer(a.model), load_config(a.model).vocab_size
    engines = {"argmax": run_argmax, "llguidance": run_llguidance, "llguidance-answer": run_llguidance_answer}
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
            print(f"rep {rep} {e:17} tables {tables:.2f} s, compile {comp:.3f} s, {len(ts)} tokens, "
                  f"median {med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us", file=sys.stderr)
    for e, v in res.items():
        print(f"{e:17} median of rep medians {statistics.median(v) * 1e6:.0f} us "
              f"({' / '.join(f'{x * 1e6:.0f}' for x in v)})", file=sys.stderr)
    print(f"wrote {a.tsv} (run {tsv.run}); {flags}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
