"""The grammar of a K3 answer (llguidance's Lark), for constrained decoding (k3.constrain).

An answer starts after the generation prompt (`<|open|>message role="assistant"<|sep|>`
and `<|open|>think<|sep|>`, or `<|open|>response<|sep|>` with thinking off) and is
written as the rendered history writes an assistant message (k3.chat_format):

    [think text  <|close|>think<|sep|> <|open|>response<|sep|>]
    response     <|close|>response<|sep|>
    [<|open|>tools<|sep|> call ... <|close|>tools<|sep|>]
    <|close|>message<|sep|>                       (then the format's end token)

Free text (think, a text response) is any text without special tokens. A JSON response
is JSON valid against its schema. Each call is `<|open|>call tool="NAME" index="k"<|sep|>`
(k counting from 1) holding the tool's arguments in either form K3 writes:
one `argument key="K" type="T"` block per argument, whose value is raw text for a string
and JSON text otherwise, or one `json type="object"` block. Both forms are held to the
tool's JSON schema: the `json` block through the grammar engine's JSON schema support,
the argument blocks by a grammar derived from the schema's properties (in their
declared order, the required ones present, each value valid against its property's
schema). A schema the argument form cannot express exactly (references or combinators
at its top, a required property with a string pattern or format, ...) leaves that tool
the `json` form only; an optional property it cannot express can only be given in the
`json` form. So whatever the grammar lets through parses into arguments that validate.
The whitespace between JSON tokens is bounded (JSON_TEXT_WS, JSON_CALL_WS), so a schema
whose every value is bounded bounds the answer's length.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Sequence

from .chat_format import CLOSE, OPEN, SEP, _escape

MAX_CALLS = 16      # calls one answer may make (a forced or a single call: 1)
CALLS = ("none", "auto", "required")

# Schema keys the argument form honours (anything else: the json form only).
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
                "$comment", "strict", "default", "examples"}
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
_STRING_KEYS = _ANNOTATIONS | {"type", "enum", "const", "minLength", "maxLength"}
_JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")

# Whitespace between JSON tokens (llguidance lets any run of it through by default: a
# noise model spent its whole budget on it, and no schema could bound an answer's
# length). JSON the answer gives as text (a JSON response): a space, or one newline and
# an indent of at most 20 (pretty-printed JSON, as llama.cpp's grammars allow). JSON in
# K3's own tool-call format (a json block, an argument's value): at most one space, as
# the rendered history writes it (json.dumps on one line).
JSON_TEXT_WS = {"whitespace_pattern": r" |\n[ \t]{0,20}"}
JSON_CALL_WS = {"whitespace_pattern": " ?"}


def json_schema_ws(schema: dict, ws: dict) -> dict:
    """``schema`` with llguidance's whitespace options ``ws`` at its top (over any the
    schema's own x-guidance sets)."""
    opts = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(opts if isinstance(opts, dict) else {}), **ws}}


def _json_rule(name: str, schema: dict, ws: dict) -> str:
    return f"{name}: %json {json.dumps(json_schema_ws(schema, ws), ensure_ascii=False)}"


