"""`k3 chat MODEL`: an interactive conversation with retained state.

Each turn feeds only the new tokens (the previous answer's last token, the tokens
that close it, the new user message and the generation prompt) through the model on
top of the carried KDA/conv state and MLA KV cache. The conversation is kept as the
exact token sequence fed so far (`ChatSession.seq`), so the state after any turn is
the state a re-prefill of that sequence would give, and so is every answer.

Ctrl-C during an answer stops it and keeps the session usable. It takes effect at the
next layer boundary (never inside an expert or trunk read; a second Ctrl-C stops at
once); the forward pass it cuts short is undone (the state goes back to a snapshot
taken before it), the partial answer is kept and closed with the format's closing
tags. Ctrl-C while the new message is being read drops that message.

The model is opened through k3.runner (presets, --trunk, --cache-gb, ...), and the
memory plan includes a KV cache for --max-context positions.

The conversation's messages are kept in a JSONL history file (one message object a
line), rewritten atomically after every turn; pointing --history at an existing file
continues that conversation.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence

from .errors import EXIT_OK, K3Error, UsageError
from .fsutil import atomic_write_bytes

DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_CONTEXT = 8192

HELP = """commands:
  /help             this list
  /reset            start a new conversation (the system prompt is kept)
  /save FILE        write the conversation (JSONL, one message a line) to FILE
  /save-state FILE  write the model state (continue later with --load-state FILE)
  /think on|off     show or hide the think channel
  /exit             leave (also /quit or Ctrl-D)
