"""The builders that turn generated tokens into an answer: ``content`` /
``reasoning_content`` / ``tool_calls`` for chat, text for /v1/completions, with ``stop``
strings held back until they can no longer match; the finish reason, the tokens'
logprobs, and the fields of the response objects (ids, usage).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Sequence

from ..chat_format import AnswerParser, K3Format
from ..tokenizer import StreamDecoder, Tokenizer
from .tool_calls import K2ToolCalls, XTMLToolCalls


# ====================================================================== answers
class StopMatcher:
    """Text that is safe to emit given the `stop` strings: a tail that may still become a
    stop string is held back; at the first stop string the text ends before it."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit = False
        self.matched: str | None = None  # the stop string the text ended at

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out
        at = [(i, s) for i, s in ((self.buf.find(s), s) for s in self.stops) if i >= 0]
        if at:
            i, self.matched = min(at, key=lambda x: x[0])
            out, self.buf, self.hit = self.buf[:i], "", True
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if self.buf.endswith(s[:k]):
                    keep = k
                    break
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.hit else self.buf), ""
        return out


class CompletionAnswer:
    """Generated tokens -> text for /v1/completions (special tokens as their names, as
    `k3 run` prints them; the end-of-text token is not part of the text)."""

    def __init__(self, tok: Tokenizer | None, stop_ids, stops: Sequence[str]):
        self.tok = tok
        self.stop_ids = frozenset(stop_ids)
        self.dec = StreamDecoder(tok) if tok is not None else None
        self.stop = StopMatcher(stops)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stop.hit

    def feed(self, token: int) -> str:
        if self.stop.hit or self.dec is None or token in self.stop_ids:
            return ""
        s = self.stop.push(self.dec.push(token))
        self.text += s
        return s

    def finish(self) -> str:
        if self.dec is None or self.stop.hit:
            return ""
        s = self.stop.push(self.dec.flush())
        s += self.stop.flush()
        self.text += s
        return s


class ChatAnswer:
    """Generated tokens -> OpenAI chat deltas: the think channel as ``reasoning_content``,
    the response channel as ``content`` (``stop`` strings apply to it), tool calls as
    ``tool_calls`` when the answer is done. The format's stop tokens end the answer and
    are not part of it."""

    def __init__(self, fmt, tok: Tokenizer, stops: Sequence[str] = (), thinking: bool = False):
        self.fmt, self.tok = fmt, tok
        self.parser: AnswerParser = fmt.parser()
        self.xtml = isinstance(fmt, K3Format)
        self.tools = XTMLToolCalls(tok) if self.xtml else K2ToolCalls(tok)
        self.stop = StopMatcher(stops)
        self.thinking = thinking
        self.content = ""
        self.reasoning = ""
        self.ended = False  # a stop token came

    @property
    def stopped(self) -> bool:
        return self.stop.hit

    @property
    def tool_calls(self) -> list[dict]:
        return self.tools.calls

    def _deltas(self, pieces) -> list[dict]:
        out = []
        for ch, s in pieces:
            if ch == "think":
                self.reasoning += s
                out.append({"reasoning_content": s})
            elif ch == "response":
                s = self.stop.push(s)
                if s:
                    self.content += s
                    out.append({"content": s})
        return out

    def feed(self, token: int) -> list[dict]:
        token = int(token)
        if self.ended or self.stop.hit:
            return []
        if token in self.fmt.stop_ids:
            self.ended = True
            return []
        if self.xtml:
            self.tools.feed(token)
        elif self.tools.feed(token):
            return []
        return self._deltas(self.parser.feed(token))

    def finish(self) -> list[dict]:
        out = self._deltas(self.parser.flush())
        if not self.stop.hit:
            s = self.stop.flush()
            if s:
                self.content += s
                out.append({"content": s})
        return out

    def message(self) -> dict:
        calls = self.tool_calls
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if (self.content or not calls) else None}
        if self.thinking or self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg


def finish_reason(engine_finish: str | None, stopped: bool, tool_calls: bool = False) -> str:
    if stopped:
        return "stop"
    if engine_finish == "stop":
        return "tool_calls" if tool_calls else "stop"
    return "length"


def token_logprobs(logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log p of ``token``, the ``top`` most likely ids with theirs): the log-softmax of
    the exact fp32 logits the model gave, before any temperature, top-p or top-k (what
    the model itself assigns; docs/SERVER.md)."""
    import torch
    lp = torch.log_softmax(logits.reshape(-1).to(torch.float32), dim=-1)
    alts = []
    if top:
        v, i = torch.topk(lp, min(top, lp.numel()))
        alts = list(zip(i.tolist(), v.tolist()))
    return float(lp[token]), alts


# ====================================================================== response objects
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


SYSTEM_FINGERPRINT = "k3"
