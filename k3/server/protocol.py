"""The OpenAI side of `k3 serve`, without the web stack: request checks that answer with
OpenAI-style error bodies, prompt rendering (the model's chat format, tools), the
sampler of each request, and the builders that turn generated tokens into
``content`` / ``reasoning_content`` / ``tool_calls`` (and text for /v1/completions),
with ``stop`` strings held back until they can no longer match.

What a request may ask for, and how it maps onto the engine, is in docs/SERVER.md.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..answer_grammar import MAX_CALLS, answer_grammar
from ..chat_format import CLOSE, OPEN, SEP, THINKING_EFFORTS, AnswerParser, K3Format, render_k3
from ..errors import K3Error
from ..tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("k3.serve")

MAX_STOP_STRINGS = 4
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ====================================================================== errors
class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object (400 otherwise). NaN and Infinity are refused."""
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError:
        raise bad("The request body is not UTF-8 text.", code="invalid_json") from None
    except ValueError as e:
        raise bad(f"We could not parse the JSON body of your request ({e}). The body must be one JSON object.",
                  code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"The request body must be a JSON object, not {type(body).__name__}.", code="invalid_json")
    return body


# ====================================================================== field checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def opt_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {_kind(v)}.", key, "invalid_type")
    return v


def opt_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise bad(f"'{key}' must be an integer, got {_kind(v)}.", key, "invalid_type")
    if lo is not None and v < lo:
        raise bad(f"'{key}' must be >= {lo}, got {v}.", key, "invalid_value")
    if hi is not None and v > hi:
        raise bad(f"'{key}' must be <= {hi}, got {v}.", key, "invalid_value")
    return v


