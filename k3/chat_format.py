"""Chat formats: K3's XTML tags (rendered in Python, docs/MODEL.md §5) and a model folder's Jinja
`chat_template` (Kimi-Linear, docs/MODEL.md §6).

A rendered conversation is a list of *segments* `(text, allow_special)`. Control
text (`<|open|>`, `<|sep|>`, ...) is encoded with specials allowed; everything a
user, a tool or the model wrote is encoded with specials disabled, so a literal
`<|open|>` inside a message is ordinary text. Segments are encoded one by one, never
concatenated first.

K3 XTML (`render_k3`):
  open tag  = `<|open|>` name [` key="value"` ...] `<|sep|>` (the value escapes & and ",
              each piece is its own plain-text segment)
  close tag = `<|close|>` name `<|sep|>`; every message ends with `<|end_of_msg|>`.
  [tool-declare system message] [thinking-effort system message, when thinking]
  messages: system / user (`role`, optional `name`), assistant (think channel when
  thinking, response channel, optional tools block of calls), tool results
  (`role="tool" tool="name" index="k"`, k counting from 1 after each assistant
  message), a system message carrying `tools` declares more tools mid-conversation;
  [tool-choice / response-format system messages]; generation prompt = open assistant
  message + open think (or response when thinking is off).

Jinja (`JinjaTemplate`, in k3.chat_jinja and re-exported here): rendered like
transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, `tojson`,
`raise_exception`, `strftime_now`). Message contents are rendered as placeholders
first, so that special-token names are only recognised in the template's own text; the
text between special tokens is then encoded as one plain-text run, exactly as tiktoken
would encode the whole string.

`ChatFormat` wraps either for the REPL: the token delta of a new turn, the stop ids,
a parser that splits the model's answer into think / response / tools channels, and
the tokens that close an answer that was cut short.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from .chat_jinja import JinjaTemplate
from .errors import UsageError
from .tokenizer import Segment, StreamDecoder, Tokenizer

OPEN, CLOSE, SEP, END_OF_MSG, EOS = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"
THINKING_EFFORTS = ("low", "medium", "high", "max")
DEFAULT_EFFORT = "max"

TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
TOOL_DECLARE_DYNAMIC_HEAD = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n")


def effort_text(effort: str) -> str:
    return ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
            "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`.")


# ====================================================================== K3 XTML
def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> list[Segment]:
    segs: list[Segment] = [(OPEN, True), (tag, False)]
    for key, value in attrs:
        segs += [(f" {key}", False), ('="', False), (_escape(value), False), ('"', False)]
    segs.append((SEP, True))
    return segs


def close_tag(tag: str) -> list[Segment]:
    return [(CLOSE, True), (tag, False), (SEP, True)]


def _deep_sort(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _deep_sort(v[k]) for k in sorted(v)}
    if isinstance(v, list):
        return [_deep_sort(x) for x in v]
    return v


def compact_json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UsageError(f"{where}: content part of type {kind!r} is not supported (text only; "
                                 "k3 runs the language model without the vision tower).")
        return "".join(out)
    raise UsageError(f"{where}: content must be text or a list of text parts, got {type(content).__name__}.")


def _internal_system(kind: str, body: str) -> list[Segment]:
    return (open_tag("message", [("role", "system"), ("type", kind)]) + [(body.strip(), False)]
            + close_tag("message") + [(END_OF_MSG, True)])


def _tool_declare(tools: Any, dynamic: bool = False) -> list[Segment]:
    head = TOOL_DECLARE_DYNAMIC_HEAD if dynamic else TOOL_DECLARE_HEAD
    body = head + "```json\n" + compact_json(_deep_sort(tools)) + "\n```"
    return (open_tag("message", [("role", "system"), ("type", "tool-declare")]) + [(body, False)]
            + close_tag("message") + [(END_OF_MSG, True)])


def _arg_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, dict):
        return "object"
    return "array"


def _arg_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _call_parts(call: Any, where: str) -> tuple[str, Any, str | None]:
    if not isinstance(call, dict):
        raise UsageError(f"{where}: a tool call must be an object with a name and arguments.")
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise UsageError(f"{where}: a tool call has no function name.")
    args = fn.get("arguments", {})
    block = fn.get("json_block")
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
        elif block is None:
            block = args
    return name, args, block


def _tool_call(name: str, args: Any, block: str | None, index: int) -> list[Segment]:
    segs = open_tag("call", [("tool", name), ("index", index)])
    if block is not None:
        segs += open_tag("json", [("type", "object")]) + [(block, False)] + close_tag("json")
    elif isinstance(args, dict):
        for key, value in args.items():
            segs += open_tag("argument", [("key", key), ("type", _arg_type(value))])
            segs.append((_arg_value(value), False))
            segs += close_tag("argument")
    segs += close_tag("call")
    return segs


def _assistant_body(m: dict, thinking: bool, where: str) -> list[Segment]:
    segs: list[Segment] = []
    if thinking:
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        segs += open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            segs.append((_content_text(reasoning, where), False))
        segs += close_tag("think")
    segs += open_tag("response")
    segs.append((_content_text(m.get("content"), where), False))
    segs += close_tag("response")
    calls = m.get("tool_calls")
    if calls:
        segs += open_tag("tools")
        for k, call in enumerate(calls, 1):
            segs += _tool_call(*_call_parts(call, where), index=k)
        segs += close_tag("tools")
    return segs


def render_k3(messages: Sequence[dict], tools: Sequence[dict] | None = None, *, thinking: bool = True,
              thinking_effort: str | None = DEFAULT_EFFORT, add_generation_prompt: bool = True,
              tool_choice: str | None = None, response_format: Any = None,
              preamble: bool = True) -> list[Segment]:
    """Render a conversation in K3's XTML tags. `preamble=False` leaves out the
    tool-declare and thinking-effort messages that open a conversation (used to
    render the messages of a later turn)."""
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise UsageError(f"thinking effort must be one of {', '.join(THINKING_EFFORTS)}, got {thinking_effort!r}.")
    segs: list[Segment] = []
    if preamble:
        if tools:
            segs += _tool_declare(tools)
        if thinking and thinking_effort is not None:
            segs += _internal_system("thinking-effort", effort_text(thinking_effort))
    calls: list = []
    tool_index = 0
    for n, m in enumerate(messages):
        where = f"message {n + 1}"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UsageError(f"{where}: a message must be an object with a role.")
        role = m["role"]
        if role == "system" and m.get("tools"):
            segs += _tool_declare(m["tools"], dynamic=True)
        elif role in ("system", "user"):
            attrs: list[tuple[str, Any]] = [("role", role)]
            if m.get("name"):
                attrs.append(("name", m["name"]))
            segs += open_tag("message", attrs) + [(_content_text(m.get("content"), where), False)]
            segs += close_tag("message") + [(END_OF_MSG, True)]
        elif role == "assistant":
            calls = list(m.get("tool_calls") or [])
            tool_index = 0
            attrs = [("role", "assistant")]
            if m.get("name"):
                attrs.append(("name", m["name"]))
            segs += open_tag("message", attrs) + _assistant_body(m, thinking, where)
            segs += close_tag("message") + [(END_OF_MSG, True)]
        elif role == "tool":
            tool_index += 1
            name = m.get("tool", m.get("name"))
            if name is None and tool_index <= len(calls):
                name = _call_parts(calls[tool_index - 1], where)[0]
            if name is None:
                raise UsageError(f"{where}: a tool result needs the tool's name (`tool` or `name`), or a preceding "
                                 "assistant tool call to match by order.")
            segs += open_tag("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
            segs += [(_content_text(m.get("content"), where), False)] + close_tag("message") + [(END_OF_MSG, True)]
        else:
            raise UsageError(f"{where}: unknown role {role!r} (system, user, assistant or tool).")
    if tool_choice == "required":
        segs += _internal_system("tool-choice", "The system is invoked with `tool_choice=required`.\n"
                                 "You MUST call tools in the next message.")
    elif tool_choice == "none":
        segs += _internal_system("tool-choice", "The system is invoked with `tool_choice=none`.\n"
                                 "You MUST NOT call any tools in the next message.")
    elif tool_choice not in (None, "auto"):
        raise UsageError(f"tool_choice must be auto, required or none, got {tool_choice!r}.")
    rtype = response_format.get("type") if isinstance(response_format, dict) else response_format
    if rtype == "json_object":
        segs += _internal_system("response-format", "The system is invoked with `response_format=json_object`.\n"
                                 "Your response must be raw JSON data without markdown code blocks (```json) or "
                                 "any additional formatting.")
    elif rtype == "json_schema":
        schema = response_format.get("json_schema", {}) if isinstance(response_format, dict) else {}
        schema = schema.get("schema", schema) if isinstance(schema, dict) else schema
        segs += _internal_system(
            "response-format", "The system is invoked with `response_format=json_schema`.\n"
            "Your response must be raw JSON data without markdown code blocks (```json) or any additional "
            "formatting.\nThe JSON data must match the following schema:\n"
            f"```json\n{compact_json(_deep_sort(schema))}\n```")
    elif rtype not in (None, "text"):
        raise UsageError(f"response_format must be text, json_object or json_schema, got {rtype!r}.")
    if add_generation_prompt:
        segs += generation_prompt_k3(thinking)
    return segs


def generation_prompt_k3(thinking: bool = True) -> list[Segment]:
    return open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")


def segments_text(segs: Iterable[Segment]) -> str:
    return "".join(t for t, _ in segs)


# ====================================================================== answers
class AnswerParser:
    """Splits generated tokens into channels. `feed(token)` returns a list of
    (channel, text) pieces for display; channels are "think", "response", "tools"."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.decoders: dict[str, StreamDecoder] = {}
        self.text: dict[str, list[str]] = {"think": [], "response": [], "tools": []}
        self.channel = "response"

    def _emit(self, channel: str, data: bytes) -> list[tuple[str, str]]:
        dec = self.decoders.setdefault(channel, StreamDecoder(self.tok))
        s = dec.push_bytes(data)
        if s:
            self.text[channel].append(s)
            return [(channel, s)]
        return []

    def flush(self) -> list[tuple[str, str]]:
        out = []
        for ch, dec in self.decoders.items():
            s = dec.flush()
            if s:
                self.text[ch].append(s)
                out.append((ch, s))
        return out

    def feed(self, token: int) -> list[tuple[str, str]]:
        if self.tok.is_special(token):
            return []
        return self._emit(self.channel, self.tok.token_bytes(token))

    @property
    def reasoning(self) -> str:
        return "".join(self.text["think"])

    @property
    def content(self) -> str:
        return "".join(self.text["response"])

    def closing(self) -> list[Segment]:  # overridden
        return []


