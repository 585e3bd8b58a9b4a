"""Constrained decoding: a grammar the generated tokens must follow.

Before a constrained sequence's token is picked, the tokens that would break the grammar
are masked (their logits set to -inf), so greedy takes the best allowed token and the
sampler draws among the allowed ones; the picked token then advances the grammar. Once
the grammar is complete only the end tokens are allowed. The grammar engine is
llguidance (the one llama.cpp and vLLM use; it builds its token tables from a tiktoken
vocabulary directly); it is imported only when a constrained request comes.

The mask never touches the logits a caller sees (``Step.logits``, logprobs): they stay
the model's.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from . import env
from .errors import UsageError

_LL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # Tokenizer -> {(vocab, ends): LLTokenizer}
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # Tokenizer -> {key: matcher or refusal}
COMPILED_KEPT = 64   # compiled grammars kept per tokenizer (least recently used dropped)
_LOCK = threading.Lock()


def _ll_tokenizer(tok, vocab: int, ends: tuple):
    """llguidance's view of ``tok`` (its tables take a while for a large vocabulary: kept
    per tokenizer), with ``ends`` as the tokens that may end a complete answer."""
    import llguidance.tiktoken
    with _LOCK:
        per = _LL.setdefault(tok, {})
        key = (vocab, ends)
        if key not in per:
            per[key] = llguidance.tiktoken.lltokenizer_from_encoding(tok.enc, n_vocab=vocab, eos_token=list(ends))
        return per[key]


def prepare(tok, vocab: int, ends) -> None:
    """Build the grammar engine's tables for ``tok`` with the end tokens ``ends`` now,
    and the token-class masks its first grammar builds lazily (a server at start: the
    first constrained request then does not wait for them)."""
    json_constraint(tok, {"type": "object", "properties": {"a": {"type": "string"}}}, ends, vocab).mask(
        torch.zeros(vocab))


class Constraint:
    """One sequence's grammar: ``mask(logits)`` the logits with every token the grammar
    does not allow next at -inf (a copy, kept until the next one), ``accept(token)``
    after the token is picked."""

    def __init__(self, matcher, vocab: int):
        import llguidance.torch
        self.m = matcher
        self._lt = llguidance.torch
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        self._out: list = []   # the masked copies' buffers, one per row of a pass (masked_rows)
        self._compiled = env.fused()   # the mask as one compiled pass (k3.kernels.bitmask)

    def mask(self, logits: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """(``slot``: which of the sequence's buffers the copy goes to; a copy stays
        valid until the next one into the same slot.)"""
        from .kernels.bitmask import masked_copy
        if not self._compiled:   # K3_FUSED=0: llguidance's own torch mask (the same bits)
            out = logits.reshape(1, -1).to(torch.float32, copy=True)
            self._lt.fill_next_token_bitmask(self.m, self.bitmask, 0)
            self._lt.apply_token_bitmask_inplace(out, self.bitmask)
            return out.reshape(logits.shape)
        while slot >= len(self._out):
            self._out.append(np.empty(0, dtype=np.float32))
        if self._out[slot].shape[0] != logits.numel():
            self._out[slot] = np.empty(logits.numel(), dtype=np.float32)
        self._lt.fill_next_token_bitmask(self.m, self.bitmask, 0)
        return masked_copy(logits, self.bitmask, self._out[slot])

    def accept(self, token: int) -> None:
        if not self.m.consume_token(int(token)) and not self.m.is_stopped():
            raise RuntimeError(f"constrained decoding: token {token} was not allowed: {self.m.get_error()}")

    def valid_prefix(self, tokens) -> int:
        """How many of ``tokens`` (drafts) the grammar allows in a row from here."""
        return int(self.m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def masked_rows(self, rows, drafts) -> list:
        """``rows`` (the logits of the last token and of each draft) each masked for the
        grammar as it stands once the drafts before it are taken (the drafts must be a
        valid prefix, ``valid_prefix``); the grammar is left where it was."""
        out = []
        for k, d in enumerate(drafts):
            out.append(self.mask(rows[k], k))
            self.m.consume_token(int(d))
        out.append(self.mask(rows[len(drafts)], len(drafts)))
        if drafts:
            self.m.rollback(len(drafts))
        return out


def json_constraint(tok, schema: dict | None, ends, vocab: int) -> Constraint:
    """A constraint to JSON text: valid against ``schema`` (None: any JSON object; its
    whitespace bounded as answer_grammar.JSON_TEXT_WS says), then one of the tokens
    ``ends``. UsageError naming the problem for a schema the grammar engine cannot take."""
    import llguidance
    from .answer_grammar import JSON_TEXT_WS, json_schema_ws
    schema = json_schema_ws(schema if schema is not None else {"type": "object"}, JSON_TEXT_WS)
    return _constraint(tok, ("json", json.dumps(schema)),
                       lambda: llguidance.LLMatcher.grammar_from_json_schema(schema), ends, vocab, "the JSON schema")


def lark_constraint(tok, lark: str, ends, vocab: int, what: str) -> Constraint:
    """A constraint to a Lark grammar (llguidance's: ``<[id]>`` is one token, ``%json
    {schema}`` JSON valid against the schema), then one of the tokens ``ends``."""
    import llguidance
    return _constraint(tok, ("lark", lark), lambda: llguidance.LLMatcher.grammar_from_lark(lark), ends, vocab, what)


def _constraint(tok, key: tuple, grammar, ends, vocab: int, what: str) -> Constraint:
    """A fresh copy of the matcher ``grammar()`` compiles, kept per tokenizer under
    ``key`` (the grammar's text) with its refusal too: agents send the same tools with
    every request, and a grammar with many tools takes milliseconds to compile."""
    import llguidance
    if tok is None:
        raise UsageError("constrained output needs the model's tokenizer (tiktoken.model).")
    ends = tuple(sorted({int(e) for e in ends}))
    key = (vocab, ends) + key
    with _LOCK:
        cache = _COMPILED.setdefault(tok, OrderedDict())
        got = cache.get(key)
        if got is not None:
            cache.move_to_end(key)
    if got is None:
        try:
            m = llguidance.LLMatcher(_ll_tokenizer(tok, vocab, ends), grammar())
            got = m.get_error() if m.is_error() else m
        except (ValueError, TypeError, RuntimeError) as e:
            got = str(e)
        with _LOCK:
            cache[key] = got
            while len(cache) > COMPILED_KEPT:
                cache.popitem(last=False)
    if isinstance(got, str):
        raise UsageError(f"{what} cannot be used to constrain the output: {got}")
    return Constraint(got.deep_copy(), vocab)