def opt_num(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(f"'{key}' must be a number, got {_kind(v)}.", key, "invalid_type")
    if v < lo or (lo_open and v == lo) or v > hi:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(f"'{key}' must be in {rng}, got {v}.", key, "invalid_value")
    return float(v)


def stop_strings(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or an array of strings.", "stop", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(v)}.", "stop", "invalid_value")
    if any(s == "" for s in v):
        raise bad("'stop' strings must not be empty.", "stop", "invalid_value")
    return v


def refuse_unsupported(body: dict) -> None:
    """Parameters k3 does not implement: refused when they would change the answer."""
    n = opt_int(body, "n", lo=1)
    if n is not None and n != 1:
        raise bad("k3 serve returns one choice per request: 'n' must be 1.", "n", "unsupported_value")
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and (not _is_num(v)):
            raise bad(f"'{key}' must be a number, got {_kind(v)}.", key, "invalid_type")
        if v:
            raise bad(f"'{key}' is not supported (only 0).", key, "unsupported_parameter")


def logit_bias(body: dict, ctx: ModelContext) -> tuple | None:
    """OpenAI's ``logit_bias`` ({token id: bias in [-100, 100]}) as (ids, values) for
    k3.decode.Batch.add, or None."""
    lb = body.get("logit_bias")
    if lb is None or lb == {}:
        return None
    if not isinstance(lb, dict):
        raise bad(f"'logit_bias' must be an object, got {_kind(lb)}.", "logit_bias", "invalid_type")
    import torch
    ids, values = [], []
    for k, v in lb.items():
        canonical = isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12 and str(int(k)) == k
        if not canonical or int(k) >= ctx.cfg.vocab_size:
            raise bad(f"'logit_bias' key {str(k)[:40]!r} is not a token id of this model (0 to "
                      f"{ctx.cfg.vocab_size - 1}, written without leading zeros).", "logit_bias", "invalid_value")
        tid = int(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' value for token {k} must be a number from -100 to 100.",
                      "logit_bias", "invalid_value")
        ids.append(tid)
        values.append(float(v))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(values, dtype=torch.float32)


# ====================================================================== what the server knows
@dataclass
class ServeDefaults:
    """Server-wide settings from the command line, under each request's own values."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    greedy: bool = False
    thinking: bool = True
    thinking_effort: str | None = "max"
    max_tokens: int | None = None  # per-request cap (None: the rest of the context)


@dataclass
class ModelContext:
    """The loaded model as the request checks see it."""

    name: str
    model_dir: Any
    cfg: Any
    tokenizer: Tokenizer | None
    max_context: int
    defaults: ServeDefaults
    chat_kind: str = "auto"  # auto | xtml | jinja
    _formats: dict = field(default_factory=dict)

    def chat_format(self, thinking: bool, effort: str | None):
        """The model's chat format (K3Format or JinjaFormat), or a 400 saying why there is none."""
        from ..chat_format import chat_format_for
        if self.tokenizer is None:
            raise bad(f"this model ({self.name}) has no tokenizer (tiktoken.model), so it cannot chat; use "
                      "/v1/completions with token ids.", "messages", "no_tokenizer")
        key = (thinking, effort)
        if key not in self._formats:
            try:
                self._formats[key] = chat_format_for(self.tokenizer, self.cfg, thinking=thinking,
                                                     thinking_effort=effort, kind=self.chat_kind)
            except K3Error as e:
                raise bad(str(e), "messages", "no_chat_format") from None
        return self._formats[key]


@dataclass
class GenRequest:
    """One checked request, ready for the scheduler."""

    kind: str  # "chat" | "completion"
    prompt: list[int]
    max_tokens: int
    sampler: Any
    stop_ids: frozenset
    stops: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    fmt: Any = None  # chat: the ChatFormat the answer is parsed with
    logprobs: int | None = None  # None: no logprobs; else how many most likely alternatives each token lists
    constraint: Any = None  # k3.constrain.Constraint the answer's tokens must follow (tools, a JSON response_format)
    thinking: bool = False
    settings: Any = None  # the SamplingSettings (None: greedy)
    bias: Any = None  # logit_bias as (token ids, values), or None


def check_model(body: dict, ctx: ModelContext) -> None:
    m = body.get("model")
    if m is None:
        raise bad("you must provide a model parameter.", "model", "missing_required_parameter")
    if not isinstance(m, str):
        raise bad(f"'model' must be a string, got {_kind(m)}.", "model", "invalid_type")
    if m != ctx.name:
        raise ApiError(404, f"The model '{m}' does not exist; this server serves '{ctx.name}' (GET /v1/models).",
                       param="model", code="model_not_found")


def _stream_opts(body: dict) -> tuple[bool, bool]:
    stream = opt_bool(body, "stream")
    so = body.get("stream_options")
    include = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"'stream_options' must be an object, got {_kind(so)}.", "stream_options", "invalid_type")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true.", "stream_options", "invalid_value")
        include = opt_bool(so, "include_usage")
    return stream, include


def make_sampler(ctx: ModelContext, body: dict):
    """(sampler or None for greedy, settings): the request's temperature / top_p / top_k /
    seed over the server's flags over the model's generation_config.json
    (k3.sampling.resolve); a fresh seed when neither the request nor the server gives one.
    The sampler is the one `k3 run` makes (stream 0)."""
    from ..sampling import resolve
    t = opt_num(body, "temperature", 0.0, 2.0)
    p = opt_num(body, "top_p", 0.0, 1.0, lo_open=True)
    k = opt_int(body, "top_k", lo=0)
    seed = opt_int(body, "seed", lo=0)
    d = ctx.defaults
    given = t is not None or p is not None or k is not None
    try:
        settings = resolve(ctx.model_dir, temperature=t if t is not None else d.temperature,
                           top_p=p if p is not None else d.top_p, top_k=k if k is not None else d.top_k,
                           seed=seed if seed is not None else d.seed, greedy=d.greedy and not given)
    except K3Error as e:
        raise bad(str(e), None, "invalid_value") from None
    return (settings.sampler(stream=0) if settings is not None else None), settings