A line ending in \\ continues on the next line; start a message with // to send a
line that begins with /. Ctrl-C stops an answer; the conversation goes on."""


# ====================================================================== session
@dataclass
class TurnResult:
    tokens: list[int] = field(default_factory=list)  # sampled, including a stop token
    stop: str = ""  # end | max_tokens | context | interrupted | dropped
    content: str = ""
    reasoning: str = ""
    new_tokens: int = 0  # tokens fed before the first answer token
    prompt_len: int = 0  # the transcript before the answer is session.seq[:prompt_len]
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    reprefilled: bool = False


class ChatSession:
    """A conversation over a Model with carried state. `send(text)` runs one turn."""

    def __init__(self, model, tok, fmt, *, system: str | None = None, sampling=None,
                 max_context: int = DEFAULT_MAX_CONTEXT, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.model, self.tok, self.fmt = model, tok, fmt
        self.system = system
        self.sampling = sampling  # SamplingSettings or None (greedy)
        self.max_context = int(max_context)
        self.max_tokens = int(max_tokens)
        if self.max_context < 2:
            raise UsageError(f"--max-context must be >= 2, got {max_context}.")
        if self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}.")
        self.reset()

    # ------------------------------------------------------------ state
    def reset(self) -> None:
        self.state = self.model.new_state()
        self.seq: list[int] = []  # every token of the conversation, fed or pending
        self.messages: list[dict] = []
        self.turn = 0

    @property
    def pending(self) -> list[int]:
        return self.seq[len(self.state.ids):]

    def resume_messages(self, messages: Sequence[dict]) -> None:
        """Continue a conversation known only by its messages (a history file): its
        tokens are rendered now and read at the next turn."""
        self.reset()
        self.messages = [dict(m) for m in messages]
        if self.messages:
            self.seq = self.fmt.prompt_ids(self.messages, add_generation_prompt=False)
            self.turn = sum(1 for m in self.messages if m.get("role") == "assistant")
        self._check_context(0)

    def resume_state(self, loaded) -> None:
        """Continue from a state file (k3.state.LoadedState)."""
        self.reset()
        self.state = loaded.state
        self.seq = loaded.tokens
        self.messages = [dict(m) for m in loaded.extra.get("messages", [])]
        self.turn = int(loaded.extra.get("turn", sum(1 for m in self.messages if m.get("role") == "assistant")))

    def state_extra(self) -> dict:
        return {"messages": self.messages, "turn": self.turn, "format": self.fmt.name,
                "thinking": getattr(self.fmt, "thinking", None)}

    def save_state(self, path) -> int:
        from .state import save_state
        return save_state(path, self.state, self.model.cfg, pending=self.pending, extra=self.state_extra())

    def _check_context(self, extra: int) -> None:
        if len(self.seq) + extra > self.max_context:
            raise UsageError(
                f"the conversation would hold {len(self.seq) + extra} tokens and the context limit is "
                f"{self.max_context} (--max-context). /reset to start over, or raise --max-context "
                "(the KV cache grows with every position).")

    def _sampler(self):
        if self.sampling is None:
            from .engine import greedy
            return greedy
        return self.sampling.sampler(stream=self.turn)

    # ------------------------------------------------------------ one turn
    def send(self, text: str, on_text: Callable[[str, str], None] | None = None,
             on_prefill_done: Callable[[], None] | None = None) -> TurnResult:
        from .state import restore, snapshot

        new = []
        if not self.messages and self.system:
            new.append({"role": "system", "content": self.system})
        new.append({"role": "user", "content": text})
        res = TurnResult()
        delta = self.fmt.turn_ids(self.messages, new)
        turn_start = len(self.seq)
        saved = None
        if delta is None:  # the template cannot extend the transcript: re-read it all
            saved = (self.state, self.seq)
            self.state = self.model.new_state()
            self.seq = self.fmt.prompt_ids(self.messages + new, add_generation_prompt=True)
            turn_start = 0
            res.reprefilled = True
        else:
            self.seq = self.seq + delta
        try:
            self._check_context(1)
        except UsageError:
            if saved is not None:
                self.state, self.seq = saved
            else:
                del self.seq[turn_start:]
            raise
        res.new_tokens = len(self.pending)
        ans0 = res.prompt_len = len(self.seq)  # the answer's tokens are self.seq[ans0:]
        sampler = self._sampler()
        live = self.fmt.parser()  # for display only; the answer is re-parsed from seq at the end
        emit = on_text or (lambda ch, s: None)
        snap0 = snap = snapshot(self.state)
        t0 = time.perf_counter()
        t_first = None
        in_forward = False
        with _InterruptAtLayerBoundary(self.model) as intr:
            try:
                while True:
                    snap = snapshot(self.state)
                    in_forward = True
                    logits = self.model.forward(self.pending, self.state)
                    in_forward = False
                    if t_first is None:
                        t_first = time.perf_counter()
                        res.prefill_seconds = t_first - t0
                        if on_prefill_done is not None:
                            on_prefill_done()
                    tok = int(sampler(logits.reshape(-1)))
                    self.seq.append(tok)
                    if tok in self.fmt.stop_ids:
                        res.stop = "end"
                        break
                    for ch, s in live.feed(tok):
                        emit(ch, s)
                    if len(self.seq) - ans0 >= self.max_tokens:
                        res.stop = "max_tokens"
                        break
                    if len(self.seq) >= self.max_context:
                        res.stop = "context"
                        break
                    intr.check()
            except KeyboardInterrupt:
                # A forward pass cut short (at a layer boundary, or anywhere on a second
                # Ctrl-C) is undone: back to the snapshot taken before it, whose ids are
                # a prefix of seq; whatever that pass was feeding is pending again.
                if in_forward:
                    restore(self.state, snap)
                res.stop = "interrupted"
                if len(self.seq) == ans0:  # stopped while reading the new message: drop it
                    restore(self.state, snap0)
                    if saved is not None:
                        self.state, self.seq = saved
                    else:
                        del self.seq[turn_start:]
                    res.stop = "dropped"
                    return res
        res.decode_seconds = time.perf_counter() - (t_first or t0)
        for ch, s in live.flush():
            emit(ch, s)
        # Close the answer: a stop token (never fed) is replaced by the format's
        # canonical closing; for a complete answer that is the same end token.
        res.tokens = self.seq[ans0:]
        answer_ids = list(res.tokens)
        if answer_ids and answer_ids[-1] in self.fmt.stop_ids and len(self.seq) > len(self.state.ids):
            self.seq.pop()
            answer_ids.pop()
        parser = self.fmt.parser()
        for t in answer_ids:
            parser.feed(t)
        parser.flush()
        self.seq += self.fmt.closing_ids(parser)
        res.content, res.reasoning = parser.content, parser.reasoning
        answer = {"role": "assistant", "content": res.content}
        if res.reasoning:
            answer["reasoning_content"] = res.reasoning
        if res.stop != "end":
            answer["stopped"] = res.stop
        self.messages += new + [answer]
        self.turn += 1
        return res


class _InterruptAtLayerBoundary:
    """During a turn, Ctrl-C sets a flag instead of raising wherever the interpreter
    happens to be (inside an expert read, a trunk prefetch...): the model raises
    KeyboardInterrupt at the next layer boundary (through `model.on_layer`), the loop
    between tokens. A second Ctrl-C raises at once. Only in the main thread (signal
    handlers live there); elsewhere Ctrl-C keeps its default behaviour."""

    def __init__(self, model):
        self.model = model
        self.count = 0
        self.active = threading.current_thread() is threading.main_thread()

    def _on_sigint(self, signum, frame):
        self.count += 1
        if self.count >= 2:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.count:
            raise KeyboardInterrupt

    def __enter__(self):
        if not self.active:
            return self
        self.prev_hook = self.model.on_layer
        prev = self.prev_hook

        def hook(i):
            if prev is not None:
                prev(i)
            self.check()

        self.model.on_layer = hook
        self.prev_handler = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc):
        if self.active:
            signal.signal(signal.SIGINT, self.prev_handler)
            self.model.on_layer = self.prev_hook
        return False


# ====================================================================== history files
def read_history(path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    msgs = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read the history file ({e}).") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"{path}: line {n} is not JSON; a history file holds one message object a line.") from None
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise UsageError(f"{path}: line {n} is not a message (an object with role system/user/assistant/tool).")
        msgs.append(m)
    return msgs


def write_jsonl_atomic(path, messages: Sequence[dict]) -> None:
    data = "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in messages).encode("utf-8")
    atomic_write_bytes(path, data, what="the conversation")


def default_history_path() -> Path:
    base = Path(os.environ.get("K3_CACHE", Path.home() / ".cache" / "k3")) / "chats"
    return base / f"chat-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"


# ====================================================================== the REPL
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


def repl(session: ChatSession, console: Console, history_path: Path | None, state_path: str | None) -> int:
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
            text = _read_message()
        except KeyboardInterrupt:
            err.write("\n(Ctrl-C: type /exit or press Ctrl-D to leave)\n")
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
                    err.write(HELP + "\n")
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
def add_chat_args(p) -> None:
    from .sampling import add_sampling_args

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
    p.add_argument("--config", help="config.json to use instead of MODEL/config.json")
    p.add_argument("--layers", type=int, help="run only the first N layers (NOT the full model; for testing)")
    p.add_argument("--threads", type=int, help="compute threads (default: all available cores)")
    add_sampling_args(p)
    from .runner import add_budget_args
    add_budget_args(p)


def _open_model(args, cfg):
    """The budgeted model (presets, --trunk, ...) with the memory plan checked for
    a KV cache of --max-context positions before anything large is allocated."""
    from .runner import open_session

    args.incremental = True  # the chat always carries state
    try:
        sess = open_session(args, cfg, args.model, args.max_context,
                            log=lambda m="": print(m, file=sys.stderr, flush=True))
    except K3Error as e:
        if "REFUSING" in str(e):
            raise K3Error(f"{e} For a chat, a smaller --max-context also helps: the plan holds the KV cache for "
                          f"all {args.max_context} positions.", e.exit_code) from None
        raise
    return sess.model


def cmd_chat(args) -> int:
    from .chat_format import chat_format_for
    from .config import load_config
    from .sampling import settings_from_args
    from .runner import set_threads
    from .tokenizer import Tokenizer

    err = sys.stderr
    if not Path(args.model).is_dir():
        raise UsageError(f"{args.model}: not a folder. Give the model folder (config.json + shards) as the first argument.")
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
    threads = set_threads(args.threads)
    cfg = load_config(args.config or args.model)
    tok = Tokenizer(args.model)
    fmt = chat_format_for(tok, cfg, thinking=not args.no_think, thinking_effort=args.thinking_effort,
                          kind=args.format)
    sampling = settings_from_args(args, args.model)
    history_path = None if args.no_history else Path(args.history) if args.history else default_history_path()
    if history_path is not None and not history_path.parent.is_dir():
        if args.history:
            raise UsageError(f"{args.history}: the folder {history_path.parent} does not exist.")
        history_path.parent.mkdir(parents=True, exist_ok=True)
    loaded = None
    if args.load_state:
        from .state import load_state
        loaded = load_state(args.load_state, cfg, max_positions=args.max_context, n_layers=args.layers)

    err.write(cfg.summary() + "\n")
    if args.layers is not None:
        err.write(f"WARNING: --layers {args.layers}: only the first {args.layers} of {cfg.num_hidden_layers} layers "
                  "run. Output is NOT the full model.\n")
    if args.layers is not None and not 1 <= args.layers <= cfg.num_hidden_layers:
        raise UsageError(f"--layers must be in 1..{cfg.num_hidden_layers} for this model, got {args.layers}.")
    if args.trunk_ring < 1 or args.io_threads < 1:
        raise UsageError("--trunk-ring and --io-threads must be >= 1.")
    t0 = time.perf_counter()
    model = _open_model(args, cfg)
    err.write(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s, {threads} threads\n")
    session = ChatSession(model, tok, fmt, system=system, sampling=sampling, max_context=args.max_context,
                          max_tokens=args.max_tokens)
    if loaded is not None:
        session.resume_state(loaded)
        err.write(f"resuming from {args.load_state}: {len(loaded.state.ids)} positions in the state, "
                  f"{len(loaded.pending)} pending, {len(session.messages)} messages\n")
    elif history_path is not None and history_path.is_file():
        msgs = read_history(history_path)
        if msgs:
            session.resume_messages(msgs)
            err.write(f"continuing {history_path}: {len(msgs)} messages, {len(session.seq)} tokens to read at the "
                      "first turn\n")
    if session.messages and system and session.messages[0].get("role") == "system" \
            and session.messages[0].get("content") != system:
        err.write("note: the conversation already has a system prompt; --system applies to /reset\n")
    think = "off" if args.no_think else f"on (effort {args.thinking_effort}" + (", hidden)" if args.hide_think else ")")
    err.write(f"chat format: {fmt.name}; thinking {think if fmt.name == 'k3-xtml' else 'by template'}; "
              f"{sampling.describe() if sampling else 'greedy decoding'}\n")
    try:
        from .memory.planner import kv_bytes_per_position
        kvp = kv_bytes_per_position(cfg, args.layers)
        err.write(f"context: up to {args.max_context} tokens (KV cache {kvp / 1e6:.2f} MB/position, "
                  f"{kvp * args.max_context / 1e9:.2f} GB when full); up to {args.max_tokens} tokens per answer\n")
    except ImportError:  # pragma: no cover
        pass
    err.write(f"history: {history_path if history_path else 'off'}\n")
    err.write("type a message; /help for commands, /exit or Ctrl-D to leave\n")
    err.flush()
    console = Console(show_think=not args.hide_think)
    return repl(session, console, history_path, args.save_state)


def register(subparsers):
    """Add `chat` to an argparse subparsers object (with the memory flags of
    k3.runner: --preset, --trunk-gb, --cache-gb, --trunk, ...)."""
    import argparse

    p = subparsers.add_parser(
        "chat", help="talk to the model (interactive, streaming, state kept between turns)",
        description="Interactive chat. Each turn reads only the new tokens on top of the carried KDA/KV state.",
        epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_chat_args(p)
    p.set_defaults(fn=cmd_chat)
    return p


def main(argv=None) -> int:
    """`python -m k3.chat ...` is `k3 chat ...`."""
    from .cli import main as k3_main

    return k3_main(["chat", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
