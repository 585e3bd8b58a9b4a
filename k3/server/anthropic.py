"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the same
chat path as /v1/chat/completions.

A Messages request is translated into the OpenAI chat body ``chat.parse_chat``
checks (system, user and assistant turns, ``tool_use`` blocks as tool calls,
``tool_result`` blocks as tool messages, ``tools`` with their ``input_schema`` as
functions, ``thinking`` as the reasoning effort), so both APIs render the same prompt
and decode through one scheduler. The answer (a ``ChatAnswer``) is turned back into
content blocks: ``thinking`` (K3's think channel), ``text``, ``tool_use``; streamed as
Anthropic's event sequence. Errors have Anthropic's shape.
"""

from __future__ import annotations

import json

from .protocol import ApiError, bad, new_id

#: HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _text(content, where: str) -> str:
    """A string, or text blocks joined (the only blocks a system prompt or a tool result takes)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of text blocks.", where, "invalid_type")
    out = []
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}[{i}] must be a text block ({{\"type\": \"text\", \"text\": ...}}); k3 serves text "
                      "only.", f"{where}[{i}]", "invalid_value")
        out.append(b["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    """Anthropic system + messages -> OpenAI chat messages."""
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages.", "messages", "invalid_value")
    if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
        raise bad("the last message is an assistant turn: continuing a prefilled answer is not supported; end with "
                  "a user turn.", f"messages[{len(msgs) - 1}]", "unsupported_value")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role must be user or assistant.", f"{where}.role", "invalid_value")
        c = m.get("content")
        if isinstance(c, str):
            out.append({"role": m["role"], "content": c})
            continue
        if not isinstance(c, list):
            raise bad(f"{where}.content must be a string or an array of content blocks.", f"{where}.content",
                      "invalid_type")
        text, thinking, calls = [], [], []
        for j, b in enumerate(c):
            kind = b.get("type") if isinstance(b, dict) else None
            bw = f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "thinking" and m["role"] == "assistant":
                thinking.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                    raise bad(f"{bw}: a tool_use block needs 'id' and 'name'.", bw, "invalid_value")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"],
                                           "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                if text:   # text before a result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                res = b.get("content", "")
                r = _text(res, f"{bw}.content") if res is not None else ""
                if b.get("is_error"):
                    r = "Error: " + r
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": r})
            else:
                raise bad(f"{bw}: a {kind!r} block is not supported in a {m['role']} turn (k3 serves text, "
                          "thinking, tool_use and tool_result blocks).", bw, "invalid_value")
        if m["role"] == "assistant":
            msg = {"role": "assistant", "content": "".join(text)}
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in c):
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be an array.", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad(f"tools[{i}] must be an object with a 'name'.", f"tools[{i}]", "invalid_value")
        if t.get("type") not in (None, "custom"):
            raise bad(f"tools[{i}]: server tools ({t.get('type')!r}) are not supported; give client tools with an "
                      "input_schema.", f"tools[{i}]", "invalid_value")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict):
    tc = body.get("tool_choice")
    if tc is None:
        return None
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise bad("'tool_choice' of type tool needs the tool's 'name'.", "tool_choice", "invalid_value")
        return {"type": "function", "function": {"name": tc["name"]}}
    raise bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}.", "tool_choice",
              "invalid_value")


def to_chat_body(body: dict, *, count_only: bool = False) -> dict:
    """The OpenAI chat body of a Messages request (400 for what it cannot say)."""
    if not count_only:
        mt = body.get("max_tokens")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise bad("'max_tokens' is required: a positive integer.", "max_tokens", "invalid_value")
    out = {"model": body.get("model"), "messages": _messages(body)}
    for k in ("temperature", "top_p", "top_k", "stream"):
        if body.get(k) is not None:
            out[k] = body[k]
    if not count_only:
        out["max_tokens"] = body["max_tokens"]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("'stop_sequences' must be an array of strings.", "stop_sequences", "invalid_type")
        out["stop"] = stops
    tools = _tools(body)
    if tools:
        out["tools"] = tools
    tc = _tool_choice(body)
    if tc is not None:
        out["tool_choice"] = tc
        if body["tool_choice"].get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    th = body.get("thinking")
    if th is not None:
        kind = th.get("type") if isinstance(th, dict) else None
        if kind == "disabled":
            out["reasoning_effort"] = "none"
        elif kind in ("enabled", "adaptive"):   # on, whatever the server's default (at its effort)
            out["chat_template_kwargs"] = {"thinking": True}
        else:
            raise bad("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}.",
                      "thinking", "invalid_value")
    return out


def stop_reason(finish: str | None, ans) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if ans.stopped:
        return "stop_sequence", ans.stop.matched
    if finish == "stop":
        return ("tool_use" if ans.tool_calls else "end_turn"), None
    return "max_tokens", None


def _input(call: dict) -> dict:
    try:
        v = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        v = {"_raw": call["function"]["arguments"]}
    return v if isinstance(v, dict) else {"_value": v}


def content_blocks(ans) -> list[dict]:
    """The answer's content blocks: thinking, text, tool_use (in that order)."""
    out = []
    if ans.reasoning:
        out.append({"type": "thinking", "thinking": ans.reasoning, "signature": ""})
    if ans.content or not (ans.reasoning or ans.tool_calls):
        out.append({"type": "text", "text": ans.content})
    for c in ans.tool_calls:
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(c)})
    return out


def message(model: str, ans, finish: str | None, prompt_tokens: int, output_tokens: int, cached: int,
            mid: str | None = None) -> dict:
    reason, seq = stop_reason(finish, ans)
    return {"id": mid or new_id("msg"), "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(ans), "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(prompt_tokens, output_tokens, cached)}


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}


class EventStream:
    """Chat deltas -> Anthropic's stream events. One block is open at a time: a delta of
    another kind (thinking, text) closes it and opens the next; tool calls come last,
    each a tool_use block with its whole input as one input_json_delta."""

    def __init__(self, model: str, prompt_tokens: int, cached: int):
        self.model, self.prompt_tokens, self.cached = model, prompt_tokens, cached
        self.id = new_id("msg")
        self.index = -1
        self.open: str | None = None

    def start(self) -> list[tuple[str, dict]]:
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage(self.prompt_tokens, 0, self.cached)}
        return [("message_start", {"type": "message_start", "message": msg})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        ev = []
        if self.open == "thinking":   # a thinking block ends with its signature (empty: k3 does not sign)
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        return ev + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _begin(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        ev = self._close()
        self.index += 1
        self.open = kind
        return ev + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                              "content_block": block})]

    def deltas(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        ev = []
        for d in deltas:
            for key, s in d.items():
                if not s:
                    continue
                kind = "thinking" if key == "reasoning_content" else "text"
                if self.open != kind:
                    ev += self._begin(kind, {"type": "thinking", "thinking": "", "signature": ""}
                                      if kind == "thinking" else {"type": "text", "text": ""})
                delta = {"type": "thinking_delta", "thinking": s} if kind == "thinking" else \
                    {"type": "text_delta", "text": s}
                ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": delta}))
        return ev

    def end(self, ans, finish: str | None, output_tokens: int) -> list[tuple[str, dict]]:
        ev = []
        if self.index < 0 and not ans.tool_calls:   # an empty answer is one empty text block
            ev += self._begin("text", {"type": "text", "text": ""})
        for c in ans.tool_calls:
            ev += self._begin("tool_use", {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                                           "input": {}})
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": json.dumps(_input(c), ensure_ascii=False)}}))
        ev += self._close()
        reason, seq = stop_reason(finish, ans)
        ev.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                     "usage": {"output_tokens": output_tokens}}))
        ev.append(("message_stop", {"type": "message_stop"}))
        return ev


def frame(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode("utf-8") + b"\n\n"


def api_error(e: ApiError) -> tuple[dict, int]:
    return error_body(e.status, e.message), e.status