def _max_tokens(body: dict, ctx: ModelContext, n_prompt: int, keys: Sequence[str], default: int | None,
                prompt_param: str) -> int:
    mt = None
    for key in keys:
        v = opt_int(body, key, lo=1)
        if v is not None:
            mt, param = v, key
            break
    room = ctx.max_context - n_prompt
    if room < 1:
        raise bad(f"This model's maximum context length is {ctx.max_context} tokens (--max-context), and the prompt "
                  f"has {n_prompt} tokens, leaving no room for an answer. Shorten the prompt.", prompt_param,
                  "context_length_exceeded")
    cap = ctx.defaults.max_tokens
    if mt is None:
        mt = min(x for x in (default, cap, room) if x is not None)
        return mt
    if cap is not None and mt > cap:
        raise bad(f"'{param}' is {mt} but this server allows at most {cap} tokens per answer (--max-tokens).",
                  param, "invalid_value")
    if mt > room:
        raise bad(f"This model's maximum context length is {ctx.max_context} tokens (--max-context). However, you "
                  f"requested {n_prompt + mt} tokens ({n_prompt} in the prompt, {mt} for the answer). Reduce the "
                  f"prompt or '{param}'.", param, "context_length_exceeded")
    return mt


# ====================================================================== /v1/chat/completions
ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad(f"'tools' must be an array, got {_kind(tools)}.", "tools", "invalid_type")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": "
                      "...}}}.", f"tools[{i}]", "invalid_value")
    return tools or None


