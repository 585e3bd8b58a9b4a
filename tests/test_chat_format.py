"""Chat formats: K3 XTML rendered token-exact against sequences written out by hand
from the spec (each control token by id, each text piece encoded as plain text), the
answer parser and its closing tokens, and Jinja chat templates (Kimi-Linear)."""

from __future__ import annotations

import json

import pytest

from k3.chat_format import (JinjaFormat, JinjaTemplate, K3Format, XTMLAnswerParser, chat_format_for, effort_text,
                            render_k3, segments_text)
from k3.config import load_config
from k3.errors import UsageError
from k3.synth import synthesize
from k3.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def k3dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    synthesize(d, preset="tiny", arch="k3", seed=5)
    return d


@pytest.fixture(scope="module")
def tok(k3dir):
    return Tokenizer(k3dir)


@pytest.fixture(scope="module")
def ids(tok):
    n = tok.n_base
    # spec 5: [EOS] +1, <|end_of_msg|> +2, <|open|> +3, <|close|> +4, <|sep|> +5
    return {"EOS": n + 1, "END": n + 2, "O": n + 3, "C": n + 4, "S": n + 5}


def build(tok, ids, *items):
    """Expected tokens: ints are control ids, strings are plain text pieces."""
    out = []
    for it in items:
        if isinstance(it, int):
            out.append(it)
        else:
            out += tok.encode(it)
    return out


def open_(ids, tag, **attrs):
    items = [ids["O"], tag]
    for k, v in attrs.items():
        items += [f" {k}", '="', v, '"']
    return items + [ids["S"]]


def close_(ids, tag):
    return [ids["C"], tag, ids["S"]]


def msg(ids, body, **attrs):
    return open_(ids, "message", **attrs) + [body] + close_(ids, "message") + [ids["END"]]


def test_spec_example_text(tok):
    segs = render_k3([{"role": "user", "content": "Hi"}], thinking_effort=None)
    assert segments_text(segs) == ('<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
                                   '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_user_turn_thinking_default_effort(tok, ids):
    got = tok.encode_segments(render_k3([{"role": "user", "content": "Hi"}]))
    want = build(tok, ids,
                 *msg(ids, effort_text("max"), role="system", type="thinking-effort"),
                 *msg(ids, "Hi", role="user"),
                 *open_(ids, "message", role="assistant"), *open_(ids, "think"))
    assert got == want
    assert effort_text("max").endswith("Now the system is invoked with `thinking_effort=max`.")


def test_system_user_assistant_with_thinking(tok, ids):
    conv = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    got = tok.encode_segments(render_k3(conv, thinking_effort="low"))
    want = build(tok, ids,
                 *msg(ids, effort_text("low"), role="system", type="thinking-effort"),
                 *msg(ids, "You are terse.", role="system"),
                 *msg(ids, "What is 2+2?", role="user"),
                 *open_(ids, "message", role="assistant"),
                 *open_(ids, "think"), "Add them.", *close_(ids, "think"),
                 *open_(ids, "response"), "4", *close_(ids, "response"),
                 *close_(ids, "message"), ids["END"],
                 *msg(ids, "And 3+3?", role="user"),
                 *open_(ids, "message", role="assistant"), *open_(ids, "think"))
    assert got == want
    # with ordinary content, piece-wise encoding equals encoding the rendered string
    assert got == tok.encode(segments_text(render_k3(conv, thinking_effort="low")), allow_special=True)


def test_thinking_off(tok, ids):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "hidden", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    got = tok.encode_segments(render_k3(conv, thinking=False))
    want = build(tok, ids,
                 *msg(ids, "Hi", role="user"),
                 *open_(ids, "message", role="assistant"),
                 *open_(ids, "response"), "Hello", *close_(ids, "response"),
                 *close_(ids, "message"), ids["END"],
                 *msg(ids, "Bye", role="user"),
                 *open_(ids, "message", role="assistant"), *open_(ids, "response"))
    assert got == want


def test_empty_reasoning_still_has_think_block(tok, ids):
    conv = [{"role": "assistant", "content": "ok", "reasoning_content": "   "}]
    got = tok.encode_segments(render_k3(conv, thinking_effort=None, add_generation_prompt=False))
    want = build(tok, ids, *open_(ids, "message", role="assistant"), *open_(ids, "think"), *close_(ids, "think"),
                 *open_(ids, "response"), "ok", *close_(ids, "response"), *close_(ids, "message"), ids["END"])
    assert got == want


def test_tools_declaration_calls_and_results(tok, ids):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    conv = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "reasoning_content": "Call it twice.", "content": "",
         "tool_calls": [
             {"type": "function", "function": {"name": "get_weather",
                                               "arguments": json.dumps({"city": "Paris", "days": 2, "metric": True,
                                                                        "hint": None, "opts": {"b": 1, "a": [1, 2]},
                                                                        "tags": ["x"]})}},
             {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "18C"},
        {"role": "tool", "tool": "get_weather", "content": "9C"},
        {"role": "assistant", "reasoning_content": "", "content": "Paris 18C, Oslo 9C."},
    ]
    got = tok.encode_segments(render_k3(conv, tools, thinking_effort=None, add_generation_prompt=False))
    declared = ('# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n'
                '[{"function":{"description":"Weather now","name":"get_weather","parameters":{"properties":'
                '{"city":{"type":"string"}},"type":"object"}},"type":"function"}]\n```')

    def arg(key, typ, value):
        return [*open_(ids, "argument", key=key, type=typ), value, *close_(ids, "argument")]

    want = build(tok, ids,
                 *msg(ids, declared, role="system", type="tool-declare"),
                 *msg(ids, "Weather in Paris and Oslo?", role="user"),
                 *open_(ids, "message", role="assistant"),
                 *open_(ids, "think"), "Call it twice.", *close_(ids, "think"),
                 *open_(ids, "response"), *close_(ids, "response"),
                 *open_(ids, "tools"),
                 *open_(ids, "call", tool="get_weather", index="1"),
                 *arg("city", "string", "Paris"), *arg("days", "number", "2"), *arg("metric", "boolean", "true"),
                 *arg("hint", "null", "null"), *arg("opts", "object", '{"b": 1, "a": [1, 2]}'),
                 *arg("tags", "array", '["x"]'),
                 *close_(ids, "call"),
                 *open_(ids, "call", tool="get_weather", index="2"), *arg("city", "string", "Oslo"),
                 *close_(ids, "call"),
                 *close_(ids, "tools"),
                 *close_(ids, "message"), ids["END"],
                 *msg(ids, "18C", role="tool", tool="get_weather", index="1"),
                 *msg(ids, "9C", role="tool", tool="get_weather", index="2"),
                 *open_(ids, "message", role="assistant"), *open_(ids, "think"), *close_(ids, "think"),
                 *open_(ids, "response"), "Paris 18C, Oslo 9C.", *close_(ids, "response"),
                 *close_(ids, "message"), ids["END"])
    assert got == want


def test_json_block_call_and_internal_system_messages(tok, ids):
    conv = [{"role": "assistant", "content": "x", "tool_calls": [{"name": "run", "arguments": "not json {"}]},
            {"role": "system", "tools": [{"name": "late"}]}]
    segs = render_k3(conv, thinking=False, add_generation_prompt=False, tool_choice="required",
                     response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "a": 1}}})
    text = segments_text(segs)
    assert ('<|open|>call tool="run" index="1"<|sep|><|open|>json type="object"<|sep|>not json {<|close|>json<|sep|>'
            '<|close|>call<|sep|>') in text
    assert '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\n' in text
    assert ('<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with '
            '`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|>') in text
    assert text.endswith('```json\n{"a":1,"type":"object"}\n```<|close|>message<|sep|><|end_of_msg|>')