def _lit(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


def _has_ref(v: Any) -> bool:
    if isinstance(v, dict):
        return "$ref" in v or "$defs" in v or "definitions" in v or any(_has_ref(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_ref(x) for x in v)
    return False


def _string_value(schema: dict, values: list | None) -> str | None:
    """The grammar of a string argument's raw text, or None where it cannot be exact."""
    if set(schema) - _STRING_KEYS:
        return None
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
        return None
    if values is not None:
        ok = [v for v in values if isinstance(v, str) and lo <= len(v) and (hi is None or len(v) <= hi)]
        return "(" + " | ".join(_lit(v) for v in ok) + ")" if ok else None
    if hi is not None and hi < lo:
        return None
    return f"/(?s:.{{{lo},{'' if hi is None else hi}}})/" if lo or hi is not None else "/(?s:.*)/"


def _value_alternatives(schema: Any, rules: list[str], name: str, s: str) -> list[str] | None:
    """The alternatives of one argument block after `type="`: per K3 type the type's
    name, `<|sep|>` and the value (rules it needs appended to ``rules``); None where the
    property cannot be written in the argument form."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None and not isinstance(values, list):
        return None
    t = schema.get("type")
    if t is None:
        types = sorted({_json_type(v) for v in values}, key=_JSON_TYPES.index) if values is not None else _JSON_TYPES
    else:
        types = [t] if isinstance(t, str) else t
        if not isinstance(types, list) or not all(x in _JSON_TYPES for x in types):
            return None
    if "integer" in types and "number" in types:
        types = [x for x in types if x != "integer"]
    out = []
    for jt in types:
        if jt == "string":
            value = _string_value(schema, values)
        else:
            sub = {k: v for k, v in schema.items() if k not in ("const", "enum")} | {"type": jt}
            if values is not None:
                kept = [v for v in values if _json_type(v) == jt or (jt == "number" and _json_type(v) == "integer")]
                if not kept:
                    continue
                sub["enum"] = kept
            rule = f"{name}_{jt}"
            rules.append(_json_rule(rule, sub, JSON_CALL_WS))
            value = rule
        if value is not None:
            kind = "number" if jt == "integer" else jt
            out.append(f'{_lit(kind + chr(34))} {s} {value}')
    return out or None


def _argument_form(schema: Any, rules: list[str], name: str, tags: tuple[str, str, str]) -> str | None:
    """The argument blocks of a call whose arguments must validate against ``schema``
    (rules appended to ``rules``; ``tags`` the open, close and separator tokens), or
    None where that cannot be said exactly. A property whose values cannot be said
    exactly is left out (given in the json block only) unless it is required."""
    o, c, s = tags
    if not isinstance(schema, dict) or set(schema) - _OBJECT_KEYS or schema.get("type", "object") != "object":
        return None
    if _has_ref(schema):
        return None
    props = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list) or any(r not in props for r in required):
        return None
    parts = []
    for i, (key, sub) in enumerate(props.items()):
        alts = _value_alternatives(sub, rules, f"{name}_{i}", s)
        if alts is None:
            if key in required:
                return None
            continue
        rule = f"{name}_{i}"
        head = _lit(f'argument key="{_escape(key)}" type="')
        rules.append(f"{rule}: {o} {head} ({' | '.join(alts)}) {c} \"argument\" {s}")
        parts.append(rule if key in required else f"{rule}?")
    return " ".join(parts) if parts else '""'


def answer_grammar(tok, *, thinking: bool, content_schema: dict | None = None, json_content: bool = False,
                   tools: Sequence[tuple[str, Any]] = (), calls: str = "auto", max_calls: int = MAX_CALLS,
                   json_only: Collection[str] = ()) -> str:
    """The Lark grammar of an assistant answer (see the module's doc).

    ``thinking``: the generation prompt opened the think channel. ``json_content``: the
    response is JSON valid against ``content_schema`` (None: any object), else free text.
    ``tools``: [(name, JSON schema of its arguments)]; ``calls``: none (no tools block),
    auto (the model's choice; with a JSON response, either the JSON or an empty response
    and calls), required (an empty response, then calls); at most ``max_calls`` calls.
    The tools named in ``json_only`` are given the json form only."""
    if calls not in CALLS:
        raise ValueError(f"calls must be one of {CALLS}, got {calls!r}")
    ids = {"o": tok.token_id(OPEN), "c": tok.token_id(CLOSE), "s": tok.token_id(SEP)}
    o, c, s = (f"<[{ids[k]}]>" for k in "ocs")
    rules: list[str] = ["TEXT: /(?s:.*)/"]
    close_resp = f'{c} "response" {s}'
    if json_content:
        schema = content_schema if isinstance(content_schema, dict) else {"type": "object"}
        rules.append(_json_rule("content", schema, JSON_TEXT_WS))
        content = "content"
    else:
        content = "TEXT"
    if tools and calls != "none":
        rules += _tools_rules(tools, max(1, min(int(max_calls), MAX_CALLS)), set(json_only), (o, c, s))
        if calls == "required":
            body = f"{close_resp} tools"
        elif json_content:
            body = f"({close_resp} tools | {content} {close_resp})"
        else:
            body = f"{content} {close_resp} tools?"
    else:
        body = f"{content} {close_resp}"
    think = f'TEXT {c} "think" {s} {o} "response" {s} ' if thinking else ""
    start = f'start: {think}{body} {c} "message" {s}'
    return "\n".join([start] + rules) + "\n"


def _tools_rules(tools, max_calls: int, json_only: set, tags) -> list[str]:
    o, c, s = tags
    rules = [f'tools: {o} "tools" {s} calls1 {c} "tools" {s}']
    for i, (name, schema) in enumerate(tools):
        schema = schema if isinstance(schema, dict) else {"type": "object"}
        rules.append(_json_rule(f"json{i}", schema, JSON_CALL_WS))
        alts = [f'{o} "json type=\\"object\\"" {s} json{i} {c} "json" {s}']
        args = None if name in json_only else _argument_form(schema, rules, f"arg{i}", tags)
        if args is not None:
            alts.append(args)
        rules.append(f"args{i}: {' | '.join(alts)}")
    for k in range(1, max_calls + 1):
        heads = " | ".join(f'{_lit(_escape(name) + chr(34) + f" index={chr(34)}{k}{chr(34)}")} {s} args{i}'
                           for i, (name, _) in enumerate(tools))
        rules.append(f'call{k}: {o} "call tool=\\"" ({heads}) {c} "call" {s}')
        rules.append(f"calls{k}: call{k}" + (f" calls{k + 1}?" if k < max_calls else ""))
    return rules
