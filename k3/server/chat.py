"""/v1/chat/completions requests (and the Messages API, translated into them): the
messages, tools and thinking settings checked, the prompt rendered in the model's chat
format, one GenRequest built (docs/SERVER.md).
"""

from __future__ import annotations

import copy
from typing import Any

from ..chat_format import THINKING_EFFORTS, K3Format, render_k3
from ..errors import K3Error
from .checks import (MAX_TOP_LOGPROBS, GenRequest, ModelContext, _kind, _max_tokens, _stream_opts, bad,
                     check_model, logit_bias, make_sampler, opt_bool, opt_int, refuse_unsupported, stop_strings)
from .constraints import _constraint, _json_format, _named_tool


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


def _chat_logprobs(body: dict) -> int | None:
    """A chat request's logprobs: None, or the number of alternatives (top_logprobs, 0..20,
    which needs logprobs: true)."""
    top = opt_int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if not opt_bool(body, "logprobs"):
        if top is not None:
            raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs", "invalid_value")
        return None
    return top or 0


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