def test_names_escaping_and_literal_specials(tok, ids):
    conv = [{"role": "user", "name": 'Bob & "Al"', "content": "type <|open|> and [EOS] here"}]
    got = tok.encode_segments(render_k3(conv, thinking_effort=None, add_generation_prompt=False))
    want = build(tok, ids, ids["O"], "message", " role", '="', "user", '"', " name", '="',
                 "Bob &amp; &quot;Al&quot;", '"', ids["S"], "type <|open|> and [EOS] here",
                 ids["C"], "message", ids["S"], ids["END"])
    assert got == want
    assert sum(1 for t in got if t >= tok.n_base) == 5  # open, sep, close, sep, end: the literal ones stayed text


def test_content_parts_and_refusals(tok):
    a = render_k3([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    b = render_k3([{"role": "user", "content": "ab"}])
    assert tok.encode_segments(a) == tok.encode_segments(b)
    with pytest.raises(UsageError, match="image"):
        render_k3([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    with pytest.raises(UsageError, match="tool's name"):
        render_k3([{"role": "tool", "content": "r"}])
    with pytest.raises(UsageError, match="unknown role"):
        render_k3([{"role": "robot", "content": "r"}])
    with pytest.raises(UsageError, match="thinking effort"):
        render_k3([], thinking_effort="extreme")


def test_k3_format_turns_compose(tok):
    fmt = K3Format(tok, thinking=True)
    h1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]
    ans = {"role": "assistant", "reasoning_content": "r", "content": "a1"}
    first = fmt.turn_ids([], h1)
    assert first == fmt.prompt_ids(h1)
    asst = tok.encode_segments(render_k3([ans], add_generation_prompt=False, preamble=False))
    second = fmt.turn_ids(h1 + [ans], [{"role": "user", "content": "u2"}])
    # transcript = prompt of turn 1 + the assistant message (from the generation prompt on) + turn 2
    gen = tok.encode_segments(render_k3([], preamble=False))
    assert asst[:len(gen)] == gen
    assert first + asst[len(gen):] + second == fmt.prompt_ids(h1 + [ans, {"role": "user", "content": "u2"}])
    assert fmt.stop_ids == {tok.token_id("<|end_of_msg|>"), tok.token_id("[EOS]")}


def _feed(parser, tok, text):
    out = []
    for t in tok.encode(text, allow_special=True):
        out += parser.feed(t)
    return out + parser.flush()


def test_answer_parser_channels_and_closing(tok, ids):
    p = XTMLAnswerParser(tok, thinking=True)
    ev = _feed(p, tok, "Let me see.<|close|>think<|sep|><|open|>response<|sep|>It is 4.<|close|>response<|sep|>"
                       "<|close|>message<|sep|>")
    assert p.reasoning == "Let me see." and p.content == "It is 4."
    assert {ch for ch, _ in ev} == {"think", "response"}
    assert p.closing() == [("<|end_of_msg|>", True)]

    p = XTMLAnswerParser(tok, thinking=True)
    _feed(p, tok, "still thinking")
    assert segments_text(p.closing()) == ("<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
                                          "<|close|>message<|sep|><|end_of_msg|>")
    p = XTMLAnswerParser(tok, thinking=False)
    _feed(p, tok, "partial answer")
    assert segments_text(p.closing()) == "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    p = XTMLAnswerParser(tok, thinking=True)
    _feed(p, tok, "x<|close|>think<|sep|><|open|>respo")  # cut inside a tag header
    text = segments_text(p.closing())
    assert text.startswith("<|sep|><|close|>respo<|sep|>") and text.endswith("<|close|>message<|sep|><|end_of_msg|>")
    p = XTMLAnswerParser(tok, thinking=False)
    _feed(p, tok, 'a<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>')
    assert p.content == "a"
    assert segments_text(p.closing()) == "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"


# ---------------------------------------------------------------- Jinja (Kimi-Linear)
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


@pytest.fixture(scope="module")
def kldir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kl")
    synthesize(d, preset="tiny", arch="kimi_linear", seed=5)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


def test_jinja_tokens_by_hand(kldir):
    tok = Tokenizer(kldir)
    fmt = chat_format_for(tok, load_config(kldir))
    assert isinstance(fmt, JinjaFormat)
    sp = tok.token_id
    conv = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "say <|im_end|> now"}]
    got = fmt.prompt_ids(conv)
    want = ([sp("<|im_system|>")] + tok.encode("system") + [sp("<|im_middle|>")] + tok.encode("Be kind.")
            + [sp("<|im_end|>"), sp("<|im_user|>")] + tok.encode("user") + [sp("<|im_middle|>")]
            + tok.encode("say <|im_end|> now") + [sp("<|im_end|>"), sp("<|im_assistant|>")]
            + tok.encode("assistant") + [sp("<|im_middle|>")])
    assert got == want
    # like transformers when contents hold no special names
    plain = [{"role": "user", "content": "hello"}]
    assert fmt.prompt_ids(plain) == tok.encode(fmt.template.render_text(plain), allow_special=True)
    assert fmt.end_id == sp("<|im_end|>") and sp("<|im_end|>") in fmt.stop_ids
    # a new turn extends the transcript by exactly the new tokens
    hist = conv + [{"role": "assistant", "content": "ok"}]
    new = [{"role": "user", "content": "again"}]
    delta = fmt.turn_ids(hist, new)
    assert fmt.prompt_ids(hist, add_generation_prompt=False) + delta == fmt.prompt_ids(hist + new)


def test_jinja_template_from_tokenizer_config_and_fallbacks(tmp_path, kldir):
    import shutil

    d = tmp_path / "kl2"
    shutil.copytree(kldir, d)
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<|im_user|>{{ m.content | upper }}<|im_end|>{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(d)
    fmt = chat_format_for(tok, load_config(d))
    # the template transforms the content: rendered as transformers does
    got = fmt.prompt_ids([{"role": "user", "content": "hi"}])
    assert got == [tok.token_id("<|im_user|>")] + tok.encode("HI") + [tok.token_id("<|im_end|>")]
    t = JinjaTemplate("{{ raise_exception('no system messages') }}")
    with pytest.raises(UsageError, match="no system messages"):
        t.render([])
    with pytest.raises(UsageError, match="does not parse"):
        JinjaTemplate("{% for %}")
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="no chat template"):
        chat_format_for(Tokenizer(d), load_config(d))


def test_k3_folder_uses_xtml(k3dir):
    tok = Tokenizer(k3dir)
    assert isinstance(chat_format_for(tok, load_config(k3dir)), K3Format)
    assert chat_format_for(tok, load_config(k3dir), thinking=False).parser().channel == "response"
