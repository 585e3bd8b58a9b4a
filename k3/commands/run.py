"""`k3 run MODEL --prompt TEXT`: generate from a prompt.

stdout carries only the generated text (the ids, without a tokenizer; the JSON result
with --json); a compact summary follows on stderr, the per-step table with --verbose.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from dataclasses import replace
from pathlib import Path

from .. import interrupt
from ..errors import EXIT_OK, UsageError
from .common import (CompileReport, add_budget_args, add_model_args, add_prompt_cache_args, add_sampling_args,
                     add_spec_args, budgets_from_args, check_model_dir, check_output_path, check_prompt_cache_args, err,
                     check_text, open_prompt_cache, sampling_from_args, spec_corpus_from_args, spec_summary, load_options)

HELP = "generate tokens from a prompt"
MAX_GEN = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model folder (config.json, model.safetensors.index.json, shards)")
    src = p.add_argument_group("prompt (exactly one)")
    src.add_argument("--prompt", help="prompt text (tokenized with the model folder's tiktoken.model)")
    src.add_argument("--prompt-file", help="file whose bytes are the prompt text (UTF-8)")
    src.add_argument("--ids", help="raw token ids, comma or space separated (no tokenizer needed); @FILE reads "
                                   "them from FILE (for prompts longer than a command line holds)")
    src.add_argument("--batch", metavar="FILE",
                     help="decode many sequences together: a JSONL file, one {\"prompt\": TEXT} or {\"ids\": [...]} "
                          "a line, each with an optional \"max_tokens\" and \"seed\"; one JSON line per sequence on "
                          "stdout")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="with --batch: the most sequences decoded together (default: all of them)")
    p.add_argument("--gen", "--max-tokens", dest="gen", type=int, default=8,
                   help=f"tokens to generate (default 8, at most {MAX_GEN})")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--incremental", dest="incremental", action="store_true", default=True,
                      help="prefill once, then one token per step carrying the KDA state and the MLA KV cache "
                           "(the default)")
    mode.add_argument("--full-recompute", dest="incremental", action="store_false",
                      help="re-read the whole prefix every step (no KV cache; the C engine's validation mode)")
    add_model_args(p)
    add_spec_args(p)
    p.add_argument("--out", help="write a JSON result (ids, timings, statistics) to this file")
    p.add_argument("--dump-logits", help="write the first step's float32 logits (raw little-endian) here")
    p.add_argument("--dump-cache-trace", metavar="DIR", help="write expert_trace.bin + expert_hist.json here")
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout instead of text")
    p.add_argument("--list-presets", action="store_true", help="print the memory presets and exit")
    p.add_argument("--save-state", metavar="PATH",
                   help="after the run, write the carried state (ids, KDA/conv state, MLA KV) here")
    p.add_argument("--load-state", metavar="PATH",
                   help="resume from a state file; the prompt is appended to its sequence")
    add_prompt_cache_args(p)
    add_budget_args(p)
    add_sampling_args(p)


def parse_ids(text: str, source: str = "--ids") -> list[int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    ids = []
    for i, p in enumerate(parts):
        try:
            ids.append(int(p))
        except ValueError:
            shown = repr(text) if len(text) <= 200 else f"{p!r} (item {i + 1} of {len(parts)})"
            raise UsageError(f"{source} must be integers separated by commas or spaces, got {shown}.") from None
    return ids


def _read_prompt(args) -> tuple[list[int], object]:
    """(prompt ids, tokenizer or None). Text is tokenized here, before the model is
    opened, because the memory plan needs the prompt's length."""
    given = [x for x in (args.prompt, args.prompt_file, args.ids, args.batch) if x is not None]
    if len(given) != 1:
        raise UsageError("give exactly one of --prompt, --prompt-file, --ids or --batch.")
    if args.ids is not None:
        if args.ids.startswith("@"):
            path = args.ids[1:]
            if not path:
                raise UsageError("--ids @FILE needs the file's name after the @.")
            try:
                text = Path(path).read_text(encoding="ascii")
            except OSError as e:
                raise UsageError(f"{path}: cannot read the ids file given as --ids @{path} ({e.strerror}).") from None
            except UnicodeDecodeError:
                raise UsageError(f"{path}: the ids file holds something other than ids separated by commas or "
                                 "spaces.") from None
            ids = parse_ids(text, f"{path} (--ids @{path})")
            if not ids:
                raise UsageError(f"{path}: the ids file given as --ids @{path} is empty.")
            return ids, None
        return parse_ids(args.ids), None
    from ..tokenizer import Tokenizer
    tok = Tokenizer(args.model)
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_bytes().decode("utf-8")
        except OSError as e:
            raise UsageError(f"{args.prompt_file}: cannot read the prompt file ({e.strerror}).") from None
        except UnicodeDecodeError:
            raise UsageError(f"{args.prompt_file}: the prompt file is not UTF-8 text.") from None
    else:
        text = check_text(args.prompt, "--prompt")
    return tok.encode(text), tok


