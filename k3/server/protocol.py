"""The OpenAI side of `k3 serve`, without the web stack: request checks that answer with
OpenAI-style error bodies, prompt rendering (the model's chat format, tools), the
sampler of each request, and the builders that turn generated tokens into
``content`` / ``reasoning_content`` / ``tool_calls`` (and text for /v1/completions),
with ``stop`` strings held back until they can no longer match.

This module is where the rest of k3 imports these names from; they live by subject in:

* :mod:`k3.server.checks` - errors with OpenAI-style bodies, the single-field checks,
  what the server knows (ServeDefaults, ModelContext, GenRequest) and the request parts
  every endpoint reads (model, stream, sampling, max_tokens).
* :mod:`k3.server.chat` - /v1/chat/completions: messages, thinking, the rendered prompt.
* :mod:`k3.server.constraints` - tools / tool_choice / response_format as a grammar on
  the answer.
* :mod:`k3.server.completions` - /v1/completions: a raw prompt, its end tokens.
* :mod:`k3.server.tool_calls` - tool calls out of generated tokens (K3's tags, Kimi's
  section).
* :mod:`k3.server.answers` - generated tokens -> chat deltas or completion text, stop
  strings, finish reasons, logprobs, ids and usage of the response objects.

What a request may ask for, and how it maps onto the engine, is in docs/SERVER.md.
"""

from __future__ import annotations

from .answers import (SYSTEM_FINGERPRINT, ChatAnswer, CompletionAnswer, StopMatcher, finish_reason, new_id, now,
                      token_logprobs, usage)
from .chat import ROLES, normalize_messages, parse_chat, render_chat
from .checks import (MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, ApiError, GenRequest, ModelContext, ServeDefaults, bad,
                     check_model, error_body, logit_bias, make_sampler, opt_bool, opt_int, opt_num, parse_json_body,
                     refuse_unsupported, stop_strings)
from .completions import COMPLETION_DEFAULT_MAX_TOKENS, completion_stop_ids, parse_completion, prepare_constraints
from .tool_calls import K2_CALL, K2_SECTION, K2ToolCalls, XTMLToolCalls, new_call_id

__all__ = [
    "ApiError", "error_body", "bad", "parse_json_body", "opt_bool", "opt_int", "opt_num", "stop_strings",
    "refuse_unsupported", "logit_bias", "ServeDefaults", "ModelContext", "GenRequest", "check_model", "make_sampler",
    "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "COMPLETION_DEFAULT_MAX_TOKENS",
    "ROLES", "normalize_messages", "parse_chat", "render_chat",
    "prepare_constraints", "completion_stop_ids", "parse_completion",
    "new_call_id", "XTMLToolCalls", "K2_SECTION", "K2_CALL", "K2ToolCalls",
    "StopMatcher", "CompletionAnswer", "ChatAnswer", "finish_reason", "token_logprobs",
    "new_id", "now", "usage", "SYSTEM_FINGERPRINT",
]
