"""The grammar a request puts on its answer (k3.constrain): ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` and a JSON ``response_format``, as the chat and completion
requests check them (docs/SERVER.md).
"""

from __future__ import annotations

import logging

from ..answer_grammar import MAX_CALLS, answer_grammar
from ..chat_format import K3Format
from ..errors import K3Error
from .checks import ModelContext, bad, opt_bool

log = logging.getLogger("k3.serve")


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