def normalize_messages(messages) -> list[dict]:
    """OpenAI messages as the chat formats take them: `developer` is a system message; a
    tool result names its tool (from the assistant call its tool_call_id answers)."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of message objects.", "messages", "invalid_value")
    out, names = [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object, got {_kind(m)}.", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}.",
                      f"messages[{i}].role", "invalid_value")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise bad(f"messages[{i}].content must be a string or an array of text parts, got {_kind(c)}.",
                      f"messages[{i}].content", "invalid_type")
        m = dict(m)
        if role == "developer":
            m["role"] = "system"
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise bad(f"messages[{i}].tool_calls must be an array.", f"messages[{i}].tool_calls", "invalid_type")
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("name"), str) and c.get("id") is not None:
                    names[c["id"]] = fn["name"]
        if role == "tool" and not m.get("name") and not m.get("tool") and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def _thinking(body: dict, ctx: ModelContext) -> tuple[bool, str | None]:
    thinking, effort = ctx.defaults.thinking, ctx.defaults.thinking_effort
    eff = body.get("reasoning_effort")
    if eff is not None:
        if eff == "none":
            thinking = False
        elif eff in THINKING_EFFORTS:
            thinking, effort = True, eff
        else:
            raise bad(f"'reasoning_effort' must be none, {', '.join(THINKING_EFFORTS)}, got {eff!r}.",
                      "reasoning_effort", "invalid_value")
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("'chat_template_kwargs' must be an object.", "chat_template_kwargs", "invalid_type")
        for key in ("thinking", "enable_thinking"):
            if key in kw:
                if not isinstance(kw[key], bool):
                    raise bad(f"'chat_template_kwargs.{key}' must be a boolean.", "chat_template_kwargs",
                              "invalid_type")
                thinking = kw[key]
    return thinking, (effort if thinking else None)


#: the most alternatives a token's logprobs list (OpenAI's limit for top_logprobs)
MAX_TOP_LOGPROBS = 20


def _chat_logprobs(body: dict) -> int | None:
    """A chat request's logprobs: None, or the number of alternatives (top_logprobs, 0..20,
    which needs logprobs: true)."""
    top = opt_int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if not opt_bool(body, "logprobs"):
        if top is not None:
            raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs", "invalid_value")
        return None
    return top or 0


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


def parse_chat(body: dict, ctx: ModelContext) -> GenRequest:
    check_model(body, ctx)
    refuse_unsupported(body)
    stream, include_usage = _stream_opts(body)
    prompt, fmt, thinking = render_chat(body, ctx)
    max_tokens = _max_tokens(body, ctx, len(prompt), ("max_completion_tokens", "max_tokens"), None, "messages")
    sampler, settings = make_sampler(ctx, body)
    return GenRequest("chat", prompt, max_tokens, sampler, frozenset(fmt.stop_ids), stop_strings(body), stream,
                      include_usage, opt_bool(body, "return_token_ids"), fmt=fmt,
                      thinking=isinstance(fmt, K3Format) and thinking, settings=settings,
                      logprobs=_chat_logprobs(body), constraint=_constraint(body, fmt, ctx, thinking),
                      bias=logit_bias(body, ctx))


def _json_format(response_format) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema")


def _named_tool(tool_choice: dict, tools) -> str:
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad("'tool_choice' naming a function must be {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                  "tool_choice", "invalid_value")
    if not any(t["function"]["name"] == name for t in tools or []):
        raise bad(f"'tool_choice' names {name!r}, which is not one of the request's tools.", "tool_choice",
                  "invalid_value")
    return name


def _constraint(body: dict, fmt, ctx: ModelContext, thinking: bool):
    """The grammar the request puts on the answer (k3.constrain), or None. In K3's chat
    format, with tools or a JSON response_format, the whole answer as K3 writes it
    (k3.answer_grammar): think text when thinking, the response (JSON valid against the
    format's schema, or free text), then the calls tool_choice allows (none: no calls;
    auto: the model's choice; required or a named function: a call at once), each call's
    arguments valid against its tool's parameters; at most one call when
    ``parallel_tool_calls`` is false or a function is named. Other chat formats: a JSON
    response_format only. Then the format's end token.

    A tool schema the grammar engine cannot take: 400 when the request names that
    tool; else its calls' arguments are any JSON object (logged). A response_format
    schema it cannot take: 400."""
    tools, tool_choice, response_format = body.get("tools"), body.get("tool_choice"), body.get("response_format")
    json_content = _json_format(response_format)
    forced = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, dict))
    if forced and json_content:
        raise bad("give 'response_format' or a 'tool_choice' that forces a call, not both.", "response_format",
                  "invalid_value")
    if not isinstance(fmt, K3Format):
        if forced:
            raise bad("a forced tool call is constrained in K3's chat format only.", "tool_choice",
                      "unsupported_value")
        return _json_constraint(response_format, fmt.stop_ids, ctx) if json_content else None
    if not (json_content or tools):
        return None
    name = _named_tool(tool_choice, tools) if isinstance(tool_choice, dict) else None
    chosen = [(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}) for t in tools or []
              if name is None or t["function"]["name"] == name]
    single = name is not None or not opt_bool(body, "parallel_tool_calls", True)
    kw = dict(thinking=thinking, json_content=json_content,
              content_schema=_schema(response_format) if json_content else None, tools=chosen,
              calls="required" if forced else "none" if tool_choice == "none" else "auto",
              max_calls=1 if single else MAX_CALLS)
    try:
        return _answer_constraint(ctx, fmt, kw)
    except K3Error:   # find what the grammar engine refused
        pass
    if json_content:
        try:
            _answer_constraint(ctx, fmt, dict(kw, tools=[], calls="none"))
        except K3Error as e:
            raise bad(str(e), "response_format", "invalid_value") from None
    json_only, loose = _tool_forms(ctx, fmt, kw, name)
    kw["tools"] = [(n, {"type": "object"} if n in loose else s) for n, s in chosen]
    try:
        return _answer_constraint(ctx, fmt, dict(kw, json_only=json_only | set(loose)))
    except K3Error as e:
        raise bad(str(e), "tools", "invalid_value") from None


def _tool_forms(ctx: ModelContext, fmt, kw: dict, named: str | None) -> tuple[set, list]:
    """Each tool's grammar alone: (the tools whose argument blocks the grammar engine
    refuses: json block only, the tools whose schema it refuses: 400 when ``named``,
    else logged)."""
    json_only, loose = set(), []
    for tname, schema in kw["tools"]:
        alone = dict(kw, thinking=False, json_content=False, tools=[(tname, schema)], calls="required", max_calls=1)
        for only in ((), (tname,)):
            try:
                _answer_constraint(ctx, fmt, dict(alone, json_only=only))
                json_only.update(only)
                break
            except K3Error as e:
                err = e
        else:   # the engine cannot take the schema itself
            if named is not None:
                raise bad(f"tool {tname!r}: {err}", "tools", "invalid_value") from None
            loose.append(tname)
    if loose:
        log.warning("k3 serve: the grammar engine cannot take the parameters of %s; their calls' arguments are "
                    "constrained to a JSON object only", ", ".join(repr(n) for n in loose))
    return json_only, loose


def _answer_constraint(ctx: ModelContext, fmt, kw: dict):
    from ..constrain import lark_constraint
    return lark_constraint(ctx.tokenizer, answer_grammar(ctx.tokenizer, **kw), fmt.stop_ids, ctx.cfg.vocab_size,
                           "the answer's grammar")


def _schema(response_format: dict) -> dict | None:
    """The schema of a json_schema response format (None for json_object: any object)."""
    if response_format["type"] != "json_schema":
        return None
    js = response_format.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise bad("'response_format.json_schema' must be an object with a 'schema' object.",
                  "response_format.json_schema", "invalid_value")
    return js.get("schema", {})


def _json_constraint(response_format: dict, ends, ctx: ModelContext):
    """The JSON grammar of a json_object / json_schema response format, then ``ends``."""
    from ..constrain import json_constraint
    schema = _schema(response_format)
    try:
        return json_constraint(ctx.tokenizer, schema, ends, ctx.cfg.vocab_size)
    except K3Error as e:
        raise bad(str(e), "response_format", "invalid_value") from None


def render_chat(body: dict, ctx: ModelContext) -> tuple[list[int], Any, bool]:
    """A chat request's prompt: (its token ids, the chat format its answer is parsed
    with, whether thinking is on)."""
    messages = normalize_messages(body.get("messages"))
    tools = _check_tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict):   # one function by name: the answer is a call of it (constrained)
        _named_tool(tool_choice, tools)
        tool_choice = "required"
    elif tool_choice is not None and tool_choice not in ("auto", "none", "required"):
        raise bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}.", "tool_choice", "invalid_value")
    response_format = body.get("response_format")
    if response_format is not None and not (isinstance(response_format, dict)
                                            and response_format.get("type") in ("text", "json_object", "json_schema")):
        raise bad("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}.",
                  "response_format", "invalid_value")
    thinking, effort = _thinking(body, ctx)
    if _json_format(response_format) or (tools and tool_choice == "required"):
        thinking, effort = False, None   # a constrained answer starts at once (no think channel)
    fmt = ctx.chat_format(thinking, effort)
    tok = ctx.tokenizer
    try:
        if isinstance(fmt, K3Format):
            fmt = K3Format(tok, thinking, effort, tools)
            segs = render_k3(messages, tools, thinking=thinking, thinking_effort=effort, add_generation_prompt=True,
                             tool_choice=tool_choice, response_format=response_format)
            prompt = tok.encode_segments(segs)
        else:
            if tool_choice not in (None, "auto") or (response_format or {}).get("type", "text") != "text":
                raise bad("this model's chat template takes no 'tool_choice' or 'response_format'.",
                          "tool_choice" if tool_choice not in (None, "auto") else "response_format",
                          "unsupported_parameter")
            fmt = copy.copy(fmt)
            fmt.tools = tools
            prompt = fmt.prompt_ids(messages, add_generation_prompt=True)
    except K3Error as e:
        raise bad(str(e), "messages", "invalid_value") from None
    from ..prompt_cache import Prompt   # its message ends: the prompt cache's snapshot points
    return Prompt(prompt, fmt.message_ends(prompt)), fmt, thinking


# ====================================================================== /v1/completions
def prepare_constraints(ctx: ModelContext) -> None:
    """The grammar engine's vocabulary tables for the answers' end tokens (chat, raw
    completions), built before the server listens: they take seconds for a large
    vocabulary, which the first constrained request would otherwise wait for (blocking
    the others)."""
    from ..constrain import prepare
    if ctx.tokenizer is None:
        return
    ends = [completion_stop_ids(ctx)]
    try:
        ends.append(ctx.chat_format(False, None).stop_ids)
    except ApiError:   # no chat format: completions only
        pass
    for e in ends:
        prepare(ctx.tokenizer, ctx.cfg.vocab_size, e)


def completion_stop_ids(ctx: ModelContext) -> frozenset:
    """A raw completion ends at the end-of-text token (the tokenizer's eos_token and the
    config's eos_token_id)."""
    ids = set()
    if ctx.tokenizer is not None and ctx.tokenizer.eos_id is not None:
        ids.add(int(ctx.tokenizer.eos_id))
    eos = getattr(ctx.cfg, "eos_token_id", None)
    for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if _is_int(e):
            ids.add(e)
    return frozenset(ids)


def parse_completion(body: dict, ctx: ModelContext) -> GenRequest:
    check_model(body, ctx)
    refuse_unsupported(body)
    stream, include_usage = _stream_opts(body)
    if opt_bool(body, "echo"):
        raise bad("'echo' is not supported.", "echo", "unsupported_parameter")
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported.", "suffix", "unsupported_parameter")
    best_of = opt_int(body, "best_of", lo=1)
    if best_of not in (None, 1):
        raise bad("'best_of' must be 1.", "best_of", "unsupported_value")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    vocab = ctx.cfg.vocab_size
    if isinstance(p, str):
        if ctx.tokenizer is None:
            raise bad(f"this model ({ctx.name}) has no tokenizer (tiktoken.model): give the prompt as token ids.",
                      "prompt", "no_tokenizer")
        prompt = ctx.tokenizer.encode(p)
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        bad_ids = [t for t in p if not 0 <= t < vocab]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside this model's vocabulary (0..{vocab - 1}).", "prompt",
                      "invalid_value")
        prompt = list(p)
    elif isinstance(p, list) and len(p) > 1:
        raise bad("k3 serve takes one prompt per request (a string or an array of token ids), not a batch; send "
                  "several requests instead: they are decoded together.", "prompt", "unsupported_value")
    else:
        raise bad("'prompt' must be a string or a non-empty array of token ids.", "prompt",
                  "missing_required_parameter" if p is None else "invalid_type")
    if not prompt:
        raise bad("the prompt is empty: give at least one token.", "prompt", "invalid_value")
    max_tokens = _max_tokens(body, ctx, len(prompt), ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
    sampler, settings = make_sampler(ctx, body)
    if body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' is a chat parameter; a completion takes 'logprobs': N (0..20).", "top_logprobs",
                  "unsupported_parameter")
    rf = body.get("response_format")   # (an extension, as vLLM's: the raw text constrained to JSON)
    constraint = None
    if rf is not None and not (isinstance(rf, dict) and rf.get("type", "text") == "text"):
        if not _json_format(rf):
            raise bad("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}.",
                      "response_format", "invalid_value")
        constraint = _json_constraint(rf, completion_stop_ids(ctx), ctx)
    return GenRequest("completion", prompt, max_tokens, sampler, completion_stop_ids(ctx), stop_strings(body),
                      stream, include_usage, opt_bool(body, "return_token_ids"), settings=settings,
                      constraint=constraint, bias=logit_bias(body, ctx),
                      logprobs=None if body.get("logprobs") is False else
                      opt_int(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS))


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


# ====================================================================== response objects
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


SYSTEM_FINGERPRINT = "k3"