class XTMLAnswerParser(AnswerParser):
    """Tracks the XTML tag stack of an assistant message opened by the generation
    prompt, so an answer cut short can be closed canonically."""

    def __init__(self, tok: Tokenizer, thinking: bool):
        super().__init__(tok)
        self.ids = {n: tok.token_id(n) for n in (OPEN, CLOSE, SEP)}
        self.stack = ["message", "think" if thinking else "response"]
        self.seen_response = not thinking
        self.mode = "text"  # text | open | close
        self.header = b""
        self.channel = "think" if thinking else "response"

    def _set_channel(self) -> None:
        top = self.stack[-1] if self.stack else "message"
        self.channel = {"think": "think", "response": "response", "message": "response"}.get(top, "tools")

    def feed(self, token: int) -> list[tuple[str, str]]:
        token = int(token)
        out: list[tuple[str, str]] = []
        if token == self.ids[OPEN] or token == self.ids[CLOSE]:
            out += self.flush()
            self.mode = "open" if token == self.ids[OPEN] else "close"
            self.header = b""
            return out
        if token == self.ids[SEP]:
            if self.mode != "text":
                name = self.header.decode("utf-8", "replace").split(" ", 1)[0].strip()
                if self.mode == "open":
                    self.stack.append(name)
                    if name == "response":
                        self.seen_response = True
                elif name in self.stack:
                    while self.stack and self.stack.pop() != name:
                        pass
                self.mode = "text"
                self._set_channel()
            return out
        if self.tok.is_special(token):
            return out
        if self.mode != "text":
            self.header += self.tok.token_bytes(token)
            return out
        return self._emit(self.channel, self.tok.token_bytes(token))

    def closing(self) -> list[Segment]:
        """Segments that close whatever the answer left open, ending with
        <|end_of_msg|>. For a complete answer this is just <|end_of_msg|>."""
        segs: list[Segment] = []
        stack = list(self.stack)
        if self.mode != "text":
            name = self.header.decode("utf-8", "replace").split(" ", 1)[0].strip()
            segs.append((SEP, True))
            if self.mode == "open":
                stack.append(name)
            elif name in stack:
                while stack and stack.pop() != name:
                    pass
        seen_response = self.seen_response or "response" in stack
        while stack:
            tag = stack.pop()
            if tag == "message" and not seen_response:
                segs += open_tag("response") + close_tag("response")
                seen_response = True
            segs += close_tag(tag)
        segs.append((END_OF_MSG, True))
        return segs


