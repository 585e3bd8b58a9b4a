"""Tool calls out of a generated answer, token by token: K3's XTML call tags and Kimi's
(K2 / Kimi-Linear) tool-call section, each call as an OpenAI tool call (arguments as a
JSON string).
"""

from __future__ import annotations

import json
import re
import secrets

from ..chat_format import CLOSE, OPEN, SEP
from ..tokenizer import Tokenizer


def _unescape(v: str) -> str:
    return v.replace("&quot;", '"').replace("&amp;", "&")


_ATTR = re.compile(r'([A-Za-z_][\w.-]*)="([^"]*)"')


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _arg_json(text: str, kind: str | None) -> str:
    """An argument block's value as JSON text: a string's raw text quoted; another type's
    text as written when it is strict JSON (kept as written: 1e400 stays a number, not
    Python's Infinity), else quoted as a string."""
    if kind not in (None, "string"):
        try:
            json.loads(text, parse_constant=_not_json)
            return text.strip()
        except ValueError:
            pass
    return json.dumps(text, ensure_ascii=False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class XTMLToolCalls:
    """Tool calls out of a K3 answer's tags: `<|open|>tools<|sep|>` then per call
    `call tool="NAME" index="k"` holding `argument key="K" type="T"` values (or one
    `json` block); each becomes an OpenAI tool call (arguments as a JSON string)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids = {tok.token_id(n): n for n in (OPEN, CLOSE, SEP)}
        self.mode = "text"
        self.header = b""
        self.stack: list[str] = []
        self.calls: list[dict] = []
        self._call: dict | None = None
        self._arg: list | None = None  # [key, type, bytes]
        self._block: bytearray | None = None

    def feed(self, token: int) -> None:
        name = self.ids.get(int(token))
        if name in (OPEN, CLOSE):
            self.mode, self.header = ("open" if name == OPEN else "close"), b""
            return
        if name == SEP:
            if self.mode != "text":
                head = self.header.decode("utf-8", "replace")
                tag = head.split(" ", 1)[0].strip()
                attrs = {k: _unescape(v) for k, v in _ATTR.findall(head)}
                if self.mode == "open":
                    self._open(tag, attrs)
                    self.stack.append(tag)
                elif tag in self.stack:
                    while self.stack:
                        t = self.stack.pop()
                        self._close(t)
                        if t == tag:
                            break
                self.mode = "text"
            return
        if self.tok.is_special(token):
            return
        b = self.tok.token_bytes(token)
        if self.mode != "text":
            self.header += b
        elif self._arg is not None:
            self._arg[2] += b
        elif self._block is not None:
            self._block += b

    def _open(self, tag: str, attrs: dict) -> None:
        if tag == "call" and "tools" in self.stack:
            self._call = {"name": attrs.get("tool", ""), "args": {}, "block": None}
        elif tag == "argument" and self._call is not None:
            self._arg = [attrs.get("key", ""), attrs.get("type"), bytearray()]
        elif tag == "json" and self._call is not None:
            self._block = bytearray()

    def _close(self, tag: str) -> None:
        if tag == "argument" and self._arg is not None and self._call is not None:
            key, kind, data = self._arg
            self._call["args"][key] = _arg_json(bytes(data).decode("utf-8", "replace"), kind)
            self._arg = None
        elif tag == "json" and self._block is not None and self._call is not None:
            self._call["block"] = bytes(self._block).decode("utf-8", "replace")
            self._block = None
        elif tag == "call" and self._call is not None:
            c = self._call
            args = c["block"] if c["block"] is not None else \
                "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in c["args"].items()) + "}"
            self.calls.append({"id": new_call_id(), "type": "function",
                               "function": {"name": c["name"], "arguments": args}})
            self._call = None


K2_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
K2_CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")


class K2ToolCalls:
    """Kimi's (K2 / Kimi-Linear) tool-call section, when the tokenizer has its tokens:
    `<|tool_calls_section_begin|>` (`<|tool_call_begin|>` functions.NAME:k
    `<|tool_call_argument_begin|>` {json} `<|tool_call_end|>`)* `<|tool_calls_section_end|>`."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        names = K2_SECTION + K2_CALL
        self.active = all(tok.has_special(n) for n in names)
        self.ids = {tok.token_id(n): n for n in names} if self.active else {}
        self.inside = False
        self.part: str | None = None
        self.buf = {"id": bytearray(), "args": bytearray()}
        self.calls: list[dict] = []

    def feed(self, token: int) -> bool:
        """True when the token belongs to the tool-call section (not to the content)."""
        if not self.active:
            return False
        name = self.ids.get(int(token))
        if name == K2_SECTION[0]:
            self.inside = True
            return True
        if not self.inside:
            return False
        if name == K2_SECTION[1]:
            self.inside = False
        elif name == K2_CALL[0]:
            self.part, self.buf = "id", {"id": bytearray(), "args": bytearray()}
        elif name == K2_CALL[1]:
            self.part = "args"
        elif name == K2_CALL[2]:
            raw = bytes(self.buf["id"]).decode("utf-8", "replace").strip()
            fname = raw.split(".", 1)[1] if raw.startswith("functions.") else raw
            fname = fname.rsplit(":", 1)[0] if ":" in fname else fname
            self.calls.append({"id": raw or new_call_id(), "type": "function",
                               "function": {"name": fname,
                                            "arguments": bytes(self.buf["args"]).decode("utf-8", "replace").strip()}})
            self.part = None
        elif self.part is not None and not self.tok.is_special(token):
            self.buf[self.part] += self.tok.token_bytes(token)
        return True