class LiveLine:
    """A progress bar on stderr for long phases (loading the trunk, a long prefill):
    terminals only, and only once a phase has lasted a second."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.shown = False
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def update(self, what: str, done: int, total: int, unit: str = "layers", detail: str = "") -> None:
        if not self.enabled:
            return
        dt = time.perf_counter() - self.t0
        if dt < 1.0 and not self.shown:
            return
        width = 24
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r  {what} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {unit}{detail} {dt:.1f} s ")
        sys.stderr.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r" + " " * 72 + "\r")
            sys.stderr.flush()
            self.shown = False


def _prefill_observer(line: LiveLine, n_layers: int):
    from ..model.stack import Observer

    class PrefillProgress(Observer):
        active = True
        piece = None  # (tokens read, prompt tokens, this pass's tokens) for a prompt of several passes

        def on_prefill(self, done, total, piece):
            self.piece = (done, total, piece)

        def on_layer(self, i):
            if not self.active:
                return
            if self.piece is None:
                line.update("prefill", i + 1, n_layers)
            else:  # tokens done, counting this pass's layers as a fraction of its piece
                done, total, piece = self.piece
                line.update("prefill", done + piece * (i + 1) // n_layers, total, "tokens",
                            f" (layer {i + 1}/{n_layers})")

    return PrefillProgress()


def run(args) -> int:
    from ..config import check_layers, load_config
    from .. import env
    from ..decode import set_threads
    from ..engine import check_ids
    from ..loader import load
    from ..memory.planner import presets_table
    from ..memory.sysmem import peak_rss_bytes
    from ..units import human

    t_start = time.perf_counter()
    if args.list_presets:
        print(presets_table())
        return EXIT_OK
    check_model_dir(args.model)
    if not 0 <= args.gen <= MAX_GEN:
        raise UsageError(f"--gen must be in 0..{MAX_GEN}, got {args.gen}.")
    if (args.save_state or args.load_state) and env.launch() is not None:
        raise UsageError("--save-state/--load-state are for one process: under torchrun each rank holds only its "
                         "layers' part of the state. Run without torchrun to save or resume a state file.")
    if (args.save_state or args.load_state) and not args.incremental:
        raise UsageError("--save-state/--load-state carry the incremental state; drop --full-recompute.")
    check_prompt_cache_args(args)
    for path, flag in ((args.out, "--out"), (args.dump_logits, "--dump-logits"), (args.save_state, "--save-state")):
        check_output_path(path, flag)
    budgets = budgets_from_args(args)
    threads = set_threads(args.threads)
    cfg = load_config(args.config or args.model)
    if args.batch is not None:
        return _run_batch(args, cfg, budgets, threads, t_start)
    ids, tok = _read_prompt(args)
    ids = check_ids(cfg, ids)
    sampling = sampling_from_args(args, args.model)
    verbose = args.verbose
    info = err if verbose else (lambda msg="": None)
    err(cfg.summary())
    info(f"  {sampling.describe()}" if sampling is not None else "  sampling: greedy (argmax)")
    info(f"  prompt   : {len(ids)} tokens, generating {args.gen} "
         f"({'incremental' if args.incremental else 'full recompute'}), {threads} threads")
    if args.layers is not None:
        check_layers(cfg, args.layers)
        err(f"  WARNING: --layers {args.layers}: only the first {args.layers} of {cfg.num_hidden_layers} layers "
            "run. Output is NOT the full model.")
    loaded = None
    if args.load_state:
        from ..state import load_state
        loaded = load_state(args.load_state, cfg, max_positions=None,
                            n_layers=args.layers, latent=args.kv == "latent")
        info(f"resuming from {args.load_state}: {len(loaded.tokens)} prior positions, {len(ids)} new")
    prior_tokens = list(loaded.tokens) if loaded is not None else []
    tty = sys.stderr.isatty()
    line = LiveLine(tty)
    n_layers = args.layers or cfg.num_hidden_layers
    notes = []

    def log(msg=""):
        if verbose:
            err(msg)
        elif msg.startswith(("auto:", "ultra:", "note:", "ring held", "pipeline:")):
            notes.append(msg)

    if args.spec and not args.incremental:
        raise UsageError("--spec drafts tokens and rolls the carried state back to the ones kept: it needs "
                         "incremental decoding (drop --full-recompute).")
    report = CompileReport()
    try:
        opts = load_options(args, budgets, max_context=len(prior_tokens) + len(ids) + args.gen + args.spec + 1,
                            kv_cache=args.incremental, trace=bool(args.dump_cache_trace), spec=args.spec, kv=args.kv,
                            prefill_chunk=args.prefill_chunk)
        eng = load(args.model, opts, log=log, progress=lambda i: line.update("loading", i + 1, n_layers),
                   notice=report.notice, compile_progress=report.progress)
    finally:
        report.close()
    line.clear()
    if eng.pipeline is not None and eng.pipeline.rank:
        return eng.serve_stage()
    if not verbose:
        err(eng.plan.summary())
    for n in notes:
        err(n)
    try:
        open_prompt_cache(eng, args)
        return _generate(args, eng, cfg, ids, tok, loaded, prior_tokens, sampling, threads, line, t_start,
                         verbose, human, peak_rss_bytes)
    finally:
        eng.close()


def _generate(args, eng, cfg, ids, tok, loaded, prior_tokens, sampling, threads, line, t_start, verbose, human,
              peak_rss_bytes) -> int:
    from ..fsutil import atomic_write, atomic_write_json
    from ..memory.sysmem import drive_read_bytes

    prov = eng.provider
    tok = tok or eng.tokenizer
    if verbose:
        c = prov.cache
        err(f"model tables: {'STREAMED (ultra-low-memory)' if prov.ultra else 'resident'}; "
            f"loaded in {eng.load_seconds:.2f} s")
        err(f"expert cache: {c.n_slots} slots x {human(c.slot_bytes)} = {human(c.arena_bytes)}")
        err(f"peak RSS after loading weights: {human(peak_rss_bytes())}  (the plan above is a forecast, this is "
            "measured)")
        err("")
        err(f"{'STEP':>5} {'TOKEN':>8} {'SECONDS':>9} {'HIT %':>7} {'READ GB':>9} {'TOK/S':>8}")
        err("-" * 52)
    block_text = tok is not None and not args.json and verbose and sys.stdout.isatty() and sys.stderr.isatty()
    stream_text = tok is not None and not args.json and not block_text
    state = loaded.state if loaded is not None else (eng.new_state() if args.incremental else None)
    feed = (loaded.pending + ids) if loaded is not None else ids
    observer = _prefill_observer(line, eng.n_layers)
    corpus = spec_corpus_from_args(args, tok)
    steps = []
    line.start()
    drive = {}  # /proc/self/io's read_bytes after the prompt's pass and at the end: the decode's drive bytes
    try:
        for s in eng.generate(feed, max_tokens=args.gen, sampling=sampling, incremental=args.incremental,
                              state=state, observer=observer, spec=args.spec, spec_corpus=corpus):
            observer.active = False  # the bar is for the prefill only
            line.clear()
            steps.append(s)
            if s.step == 0:
                drive["start"] = drive_read_bytes()
            if s.step == 0 and args.dump_logits:
                atomic_write(args.dump_logits, s.logits.detach().float().numpy().astype("<f4").tobytes(),
                             what="the logits")
            if verbose:
                err(f"{s.step:>5} {s.token:>8} {s.seconds:>9.3f} {100 * s.expert_hit_rate:>7.1f} "
                    f"{s.bytes_read / 1e9:>9.3f} {1.0 / s.seconds if s.seconds > 0 else 0:>8.2f}"
                    + (f"   pass {s.pass_index}: {s.accepted}/{s.drafted} drafts kept" if s.drafted else ""))
            if stream_text:
                sys.stdout.write(s.text)
                sys.stdout.flush()
    finally:
        line.clear()
    drive["end"] = drive_read_bytes()
    if stream_text:
        sys.stdout.write("\n")
    gen_ids = [s.token for s in steps]
    if block_text:
        err("--- generated text ---")
        print(tok.decode(gen_ids), flush=True)
        err("----------------------")
    result = _report(args, eng, cfg, ids, gen_ids, steps, tok, threads, t_start, sampling, verbose, human,
                     peak_rss_bytes)
    if drive.get("start") is not None and drive.get("end") is not None:
        # what the drive itself gave the decode: the bytes read less the page cache's hits
        result["decode_drive_bytes"] = drive["end"] - drive["start"]
    if eng.prompt_cache is not None:
        result["cached_tokens"] = steps[0].cached if steps else 0
        err(f"prompt cache: {result['cached_tokens']} of {len(ids)} prompt tokens continued from {args.prompt_cache}")
    if loaded is not None:
        result["prior_ids"] = prior_tokens
        result["full_ids"] = prior_tokens + ids + gen_ids
    # a signal before this point: no state file, no --out; once the writes start they are
    # finished whole and the run then exits 130 / 143 (k3.interrupt, k3.cli)
    interrupt.check()
    if args.save_state:
        from ..state import save_state
        pending = gen_ids[-1:] if gen_ids else list(feed)  # not fed yet: the last token (or, with --gen 0, the prompt)
        n = save_state(args.save_state, state, cfg, pending=pending)
        err(f"wrote {args.save_state} ({human(n)}, {len(state.ids) + len(pending)} positions)")
        result["state_file"] = args.save_state
    if args.out:
        atomic_write_json(args.out, result, what="the run result")
        err(f"wrote {args.out}")
    if args.dump_logits and steps:
        err(f"wrote {args.dump_logits} ({cfg.vocab_size} float32 logits)")
    if args.dump_cache_trace:
        prov.cache.dump_trace(args.dump_cache_trace)
        err(f"wrote {args.dump_cache_trace}/expert_trace.bin")
    if args.json:
        print(json.dumps(result))
    elif tok is None:
        print(" ".join(map(str, gen_ids)))
    return EXIT_OK


def _report(args, eng, cfg, ids, gen_ids, steps, tok, threads, t_start, sampling, verbose, human,
            peak_rss_bytes) -> dict:
    prov, plan = eng.provider, eng.plan
    total = sum(s.seconds for s in steps)
    spt = total / len(steps) if steps else 0.0
    decode = steps[1:]
    decode_s = sum(s.seconds for s in decode)
    prefill_s = steps[0].seconds if steps else 0.0
    st = eng.stats()
    cs, ts = st["expert_cache"], st["trunk"]
    io_trunk = ts.get("device_seconds", 0.0)
    io_exp = cs.get("read_seconds", 0.0)
    read = sum(s.bytes_read for s in steps)
    peak = peak_rss_bytes()
    share = (io_trunk + io_exp) / total if total > 0 else 0.0
    err("")
    spec = spec_summary(steps, args.spec) if args.spec else None
    if spec is not None:
        err(f"spec: {spec['passes']} weight passes for {len(steps)} tokens ({spec['tokens_per_pass']:.2f} per pass); "
            f"drafted {spec['drafted']}, accepted {spec['accepted']} ({100 * spec['acceptance']:.0f}%), withheld "
            f"{spec['withheld']} (not expected to pay), mean accepted run {spec['mean_accepted_run']:.2f}; "
            f"{human(spec['bytes_per_token'])} read per emitted token")
    err(f"prompt: {len(ids)} tokens, {prefill_s:.2f} s (prefill + first token) | decode: {len(decode)} tokens, "
        f"{len(decode) / decode_s if decode_s > 0 else 0:.2f} tok/s, {decode_s / len(decode) if decode else 0:.3f} "
        f"s/token | peak RSS {human(peak)} | read {human(read)} | I/O share {100 * share:.0f}%")
    if verbose:
        err(f"{len(steps)} tokens in {total:.2f} s, {spt:.3f} s/token average")
        err(f"PEAK RSS for the whole run: {human(peak)}   <- quote this, not the plan ({human(plan.total)})")
        if total > 0:
            err(f"I/O share of wall clock: {100 * share:.1f}%  (trunk {io_trunk:.2f} s + experts {io_exp:.2f} s of "
                f"{total:.2f} s; whole-run totals over {len(steps)} steps)")
            hidden = ts.get("overlap_seconds", 0.0)
            if hidden > 0:
                err(f"  {hidden:.2f} s of trunk device time was hidden behind arithmetic by the reader threads")
        req, ev = cs.get("requests", 0), cs.get("evictions", 0)
        err(f"experts, whole run: {human(cs.get('bytes_read', 0))} read | {req - ev} of {req} requests "
            f"retained in RAM ({100.0 * (req - ev) / req if req else 0:.1f}%) | {ev} evictions  "
            "(retention = requests - evictions)")
        if ts:
            err(f"trunk: pinned {ts.get('pinned', 0)}/{ts.get('n_layers', 0)} layers, ring {ts.get('ring_slots', 0)} "
                f"slots; binds {ts.get('binds', 0)}, hits {ts.get('hits', 0)}, reads {ts.get('reads', 0)}; "
                f"read {human(ts.get('bytes_read', 0))} in {io_trunk:.2f} s "
                f"({ts.get('bytes_read', 0) / 1e9 / io_trunk if io_trunk > 0 else 0:.2f} GB/s device)")
    rows = [{"step": s.step, "token": s.token, "seconds": s.seconds, "fed": s.fed, "pass": s.pass_index,
             "drafted": s.drafted, "accepted": s.accepted,
             "expert_requests": s.expert_requests, "expert_hits": s.expert_hits,
             "expert_hit_pct": 100.0 * s.expert_hit_rate, "expert_bytes_read": s.expert_bytes_read,
             "trunk_bytes_read": s.trunk_bytes_read, "table_bytes_read": s.table_bytes_read,
             "bytes_read": s.bytes_read, "io_seconds": s.io_seconds,
             **({"net_bytes": s.net_bytes} if eng.pipeline is not None else {})} for s in steps]
    return {
        "model": str(args.model),
        "prompt_ids": ids,
        "generated_ids": gen_ids,
        "full_ids": ids + gen_ids,
        "prior_ids": None,
        "generated_text": tok.decode(gen_ids) if tok is not None else None,
        "mode": "incremental" if args.incremental else "full_recompute",
        "layers_requested": args.layers if args.layers is not None else cfg.num_hidden_layers,
        "layers": eng.n_layers,
        "full_model": eng.n_layers == cfg.num_hidden_layers,
        "threads": threads,
        "preset": plan.preset,
        "trunk_budget_bytes": plan.trunk_budget,
        "cache_budget_bytes": plan.cache_budget,
        "ultra_low_memory": plan.stream_tables,
        "memory_plan": plan.as_dict(),
        "layer_paths": eng.paths(),
        "kernels": eng.kernels,
        "seconds_per_token": spt,
        "prefill_seconds": prefill_s,
        "decode_seconds_per_token": decode_s / len(decode) if decode else None,
        "step_seconds": [s.seconds for s in steps],
        "steps": rows,
        "peak_rss_bytes": peak,
        "wall_seconds": time.perf_counter() - t_start,
        "expert_cache": cs,
        "trunk": ts,
        "expert_bytes_read": cs.get("bytes_read", 0),
        "trunk_bytes_read": ts.get("bytes_read", 0) if ts else prov.bytes_read,
        "table_bytes_read": prov.table_bytes(),
        "bytes_read": read,
        "io_share": share,
        "sampling": ({"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                      "seed": sampling.seed} if sampling is not None else "greedy"),
        "spec": spec,
        "pass_cost": eng.pass_cost.as_dict() if eng.pass_cost is not None else None,
        "prefill_plan": eng.prefill_plan.as_dict() if eng.prefill_plan is not None else None,
        "pipeline": _pipeline_report(eng, cfg, steps),
    }


def _pipeline_report(eng, cfg, steps) -> dict | None:
    """The pipeline (world size, each rank's layers and bytes) and what went between ranks."""
    if eng.pipeline is None:
        return None
    d = eng.pipeline.describe(cfg)
    net = sum(s.net_bytes for s in steps)
    d["net_bytes"] = net
    d["net_bytes_per_token"] = net / len(steps) if steps else 0.0
    return d


# ---------------------------------------------------------------- --batch FILE
def _read_jobs(args, cfg) -> tuple[list[dict], object]:
    """The --batch file's sequences: [{"ids", "max_tokens", "seed"}] (seed None: not given), and the tokenizer
    if any was needed."""
    from ..engine import check_ids
    from ..fsutil import JSONProblem, loads_json
    from ..tokenizer import Tokenizer

    try:
        lines = Path(args.batch).read_bytes().splitlines()
    except OSError as e:
        raise UsageError(f"--batch {args.batch}: cannot read it ({e.strerror or e}).") from None
    jobs, tok = [], None
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"--batch {args.batch}, line {n}"
        try:
            job = loads_json(raw)
        except JSONProblem as e:
            raise UsageError(f"{where}: {e.problem}.") from None
        if not isinstance(job, dict) or ("prompt" in job) == ("ids" in job):
            raise UsageError(f"{where}: each line is an object with either \"prompt\" (text) or \"ids\" (a list of "
                             "token ids), and optionally \"max_tokens\" and \"seed\".")
        seed = job.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise UsageError(f"{where}: seed must be an integer >= 0, got {seed!r}.")
        n_gen = job.get("max_tokens", args.gen)
        if not isinstance(n_gen, int) or isinstance(n_gen, bool) or not 0 <= n_gen <= MAX_GEN:
            raise UsageError(f"{where}: max_tokens must be an integer in 0..{MAX_GEN}, got {n_gen!r}.")
        if "prompt" in job:
            if not isinstance(job["prompt"], str):
                raise UsageError(f"{where}: \"prompt\" must be a string.")
            tok = tok or Tokenizer(args.model)
            ids = tok.encode(check_text(job["prompt"], where))
        else:
            ids = job["ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise UsageError(f"{where}: \"ids\" must be a list of integers.")
        jobs.append({"ids": check_ids(cfg, ids), "max_tokens": n_gen, "seed": seed})
    if not jobs:
        raise UsageError(f"--batch {args.batch}: no sequences in it.")
    return jobs, tok


def _run_batch(args, cfg, budgets, threads, t_start) -> int:
    """Every sequence of the --batch file through one Batch: up to --max-batch at a time,
    the next one joining as soon as one finishes."""
    from ..fsutil import atomic_write_json
    from ..loader import load
    from ..memory.sysmem import peak_rss_bytes
    from ..units import human

    for flag, v in (("--save-state", args.save_state), ("--load-state", args.load_state),
                    ("--dump-logits", args.dump_logits)):
        if v:
            raise UsageError(f"{flag} is for one sequence; it cannot be combined with --batch.")
    jobs, tok = _read_jobs(args, cfg)
    width = min(len(jobs), args.max_batch or len(jobs))
    if width < 1:
        raise UsageError(f"--max-batch must be >= 1, got {args.max_batch}.")
    sampling = sampling_from_args(args, args.model)
    err(cfg.summary())
    report = CompileReport()
    try:
        opts = load_options(args, budgets, max_context=max(len(j["ids"]) + j["max_tokens"] + args.spec + 1 for j in jobs),
                            max_batch=width, kv_cache=args.incremental, spec=args.spec, kv=args.kv,
                            prefill_chunk=args.prefill_chunk)
        eng = load(args.model, opts, notice=report.notice, compile_progress=report.progress,
                   log=lambda m="": err(m) if args.verbose or m.startswith(("auto:", "ultra:", "note:", "pipeline:")) else None)
    finally:
        report.close()
    if eng.pipeline is not None and eng.pipeline.rank:
        return eng.serve_stage()
    try:
        if not args.verbose:
            err(eng.plan.summary())
        tok = tok or eng.tokenizer
        corpus = spec_corpus_from_args(args, tok)
        batch = eng.batch()
        queue = list(enumerate(jobs))
        # each job samples with its own seed (stream 0, as a run alone does), so its tokens are those
        # `k3 run --seed S` gives it alone; without --seed, a job without one gets a fresh seed of its own
        seeds = [None if sampling is None else j["seed"] if j["seed"] is not None else
                 sampling.seed if args.seed is not None else secrets.randbits(31) for j in jobs]
        reqs, steps = {}, {}
        passes, sizes, busy = 0, [], 0.0
        while queue or batch.active:
            while queue and len(batch.active) < width:
                i, job = queue.pop(0)
                r = batch.add(job["ids"], max_tokens=job["max_tokens"], incremental=args.incremental,
                              sampler=replace(sampling, seed=seeds[i]).sampler() if sampling is not None else None,
                              spec=args.spec, spec_corpus=corpus)
                reqs[r.id], steps[r.id] = i, []
            if not batch.active:
                continue
            sizes.append(len(batch.active))
            t0 = time.perf_counter()
            for r, st in batch.step():
                steps[r.id] += st
            busy += time.perf_counter() - t0
            passes += 1
        st = eng.stats()
        total = sum(len(v) for v in steps.values())
        read = st["expert_cache"].get("bytes_read", 0) + st["trunk"].get("bytes_read", 0) + st["table_bytes_read"]
        seqs = []
        for rid, i in sorted(reqs.items(), key=lambda kv: kv[1]):
            gen = [s.token for s in steps[rid]]
            seqs.append({"index": i, "prompt_ids": jobs[i]["ids"], "generated_ids": gen,
                         "text": tok.decode(gen) if tok is not None else None,
                         "finish": steps[rid][-1].finish if steps[rid] else "length", "seed": seeds[i]})
            if not args.json:
                line = {k: seqs[-1][k] for k in ("index", "text", "generated_ids", "seed")}
                print(json.dumps(line, ensure_ascii=False), flush=True)
        decode_s = busy  # the passes' wall time (each pass serves every sequence in it)
        err("")
        err(f"batch: {len(jobs)} sequences, {total} tokens in {passes} passes (up to {width} at a time, "
            f"{sum(sizes) / len(sizes):.1f} on average) | aggregate {total / decode_s if decode_s else 0:.2f} tok/s | "
            f"read {human(read)} ({human(read / total if total else 0)} per token) | peak RSS {human(peak_rss_bytes())}")
        result = {"model": str(args.model), "sequences": seqs, "passes": passes, "max_batch": width,
                  "mean_batch": sum(sizes) / len(sizes), "tokens": total, "seconds": decode_s,
                  "tokens_per_second": total / decode_s if decode_s else 0.0, "bytes_read": read,
                  "bytes_per_token": read / total if total else 0.0, "threads": threads,
                  "memory_plan": eng.plan.as_dict(), "peak_rss_bytes": peak_rss_bytes(),
                  "wall_seconds": time.perf_counter() - t_start, "mode": "incremental" if args.incremental
                  else "full_recompute", "preset": eng.plan.preset, "expert_cache": st["expert_cache"],
                  "trunk": st["trunk"], "sampling": "greedy" if sampling is None else {
                      "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                      "seed": sampling.seed},
                  "pipeline": eng.pipeline.describe(cfg) if eng.pipeline is not None else None,
                  "pass_cost": eng.pass_cost.as_dict() if eng.pass_cost is not None else None}
        interrupt.check()
        if args.out:
            atomic_write_json(args.out, result, what="the run result")
            err(f"wrote {args.out}")
        if args.json:
            print(json.dumps(result))
        return EXIT_OK
    finally:
        eng.close()
