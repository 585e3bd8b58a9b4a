"""`k3 serve`'s Anthropic Messages API, driven by the official `anthropic` client on
loopback: a plain turn streamed and not (the same answer), thinking blocks on and off,
a tool_use -> tool_result history, count_tokens against the chat endpoint's prompt,
Anthropic's error shapes (400, 401), x-api-key."""

from __future__ import annotations

import anthropic
import pytest
from test_server import KEY, MAX_CONTEXT, ServerProc, http

from k3.server.anthropic import to_chat_body
from k3.synth import synthesize


@pytest.fixture(scope="module")
def k3dir(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("k3msg") / "tiny", preset="tiny", arch="k3", seed=11)


@pytest.fixture(scope="module")
def srv(k3dir):
    s = ServerProc(k3dir, "--max-batch", "4", "--max-context", str(MAX_CONTEXT), "--api-key", KEY)
    yield s
    if s.p.poll() is None:
        assert s.stop() == 0, "".join(s.err)


def client(s, key=KEY):
    return anthropic.Anthropic(base_url=s.url, api_key=key, max_retries=0, timeout=120)


MSGS = [{"role": "user", "content": "Hello, who are you?"}]


def test_a_turn_streamed_and_not_gives_the_same_answer(srv):
    c = client(srv)
    m = c.messages.create(model="tiny", max_tokens=8, messages=MSGS, extra_body={"temperature": 0},
                          thinking={"type": "disabled"})
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("max_tokens", "end_turn") and m.usage.output_tokens <= 8
    assert m.usage.input_tokens > 0
    with c.messages.stream(model="tiny", max_tokens=8, messages=MSGS, extra_body={"temperature": 0},
                           thinking={"type": "disabled"}) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert [b.text for b in final.content] == [b.text for b in m.content]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_thinking_blocks(srv):
    """K3's think channel comes back as a thinking block first (the synthetic model never
    leaves it within a few tokens), streamed as thinking deltas; disabled, none."""
    c = client(srv)
    m = c.messages.create(model="tiny", max_tokens=6, messages=MSGS, extra_body={"temperature": 0},
                          thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking
    with c.messages.stream(model="tiny", max_tokens=6, messages=MSGS, extra_body={"temperature": 0},
                           thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == m.content[0].thinking
    off = c.messages.create(model="tiny", max_tokens=6, messages=MSGS, extra_body={"temperature": 0},
                            thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in off.content)


def test_tool_use_history_and_count_tokens(srv):
    """A tool_use -> tool_result history is rendered as the chat endpoint renders the same
    turns (count_tokens equals its prompt tokens), and answered."""
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": "18 C, sunny"}]}]
    c = client(srv)
    n = c.messages.count_tokens(model="tiny", messages=history, tools=tools, system="Be brief.",
                                tool_choice={"type": "auto"}, thinking={"type": "disabled"}).input_tokens
    oa = [{"role": "system", "content": "Be brief."}, history[0],
          {"role": "assistant", "content": "Let me check.",
           "tool_calls": [{"id": "toolu_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"}]
    code, body = http("POST", srv.url + "/v1/chat/completions",
                      {"model": "tiny", "messages": oa, "max_tokens": 1, "reasoning_effort": "none",
                       "tool_choice": "auto",
                       "tools": [{"type": "function", "function": {"name": "get_weather",
                                                                   "description": "Weather for a city",
                                                                   "parameters": tools[0]["input_schema"]}}]},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert code == 200 and body["usage"]["prompt_tokens"] == n
    m = c.messages.create(model="tiny", max_tokens=4, messages=history, tools=tools, system="Be brief.",
                          tool_choice={"type": "auto"}, thinking={"type": "disabled"})
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_a_tool_round_trip(srv):
    """tool_choice naming a tool: a tool_use block whose input validates against its
    input_schema (stop_reason tool_use); its tool_result sent back gets an answer."""
    import jsonschema
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 12}}}
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": schema}]
    c = client(srv)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    m = c.messages.create(model="tiny", max_tokens=200, messages=msgs, tools=tools,
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather"
    jsonschema.validate(use[0].input, schema)
    with c.messages.stream(model="tiny", max_tokens=200, messages=msgs, tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [use[0].input]
    back = msgs + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                 "content": "18 C, sunny"}]}]
    answer = c.messages.create(model="tiny", max_tokens=6, messages=back, tools=tools, thinking={"type": "disabled"})
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    # any, one call at most: exactly one tool_use, valid
    body = {"model": "tiny", "max_tokens": 200, "messages": msgs, "tools": tools,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    assert to_chat_body(body)["parallel_tool_calls"] is False
    m = c.messages.create(**body, extra_body={"temperature": 0.9})
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(use) == 1
    jsonschema.validate(use[0].input, schema)


def test_errors_have_anthropics_shape(srv):
    c = client(srv)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=0, messages=MSGS)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-x", max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(srv, "wrong").messages.create(model="tiny", max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):   # a prefilled assistant turn to continue: not supported
        c.messages.create(model="tiny", max_tokens=4, messages=MSGS + [{"role": "assistant", "content": "I am"}])
    code, body = http("GET", srv.url + "/v1/messages", headers={"x-api-key": KEY})   # 405, Anthropic's shape
    assert code == 405 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    # x-api-key (what the client sends) is the key; Bearer works as well
    assert http("POST", srv.url + "/v1/messages/count_tokens", {"model": "tiny", "messages": MSGS},
                headers={"Authorization": f"Bearer {KEY}"})[0] == 200
