"""Argument groups several commands share, and what they turn into: memory budgets
(:class:`k3.memory.planner.Budgets`), sampling settings, output-path checks.

Nothing here imports torch: `k3 --help` builds every parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UsageError


def err(msg: str = "") -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- memory budgets
class _BudgetEvent(argparse.Action):
    """--preset / --trunk-gb / --cache-gb are applied in command-line order."""

    def __call__(self, parser, ns, value, option_string=None):
        ns.budget_events = list(getattr(ns, "budget_events", None) or []) + [(self.dest, value)]


def add_budget_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory (later flags override earlier ones)")
    g.add_argument("--preset", dest="preset", action=_BudgetEvent, metavar="NAME",
                   help="laptop | desktop | workstation | server | max | ultra | auto (default auto: the plan "
                        "that fits and reads the fewest bytes per token)")
    g.add_argument("--trunk-gb", dest="trunk_gb", action=_BudgetEvent, metavar="X|auto",
                   help="budget for pinned trunk layers + the ring (with --trunk)")
    g.add_argument("--cache-gb", dest="cache_gb", action=_BudgetEvent, metavar="X",
                   help="routed-expert cache arena")
    g.add_argument("--trunk", metavar="DIR", help="packed trunk (k3 pack-trunk): stream the trunk within --trunk-gb")
    g.add_argument("--trunk-ring", type=int, default=2, metavar="N", help="ring slots for streamed layers (default 2)")
    g.add_argument("--ultra-low-memory", action="store_true",
                   help="stream the embedding and lm_head too (bit-identical, slower)")
    g.add_argument("--io-threads", type=int, default=4, metavar="N", help="parallel reads (default 4)")
    g.add_argument("--stage-budget", type=float, metavar="GB",
                   help="memory this process may plan in (default: what is available); under torchrun, each rank's "
                        "own budget: the layers are shared out by it (docs/SCALING.md)")
    g = p.add_argument_group("pipeline over several processes (under torchrun; docs/SCALING.md)")
    g.add_argument("--pipeline-timeout", type=float, default=None, metavar="S",
                   help="seconds a rank waits for another before it stops the run (exit 5; default 600): more than "
                        "the longest stage of one forward pass")
    p.set_defaults(budget_events=[])


def budgets_from_args(args):
    """The Budgets the flags ask for. A preset replaces the trunk/cache budgets given
    before it; --trunk-gb / --cache-gb after it override its values."""
    from ..memory.planner import Budgets

    b = Budgets(trunk=args.trunk, trunk_ring=args.trunk_ring, ultra_low_memory=args.ultra_low_memory,
                io_threads=args.io_threads, stage_gb=args.stage_budget)
    for kind, value in args.budget_events or []:
        if kind == "preset":
            b.preset, b.trunk_gb, b.cache_gb = value, None, None
        elif kind == "trunk_gb":
            b.trunk_gb = value
        else:
            b.cache_gb = value
    b.check()
    return b


def load_options(args, budgets, **run):
    """The k3.loader.LoadOptions a command opens its model with: ``budgets``, the model
    flags every command takes (--layers, --config, --model-dirs, --allow-zero-weights,
    --pipeline-timeout), and ``run``, the command's own (its context, batch, speculation,
    KV form, prefill piece)."""
    from ..loader import LoadOptions
    return LoadOptions(budgets=budgets, layers=args.layers, config=args.config, model_dirs=args.model_dirs,
                       allow_zero_weights=args.allow_zero_weights, pipeline_timeout=args.pipeline_timeout, **run)


# ---------------------------------------------------------------- sampling
def add_sampling_args(parser) -> None:
    """--temperature, --top-p, --top-k, --seed, --greedy."""
    g = parser.add_argument_group(
        "sampling", "defaults from the model's generation_config.json when it samples (K3: temperature 1.0, "
                    "top-p 0.95); greedy when there is none")
    g.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="softmax temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus: keep the smallest set of "
                   "most likely tokens whose probability reaches P (1 = off)")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="keep only the K most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed so the run "
                   "can be repeated); a seeded run gives the same tokens at every memory budget and thread count")
    g.add_argument("--greedy", action="store_true", help="greedy decoding (argmax), whatever the defaults say")


def sampling_from_args(args, model_dir):
    """The sampling settings the flags ask for (None = greedy)."""
    from ..sampling import resolve

    return resolve(model_dir, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                   greedy=args.greedy)


# ---------------------------------------------------------------- model selection
def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config.json to use instead of MODEL/config.json")
    p.add_argument("--layers", type=int, help="run only the first N layers (NOT the full model; for testing)")
    p.add_argument("--threads", type=int, help="compute threads (default: all available cores)")
    p.add_argument("--kv", choices=("latent", "expanded"), default="latent",
                   help="MLA KV cache form: latent (default; 576 floats a position and MLA layer for K3) or expanded "
                        "(every head's keys and values, 53x more memory)")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens one forward pass reads (a multiple of 32; default: the plan's, the longest "
                        "prompt in the fewest passes that fit, see docs/TUNING.md)")
    p.add_argument("--model-dirs", nargs="+", metavar="DIR", default=[],
                   help="more folders holding the checkpoint's shards (one per drive); the index in MODEL names "
                        "them, each is looked for in MODEL, then in these in order; each drive gets its own readers")
    p.add_argument("--allow-zero-weights", action="store_true",
                   help="run even when weights read as zeros (an unfinished download; refused by default, exit 3)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print the whole memory plan, the load messages and (k3 run) a per-step table")


def check_model_dir(model) -> None:
    if model is None:
        raise UsageError("give the model folder as the first argument.")
    if not Path(model).is_dir():
        raise UsageError(f"{model}: not a folder. Give the model folder (config.json + shards) as the first argument.")


def check_output_path(path, flag: str) -> None:
    """Refuse, before any work, an output path that cannot be written: its folder does
    not exist, or it is a folder itself."""
    if path is None:
        return
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UsageError(f"{flag} {path}: that is a folder; give a file name.")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist. Create it or choose another path; "
                         "nothing was run.")


def check_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode; UsageError otherwise. Bytes that are not UTF-8
    (in argv, or typed at a terminal in another encoding) arrive as lone surrogates,
    which can be neither tokenized faithfully nor written to a history file."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what} is not valid UTF-8 text (byte {text[e.start:e.end].encode('utf-8', 'surrogateescape')!r} "
                         f"at character {e.start}); nothing was run. Re-type it in UTF-8, or give --prompt-file.") from None
    return text


# ---------------------------------------------------------------- speculative decoding
def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (exact: the same tokens as without it)")
    g.add_argument("--spec", type=int, default=0, metavar="N",
                   help="draft up to N (1..8) tokens per pass from the text's own n-grams and verify them in one "
                        "pass over the weights")
    g.add_argument("--spec-corpus", metavar="FILE",
                   help="also draft from this document (UTF-8 text, or token ids in a file named *.ids): useful "
                        "when the answer repeats it")


def spec_corpus_from_args(args, tokenizer):
    if args.spec_corpus is None:
        return None
    if not args.spec:
        raise UsageError("--spec-corpus is a source of drafts for --spec N: add --spec.")
    from ..spec import read_corpus
    return read_corpus(args.spec_corpus, tokenizer)


def spec_summary(steps, n: int) -> dict:
    """The run's speculative-decoding figures, for the summary line and --out JSON."""
    passes = len({s.pass_index for s in steps}) or 1
    drafted = sum(s.drafted for s in steps)
    accepted = sum(s.accepted for s in steps)
    with_drafts = sum(1 for s in steps if s.drafted)
    return {"n": n, "passes": passes, "drafted": drafted, "accepted": accepted,
            "withheld": sum(s.withheld for s in steps),
            "acceptance": accepted / drafted if drafted else 0.0,
            "mean_accepted_run": accepted / with_drafts if with_drafts else 0.0,
            "tokens_per_pass": len(steps) / passes,
            "bytes_per_token": sum(s.bytes_read for s in steps) / len(steps) if steps else 0.0}


