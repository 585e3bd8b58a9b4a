"""k3.answer_grammar: the grammar of a whole K3 answer under constrained decoding.

A random "model" (noisy logits, the tag tokens pushed up so answers reach the tools
block) is decoded under the grammar, sampled; every answer ends with the end token,
every call it makes names a declared tool and its arguments, read back by the server's
own call parser, validate against the tool's schema (jsonschema, an independent
validator). Both argument forms K3 writes occur. The answers K3's rendered history
writes (k3.chat_format.render_k3) are answers the grammar takes, token for token."""

from __future__ import annotations

import json

import pytest
import torch

from k3.answer_grammar import answer_grammar
from k3.chat_format import CLOSE, END_OF_MSG, OPEN, SEP, render_k3
from k3.config import load_config
from k3.constrain import json_constraint, lark_constraint
from k3.server.protocol import XTMLToolCalls
from k3.synth import synthesize
from k3.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

TOOLS = [
    ("get_weather", {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                     "properties": {"city": {"type": "string", "maxLength": 12},
                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}),
    ("get_time", {"type": "object", "required": ["zone"],
                  "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}}}),
    ("ping", {"type": "object", "properties": {}}),
    ("mixed", {"type": "object", "additionalProperties": False,
               "properties": {"x": {"type": ["number", "null"]},
                              "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                              "flag": {"type": "boolean"}, "code": {"type": "string", "pattern": "^[a-z]+$"},
                              "mode": {"enum": ["fast", 1, None]}}}),
    ("by_ref", {"type": "object", "required": ["p"], "$defs": {"pt": {"type": "object", "required": ["x"],
                                                                      "properties": {"x": {"type": "integer"}}}},
                "properties": {"p": {"$ref": "#/$defs/pt"}}}),
]
SCHEMAS = dict(TOOLS)


VOCAB = {}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = synthesize(tmp_path_factory.mktemp("ag") / "tiny", preset="tiny", arch="k3", seed=11)
    t = Tokenizer(d)
    VOCAB[t] = load_config(d).vocab_size
    return t


def _vocab(tok) -> int:
    return VOCAB[tok]


def _walk(tok, grammar, seed, steps=500, push=5.0):
    """Sampled tokens of a noise model under ``grammar`` (an answer's Lark grammar, or a
    constraint; the tags favoured), the calls the server's parser reads out of them, and
    whether the end token came."""
    vocab = _vocab(tok)
    end = tok.token_id(END_OF_MSG)
    tags = [tok.token_id(n) for n in (OPEN, CLOSE, SEP)]
    con = lark_constraint(tok, grammar, [end], vocab, "test") if isinstance(grammar, str) else grammar
    g = torch.Generator().manual_seed(seed)
    parser, out = XTMLToolCalls(tok), []
    for _ in range(steps):
        logits = torch.randn(vocab, generator=g) * 2
        logits[tags] += push
        masked = con.mask(logits)
        assert masked[end] == float("-inf") or not out or out[-1] == tok.token_id(SEP) or con is grammar
        t = int(torch.multinomial(torch.softmax(masked, -1), 1, generator=g))
        out.append(t)
        if t == end:
            return out, parser.calls, True
        con.accept(t)
        parser.feed(t)
    return out, parser.calls, False


def _check_calls(calls, schemas):
    for c in calls:
        name = c["function"]["name"]
        assert name in schemas, name
        jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[name])


@pytest.mark.parametrize("thinking", [True, False])
def test_sampled_answers_make_only_valid_calls(tok, thinking):
    grammar = answer_grammar(tok, thinking=thinking, tools=TOOLS, calls="auto")
    ended = calls = forms = 0
    seen = set()
    for seed in range(30):
        out, got, done = _walk(tok, grammar, seed)
        ended += done
        _check_calls(got, SCHEMAS)
        calls += len(got)
        seen |= {c["function"]["name"] for c in got}
        text = tok.decode_bytes(out).decode("utf-8", "replace")
        forms |= (1 if "argument key=" in text else 0) | (2 if "json type=" in text else 0)
    assert ended >= 25 and calls >= 15, (ended, calls)
    assert forms == 3   # both argument forms were written
    assert {"get_weather", "get_time", "mixed", "by_ref"} <= seen


def test_required_named_single_and_none(tok):
    # required: a call at once (empty response), at most max_calls of them
    closed = [TOOLS[0], TOOLS[3]]   # no other keys: the noise model's calls end soon
    g1 = answer_grammar(tok, thinking=False, tools=closed, calls="required", max_calls=1)
    g0 = answer_grammar(tok, thinking=False, tools=TOOLS, calls="none")
    for seed in range(10):
        out, got, done = _walk(tok, g1, seed)
        assert done and len(got) == 1, (seed, got)
        _check_calls(got, SCHEMAS)
        first = out.index(tok.token_id(SEP))
        assert out[0] == tok.token_id(CLOSE) and tok.decode_bytes(out[1:first]) == b"response"
        out, got, done = _walk(tok, g0, seed)
        assert got == [] and b"tools" not in tok.decode_bytes(out)


def test_json_response_or_calls(tok):
    """A JSON response format with tools: either JSON in the response, or an empty
    response and calls."""
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}},
              "additionalProperties": False}
    g = answer_grammar(tok, thinking=False, json_content=True, content_schema=schema, tools=[TOOLS[0], TOOLS[3]],
                       calls="auto")
    kinds = set()
    for seed in range(20):
        out, got, done = _walk(tok, g, seed, push=5.0 * (seed % 2))   # even seeds: the tags not favoured
        _check_calls(got, SCHEMAS)
        assert done, seed   # (the JSON's whitespace is bounded: no walk runs on in it)
        body = tok.decode_bytes(out[:out.index(tok.token_id(CLOSE))]).decode()
        if got:
            assert body == ""
        else:
            jsonschema.validate(json.loads(body), schema)
        kinds.add("calls" if got else "json")
    assert kinds == {"json", "calls"}


