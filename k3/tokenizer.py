"""Kimi's tiktoken BPE tokenizer, built from a model folder's `tiktoken.model` and
`tokenizer_config.json` (docs/MODEL.md §5).

* `tiktoken.model`: one `base64(token bytes) rank` line per mergeable token.
* 256 special ids follow the last rank; their names come from
  `tokenizer_config.json`'s `added_tokens_decoder`, the rest are
  `<|reserved_token_{id}|>`.
* The split pattern is Kimi's `pat_str` (Han runs first, Han removed from the letter
  classes; `&&` class intersection, which tiktoken's regex engine and Python's
  `regex` module in V1 mode both read the same way).
* No BOS is added. Control text is encoded with specials allowed; user text with
  specials disabled, so a literal `<|open|>` typed by a user is ordinary text.
* Long inputs are cut the way the release does before calling tiktoken: pieces of at
  most 400,000 characters, then so that no run of whitespace or of non-whitespace is
  longer than 25,000 characters.

`StreamDecoder` turns a token stream into text without ever emitting a broken UTF-8
sequence (a character split across tokens is held back until it is complete).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from .fsutil import json_kind, path_problem, read_json_file, short_repr
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

TOKENIZER_FILE = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

Segment = tuple[str, bool]  # (text, allow_special)


def split_runs(s: str, max_run: int = MAX_RUN) -> Iterator[str]:
    """Cut s so that no run of whitespace or of non-whitespace exceeds max_run chars
    (a run that reaches the limit is cut there; the next piece continues it)."""
    start, run, kind = 0, 0, None
    for i, ch in enumerate(s):
        k = ch.isspace()
        run = run + 1 if k == kind else 1
        kind = k
        if run > max_run:
            yield s[start:i]
            start, run = i, 1
    yield s[start:]


def pieces(text: str, max_chars: int = MAX_CHARS, max_run: int = MAX_RUN) -> Iterator[str]:
    """The pieces the release hands to tiktoken one at a time."""
    for i in range(0, len(text), max_chars):
        yield from split_runs(text[i:i + max_chars], max_run)


_TOKEN_ID_RE = re.compile(r"[0-9]{1,12}")
_MAX_RANK_DIGITS = 12


def _first_line(lines: list[bytes], until: int, pred) -> int:
    """1-based number of the first line before `until` whose (token, rank) fields
    satisfy pred (for messages only: the hot loop keeps no line numbers)."""
    for n, line in enumerate(lines[:until - 1], 1):
        f = line.split()
        if len(f) == 2 and pred(f):
            return n
    return 0  # pragma: no cover


def read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken.model file; refuses anything that is not `base64 rank` lines
    with distinct tokens, ranks 0..n-1 and every single byte a token (tiktoken's
    byte-level BPE cannot encode text otherwise). Each refusal names the line."""
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    why = path_problem(path)
    if why is not None:
        raise UsageError(f"{path}: the tokenizer file {why}.")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UsageError(f"{path}: cannot read the tokenizer ({e.strerror}).") from None
    damaged = "the file is damaged; re-download it"
    lines = data.splitlines()
    b64 = base64.b64decode
    for n, line in enumerate(lines, 1):
        fields = line.split()
        if len(fields) != 2:
            if not fields:
                continue
            raise UsageError(f"{path}: line {n} is not `base64(token) rank` (it has {len(fields)} fields, "
                             f"{short_repr(line)}); {damaged}.")
        tok, rank_s = fields
        try:
            tok_b = b64(tok, validate=True)
        except (ValueError, binascii.Error):
            raise UsageError(f"{path}: line {n} is not `base64(token) rank`: {short_repr(tok)} is not valid base64; "
                             f"{damaged}.") from None
        if not tok_b:
            raise UsageError(f"{path}: line {n} is not `base64(token) rank`: the token is empty; {damaged}.")
        if not rank_s.isdigit() or len(rank_s) > _MAX_RANK_DIGITS:  # bytes.isdigit: ASCII digits only
            raise UsageError(f"{path}: line {n} is not `base64(token) rank`: the rank {short_repr(rank_s)} is not a "
                             f"non-negative decimal integer (of at most {_MAX_RANK_DIGITS} digits); {damaged}.")
        rank = int(rank_s)
        if tok_b in ranks:
            first = _first_line(lines, n, lambda f: b64(f[0]) == tok_b)
            raise UsageError(f"{path}: line {n} repeats the token of line {first}; {damaged}.")
        if rank in seen_ranks:
            first = _first_line(lines, n, lambda f: int(f[1]) == rank)
            raise UsageError(f"{path}: line {n} repeats rank {rank}, already given on line {first}; {damaged}.")
        ranks[tok_b] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise UsageError(f"{path}: the tokenizer file is empty.")
    n_ranks = len(ranks)
    if max(seen_ranks) != n_ranks - 1:  # distinct ranks: contiguous iff the largest is n-1
        r = min(r for r in seen_ranks if r >= n_ranks)
        where = _first_line(lines, len(lines) + 1, lambda f: f[1].isdigit() and int(f[1]) == r)
        raise UsageError(f"{path}: ranks are not the contiguous range 0..{n_ranks - 1}: line {where} "
                         f"has rank {r}; {damaged}.")
    lacking = [b for b in range(256) if bytes([b]) not in ranks]
    if lacking:
        shown = ", ".join(f"0x{b:02x}" for b in lacking[:8]) + (f" and {len(lacking) - 8} more" if len(lacking) > 8
                                                             else "")
        raise UsageError(f"{path}: {len(lacking)} single bytes ({shown}) are not tokens; a byte-level BPE "
                         f"vocabulary needs all 256, or some text cannot be encoded. {damaged[0].upper()}"
                         f"{damaged[1:]}.")
    return ranks