# ---------------------------------------------------------------- kernels compiling
class CompileReport:
    """What a command shows while k3's kernels compile (a first run after an install or
    an upgrade, k3.warmup): the notice at once, then a bar that ticks on a terminal, or
    one line per stage otherwise. ``notice`` and ``progress`` go to k3.load; ``close``
    after it returns or fails."""

    def __init__(self, stream=None):
        import threading
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = None
        self.done, self.total, self.label = 0, 0, ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = None

    def notice(self, msg: str = "") -> None:
        with self._lock:
            self._clear()
            print(msg, file=self.stream, flush=True)
        if msg.startswith("compiling k3's kernels") and self.t0 is None:
            import threading
            import time
            self.t0 = time.perf_counter()
            if self.tty:
                self._ticker = threading.Thread(target=self._tick, daemon=True)
                self._ticker.start()

    def progress(self, done: int, total: int, label: str, seconds: float) -> None:
        import time
        self.done, self.total, self.label = done, total, label
        if self.tty:
            with self._lock:
                self._draw()
        elif done:
            el = time.perf_counter() - (self.t0 or time.perf_counter())
            print(f"  compiled {label} ({done}/{total} stages, {el:.0f} s)", file=self.stream, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            self._clear()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        import time
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        el = time.perf_counter() - (self.t0 or time.perf_counter())
        last = f", last: {self.label}" if self.label else ""
        self.stream.write(f"\r  compiling [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total or '?'} stages "
                          f"{el:.0f} s{last} ")
        self.stream.flush()
        self._shown = True

    def _clear(self) -> None:
        if getattr(self, "_shown", False):
            self.stream.write("\r" + " " * 96 + "\r")
            self.stream.flush()
            self._shown = False


# ---------------------------------------------------------------- the prompt cache (k3.prompt_cache)
DEFAULT_PROMPT_CACHE_GB = 20.0


def add_prompt_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt cache")
    g.add_argument("--prompt-cache", metavar="DIR",
                   help="keep snapshots of prefills in DIR (created if needed) and continue each prompt from the "
                        "longest one of its prefix, whichever run wrote it: the same tokens and logits as reading "
                        "it whole (docs/TUNING.md, \"Prompt cache\")")
    g.add_argument("--prompt-cache-gb", type=float, default=DEFAULT_PROMPT_CACHE_GB, metavar="X",
                   help=f"the most the snapshots in DIR take on disk (default {DEFAULT_PROMPT_CACHE_GB:g}; the "
                        "least recently used go first)")


def check_prompt_cache_args(args) -> None:
    """Refuse, before loading, a --prompt-cache that is a file or a budget that is not
    positive (a folder that cannot be written is a warning later: the run goes on)."""
    folder = getattr(args, "prompt_cache", None)
    if folder is None:
        return
    if getattr(args, "load_state", None) or not getattr(args, "incremental", True) or getattr(args, "batch", None):
        raise UsageError("--prompt-cache continues new prompts, read incrementally, from its snapshots: it does not "
                         "go with --load-state (a state file carries its own state), --full-recompute or --batch.")
    if Path(folder).exists() and not Path(folder).is_dir():
        raise UsageError(f"--prompt-cache {folder}: that is a file; give a folder (it is created if needed).")
    if not args.prompt_cache_gb > 0:
        raise UsageError(f"--prompt-cache-gb must be > 0, got {args.prompt_cache_gb}.")


def open_prompt_cache(eng, args, memory_entries: int = 0, memory_bytes: int = 0):
    """The engine's prompt cache from the flags (None without --prompt-cache and a
    memory tier); its warnings go to stderr."""
    folder = getattr(args, "prompt_cache", None)
    if folder is None and memory_entries <= 0:
        return None
    return eng.open_prompt_cache(folder, max_bytes=int(args.prompt_cache_gb * 1e9), memory_entries=memory_entries,
                                 memory_bytes=memory_bytes, warn=lambda msg: err(f"k3: {msg}"))
