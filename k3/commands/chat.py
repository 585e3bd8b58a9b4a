"""`k3 chat MODEL`: an interactive conversation with retained state (the REPL over
k3.chat.ChatSession, which runs on the engine's decode loop).

Each turn reads only the new tokens on top of the carried KDA/KV state. The memory
plan holds a KV cache for --max-context positions. The conversation's messages are
kept in a JSONL history file (one message object a line), rewritten atomically after
every turn; pointing --history at an existing file continues that conversation.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import interrupt
from ..errors import EXIT_OK, K3Error, UsageError
from .common import (CompileReport, add_budget_args, add_model_args, add_prompt_cache_args, add_sampling_args,
                     add_spec_args, budgets_from_args, check_model_dir, check_output_path, check_prompt_cache_args,
                     check_text, open_prompt_cache, sampling_from_args, spec_corpus_from_args, load_options)

HELP = "talk to the model (interactive, streaming, state kept between turns)"
DESCRIPTION = "Interactive chat. Each turn reads only the new tokens on top of the carried KDA/KV state."
DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_CONTEXT = 8192

COMMANDS_HELP = """commands:
  /help             this list
  /reset            start a new conversation (the system prompt is kept)
  /save FILE        write the conversation (JSONL, one message a line) to FILE
  /save-state FILE  write the model state (continue later with --load-state FILE)
  /think on|off     show or hide the think channel
  /exit             leave (also /quit or Ctrl-D)
