"""The `k3` command line: a thin layer over k3.engine.

Generated text/ids go to stdout; banners, tables and statistics to stderr, so the
output can be piped. User mistakes end with one clear paragraph and a documented
exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import __version__
from .fsutil import atomic_write_bytes, atomic_write_json
from .memory.planner import human, peak_rss_bytes
from .errors import EXIT_CHECKPOINT, EXIT_OK, EXIT_READ, EXIT_RUNTIME, EXIT_USAGE, K3Error, UsageError

EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK}  success
  {EXIT_RUNTIME}  refused to start or failed while running (memory plan, forward failure)
  {EXIT_USAGE}  usage error: bad flags, unreadable config, token id outside the vocabulary
  {EXIT_CHECKPOINT}  checkpoint malformed, truncated or incomplete (missing shard or tensor)
  {EXIT_READ}  a weight read failed during the run: the output is invalid
  130 interrupted (Ctrl-C)
"""


def err(msg: str = "") -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_ids(text: str) -> list[int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--ids must be integers separated by commas or spaces, got {text!r}.") from None


# ---------------------------------------------------------------- k3 run
def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model folder (config.json, model.safetensors.index.json, shards)")
    src = p.add_argument_group("prompt (exactly one)")
    src.add_argument("--prompt", help="prompt text (tokenized with the model folder's tiktoken.model)")
    src.add_argument("--prompt-file", help="file whose bytes are the prompt text (UTF-8)")
    src.add_argument("--ids", help="raw token ids, comma or space separated (no tokenizer needed)")
    p.add_argument("--gen", type=int, default=8, help="tokens to generate (default 8, at most 4096)")
    p.add_argument("--incremental", action="store_true",
                   help="prefill once, then one token per step carrying KDA state and the MLA KV cache "
                        "(default: full recompute of the whole prefix every step)")
    p.add_argument("--config", help="config.json to use instead of MODEL/config.json")
    p.add_argument("--layers", type=int, help="run only the first N layers (NOT the full model; for testing)")
    p.add_argument("--out", help="write a JSON result (ids, timings, statistics) to this file")
    p.add_argument("--dump-logits", help="write the first step's float32 logits (raw little-endian) here")
    p.add_argument("--threads", type=int, help="compute threads (default: all available cores)")
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout instead of text")
    p.add_argument("--list-presets", action="store_true", help="print the memory presets and exit")
    p.add_argument("--save-state", metavar="PATH",
                   help="after the run, write the carried state (ids, KDA/conv state, MLA KV) here (needs --incremental)")
    p.add_argument("--load-state", metavar="PATH",
                   help="resume from a state file; the prompt is appended to its sequence (needs --incremental)")
    from .runner import add_budget_args
    from .sampling import add_sampling_args
    add_budget_args(p)
    add_sampling_args(p)


def _read_prompt(args, model_dir) -> tuple[list[int], object]:
    given = [x for x in (args.prompt, args.prompt_file, args.ids) if x is not None]
    if len(given) != 1:
        raise UsageError("give exactly one of --prompt, --prompt-file or --ids.")
    tok = None
    if args.ids is not None:
        ids = parse_ids(args.ids)
        try:
            from .tokenizer import Tokenizer
            tok = Tokenizer(model_dir) if (Path(model_dir) / "tiktoken.model").is_file() else None
        except K3Error:
            tok = None
        return ids, tok
    from .tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_bytes().decode("utf-8")
        except OSError as e:
            raise UsageError(f"{args.prompt_file}: cannot read the prompt file ({e.strerror}).") from None
        except UnicodeDecodeError:
            raise UsageError(f"{args.prompt_file}: the prompt file is not UTF-8 text.") from None
    else:
        text = args.prompt
    ids = tok.encode(text)
    err(f"  tokenized: {len(text.encode())} bytes -> {len(ids)} ids")
    return ids, tok


def cmd_run(args) -> int:
    from .config import load_config
    from .engine import check_ids, generate
    from .runner import StepStats, open_session
    from .tokenizer import StreamDecoder

    t_start = time.perf_counter()
    if args.list_presets:
        from .memory.planner import presets_table
        print(presets_table())
        return EXIT_OK
    if args.model is None:
        raise UsageError("give the model folder as the first argument (k3 run MODEL --prompt ...).")
    if not 0 <= args.gen <= 4096:
        raise UsageError(f"--gen must be in 0..4096, got {args.gen}.")
    if args.trunk_ring < 1:
        raise UsageError(f"--trunk-ring must be >= 1, got {args.trunk_ring}.")
    if args.io_threads < 1:
        raise UsageError(f"--io-threads must be >= 1, got {args.io_threads}.")
    if (args.save_state or args.load_state) and not args.incremental:
        raise UsageError("--save-state/--load-state carry the incremental state: add --incremental.")
    from .runner import set_threads
    threads = set_threads(args.threads)
    model_dir = args.model
    if not Path(model_dir).is_dir():
        raise UsageError(f"{model_dir}: not a folder. Give the model folder (config.json + shards) as the first argument.")
    ids, tok = _read_prompt(args, model_dir)
    cfg = load_config(args.config or model_dir)
    err(cfg.summary())
    ids = check_ids(cfg, ids)
    from .sampling import settings_from_args
    sampling = settings_from_args(args, model_dir)
    err(f"  {sampling.describe()}" if sampling is not None else "  sampling: greedy (argmax)")
    if args.layers is not None and not 1 <= args.layers <= cfg.num_hidden_layers:
        raise UsageError(f"--layers must be in 1..{cfg.num_hidden_layers} for this model, got {args.layers}.")
    err(f"  model    : {model_dir}")
    err(f"  prompt   : {len(ids)} tokens, generating {args.gen} "
        f"({'incremental' if args.incremental else 'full recompute'}), {threads} threads")
    if args.layers is not None:
        err(f"  WARNING: --layers {args.layers}: only the first {args.layers} of {cfg.num_hidden_layers} layers run. "
            "Output is NOT the full model.")
    loaded = None
    if args.load_state:
        from .state import load_state
        loaded = load_state(args.load_state, cfg, max_positions=None, n_layers=args.layers)
        err(f"resuming from {args.load_state}: {len(loaded.tokens)} prior positions, {len(ids)} new")
    prior_tokens = list(loaded.tokens) if loaded is not None else []  # before the run extends the state
    prior = len(prior_tokens)
    sess = open_session(args, cfg, model_dir, prior + len(ids) + args.gen + 1, log=err)
    prov, model = sess.provider, sess.model
    if prov.trunk is not None:
        err(f"trunk streaming from {args.trunk}: {prov.trunk.plan.describe(prov.trunk.n)}")
    else:
        err(f"resident trunk: {human(prov.resident_trunk_bytes)} in RAM (as stored: BF16/F32)")
    err(f"model tables: {'STREAMED (ultra-low-memory)' if prov.ultra else 'resident'}; loaded in {sess.load_seconds:.2f} s")
    c = prov.cache
    err(f"expert cache: {c.n_slots} slots x {human(c.slot_bytes)} = {human(c.arena_bytes)}")
    err(f"peak RSS after loading weights: {human(peak_rss_bytes())}  (the plan above is a forecast, this is measured)")
    err("")
    err(f"{'STEP':>5} {'TOKEN':>8} {'SECONDS':>9} {'HIT %':>7} {'READ GB':>9} {'TOK/S':>8}")
    err("-" * 52)
    stats = StepStats(prov)
    steps = []
    block_text = tok is not None and not args.json and sys.stdout.isatty() and sys.stderr.isatty()
    stream = StreamDecoder(tok) if tok is not None and not args.json and not block_text else None
    progress = _LayerProgress(model, prov) if sys.stderr.isatty() else None
    try:
        sampler = sampling.sampler() if sampling is not None else None
        state = loaded.state if loaded is not None else (model.new_state() if args.incremental else None)
        feed = (loaded.pending + ids) if loaded is not None else ids
        for s in generate(model, feed, args.gen, incremental=args.incremental, sampler=sampler, state=state):
            if progress is not None:
                progress.clear()
            steps.append(s)
            row = stats.step(s)
            if s.step == 0 and args.dump_logits:
                _write_logits(args.dump_logits, s.logits)
            read_gb = (row["expert_bytes_read"] + row.get("trunk_bytes_read", 0)) / 1e9
            err(f"{s.step:>5} {s.token:>8} {s.seconds:>9.3f} {row['expert_hit_pct']:>7.1f} {read_gb:>9.3f} "
                f"{1.0 / s.seconds if s.seconds > 0 else 0:>8.2f}")
            if stream is not None:
                sys.stdout.write(stream.push(s.token))
                sys.stdout.flush()
    finally:
        if progress is not None:
            progress.clear()
    if stream is not None:
        sys.stdout.write(stream.flush() + "\n")
    gen_ids = [s.token for s in steps]
    if tok is not None and block_text:
        err("--- generated text ---")
        print(tok.decode(gen_ids), flush=True)
        err("----------------------")
    result = _report(args, cfg, sess, ids, gen_ids, steps, stats, tok, threads, t_start)
    if loaded is not None:
        result["prior_ids"] = prior_tokens
        result["full_ids"] = prior_tokens + ids + gen_ids
    result["sampling"] = ({"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                           "seed": sampling.seed} if sampling is not None else "greedy")
    if args.save_state:
        from .state import save_state
        pending = gen_ids[-1:] if gen_ids else list(feed)  # not fed yet: the last token (or, with --gen 0, the prompt)
        n = save_state(args.save_state, state, cfg, pending=pending)
        err(f"wrote {args.save_state} ({human(n)}, {len(state.ids) + len(pending)} positions)")
        result["state_file"] = args.save_state
    if args.out:
        atomic_write_json(args.out, result, what="the run result")
        err(f"wrote {args.out}")
    if args.dump_cache_trace:
        prov.cache.dump_trace(args.dump_cache_trace)
        err(f"wrote {args.dump_cache_trace}/expert_trace.bin")
    prov.close()
    if args.json:
        print(json.dumps(result))
    elif tok is None:
        print(" ".join(map(str, gen_ids)))
    return EXIT_OK


class _LayerProgress:
    """A one-line live display on stderr (terminals only): layers done and bytes read."""

    def __init__(self, model, prov):
        self.n = model.n_layers
        self.prov = prov
        self.t0 = time.perf_counter()
        self.shown = False
        model.on_layer = self.on_layer

    def on_layer(self, i):
        dt = time.perf_counter() - self.t0
        if dt < 2.0 and not self.shown:  # only long steps get a live line
            return
        gb = self.prov.cache.stats().get("bytes_read", 0) / 1e9
        if self.prov.trunk is not None:
            gb += self.prov.trunk.stats().get("bytes_read", 0) / 1e9
        sys.stderr.write(f"\r  layer {i + 1}/{self.n}  {gb:.2f} GB read  {dt:.1f} s ")
        sys.stderr.flush()
        self.shown = True
        if i + 1 == self.n:
            self.t0 = time.perf_counter()

    def clear(self):
        if self.shown:
            sys.stderr.write("\r" + " " * 60 + "\r")
            sys.stderr.flush()
            self.shown = False
        self.t0 = time.perf_counter()


def _report(args, cfg, sess, ids, gen_ids, steps, stats, tok, threads, t_start) -> dict:
    prov = sess.provider
    total = sum(s.seconds for s in steps)
    spt = total / len(steps) if steps else 0.0
    cs = prov.cache.stats()
    ts = prov.trunk.stats() if prov.trunk is not None else {}
    err("")
    if args.dump_logits and steps:
        err(f"wrote {args.dump_logits} ({cfg.vocab_size} float32 logits)")
    err(f"{len(steps)} tokens in {total:.2f} s, {spt:.3f} s/token average")
    peak = peak_rss_bytes()
    err(f"PEAK RSS for the whole run: {human(peak)}   <- quote this, not the plan ({human(sess.plan.total)})")
    io_trunk = ts.get("device_seconds", 0.0)
    io_exp = cs.get("read_seconds", 0.0)
    if total > 0:
        share = 100.0 * (io_trunk + io_exp) / total
        err(f"I/O share of wall clock: {share:.1f}%  (trunk {io_trunk:.2f} s + experts {io_exp:.2f} s of {total:.2f} s; "
            f"whole-run totals over {len(steps)} steps)")
        hidden = ts.get("overlap_seconds", 0.0)
        if hidden > 0:
            err(f"  {hidden:.2f} s of trunk device time was hidden behind arithmetic by the reader threads")
    req, ev = cs.get("requests", 0), cs.get("evictions", 0)
    err(f"experts, whole run: {cs.get('bytes_read', 0) / 1e9:.2f} GB read | {req - ev} of {req} requests retained "
        f"in RAM ({100.0 * (req - ev) / req if req else 0:.1f}%) | {ev} evictions  (retention = requests - evictions)")
    if ts:
        err(f"trunk: pinned {ts.get('pinned', 0)}/{ts.get('n_layers', 0)} layers, ring {ts.get('ring_slots', 0)} slots; "
            f"binds {ts.get('binds', 0)}, hits {ts.get('hits', 0)}, reads {ts.get('reads', 0)}; "
            f"read {ts.get('bytes_read', 0) / 1e9:.2f} GB in {io_trunk:.2f} s "
            f"({ts.get('bytes_read', 0) / 1e9 / io_trunk if io_trunk > 0 else 0:.2f} GB/s device)")
    return {
        "model": str(args.model),
        "prompt_ids": ids,
        "generated_ids": gen_ids,
        "full_ids": ids + gen_ids,
        "prior_ids": None,
        "generated_text": tok.decode(gen_ids) if tok is not None else None,
        "mode": "incremental" if args.incremental else "full_recompute",
        "layers_requested": args.layers if args.layers is not None else cfg.num_hidden_layers,
        "layers": sess.model.n_layers,
        "full_model": sess.model.n_layers == cfg.num_hidden_layers,
        "threads": threads,
        "preset": sess.budgets.preset,
        "trunk_budget_bytes": sess.budgets.trunk,
        "cache_budget_bytes": sess.budgets.cache,
        "ultra_low_memory": sess.budgets.ultra,
        "memory_plan": sess.plan.as_dict(),
        "seconds_per_token": spt,
        "step_seconds": [s.seconds for s in steps],
        "steps": stats.rows,
        "peak_rss_bytes": peak,
        "wall_seconds": time.perf_counter() - t_start,
        "expert_cache": cs,
        "trunk": ts,
        "expert_bytes_read": cs.get("bytes_read", 0),
        "trunk_bytes_read": ts.get("bytes_read", 0) if ts else prov.bytes_read,
        "table_bytes_read": prov.table_bytes(),
        "io_share": (io_trunk + io_exp) / total if total > 0 else 0.0,
    }


def _write_logits(path, logits) -> None:
    atomic_write_bytes(path, logits.detach().to("cpu").float().numpy().astype("<f4").tobytes(), what="the logits")


def cmd_presets(args) -> int:
    from .memory.planner import presets_table
    print(presets_table())
    return EXIT_OK


# ---------------------------------------------------------------- k3 synth
def add_synth_args(p):
    from . import synth
    synth.add_arguments(p)


def cmd_synth(args) -> int:
    from . import synth
    return synth.run(args) or EXIT_OK


# ---------------------------------------------------------------- k3 demo
def cmd_demo(args) -> int:
    """Generate the built-in synthetic checkpoint once (cached), then run on it."""
    from . import synth

    cache = Path(args.cache_dir or os.environ.get("K3_CACHE", Path.home() / ".cache" / "k3"))
    model_dir = cache / f"synth-{args.preset}-seed{args.seed}"
    if not (model_dir / "model.safetensors.index.json").is_file():
        err(f"demo: generating the synthetic '{args.preset}' checkpoint into {model_dir} (once)")
        synth.synthesize(model_dir, preset=args.preset, seed=args.seed)
    else:
        err(f"demo: using the cached synthetic checkpoint {model_dir}")
    run_args = build_parser().parse_args(
        ["run", str(model_dir), "--prompt", args.prompt, "--gen", str(args.gen)]
        + (["--incremental"] if args.incremental else []) + (["--out", args.out] if args.out else []))
    return cmd_run(run_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3", description="k3: exact Kimi K3 / Kimi-Linear inference on ordinary machines.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"k3 {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    r = sub.add_parser("run", help="generate tokens from a prompt", epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(r)
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("synth", help="write a synthetic checkpoint in the exact release format")
    add_synth_args(s)
    s.set_defaults(fn=cmd_synth)
    pr = sub.add_parser("presets", help="print the memory presets (trunk / expert-cache GB)")
    pr.set_defaults(fn=cmd_presets)
    from . import chat, doctor
    from .memory import cache_sim, trunk
    trunk.register(sub)
    chat.register(sub)
    doctor.register(sub)
    cache_sim.register(sub)
    d = sub.add_parser("demo", help="generate a small synthetic checkpoint once and run on it")
    d.add_argument("--preset", default="small", help="synthetic preset (default small)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--prompt", default="The capital of France is")
    d.add_argument("--gen", type=int, default=16)
    d.add_argument("--incremental", action="store_true")
    d.add_argument("--out")
    d.add_argument("--cache-dir", help="where the synthetic checkpoint is kept (default ~/.cache/k3)")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its message; usage errors are exit 2
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if not getattr(args, "fn", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.fn(args)
    except K3Error as e:
        err(f"k3: {e}")
        if e.exit_code == EXIT_READ:
            err("RUN INVALID: a weight read failed, so no token from the failed step was produced; "
                "nothing was written for it (no --out result).")
        return e.exit_code
    except KeyboardInterrupt:
        err("k3: interrupted.")
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
