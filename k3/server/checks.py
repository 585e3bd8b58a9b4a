"""The request checks both APIs share (/v1/chat/completions, /v1/completions, and the
Messages API through the chat path): OpenAI-style errors, the checks of single fields,
and what the server knows (its defaults, the loaded model, one checked request), with
the parts of a request every endpoint reads (model, stream, sampling, max_tokens).

What a request may ask for, and how it maps onto the engine, is in docs/SERVER.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import K3Error
from ..tokenizer import Tokenizer

MAX_STOP_STRINGS = 4

#: the most alternatives a token's logprobs list (OpenAI's limit for top_logprobs)
MAX_TOP_LOGPROBS = 20


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