A line ending in \\ continues on the next line; start a message with // to send a
line that begins with /. Ctrl-C stops an answer; the conversation goes on."""
EPILOG = COMMANDS_HELP


class Console:
    """Streams an answer: the think channel dimmed (or hidden), then the response."""

    def __init__(self, out=None, err=None, show_think: bool = True):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.show_think = show_think
        self.tty = self.out.isatty()
        self.channel = None
        self.hidden_notice = False

    def _style(self, code: str) -> str:
        return code if self.tty else ""

    def start(self) -> None:
        self.channel = None
        self.hidden_notice = False

    def text(self, channel: str, s: str) -> None:
        if channel == "think" and not self.show_think:
            if not self.hidden_notice:
                self.out.write(self._style("\x1b[2m") + "(thinking...)" + self._style("\x1b[0m") + "\n")
                self.hidden_notice = True
            self.out.flush()
            return
        if channel != self.channel:
            if self.channel == "think":
                self.out.write(self._style("\x1b[0m") + "\n")
            if channel == "think":
                self.out.write(self._style("\x1b[2m") + "[think] ")
            elif channel == "tools":
                self.out.write("[tools] ")
            self.channel = channel
        self.out.write(s)
        self.out.flush()

    def end(self) -> None:
        if self.channel == "think":
            self.out.write(self._style("\x1b[0m"))
        self.out.write("\n")
        self.out.flush()
        self.channel = None


def _read_message(prompt: str = ">>> ") -> str | None:
    """One message from stdin (None at end of input); `\\` at a line end continues."""
    lines = []
    p = prompt
    while True:
        try:
            line = input(p)
        except EOFError:
            return None if not lines else "\n".join(lines)
        if line.endswith("\\"):
            lines.append(line[:-1])
            p = "... "
            continue
        lines.append(line)
        return "\n".join(lines)


def repl(session, console: Console, history_path: Path | None, state_path: str | None) -> int:
    from ..chat import write_jsonl_atomic

    err = console.err
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and recall for input())
        except ImportError:  # pragma: no cover
            pass

    def save_history():
        if history_path is not None:
            write_jsonl_atomic(history_path, session.messages)

    while True:
        try:
            with interrupt.raising():  # reading a line is pure Python: Ctrl-C / SIGTERM raise at once here
                text = _read_message()
            if text is not None:
                check_text(text, "that message")
        except KeyboardInterrupt:
            interrupt.clear()  # spent here: a Ctrl-C left recorded would be raised again at every prompt
            err.write("\n(Ctrl-C: type /exit or press Ctrl-D to leave)\n")
            err.flush()
            continue
        except (UnicodeDecodeError, UsageError) as e:  # bytes that are not UTF-8: say so, keep the session
            what = e if isinstance(e, UsageError) else "that message is not valid UTF-8 text; nothing was sent"
            err.write(f"k3: {what}\n")
            err.flush()
            continue
        if text is None:
            err.write("\n")
            break
        stripped = text.strip()
        if not stripped:
            continue
        if stripped.startswith("/") and not stripped.startswith("//"):
            cmd, _, arg = stripped.partition(" ")
            arg = arg.strip()
            try:
                if cmd in ("/exit", "/quit"):
                    break
                elif cmd == "/help":
                    err.write(COMMANDS_HELP + "\n")
                elif cmd == "/reset":
                    session.reset()
                    err.write("(new conversation)\n")
                    save_history()
                elif cmd == "/save":
                    if not arg:
                        raise UsageError("/save needs a file name: /save FILE")
                    write_jsonl_atomic(arg, session.messages)
                    err.write(f"(wrote {len(session.messages)} messages to {arg})\n")
                elif cmd == "/save-state":
                    if not arg:
                        raise UsageError("/save-state needs a file name: /save-state FILE")
                    n = session.save_state(arg)
                    err.write(f"(wrote the state, {len(session.seq)} tokens, {n / 1e6:.1f} MB, to {arg})\n")
                elif cmd == "/think":
                    if arg not in ("on", "off"):
                        raise UsageError("/think on or /think off")
                    console.show_think = arg == "on"
                    err.write(f"(think channel {'shown' if console.show_think else 'hidden'})\n")
                else:
                    err.write(f"unknown command {cmd}; /help lists them\n")
            except K3Error as e:
                err.write(f"k3: {e}\n")
            err.flush()
            continue
        if stripped.startswith("//"):
            text = text.lstrip()[1:]
        console.start()
        try:
            res = session.send(text, on_text=console.text)
        except K3Error as e:
            console.end()
            err.write(f"k3: {e}\n")
            err.flush()
            continue
        console.end()
        if res.stop == "dropped":
            err.write("(interrupted before the answer began; that message was dropped)\n")
        else:
            note = {"end": "", "max_tokens": " - stopped at --max-tokens", "context": " - context limit reached",
                    "interrupted": " - interrupted"}[res.stop]
            n = len(res.tokens)
            rate = n / res.decode_seconds if res.decode_seconds > 0 else 0.0
            err.write(f"[{n} tokens, {rate:.2f} tok/s; read {res.new_tokens} new tokens in "
                      f"{res.prefill_seconds:.2f} s; {len(session.seq)}/{session.max_context} context{note}]\n")
            if res.reprefilled:
                err.write("(the chat template could not extend the transcript, so the whole conversation was re-read)\n")
        err.flush()
        try:
            save_history()
        except K3Error as e:
            err.write(f"k3: {e}\n")
    if state_path:
        n = session.save_state(state_path)
        err.write(f"wrote the state ({len(session.seq)} tokens, {n / 1e6:.1f} MB) to {state_path}\n")
    return EXIT_OK


# ====================================================================== command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder (config.json, shards, tiktoken.model, tokenizer_config.json)")
    p.add_argument("--system", help="system prompt for the conversation")
    p.add_argument("--system-file", help="read the system prompt from this UTF-8 file")
    p.add_argument("--no-think", action="store_true", help="thinking off: the answer opens the response channel")
    p.add_argument("--thinking-effort", choices=("low", "medium", "high", "max"), default="max",
                   help="K3 thinking effort message (default max)")
    p.add_argument("--hide-think", action="store_true", help="do not print the think channel (it is still generated)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"most tokens per answer (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT,
                   help=f"most tokens in the conversation, i.e. the KV capacity (default {DEFAULT_MAX_CONTEXT})")
    p.add_argument("--history", help="JSONL conversation file, rewritten after every turn; an existing one is "
                   "continued (default: a new file under ~/.cache/k3/chats)")
    p.add_argument("--no-history", action="store_true", help="keep no history file")
    p.add_argument("--save-state", metavar="PATH", help="write the model state here on exit")
    p.add_argument("--load-state", metavar="PATH", help="continue the conversation saved in this state file")
    p.add_argument("--format", choices=("auto", "xtml", "jinja"), default="auto",
                   help="chat format: K3 XTML or the folder's Jinja chat_template (default: by model)")
    add_prompt_cache_args(p)
    add_model_args(p)
    add_spec_args(p)
    add_sampling_args(p)
    add_budget_args(p)


def run(args) -> int:
    from ..chat import ChatSession, default_history_path, read_history
    from ..chat_format import chat_format_for
    from ..config import check_layers, load_config
    from ..decode import set_threads
    from ..loader import load
    from ..memory.planner import kv_bytes_per_position
    from ..units import human
    from ..tokenizer import Tokenizer

    err = sys.stderr
    check_model_dir(args.model)
    if args.system is not None and args.system_file is not None:
        raise UsageError("give --system or --system-file, not both.")
    system = args.system
    if args.system_file is not None:
        try:
            system = Path(args.system_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{args.system_file}: cannot read the system prompt ({e}).") from None
    if not 1 <= args.max_tokens <= 1_000_000:
        raise UsageError(f"--max-tokens must be in 1..1000000, got {args.max_tokens}.")
    if args.max_context < 2:
        raise UsageError(f"--max-context must be >= 2, got {args.max_context}.")
    check_output_path(args.save_state, "--save-state")
    check_prompt_cache_args(args)
    budgets = budgets_from_args(args)
    threads = set_threads(args.threads)
    cfg = load_config(args.config or args.model)
    tok = Tokenizer(args.model)
    fmt = chat_format_for(tok, cfg, thinking=not args.no_think, thinking_effort=args.thinking_effort,
                          kind=args.format)
    sampling = sampling_from_args(args, args.model)
    history_path = None if args.no_history else Path(args.history) if args.history else default_history_path()
    if history_path is not None and not history_path.parent.is_dir():
        if args.history:
            raise UsageError(f"--history {args.history}: the folder {history_path.parent} does not exist.")
        history_path.parent.mkdir(parents=True, exist_ok=True)
    check_layers(cfg, args.layers)
    loaded = None
    if args.load_state:
        from ..state import load_state
        loaded = load_state(args.load_state, cfg, max_positions=args.max_context, n_layers=args.layers,
                            latent=args.kv == "latent")

    err.write(cfg.summary() + "\n")
    if args.layers is not None:
        err.write(f"WARNING: --layers {args.layers}: only the first {args.layers} of {cfg.num_hidden_layers} layers "
                  "run. Output is NOT the full model.\n")
    t0 = time.perf_counter()
    say = (lambda m="": print(m, file=sys.stderr, flush=True))
    report = CompileReport()
    try:
        opts = load_options(args, budgets, max_context=args.max_context, spec=args.spec, kv=args.kv,
                            prefill_chunk=args.prefill_chunk)
        eng = load(args.model, opts, notice=report.notice, compile_progress=report.progress,
                   log=say if args.verbose else (lambda m="": say(m) if m.startswith(("auto:", "ultra:", "note:", "pipeline:"))
                                                 else None))
    finally:
        report.close()
    if eng.pipeline is not None and eng.pipeline.rank:
        return eng.serve_stage()
    if not args.verbose:
        say(eng.plan.summary())
    try:
        err.write(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s, {threads} threads\n")
        open_prompt_cache(eng, args)
        session = ChatSession(eng, fmt, system=system, sampling=sampling, max_context=args.max_context,
                              max_tokens=args.max_tokens, spec=args.spec, spec_corpus=spec_corpus_from_args(args, tok))
        if loaded is not None:
            session.resume_state(loaded)
            err.write(f"resuming from {args.load_state}: {len(loaded.state.ids)} positions in the state, "
                      f"{len(loaded.pending)} pending, {len(session.messages)} messages\n")
        elif history_path is not None and history_path.is_file():
            msgs = read_history(history_path)
            if msgs:
                session.resume_messages(msgs)
                err.write(f"continuing {history_path}: {len(msgs)} messages, {len(session.seq)} tokens to read at "
                          "the first turn\n")
        if session.messages and system and session.messages[0].get("role") == "system" \
                and session.messages[0].get("content") != system:
            err.write("note: the conversation already has a system prompt; --system applies to /reset\n")
        think = "off" if args.no_think else f"on (effort {args.thinking_effort}" + (", hidden)" if args.hide_think
                                                                                      else ")")
        err.write(f"chat format: {fmt.name}; thinking {think if fmt.name == 'k3-xtml' else 'by template'}; "
                  f"{sampling.describe() if sampling else 'greedy decoding'}\n")
        kvp = kv_bytes_per_position(cfg, args.layers, args.kv == "latent")
        err.write(f"context: up to {args.max_context} tokens (KV cache {kvp / 1e6:.2f} MB/position, "
                  f"{human(kvp * args.max_context)} when full); up to {args.max_tokens} tokens per answer\n")
        err.write(f"history: {history_path if history_path else 'off'}\n")
        err.write("type a message; /help for commands, /exit or Ctrl-D to leave\n")
        err.flush()
        console = Console(show_think=not args.hide_think)
        return repl(session, console, history_path, args.save_state)
    finally:
        eng.close()
