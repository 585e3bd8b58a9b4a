"""Tokenizer: parity of tiktoken (as configured by k3.tokenizer) with an independent
rank-BPE over Python `regex` (V1) pre-tokenization, round trips, specials, the
long-input splitting rules, and streaming decode."""

from __future__ import annotations

import base64
import json

import pytest
import regex

from k3.errors import UsageError
from k3.synth import synthesize
from k3.tokenizer import MAX_RUN, NUM_RESERVED, PAT_STR, StreamDecoder, Tokenizer, pieces, read_ranks, split_runs

SAMPLES = [
    "",
    "hello world",
    "The capital of France is Paris.",
    "中文测试，汉字很多。混合 English text 和中文",
    "日本語のテキストとカタカナ、ひらがな",
    "한국어 문장도 있습니다",
    "emoji 😀🌍🚀 and flags 🇫🇷🇯🇵",
    "family 👨‍👩‍👧‍👦 ZWJ, 🏳️‍🌈 and skin tones 👍🏽",
    "café naïve façade résumé; combining e\u0301 a\u0300 n\u0303",
    "don't I'LL we've they'RE she's it'd you'M THEY'S",
    "tabs\tand\r\nCRLF\n\n\nblank lines   \n  trailing   ",
    " " * 70 + "x" + "\t" * 9 + "\n" * 5,
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10 ٣٤٥",
    "code: def f(x):\n    return x**2  # square\n\tif a != b: pass",
    "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>",
    "[EOS] [BOS] <|im_end|> <|reserved_token_1030|> <| |> <|not_a_token|>",
    "Ελληνικά, русский текст, עברית, العربية",
    "\u200b zero width \ufeff BOM \u00a0 nbsp \u3000 ideographic space",
    "MixedCASEWords camelCase snake_case kebab-case ALLCAPS",
    "invalid-ish \ud7ff \ue000 private use \U0010fffd",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for arch in ("k3", "kimi_linear"):
        d = tmp_path_factory.mktemp(arch)
        synthesize(d, preset="tiny", arch=arch, seed=3)
        out[arch] = d
    return out


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def tok_and_ranks(request, folders):
    d = folders[request.param]
    return Tokenizer(d), read_ranks(d / "tiktoken.model")


def _bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def reference_encode(text: str, ranks) -> list[int]:
    out = []
    for piece in pieces(text):
        for m in regex.findall(PAT_STR, piece, flags=regex.V1):
            out += _bpe(m.encode("utf-8"), ranks)
    return out


@pytest.mark.parametrize("text", SAMPLES)
def test_parity_with_reference_bpe_and_round_trip(tok_and_ranks, text):
    tok, ranks = tok_and_ranks
    ids = tok.encode(text)
    assert ids == reference_encode(text, ranks)
    assert all(0 <= t < tok.n_base for t in ids)  # plain text never yields a special id
    assert tok.decode(ids) == text


def test_pattern_splits_as_specified():
    words = regex.findall(PAT_STR, "中文English text's 123456 !!\n\n  x", flags=regex.V1)
    assert words == ["中文", "English", " text's", " ", "123", "456", " !!\n\n", " ", " x"]
    # Han is its own run even next to other letters; the letter classes exclude it
    assert regex.findall(PAT_STR, "abc中def", flags=regex.V1) == ["abc", "中", "def"]


def test_specials_only_when_allowed(folders):
    tok = Tokenizer(folders["k3"])
    n = tok.n_base
    assert tok.vocab_size == n + NUM_RESERVED
    assert tok.encode("<|open|>", allow_special=True) == [n + 3]
    plain = tok.encode("<|open|>")
    assert len(plain) > 1 and all(t < n for t in plain)
    assert tok.decode(plain) == "<|open|>"
    text = 'a<|open|>message<|sep|>b<|end_of_msg|>[EOS]'
    ids = tok.encode(text, allow_special=True)
    assert [t for t in ids if t >= n] == [n + 3, n + 5, n + 2, n + 1]
    assert tok.decode(ids) == text
    assert tok.encode_segments([("<|sep|>", True), ("<|sep|>", False)])[0] == n + 5
    # named and reserved specials
    assert tok.token_id("<|end_of_msg|>") == n + 2 and tok.token_id("[EOS]") == n + 1
    assert tok.id_to_special[n + 8] == f"<|reserved_token_{n + 8}|>"
    assert tok.encode(f"<|reserved_token_{n + 8}|>", allow_special=True) == [n + 8]
    assert tok.bos_id == n and tok.eos_id == n + 2 and tok.pad_id == n + 255
    assert tok.is_special(n) and not tok.is_special(n - 1)
    with pytest.raises(UsageError):
        tok.token_id("<|no_such|>")


def test_no_bos_added(folders):
    tok = Tokenizer(folders["k3"])
    ids = tok.encode("The capital of France is")
    assert ids and ids[0] != tok.bos_id and tok.bos_id not in ids


def test_long_input_splitting_rules():
    assert [len(p) for p in split_runs(" " * 60_000)] == [MAX_RUN, MAX_RUN, 10_000]
    assert [len(p) for p in split_runs("a" * 25_000 + " " * 25_000)] == [50_000]
    s = "x" * 25_001 + " " + "y" * 3
    assert list(split_runs(s)) == ["x" * 25_000, "x" + " " + "yyy"]
    assert list(split_runs("")) == [""]
    # 400,000-character pieces first, then the run rule inside each
    long = ("ab " * 200_000)[:600_000]
    ps = list(pieces(long))
    assert "".join(ps) == long and len(ps) == 2 and len(ps[0]) == 400_000


def test_long_inputs_encode_piecewise(folders):
    tok = Tokenizer(folders["k3"])
    for text in (" " * 60_000, "a" * 60_000, "中" * 30_000, ("hello world\n" * 40_000)):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        expect = []
        for p in pieces(text):
            expect += tok.enc.encode(p, disallowed_special=())
        assert ids == expect
    # the run limit really cuts: 60,000 spaces are not one whitespace run
    assert tok.encode(" " * 60_000) == tok.encode(" " * 25_000) * 2 + tok.encode(" " * 10_000)


@pytest.mark.parametrize("text", SAMPLES[3:9] + ["é" * 7, "🇫🇷👨‍👩‍👧"])
def test_stream_decoder_never_breaks_utf8(folders, text):
    tok = Tokenizer(folders["k3"])
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    chunks = [dec.push(t) for t in ids] + [dec.flush()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_stream_decoder_holds_split_characters(folders):
    tok = Tokenizer(folders["k3"])
    # single-byte tokens (ranks 0..255) split a 4-byte emoji into four tokens
    data = "😀".encode()
    dec = StreamDecoder(tok)
    outs = [dec.push(b) for b in data]
    assert outs == ["", "", "", "😀"]
    # invalid bytes come out replaced, never as a broken sequence
    outs = [dec.push(0xFF), dec.push(ord("a")), dec.push(0xE4), dec.flush()]
    assert "".join(outs) == "\ufffda\ufffd"


def test_refuses_damaged_files(tmp_path, folders):
    src = folders["k3"]
    d = tmp_path / "bad"
    d.mkdir()
    lines = (src / "tiktoken.model").read_bytes().splitlines()
    (d / "tiktoken.model").write_bytes(b"\n".join(lines[:10] + [b"not base64!! 10"]) + b"\n")
    with pytest.raises(UsageError, match="line 11"):
        Tokenizer(d)
    (d / "tiktoken.model").write_bytes(b"\n".join(lines[:10] + [lines[3]]) + b"\n")
    with pytest.raises(UsageError, match="repeats"):
        Tokenizer(d)
    (d / "tiktoken.model").write_bytes(b"\n".join(lines[:5] + lines[6:10]) + b"\n")
    with pytest.raises(UsageError, match="contiguous"):
        Tokenizer(d)
    (d / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["5"] = {"content": "<|oops|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="outside the special range"):
        Tokenizer(d)
    (d / "tokenizer_config.json").unlink()
    t = Tokenizer(d)  # no config: every special is a reserved name
    assert t.id_to_special[t.n_base] == f"<|reserved_token_{t.n_base}|>"
    with pytest.raises(UsageError, match="no tiktoken.model"):
        Tokenizer(tmp_path)


def test_ranks_file_format(tmp_path):
    toks = [bytes([b]) for b in range(256)] + [b"ab", b"abc"]
    (tmp_path / "tiktoken.model").write_bytes(
        b"".join(base64.b64encode(t) + b" " + str(i).encode() + b"\n" for i, t in enumerate(toks)))
    t = Tokenizer(tmp_path)
    assert t.n_base == 258 and t.encode("abc") == [257] and t.encode("abab") == [256, 256]