def _answer_tokens(tok, history, thinking, declared=TOOLS):
    """The tokens of the last (assistant) message of ``history`` after the generation
    prompt, as render_k3 writes them (its <|end_of_msg|> included)."""
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in declared]
    full = tok.encode_segments(render_k3(history, tools, thinking=thinking, add_generation_prompt=False))
    head = tok.encode_segments(render_k3(history[:-1], tools, thinking=thinking, add_generation_prompt=True))
    assert full[:len(head)] == head
    return full[len(head):]


@pytest.mark.parametrize("thinking", [True, False])
def test_the_rendered_history_is_an_answer_the_grammar_takes(tok, thinking):
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
             {"type": "function", "function": {"name": "mixed",
                                               "arguments": {"x": None, "tags": [1, 2], "flag": True}}},
             {"type": "function", "function": {"name": "ping", "arguments": "{}"}},
             {"type": "function", "function": {"name": "by_ref", "arguments": {"p": {"x": 4}},
                                               "json_block": json.dumps({"p": {"x": 4}})}}]
    answers = [{"role": "assistant", "content": "Let me look.", "reasoning_content": "Weather, then time.",
                "tool_calls": calls},
               {"role": "assistant", "content": "It is sunny.\nAnything else?"}]
    grammar = answer_grammar(tok, thinking=thinking, tools=TOOLS, calls="auto")
    end = tok.token_id(END_OF_MSG)
    for answer in answers:
        ids = _answer_tokens(tok, [{"role": "user", "content": "Weather in Paris?"}, answer], thinking)
        assert ids[-1] == end
        con = lark_constraint(tok, grammar, [end], _vocab(tok), "test")
        for t in ids:
            assert con.mask(torch.zeros(_vocab(tok)))[t] == 0, (t, tok.decode_bytes([t]))
            if t != end:
                con.accept(t)


def test_a_schema_the_argument_form_cannot_say_leaves_the_json_form(tok):
    g = answer_grammar(tok, thinking=False, tools=[TOOLS[4]], calls="required")
    assert "arg0_" not in g and "json0" in g
    g = answer_grammar(tok, thinking=False, tools=[TOOLS[0]], calls="required")
    assert "arg0_0" in g and "arg0_1" in g
    g = answer_grammar(tok, thinking=False, tools=[TOOLS[0]], calls="required", json_only={"get_weather"})
    assert "arg0_" not in g


def _takes(tok, grammar, ids) -> bool:
    """Whether the grammar allows the answer ``ids`` (ending with the end token)."""
    end = tok.token_id(END_OF_MSG)
    con = lark_constraint(tok, grammar, [end], _vocab(tok), "test")
    for t in ids:
        if con.mask(torch.zeros(_vocab(tok)))[t] != 0:
            return False
        if t != end:
            con.accept(t)
    return True


def test_argument_blocks_keep_every_keyword_and_any_key(tok):
    """An enum with other keywords keeps them all (an enum value below the minimum is
    refused in the argument blocks as in the json block); a key holding what looks like
    a grammar's token reference is written as the text it is."""
    odd = "a<[{s}]>b"
    declared = [("pick", {"type": "object", "required": ["n", odd],
                          "properties": {"n": {"type": "integer", "enum": [1, 5], "minimum": 3},
                                         odd: {"type": "string"}}})]
    user = {"role": "user", "content": "Pick."}

    def answer(n):
        call = {"type": "function", "function": {"name": "pick", "arguments": {"n": n, odd: "x"}}}
        return _answer_tokens(tok, [user, {"role": "assistant", "content": "", "tool_calls": [call]}], False,
                              declared)
    g = answer_grammar(tok, thinking=False, tools=declared, calls="auto")
    assert _takes(tok, g, answer(5))
    assert not _takes(tok, g, answer(1))


