"""Kimi's tiktoken BPE tokenizer, built from a model folder's `tiktoken.model` and
`tokenizer_config.json` (spec 5).

No BOS is added. Control text is encoded with specials allowed; user text with
specials disabled (a literal `<|open|>` typed by a user is ordinary text). Long
inputs are split the way the release does before calling tiktoken.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from .errors import UsageError

PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256
MAX_CHARS = 400_000
MAX_RUN = 25_000


def _split_runs(s: str, max_run: int):
    """Cut s so that no run of whitespace or of non-whitespace exceeds max_run chars."""
    start, run, kind = 0, 0, None
    for i, ch in enumerate(s):
        k = ch.isspace()
        run = run + 1 if k == kind else 1
        kind = k
        if run > max_run:
            yield s[start:i]
            start, run = i, 1
    yield s[start:]


class Tokenizer:
    def __init__(self, model_dir):
        import tiktoken

        d = Path(model_dir)
        path = d / "tiktoken.model"
        if not path.is_file():
            raise UsageError(f"{path}: no tiktoken.model in the model folder; a text prompt needs the tokenizer "
                             "(or pass token ids with --ids).")
        ranks = {}
        try:
            for n, line in enumerate(path.read_bytes().splitlines(), 1):
                if not line.strip():
                    continue
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        except (ValueError, base64.binascii.Error):
            raise UsageError(f"{path}: line {n} is not `base64(token) rank`; the file is damaged.") from None
        n_base = len(ranks)
        names = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                tc = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise UsageError(f"{cfg_path}: not valid JSON ({e.msg}).") from None
            for k, v in (tc.get("added_tokens_decoder") or {}).items():
                names[int(k)] = v["content"] if isinstance(v, dict) else str(v)
        specials = {}
        for i in range(n_base, n_base + NUM_RESERVED):
            specials[names.get(i, f"<|reserved_token_{i}|>")] = i
        self.enc = tiktoken.Encoding(name=f"kimi:{d.name}", pat_str=PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=specials)
        self.n_base = n_base
        self.special_ids = specials
        self.id_to_special = {v: k for k, v in specials.items()}
        self.vocab_size = n_base + NUM_RESERVED

    def _pieces(self, text: str):
        for i in range(0, len(text), MAX_CHARS):
            yield from _split_runs(text[i:i + MAX_CHARS], MAX_RUN)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        out: list[int] = []
        for piece in self._pieces(text):
            if allow_special:
                out += self.enc.encode(piece, allowed_special="all")
            else:
                out += self.enc.encode(piece, disallowed_special=())
        return out

    def decode_bytes(self, ids) -> bytes:
        return self.enc.decode_bytes([int(t) for t in ids])

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Incremental detokenizer that never emits a broken UTF-8 sequence."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.buf = b""

    def push(self, token: int) -> str:
        self.buf += self.tok.decode_bytes([token])
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                s = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.buf = self.buf[cut:]
            return s
        # Invalid bytes (not merely an unfinished character): emit them replaced,
        # keeping only a possible unfinished tail.
        s, self.buf = self.buf[:-3].decode("utf-8", errors="replace"), self.buf[-3:]
        return s

    def flush(self) -> str:
        s, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return s