class ChatFormat:
    """What the REPL needs from a chat format."""

    name = ""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.stop_ids: frozenset[int] = frozenset()
        self.end_id: int = -1

    def prompt_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        raise NotImplementedError

    def message_ends(self, ids: Sequence[int]) -> list[int]:
        """Offsets in rendered ``ids`` just past each message (its end token, one of
        stop_ids: special tokens are never split, so one pass over the ids finds them), and
        its whole length: where conversations sharing a start part (the prompt cache's
        snapshot points, k3.prompt_cache)."""
        return [i + 1 for i, t in enumerate(ids) if t in self.stop_ids] + [len(ids)]

    def turn_ids(self, history: Sequence[dict], new: Sequence[dict]) -> list[int] | None:
        """Tokens to append after a transcript holding `history` (closed) so that it
        holds `history + new` and the generation prompt; None when the format cannot
        extend the transcript (the caller re-reads the whole conversation)."""
        raise NotImplementedError

    def parser(self) -> AnswerParser:
        return AnswerParser(self.tok)

    def closing_ids(self, parser: AnswerParser) -> list[int]:
        return self.tok.encode_segments(parser.closing())


class K3Format(ChatFormat):
    name = "k3-xtml"

    def __init__(self, tok: Tokenizer, thinking: bool = True, thinking_effort: str | None = DEFAULT_EFFORT,
                 tools: Sequence[dict] | None = None):
        super().__init__(tok)
        for n in (OPEN, CLOSE, SEP, END_OF_MSG):
            if not tok.has_special(n):
                raise UsageError(f"{tok.dir}: the tokenizer has no {n} token, so it cannot use K3's chat format.")
        self.thinking = thinking
        self.thinking_effort = thinking_effort if thinking else None
        self.tools = list(tools) if tools else None
        self.end_id = tok.token_id(END_OF_MSG)
        stops = {self.end_id}
        if tok.has_special(EOS):
            stops.add(tok.token_id(EOS))
        self.stop_ids = frozenset(stops)

    def segments(self, messages, add_generation_prompt=True, preamble=True) -> list[Segment]:
        return render_k3(messages, self.tools, thinking=self.thinking, thinking_effort=self.thinking_effort,
                         add_generation_prompt=add_generation_prompt, preamble=preamble)

    def prompt_ids(self, messages, add_generation_prompt=True) -> list[int]:
        return self.tok.encode_segments(self.segments(messages, add_generation_prompt))

    def turn_ids(self, history, new) -> list[int]:
        return self.tok.encode_segments(self.segments(new, True, preamble=not history))

    def parser(self) -> AnswerParser:
        return XTMLAnswerParser(self.tok, self.thinking)