class Tokenizer:
    """Kimi tokenizer for one model folder. `encode(text)` treats everything as plain
    text; `encode(text, allow_special=True)` matches special-token names;
    `encode_segments` encodes a rendered chat (a list of (text, allow_special))."""

    def __init__(self, model_dir):
        import tiktoken

        d = Path(model_dir)
        self.dir = d
        path = d / TOKENIZER_FILE
        if not os.path.lexists(path):
            raise UsageError(f"{path}: no {TOKENIZER_FILE} in the model folder; a text prompt needs the tokenizer "
                             "(or pass token ids with --ids).")
        ranks = read_ranks(path)
        n_base = len(ranks)
        names: dict[int, str] = {}
        self.config: dict = {}
        cfg_path = d / TOKENIZER_CONFIG
        if os.path.lexists(cfg_path):  # present but not a file (a directory, a broken link) is refused
            tc = read_json_file(cfg_path, error=UsageError, hint="Fix it or restore the release's file.")
            if not isinstance(tc, dict):
                raise UsageError(f"{cfg_path}: tokenizer_config.json must hold a JSON object, not {json_kind(tc)}. "
                                 "Fix it or restore the release's file.")
            self.config = tc
            atd = tc.get("added_tokens_decoder")
            if atd is not None and not isinstance(atd, dict):
                raise UsageError(f"{cfg_path}: `added_tokens_decoder` must be an object (token id -> "
                                 f"{{\"content\": name, ...}}), got {json_kind(atd)}.")
            for k, v in (atd or {}).items():
                if not _TOKEN_ID_RE.fullmatch(k):
                    raise UsageError(f"{cfg_path}: `added_tokens_decoder` key {short_repr(k)} is not a token id "
                                     "(a non-negative decimal integer).")
                i = int(k)
                name = v.get("content") if isinstance(v, dict) else v
                if not isinstance(name, str) or not name:
                    raise UsageError(f"{cfg_path}: `added_tokens_decoder.{k}` has no `content` string (it must be "
                                     f"an object like {{\"content\": \"[EOS]\"}}), got {short_repr(v)}.")
                if not n_base <= i < n_base + NUM_RESERVED:
                    raise UsageError(
                        f"{cfg_path}: added token {i} ({name!r}) is outside the special range "
                        f"{n_base}..{n_base + NUM_RESERVED - 1} that follows the {n_base} ranks of {TOKENIZER_FILE}. "
                        "The tokenizer files do not belong together.")
                names[i] = name
        specials: dict[str, int] = {}
        for i in range(n_base, n_base + NUM_RESERVED):
            name = names.get(i, f"<|reserved_token_{i}|>")
            if name in specials:
                raise UsageError(f"{cfg_path}: the special token name {name!r} is given to both "
                                 f"{specials[name]} and {i}.")
            specials[name] = i
        try:
            self.enc = tiktoken.Encoding(name=f"kimi:{d.name}", pat_str=PAT_STR, mergeable_ranks=ranks,
                                         special_tokens=specials)
        except ValueError as e:
            raise UsageError(
                f"{path}: tiktoken refuses this vocabulary ({e}); the tokenizer files are damaged.") from None
        self.n_base = n_base
        self.special_ids = specials
        self.id_to_special = {v: k for k, v in specials.items()}
        self.vocab_size = n_base + NUM_RESERVED

    # ---------------------------------------------------------------- names and ids
    def token_id(self, name: str) -> int:
        """Id of a special token by name (e.g. "<|end_of_msg|>")."""
        try:
            return self.special_ids[name]
        except KeyError:
            raise UsageError(f"{self.dir}: the tokenizer has no special token {name!r}.") from None

    def has_special(self, name: str) -> bool:
        return name in self.special_ids

    def is_special(self, token: int) -> bool:
        return int(token) >= self.n_base

    def _named(self, key: str) -> int | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return self.special_ids.get(v) if isinstance(v, str) else None

    @property
    def bos_id(self) -> int | None:
        return self._named("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._named("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._named("pad_token")

    def chat_template(self) -> str | None:
        """The folder's Jinja chat template: `chat_template.jinja`, else the
        `chat_template` field of tokenizer_config.json (None when neither exists)."""
        f = self.dir / CHAT_TEMPLATE_FILE
        if f.is_file():
            try:
                return f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"{f}: cannot read the chat template ({e}).") from None
        t = self.config.get("chat_template")
        if isinstance(t, str):
            return t
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            for entry in t:
                if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                    return entry["template"]
        return None

    # ---------------------------------------------------------------- encode / decode
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        out: list[int] = []
        for piece in pieces(text):
            if not piece:
                continue
            if allow_special:
                out += self.enc.encode(piece, allowed_special="all")
            else:
                out += self.enc.encode(piece, disallowed_special=())
        return out

    def encode_segments(self, segments: Iterable[Segment]) -> list[int]:
        """Encode a rendered chat segment by segment (never concatenated first, so the
        boundary between control text and user text is kept)."""
        out: list[int] = []
        for text, allow_special in segments:
            out += self.encode(text, allow_special=allow_special)
        return out

    def _check_ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the tokenizer's vocabulary (0..{self.vocab_size - 1}, "
                             f"from {self.dir / TOKENIZER_FILE}); the tokenizer and config.json do not belong "
                             "together.")
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.enc.decode_bytes(self._check_ids([int(t) for t in ids]))

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self.enc.decode_single_token_bytes(self._check_ids([int(token)])[0])


class StreamDecoder:
    """Incremental detokenizer: `push(token)` returns the text that is complete so
    far; bytes of a character split across tokens are held until it completes.
    Invalid bytes come out as U+FFFD, never as a broken sequence."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(self.tok.token_bytes(token))

    def push_bytes(self, data: bytes) -> str:
        return self._dec.decode(data)

    def flush(self) -> str:
        s = self._dec.decode(b"", final=True)
        self._dec.reset()
        return s
