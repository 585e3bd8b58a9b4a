"""A conversation with retained state (the library behind `k3 chat` and Engine.chat).

Each turn feeds only the new tokens (the previous answer's last token, the tokens
that close it, the new user message and the generation prompt) through the model on
top of the carried KDA/conv state and MLA KV cache. The conversation is kept as the
exact token sequence fed so far (`ChatSession.seq`), so the state after any turn is
the state a re-prefill of that sequence would give, and so is every answer.

Ctrl-C during an answer stops it and keeps the session usable. It takes effect at the
next layer boundary (never inside an expert or trunk read; a second Ctrl-C stops at
once); the engine's decode loop undoes the forward pass it cuts short (the state goes
back to a snapshot taken before it), the partial answer is kept and closed with the
format's closing tags. Ctrl-C while the new message is being read drops that message.

The engine's memory plan holds a KV cache for ``max_context`` positions. The
conversation's messages can be kept in a JSONL history file (one message object a
line), rewritten atomically after every turn.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence

from . import env, interrupt
from .errors import UsageError
from .fsutil import JSONProblem, atomic_write, loads_json
from .model.stack import Observer

DEFAULT_MAX_TOKENS = 4096


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
    """A conversation on an Engine with carried state. `send(text)` runs one turn.
    ``observer`` (optional) also watches every forward pass (a progress display)."""

    def __init__(self, engine, fmt, *, system: str | None = None, sampling=None,
                 max_context: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                 observer: Observer | None = None, spec: int = 0, spec_corpus=None):
        self.engine, self.fmt = engine, fmt
        self.tok = engine.tokenizer
        self.system = system
        self.sampling = sampling  # SamplingSettings or None (greedy)
        self.max_context = int(max_context if max_context is not None else engine.max_context)
        self.max_tokens = int(max_tokens)
        self.observer = observer
        self.spec, self.spec_corpus = spec, spec_corpus  # speculative decoding (exact) for every answer
        if self.max_context < 2:
            raise UsageError(f"--max-context must be >= 2, got {max_context}.")
        if self.max_context > engine.max_context:
            raise UsageError(f"max_context {self.max_context} is more than the engine was loaded for "
                             f"({engine.max_context}); its memory plan covers only that many positions.")
        if self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}.")
        self.reset()

    # ------------------------------------------------------------ state
    def reset(self) -> None:
        self.state = self.engine.new_state()
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
        from .state import StateFileError

        msgs, turn = loaded.extra.get("messages", []), loaded.extra.get("turn")
        if not (isinstance(msgs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)):
            raise StateFileError("the state file's `extra.messages` is not a list of message objects (with a role); "
                                 "it was not written by k3 chat, or was edited. Start a new conversation.")
        if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or turn < 0):
            raise StateFileError(f"the state file's `extra.turn` is {turn!r}, not a turn count; it was edited. "
                                 "Start a new conversation.")
        self.reset()
        self.state = loaded.state
        self.seq = loaded.tokens
        self.messages = [dict(m) for m in msgs]
        self.turn = turn if turn is not None else sum(1 for m in self.messages if m.get("role") == "assistant")

    def state_extra(self) -> dict:
        return {"messages": self.messages, "turn": self.turn, "format": self.fmt.name,
                "thinking": getattr(self.fmt, "thinking", None)}

    def save_state(self, path) -> int:
        from .state import save_state
        return save_state(path, self.state, self.engine.cfg, pending=self.pending, extra=self.state_extra())

    def _cached_feed(self) -> list[int]:
        """What this turn reads. With the engine's prompt cache (k3.prompt_cache) the
        whole conversation, from a fresh state the cache fills with the longest snapshot
        of it (the bits of a prefill of the conversation; the last answer, decoded one
        token at a time, is read again), its message ends given as snapshot points;
        else the tokens not yet in the carried state."""
        if self.engine.prompt_cache is None:
            return self.pending
        from .prompt_cache import Prompt
        self.state = self.engine.new_state()
        return Prompt(self.seq, self.fmt.message_ends(self.seq))

    def _check_context(self, extra: int) -> None:
        if len(self.seq) + extra > self.max_context:
            raise UsageError(
                f"the conversation would hold {len(self.seq) + extra} tokens and the context limit is "
                f"{self.max_context} (--max-context). /reset to start over, or raise --max-context "
                "(the KV cache grows with every position).")

    def _sampler(self):
        return None if self.sampling is None else self.sampling.sampler(stream=self.turn)

    # ------------------------------------------------------------ one turn
    def send(self, text: str, on_text: Callable[[str, str], None] | None = None,
             on_prefill_done: Callable[[], None] | None = None) -> TurnResult:
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
            self.state = self.engine.new_state()
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
        feed = self._cached_feed()
        res.new_tokens = len(feed)
        ans0 = res.prompt_len = len(self.seq)  # the answer's tokens are self.seq[ans0:]
        live = self.fmt.parser()  # for display only; the answer is re-parsed from seq at the end
        emit = on_text or (lambda ch, s: None)
        snap0 = self.state.snapshot()
        budget = min(self.max_tokens, self.max_context - len(self.seq))
        with _InterruptAtLayerBoundary(self.observer) as intr:
            try:
                for st in self.engine.decode(feed, state=self.state, max_tokens=budget,
                                             sampler=self._sampler(), stop_ids=self.fmt.stop_ids,
                                             observer=intr, undo_on_interrupt=True, spec=self.spec,
                                             spec_corpus=self.spec_corpus):
                    if st.step == 0:
                        res.prefill_seconds, res.new_tokens = st.seconds, st.fed
                        if on_prefill_done is not None:
                            on_prefill_done()
                    else:
                        res.decode_seconds += st.seconds
                    self.seq.append(st.token)
                    if st.finish == "stop":
                        res.stop = "end"
                        break
                    for ch, s in live.feed(st.token):
                        emit(ch, s)
                    intr.check()
                else:
                    res.stop = "max_tokens" if len(self.seq) - ans0 >= self.max_tokens else "context"
            except KeyboardInterrupt:
                # The loop has undone a forward pass cut short, so the state's ids are a
                # prefix of seq and whatever that pass was feeding is pending again.
                interrupt.clear()  # this Ctrl-C is spent: it stopped the answer
                res.stop = "interrupted"
                if len(self.seq) == ans0:  # stopped while reading the new message: drop it
                    self.state.restore(snap0)
                    if saved is not None:
                        self.state, self.seq = saved
                    else:
                        del self.seq[turn_start:]
                    res.stop = "dropped"
                    return res
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


class _InterruptAtLayerBoundary(Observer):
    """During a turn, Ctrl-C (and SIGTERM) are only recorded (k3.interrupt.deferred), never
    raised wherever the interpreter happens to be (inside a compiled kernel, an expert
    read, a trunk prefetch...): KeyboardInterrupt is raised at the next layer boundary
    (Model.run_layers looks at the record after each layer) or between tokens (check). A second Ctrl-C is recorded
    the same way: the answer stops at the same boundary, within one layer's time (a
    Ctrl-C raised "at once" could land inside compiled code, an internal error). A
    SIGTERM raises Terminated there instead and ends the chat (exit 143). Only in the
    main thread (signal handlers live there); elsewhere Ctrl-C keeps its default
    behaviour. ``inner`` is another observer called at every layer first."""

    def __init__(self, inner: Observer | None = None):
        self.inner = inner

    def check(self) -> None:
        interrupt.check()

    def on_layer(self, i: int) -> None:
        if self.inner is not None:   # the record itself is looked at by the layer loop (Model.run_layers)
            self.inner.on_layer(i)

    def on_route(self, layer, ids) -> None:
        if self.inner is not None:
            self.inner.on_route(layer, ids)

    def __enter__(self):
        self._deferred = interrupt.deferred()
        self._deferred.__enter__()
        return self

    def __exit__(self, *exc):
        self._deferred.__exit__(*exc)
        interrupt.clear()  # the turn is over: a Ctrl-C recorded as it ended must not stop the next one
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
            m = loads_json(line)
        except JSONProblem as e:
            raise UsageError(f"{path}: line {n} {e.problem}; a history file holds one message object a line.") from None
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise UsageError(f"{path}: line {n} is not a message (an object with role system/user/assistant/tool).")
        msgs.append(m)
    return msgs


def write_jsonl_atomic(path, messages: Sequence[dict]) -> None:
    data = "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in messages).encode("utf-8")
    atomic_write(path, data, what="the conversation")


def default_history_path() -> Path:
    return env.cache_dir() / "chats" / f"chat-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
