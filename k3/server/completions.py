"""/v1/completions requests: a raw prompt (text or token ids) checked into one
GenRequest, the end tokens of a raw completion, and the grammar tables built before
the server listens (docs/SERVER.md).
"""

from __future__ import annotations

from .checks import (MAX_TOP_LOGPROBS, ApiError, GenRequest, ModelContext, _is_int, _max_tokens, _stream_opts, bad,
                     check_model, logit_bias, make_sampler, opt_bool, opt_int, refuse_unsupported, stop_strings)
from .constraints import _json_constraint, _json_format

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