def test_argument_values_come_back_as_strict_json(tok):
    """A number the grammar allows but Python reads as infinity (1e400) comes back as
    written, so the arguments stay strict JSON; a value that is not JSON comes back as a
    string."""
    from k3.chat_format import close_tag, open_tag
    segs = open_tag("tools") + open_tag("call", [("tool", "t"), ("index", 1)])
    for key, kind, text in (("x", "number", "1e400"), ("y", "number", "NaN"), ("z", "array", "[1, 2]")):
        segs += open_tag("argument", [("key", key), ("type", kind)]) + [(text, False)] + close_tag("argument")
    segs += close_tag("call") + close_tag("tools")
    parser = XTMLToolCalls(tok)
    for t in tok.encode_segments(segs):
        parser.feed(t)
    args = parser.calls[0]["function"]["arguments"]

    def strict(name):
        raise ValueError(name)
    assert json.loads(args, parse_constant=strict) == {"x": float("inf"), "y": "NaN", "z": [1, 2]}
    assert "1e400" in args


# every value bounded: a name of at most 20 characters, an age 0-150, at most 3 tags of at most 10
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}}}}


def test_bounded_json_whitespace_bounds_a_bounded_schemas_answers(tok):
    """Between JSON tokens the grammar lets through a space, or one newline and an indent
    of at most 20 (JSON the answer gives), at most one space in a tool call's JSON (K3's
    format writes it on one line); not any run of whitespace. So a noise model under a
    schema whose every value is bounded ends within 120 tokens, its JSON valid, both as
    a response_format of K3's answer grammar and as the bare JSON grammar (other chat
    formats, completions). (With any whitespace let through, most such answers ran out
    of tokens on it.)"""
    end = tok.token_id(END_OF_MSG)
    g = answer_grammar(tok, thinking=False, json_content=True, content_schema=PERSON, calls="none")
    for seed in range(8):
        for con in (lark_constraint(tok, g, [end], _vocab(tok), "test"),
                    json_constraint(tok, PERSON, [end], _vocab(tok))):
            out, _, done = _walk(tok, con, seed, steps=120, push=0.0)
            assert done, (seed, tok.decode_bytes(out))
            text = tok.decode_bytes(out[:-1]).decode()
            jsonschema.validate(json.loads(text.split(CLOSE)[0]), PERSON)

    person = {"name": "Ada", "age": 36, "tags": ["x", "y"]}
    pretty = json.dumps(person, indent=2)
    deep = '{"name": "Ada", "age": 36, "tags": [\n' + " " * 20 + '"x"]}'
    for text, ok in ((pretty, True), (json.dumps(person), True), (json.dumps(person, separators=(",", ":")), True),
                     (deep, True), (deep.replace('[\n', '[\n '), False), (pretty.replace("\n", "\n\n", 1), False),
                     (pretty.replace("\n", "\r\n", 1), False), (json.dumps(person).replace(": ", ":  "), False)):
        assert _takes(tok, g, tok.encode(text) + [tok.token_id(CLOSE)] + tok.encode("response")
                      + [tok.token_id(SEP), tok.token_id(CLOSE)] + tok.encode("message")
                      + [tok.token_id(SEP), end]) == ok, text
        con = json_constraint(tok, PERSON, [end], _vocab(tok))
        ids = tok.encode(text)
        assert (con.valid_prefix(ids) == len(ids)) == ok, text

    # a call's JSON: one line, at most one space between tokens
    declared = [TOOLS[0]]
    user = {"role": "user", "content": "Weather?"}
    g = answer_grammar(tok, thinking=False, tools=declared, calls="required")
    for block, ok in (('{"city": "Paris", "days": 3}', True), ('{"city":"Paris","days":3}', True),
                      ('{ "city": "Paris", "days": 3 }', True), ('{"city":  "Paris", "days": 3}', False),
                      ('{"city": "Paris",\n"days": 3}', False)):
        call = {"type": "function", "function": {"name": "get_weather", "arguments": block, "json_block": block}}
        ids = _answer_tokens(tok, [user, {"role": "assistant", "content": "", "tool_calls": [call]}], False, declared)
        assert _takes(tok, g, ids) == ok, block