class JinjaFormat(ChatFormat):
    name = "jinja"

    def __init__(self, tok: Tokenizer, template: str, eos_id: int | None = None, thinking: bool = True,
                 tools: Sequence[dict] | None = None):
        super().__init__(tok)
        self.template = JinjaTemplate(template, tok.special_ids.keys(),
                                      bos_token=tok.id_to_special.get(tok.bos_id) if tok.bos_id is not None else None,
                                      eos_token=tok.id_to_special.get(tok.eos_id) if tok.eos_id is not None else None)
        end = tok.eos_id if tok.eos_id is not None else eos_id
        if end is None:
            raise UsageError(f"{tok.dir}: no eos_token in tokenizer_config.json and none in config.json, so the end "
                             "of an answer cannot be recognised.")
        self.end_id = int(end)
        stops = {self.end_id}
        if eos_id is not None:
            stops.add(int(eos_id))
        if tok.has_special(EOS):
            stops.add(tok.token_id(EOS))
        self.stop_ids = frozenset(stops)
        self.thinking = thinking
        self.tools = list(tools) if tools else None

    def segments(self, messages, add_generation_prompt=True) -> list[Segment]:
        return self.template.render(messages, add_generation_prompt, self.tools, thinking=self.thinking,
                                    enable_thinking=self.thinking)

    def prompt_ids(self, messages, add_generation_prompt=True) -> list[int]:
        return self.tok.encode_segments(self.segments(messages, add_generation_prompt))

    def turn_ids(self, history, new) -> list[int] | None:
        full = self.segments(list(history) + list(new), True)
        if not history:
            return self.tok.encode_segments(full)
        prev = self.segments(history, False)
        if full[:len(prev)] != prev or (prev and not prev[-1][1]):
            return None  # not a clean, special-token-bounded prefix: re-read everything
        return self.tok.encode_segments(full[len(prev):])

    def closing_ids(self, parser: AnswerParser) -> list[int]:
        return [self.end_id]


def chat_format_for(tok: Tokenizer, cfg=None, *, thinking: bool = True,
                    thinking_effort: str | None = DEFAULT_EFFORT, tools=None, kind: str = "auto") -> ChatFormat:
    """K3 XTML for K3 (or any tokenizer with the XTML tokens and no template); the
    folder's Jinja chat template otherwise (Kimi-Linear)."""
    arch = getattr(cfg, "arch", None)
    xtml_ok = all(tok.has_special(n) for n in (OPEN, CLOSE, SEP, END_OF_MSG))
    if kind == "xtml" or (kind == "auto" and (arch == "k3" or (xtml_ok and tok.chat_template() is None))):
        return K3Format(tok, thinking, thinking_effort, tools)
    template = tok.chat_template()
    if template is None:
        raise UsageError(
            f"{tok.dir}: no chat template (chat_template.jinja, or chat_template in tokenizer_config.json) and the "
            "tokenizer has no K3 XTML tokens, so there is no chat format for this model. Add the release's "
            "chat_template.jinja to the folder, or use `k3 run` with a raw prompt.")
    return JinjaFormat(tok, template, eos_id=getattr(cfg, "eos_token_id", None), thinking=thinking, tools=tools)
