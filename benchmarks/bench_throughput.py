"""More tokens per pass over the weights, and long contexts in little memory (issue 11).

Four sweeps, each appending one row per rep to benchmarks/results/throughput-<sweep>.tsv
(the CPU model and SIMD flags in every row) and printing a markdown table of arm means;
ratios are taken within one invocation (same machine state), never across runs.

  spec     `--spec N` against plain decode on a prompt of distinct ids, inside a memory
           cgroup per ceiling (default 4 and 8 GiB): best case = a corpus holding the
           model's own greedy continuation (taken from the first plain rep), worst case
           = no corpus (the prompt has no repeated n-gram). Emitted tokens/s over the
           decode (after the prefill pass), tokens per pass, bytes read per emitted
           token; best case also at N = 1, 2, 4 for the plot. Tokens must equal plain.
  batch    `k3 run --batch` with B = 1, 2, 4, 8, 16 sequences of distinct prompts:
           aggregate tokens/s, bytes read per token, peak RSS.
  kv       latent vs expanded MLA KV cache: the plan's KV bytes per position at K3's
           shapes (93 layers, 896 experts), and decode s/token after a prompt of 1k and
           8k positions (`--kv latent|expanded`, same tokens required).
  prefill  one long prompt (default 32k tokens) on the `small` checkpoint: prefill
           tokens/s by `--prefill-chunk`, peak RSS against the plan's total.

    python benchmarks/bench_throughput.py spec --model /work/rd4 --trunk /work/rd4-trunk
    python benchmarks/bench_throughput.py batch --model /work/rd4 --trunk /work/rd4-trunk
    python benchmarks/bench_throughput.py kv --model SMALL
    python benchmarks/bench_throughput.py prefill --model SMALL

PNG plots (matplotlib, optional) go beside the TSVs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RESULTS, Tsv, cpu_flags, loadavg, mean_sd_spread, run_k3, table  # noqa: E402

COLS = ["sweep", "arm", "rep", "ceiling_gb", "x", "tok_s", "tokens", "passes", "tokens_per_pass", "drafted",
        "accepted", "bytes_per_token", "s_tok", "prefill_s", "peak_rss_gb", "cg_max_gb", "plan_gb", "ids_ok",
        "load1", "cpu", "model", "flags"]


def distinct_prompt(n: int, vocab_ranks: int, seed: int = 11) -> list[int]:
    """n distinct ordinary ids (below the specials), so no n-gram repeats."""
    step = 37
    return [(seed + step * i) % vocab_ranks for i in range(n)]


def _ids(xs) -> str:
    return ",".join(map(str, xs))


def _common(a) -> list[str]:
    return ["--trunk", a.trunk] if a.trunk else []


def _plan_gb(d: dict) -> float:
    return (d.get("memory_plan") or {}).get("total", 0) / 1e9


def _decode_rate(d: dict) -> tuple[float, int]:
    """Emitted tokens/s after the prefill pass, and the passes the run took."""
    secs = d["step_seconds"]
    dec = sum(secs[1:])
    passes = sum(1 for s in d["steps"] if s["seconds"] > 0)
    return ((len(secs) - 1) / dec if dec > 0 else float("nan")), passes


def sweep_spec(a, tsv: Tsv) -> list[list]:
    prompt = distinct_prompt(a.prompt_len, a.ranks)
    rows, plot_pts = [], []
    tmp = Path(tempfile.mkdtemp(prefix="k3spec-"))
    for ceiling in a.ceilings:
        plain_ids = None
        arms = [("plain", [], None)]
        for n in a.spec_lengths:
            arms.append((f"best-spec{n}", ["--spec", str(n)], "corpus"))
        arms.append((f"worst-spec{max(a.spec_lengths)}", ["--spec", str(max(a.spec_lengths))], None))
        res: dict[str, list[float]] = {}
        for arm, flags, corpus in arms:
            reps = a.reps if arm in ("plain", f"best-spec{max(a.spec_lengths)}", f"worst-spec{max(a.spec_lengths)}") \
                else a.minor_reps
            for rep in range(reps):
                f = _common(a) + flags
                if corpus:
                    f += ["--spec-corpus", str(tmp / "continuation.ids")]
                d = run_k3(a.model, f, ceiling_gb=ceiling, ids=_ids(prompt), gen=a.gen, tag=f"spec-{arm}")
                if "_error" in d:
                    print(f"{arm} rep {rep}: {d['_error']}", file=sys.stderr)
                    tsv.add(sweep="spec", arm=arm, rep=rep, ceiling_gb=ceiling, ids_ok="ERROR", cpu=cpu_flags(),
                            model=a.model, flags=" ".join(f))
                    continue
                if arm == "plain" and plain_ids is None:
                    plain_ids = d["generated_ids"]
                    (tmp / "continuation.ids").write_text(_ids(prompt + plain_ids))
                rate, passes = _decode_rate(d)
                sp = d.get("spec") or {}
                n_tok = len(d["generated_ids"])
                bpt = sp.get("bytes_per_token") or d["bytes_read"] / max(1, n_tok)
                ok = d["generated_ids"] == plain_ids
                tsv.add(sweep="spec", arm=arm, rep=rep, ceiling_gb=ceiling, x=sp.get("n", 0), tok_s=rate,
                        tokens=n_tok, passes=passes, tokens_per_pass=n_tok / max(1, passes),
                        drafted=sp.get("drafted", 0), accepted=sp.get("accepted", 0), bytes_per_token=bpt,
                        s_tok=1 / rate if rate == rate and rate else float("nan"), prefill_s=d["prefill_seconds"],
                        peak_rss_gb=d["peak_rss_bytes"] / 1e9,
                        cg_max_gb=(d["_cg_max_usage"] or 0) / 1e9, plan_gb=_plan_gb(d), ids_ok=ok,
                        load1=d["_load1"], cpu=cpu_flags(), model=a.model, flags=" ".join(f))
                res.setdefault(arm, []).append(rate)
                res.setdefault(arm + ":tpp", []).append(n_tok / max(1, passes))
                res.setdefault(arm + ":bpt", []).append(bpt)
                res.setdefault(arm + ":ok", []).append(ok)
                if arm.startswith("best") or arm == "plain":
                    plot_pts.append((ceiling, 0 if arm == "plain" else int(arm.split("spec")[1]), rate))
                print(f"  {ceiling} GiB {arm} rep {rep}: {rate:.3f} tok/s, {n_tok} tokens in {passes} passes, "
                      f"same tokens as plain: {ok}", file=sys.stderr)
        base = statistics.fmean(res.get("plain", [float("nan")]))
        for arm, _, _ in arms:
            xs = res.get(arm, [])
            if not xs:
                continue
            m, sd, spr = mean_sd_spread(xs)
            rows.append([f"{ceiling} GiB", arm, len(xs), m, sd, f"{spr:.0%}", m / base,
                         statistics.fmean(res[arm + ":tpp"]), statistics.fmean(res[arm + ":bpt"]) / 1e9,
                         all(res[arm + ":ok"])])
    _plot_lines(RESULTS / "throughput-spec.png", plot_pts, "drafted length N (0 = plain decode)",
                "emitted tokens/s (decode)", "k3 --spec N, best case (corpus = own continuation)")
    return rows


def sweep_batch(a, tsv: Tsv) -> list[list]:
    rows, pts = [], []
    tmp = Path(tempfile.mkdtemp(prefix="k3batch-"))
    for ceiling in a.ceilings:
        res: dict[int, list] = {}
        for b in a.batches:
            jobs = tmp / f"b{b}.jsonl"
            jobs.write_text("".join(json.dumps({"ids": distinct_prompt(a.prompt_len, a.ranks, seed=100 + 7 * i),
                                                "max_tokens": a.gen}) + "\n" for i in range(b)))
            for rep in range(a.reps):
                f = ["--batch", str(jobs), "--greedy", "--prefill-chunk", str(a.chunk)] + _common(a)
                d = run_k3(a.model, f, ceiling_gb=ceiling, tag=f"batch{b}", raw=True)
                if "_error" in d:
                    print(f"batch {b} rep {rep}: {d['_error']}", file=sys.stderr)
                    tsv.add(sweep="batch", arm=f"batch{b}", rep=rep, ceiling_gb=ceiling, x=b, ids_ok="ERROR",
                            cpu=cpu_flags(), model=a.model, flags=" ".join(f))
                    continue
                tok_s = d["tokens_per_second"]
                tsv.add(sweep="batch", arm=f"batch{b}", rep=rep, ceiling_gb=ceiling, x=b, tok_s=tok_s,
                        tokens=d["tokens"], passes=d["passes"], tokens_per_pass=d["tokens"] / max(1, d["passes"]),
                        bytes_per_token=d["bytes_per_token"], peak_rss_gb=d["peak_rss_bytes"] / 1e9,
                        cg_max_gb=(d["_cg_max_usage"] or 0) / 1e9, plan_gb=_plan_gb(d), load1=d["_load1"],
                        cpu=cpu_flags(), model=a.model, flags=" ".join(f))
                res.setdefault(b, []).append((tok_s, d["bytes_per_token"], d["peak_rss_bytes"] / 1e9, _plan_gb(d)))
                pts.append((ceiling, b, tok_s))
                print(f"  {ceiling} GiB batch {b} rep {rep}: {tok_s:.3f} tok/s aggregate, "
                      f"{d['bytes_per_token'] / 1e9:.3f} GB read/token", file=sys.stderr)
        base = statistics.fmean(x[0] for x in res.get(1, [(float("nan"),)]))
        for b, xs in res.items():
            m, sd, spr = mean_sd_spread([x[0] for x in xs])
            rows.append([f"{ceiling} GiB", b, len(xs), m, sd, f"{spr:.0%}", m / base,
                         statistics.fmean(x[1] for x in xs) / 1e9, max(x[2] for x in xs), xs[0][3]])
    _plot_lines(RESULTS / "throughput-batch.png", pts, "sequences in the batch", "aggregate tokens/s",
                "k3 run --batch: one pass over the weights per step for all sequences")
    return rows


def sweep_kv(a, tsv: Tsv) -> list[list]:
    from k3 import synth
    from k3.config import parse_config
    from k3.memory.planner import kv_bytes_per_position

    k3cfg = parse_config(synth.build_config("realdims", layers=93, experts=896))
    lat, exp = kv_bytes_per_position(k3cfg), kv_bytes_per_position(k3cfg, latent=False)
    print(f"K3 shapes (93 layers, {sum(k3cfg.is_mla(i) for i in range(93))} MLA): KV per position latent "
          f"{lat} B, expanded {exp} B: latent = 1/{exp / lat:.1f}", file=sys.stderr)
    rows = [["K3 plan", "bytes/position", "", lat, exp, "", f"1/{exp / lat:.1f}", ""]]
    for n in a.contexts:
        prompt = distinct_prompt(n, a.ranks)
        res, ids = {}, {}
        for form in ("latent", "expanded"):
            for rep in range(a.reps):
                f = ["--kv", form] + _common(a)
                d = run_k3(a.model, f, ids=_ids(prompt), gen=a.gen, tag=f"kv-{form}-{n}")
                if "_error" in d:
                    print(f"kv {form} {n}: {d['_error']}", file=sys.stderr)
                    continue
                s_tok = d["decode_seconds_per_token"]
                ids.setdefault(form, d["generated_ids"])
                tsv.add(sweep="kv", arm=form, rep=rep, x=n, s_tok=s_tok, tok_s=1 / s_tok,
                        tokens=len(d["generated_ids"]), prefill_s=d["prefill_seconds"],
                        peak_rss_gb=d["peak_rss_bytes"] / 1e9, plan_gb=_plan_gb(d),
                        ids_ok=d["generated_ids"] == ids.get("latent"), load1=d["_load1"], cpu=cpu_flags(),
                        model=a.model, flags=" ".join(f))
                res.setdefault(form, []).append((s_tok, d["prefill_seconds"],
                                                 (d["memory_plan"]["components"].get("KV cache", 0))))
                print(f"  {n} positions {form} rep {rep}: {s_tok:.4f} s/token decode, prefill "
                      f"{d['prefill_seconds']:.1f} s", file=sys.stderr)
        if len(res) == 2:
            ml, sdl, _ = mean_sd_spread([x[0] for x in res["latent"]])
            me, sde, _ = mean_sd_spread([x[0] for x in res["expanded"]])
            rows.append([f"{n} positions", "decode s/token", len(res["latent"]), f"{ml:.4f} ± {sdl:.4f}",
                         f"{me:.4f} ± {sde:.4f}", f"{ml / me:.2f}",
                         f"{res['latent'][0][2] / 1e6:.1f} / {res['expanded'][0][2] / 1e6:.1f} MB",
                         ids.get("latent") == ids.get("expanded")])
            pl = statistics.fmean(x[1] for x in res["latent"])
            pe = statistics.fmean(x[1] for x in res["expanded"])
            rows.append([f"{n} positions", "prefill s", len(res["latent"]), f"{pl:.2f}", f"{pe:.2f}",
                         f"{pl / pe:.2f}", "", ""])
    return rows


def sweep_prefill(a, tsv: Tsv) -> list[list]:
    prompt = distinct_prompt(a.prompt_len, a.ranks)
    rows, pts = [], []
    for chunk in a.chunks:
        xs = []
        for rep in range(a.reps):
            f = ["--prefill-chunk", str(chunk)] + _common(a)
            d = run_k3(a.model, f, ids=_ids(prompt), gen=2, tag=f"prefill{chunk}", timeout=7200)
            if "_error" in d:
                print(f"chunk {chunk}: {d['_error']}", file=sys.stderr)
                continue
            tps = len(prompt) / d["prefill_seconds"]
            tsv.add(sweep="prefill", arm=f"chunk{chunk}", rep=rep, x=chunk, tok_s=tps, tokens=len(prompt),
                    prefill_s=d["prefill_seconds"], peak_rss_gb=d["peak_rss_bytes"] / 1e9, plan_gb=_plan_gb(d),
                    load1=d["_load1"], cpu=cpu_flags(), model=a.model, flags=" ".join(f),
                    ids_ok=",".join(map(str, d["generated_ids"])))
            xs.append((tps, d["peak_rss_bytes"] / 1e9, _plan_gb(d), d["generated_ids"]))
            pts.append((0, chunk, tps))
            print(f"  chunk {chunk} rep {rep}: {tps:.1f} prompt tokens/s, peak RSS "
                  f"{d['peak_rss_bytes'] / 1e9:.2f} GB (plan {_plan_gb(d):.2f} GB)", file=sys.stderr)
        if xs:
            m, sd, spr = mean_sd_spread([x[0] for x in xs])
            rows.append([chunk, len(xs), m, sd, f"{spr:.0%}", max(x[1] for x in xs), xs[0][2],
                         max(x[1] for x in xs) <= xs[0][2], _ids(xs[0][3])])
    _plot_lines(RESULTS / "throughput-prefill.png", pts, "--prefill-chunk (tokens per pass)",
                "prefill tokens/s", f"{len(prompt)}-token prompt on {Path(a.model).name}")
    return rows


def _plot_lines(path: Path, pts, xlabel: str, ylabel: str, title: str) -> None:
    """One series per ceiling: every rep as a dot, the arm means joined."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG; pip install matplotlib)", file=sys.stderr)
        return
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, c in enumerate(sorted({p[0] for p in pts})):
        xs = [(x, y) for cc, x, y in pts if cc == c and y == y]
        label = f"{c} GiB cgroup" if c else "no cgroup"
        ax.scatter([x for x, _ in xs], [y for _, y in xs], s=16, alpha=0.6, color=f"C{i}")
        by = {}
        for x, y in xs:
            by.setdefault(x, []).append(y)
        mx = sorted(by)
        ax.plot(mx, [statistics.fmean(by[x]) for x in mx], "-o", color=f"C{i}", label=label + " (mean)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


HEADERS = {
    "spec": ["ceiling", "arm", "reps", "tok/s mean", "sd", "spread", "x plain", "tokens/pass", "GB read/token",
             "same tokens"],
    "batch": ["ceiling", "B", "reps", "agg tok/s", "sd", "spread", "x B=1", "GB read/token", "peak RSS GB",
              "plan GB"],
    "kv": ["what", "measure", "reps", "latent", "expanded", "latent/expanded", "KV row (plan)", "same tokens"],
    "prefill": ["chunk", "reps", "prefill tok/s", "sd", "spread", "peak RSS GB", "plan GB", "RSS <= plan",
                "tokens"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", choices=["spec", "batch", "kv", "prefill"])
    p.add_argument("--model", required=True)
    p.add_argument("--trunk", help="packed trunk folder (streamed)")
    p.add_argument("--ceilings", default="4,8", help="cgroup ceilings in GiB (spec, batch)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--minor-reps", type=int, default=1, help="reps of the plot-only arms (spec N < max)")
    p.add_argument("--gen", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--spec-lengths", default="2,4,8")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--chunk", type=int, default=32, help="--prefill-chunk for the batch runs (short prompts)")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--chunks", default="64,128,256,512,1024")
    p.add_argument("--ranks", type=int, default=None, help="ordinary ids below this (default: the model's BPE ranks)")
    a = p.parse_args(argv)
    a.ceilings = [float(x) for x in a.ceilings.split(",") if x]
    a.spec_lengths = [int(x) for x in a.spec_lengths.split(",")]
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.chunks = [int(x) for x in a.chunks.split(",")]
    defaults = {"spec": (32, 24), "batch": (8, 6), "kv": (8, 0), "prefill": (2, 32768)}
    g, pl = defaults[a.sweep]
    a.gen = a.gen if a.gen is not None else g
    a.prompt_len = a.prompt_len if a.prompt_len is not None else pl
    if a.ranks is None:
        from k3.config import load_config
        a.ranks = load_config(a.model).vocab_size - 256  # the specials sit at the top 256 ids
    if a.sweep in ("kv", "prefill"):
        a.ceilings = []
    tsv = Tsv(RESULTS / f"throughput-{a.sweep}.tsv", COLS)
    print(f"run {tsv.run}: {a.sweep} on {a.model}; {cpu_flags()}; load {loadavg():.2f}", file=sys.stderr)
    rows = {"spec": sweep_spec, "batch": sweep_batch, "kv": sweep_kv, "prefill": sweep_prefill}[a.sweep](a, tsv)
    print(f"\nrun {tsv.run} ({a.sweep}), {cpu_flags()}, load after {loadavg():.2f}")
    print(table(rows, HEADERS[a.sweep]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
