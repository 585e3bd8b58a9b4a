"""Bad input files end in a K3Error with one clear paragraph that names the file and
the field (or tensor) at fault, and the documented exit code (2: config, tokenizer,
generation config, state file; 3: checkpoint) - never a traceback and never k3's
"internal error" line. Driven through the command line (`k3.cli.main`) where a user
would meet the case, and through the readers for the cases below the command line.

Each case is one malformed input; the reader's one mechanism for that class of input
is what is under test (config.json: typed, finite, bounded fields; JSON files: one
strict loader; the checkpoint: path kinds, header types and bounds; state files:
typed metadata)."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest

from k3.checkpoint.safetensors import CheckpointIndex, read_header
from k3.cli import main
from k3.config import load_config, parse_config
from k3.errors import EXIT_CHECKPOINT, EXIT_USAGE, CheckpointError, ConfigError, K3Error, UsageError
from k3.sampling import generation_defaults
from k3.state import StateFileError, load_state, read_state_header
from k3.synth import build_config, synthesize
from k3.tokenizer import Tokenizer, read_ranks

IDS = "1,2,3"
INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("good") / "tiny"
    synthesize(d, preset="tiny", arch="k3", seed=5)
    return d


@pytest.fixture
def model(good, tmp_path) -> Path:
    """A private copy of the good model, free to damage."""
    d = tmp_path / "m"
    shutil.copytree(good, d)
    return d


@pytest.fixture(scope="module")
def saved_state(good, tmp_path_factory) -> Path:
    """A real state file, written by `k3 run --save-state` on the tiny model."""
    p = tmp_path_factory.mktemp("state") / "conv.k3state"
    assert main(["run", str(good), "--ids", IDS, "--gen", "2", "--save-state", str(p)]) == 0
    return p


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def assert_refused(code: int, err: str, want: int, *words: str) -> None:
    assert code == want, (code, err[-2000:])
    assert "Traceback" not in err, err
    assert "internal error" not in err, err
    assert "bug in k3" not in err, err
    for w in words:
        assert w in err, f"{w!r} not in: {err[-1500:]}"


def run_refused(capsys, model: Path, want: int, *words: str, extra=("--ids", IDS)) -> str:
    code, err = cli(capsys, "run", model, *extra, "--gen", 1)
    assert_refused(code, err, want, *words)
    return err


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))  # json.dumps writes NaN / Infinity as Python's json reads them


def edit_config(model: Path, edit) -> None:
    raw = json.loads((model / "config.json").read_text())
    edit(raw)
    write_json(model / "config.json", raw)


def set_path(d: dict, dotted: str, value) -> None:
    *head, last = dotted.split(".")
    for k in head:
        d = d[k]
    d[last] = value


def shard_names(model: Path) -> list[str]:
    return sorted(p.name for p in model.glob("model-*.safetensors"))


def rewrite_header(path: Path, edit=None, text: bytes | None = None) -> None:
    """Replace a safetensors file's header (by `edit(dict)` or raw `text`), keeping the data."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    data = raw[8 + n:]
    if text is None:
        hdr = json.loads(raw[8:8 + n])
        edit(hdr)
        text = json.dumps(hdr).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def raw_st(path: Path, header: bytes | str, data: bytes = b"") -> Path:
    if isinstance(header, str):
        header = header.encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


# ================================================================ 1. config.json
K3_FIELDS = [
    # (dotted path in the synthetic K3 config.json, value, words the message must hold)
    ("text_config.routed_scaling_factor", math.nan, ["routed_scaling_factor", "NaN", "finite"]),
    ("text_config.rms_norm_eps", math.inf, ["rms_norm_eps", "Infinity", "finite"]),
    ("text_config.rms_norm_eps", -math.inf, ["rms_norm_eps", "-Infinity"]),
    ("text_config.linear_attn_config.gate_lower_bound", math.nan, ["linear_attn_config.gate_lower_bound", "NaN"]),
    ("text_config.activation_situ_beta", math.inf, ["activation_situ_beta", "finite"]),
    ("text_config.activation_situ_beta", 0.0, ["activation_situ_beta", "(0, 10000]"]),
    ("text_config.routed_scaling_factor", 10 ** 400, ["routed_scaling_factor", "finite"]),
    ("text_config.routed_scaling_factor", "1.0", ["routed_scaling_factor", "must be a number", "string"]),
    ("text_config.hidden_size", "128", ["text_config.hidden_size", "integer", "string"]),
    ("text_config.hidden_size", True, ["text_config.hidden_size", "integer", "boolean"]),
    ("text_config.num_hidden_layers", 1e9, ["text_config.num_hidden_layers", "integer"]),
    ("text_config.num_hidden_layers", 8.0, ["text_config.num_hidden_layers", "integer"]),
    ("text_config.num_hidden_layers", 10 ** 9, ["text_config.num_hidden_layers", "at most 512"]),
    ("text_config.hidden_size", 10 ** 12, ["text_config.hidden_size", "at most 65536", "7168"]),
    ("text_config.vocab_size", 10 ** 9, ["text_config.vocab_size", "at most 1048576"]),
    ("text_config.num_experts", 10 ** 6, ["text_config.num_experts", "at most 4096", "896"]),
    ("text_config.moe_intermediate_size", 2 ** 40, ["moe_intermediate_size", "at most"]),
    ("text_config.num_experts_per_token", 17, ["num_experts_per_token", "exceeds", "num_experts"]),
    ("text_config.num_experts_per_token", 1000, ["num_experts_per_token", "at most 64"]),
    ("text_config.hidden_size", 0, ["text_config.hidden_size", ">= 1"]),
    ("text_config.vocab_size", -5, ["text_config.vocab_size", ">= 1"]),
    ("text_config.kv_lora_rank", None, ["text_config.kv_lora_rank", "null"]),
    ("text_config.vocab_size", [1280], ["text_config.vocab_size", "list"]),
    ("text_config.vocab_size", {"n": 1280}, ["text_config.vocab_size", "object"]),
    ("text_config.linear_attn_config", "kda", ["text_config.linear_attn_config", "must be an object"]),
    ("text_config.linear_attn_config.num_heads", [4], ["linear_attn_config.num_heads", "integer"]),
    ("text_config.linear_attn_config.head_dim", "32", ["linear_attn_config.head_dim", "integer"]),
    ("text_config.linear_attn_config.full_attn_layers", [10 ** 9], ["full_attn_layers", "1..8"]),
    ("text_config.quantization_config", [], ["text_config.quantization_config", "must be an object"]),
    ("text_config.quantization_config.config_groups", 5, ["quantization_config.config_groups", "object"]),
    ("text_config.quantization_config.config_groups.group_0", [], ["config_groups.group_0", "object"]),
    ("text_config.quantization_config.config_groups.group_0.weights", "w", ["group_0.weights", "object"]),
    ("text_config.quantization_config.config_groups.group_0.weights.group_size", "32", ["group_size", "integer"]),
    ("text_config.quantization_config.config_groups.group_0.weights.group_size", 0, ["group size must be 32"]),
    ("text_config", [], ["`text_config`", "must be an object"]),
    ("text_config.tie_word_embeddings", "false", ["tie_word_embeddings", "true or false"]),
]


@pytest.mark.parametrize("dotted,value,words", K3_FIELDS, ids=[f"{d}={v!r}"[:60] for d, v, _ in K3_FIELDS])
def test_config_field_refused_through_cli(capsys, model, dotted, value, words):
    edit_config(model, lambda raw: set_path(raw, dotted, value))
    run_refused(capsys, model, EXIT_USAGE, str(model / "config.json"), *words)


def test_config_limits_state_what_the_limit_is():
    raw = build_config("tiny", "k3")
    raw["text_config"]["num_hidden_layers"] = 10 ** 9
    with pytest.raises(ConfigError) as e:
        parse_config(raw, "cfg.json")
    msg = str(e.value)
    assert "cfg.json" in msg and "num_hidden_layers" in msg and "512" in msg and "93" in msg


def test_config_real_k3_values_pass():
    """The released K3's sizes and Kimi-Linear-48B's are inside every bound."""
    raw = build_config("realdims", "k3", layers=93, experts=896)
    raw["text_config"]["vocab_size"] = 163840
    cfg = parse_config(raw, "k3.json")
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.hidden_size, cfg.vocab_size) == (93, 896, 7168, 163840)
    kl = build_config("realdims", "kimi_linear", layers=27, experts=256)
    kl["vocab_size"] = 163840
    assert parse_config(kl, "kl.json").routed_scaling_factor == 2.446


def test_flat_config_fields_named_without_prefix():
    raw = build_config("tiny", "kimi_linear")
    raw["routed_scaling_factor"] = math.nan
    raw["linear_attn_config"]["num_heads"] = 10 ** 6
    with pytest.raises(ConfigError) as e:
        parse_config(raw, "kl.json")
    msg = str(e.value)
    assert "`routed_scaling_factor` is NaN" in msg and "`linear_attn_config.num_heads`" in msg and "2 problems" in msg


def test_config_non_utf8_byte_names_the_field(capsys, model):
    p = model / "config.json"
    p.write_bytes(p.read_bytes().replace(b'"hidden_act": "situ"', b'"hidden_act": "s\xfftu"'))
    err = run_refused(capsys, model, EXIT_USAGE, str(p), "UTF-8", "0xff", "text_config.hidden_act")
    assert "line" in err


@pytest.mark.parametrize("text,words", [
    (b"[1, 2, 3]", ["JSON object", "a list"]),
    (b'"config"', ["JSON object", "string"]),
    (b"null", ["JSON object", "null"]),
    (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]),
    (b'{"hidden_size": ' + b"9" * 5000 + b"}", ["not valid JSON"]),
    (b'{"hidden_size": 1, "hidden_size": 2}', ["`hidden_size` twice"]),
    (b"{not json", ["not valid JSON", "line 1"]),
])
def test_config_file_not_an_object_or_not_json(capsys, model, text, words):
    (model / "config.json").write_bytes(text)
    run_refused(capsys, model, EXIT_USAGE, "config.json", *words)


def test_config_path_is_a_directory_or_a_loop(capsys, model, tmp_path):
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json: is a directory"):
        load_config(model)
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match="symbolic link loop"):
        load_config(loop)
    code, err = cli(capsys, "run", model, "--config", loop, "--ids", IDS, "--gen", 1)
    assert_refused(code, err, EXIT_USAGE, str(loop), "symbolic link loop")


# ================================================================ 2. checkpoint: shard headers and the index
@pytest.mark.parametrize("edit,words", [
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype=["BF16"]), ["dtype"]),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype=None), ["dtype"]),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(shape="128"), ["shape"]),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(shape=[10 ** 30, 10 ** 30]), ["shape"]),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(shape=[1] * 100_000), ["dimensions"]),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(data_offsets={"a": 0, "b": 1}), ["data_offsets"]),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(data_offsets=[-8, 0]), ["data_offsets"]),
    (lambda h: h[next(k for k in h if k != "__metadata__")].update(data_offsets=[0, 2 ** 70]), ["data_offsets"]),
    (lambda h: h.update(__metadata__=[1]), ["__metadata__"]),
], ids=["dtype-list", "dtype-null", "shape-str", "shape-huge", "shape-rank", "offsets-obj", "offsets-neg",
        "offsets-huge", "meta-list"])
def test_shard_header_wrong_types_through_cli(capsys, model, edit, words):
    shard = model / shard_names(model)[2]
    rewrite_header(shard, edit)
    run_refused(capsys, model, EXIT_CHECKPOINT, str(shard), *words)


@pytest.mark.parametrize("text,words", [
    (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]),
    (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, ["nested too deeply"]),
    (b'{"t": {"dtype": "U8", "shape": [\xff], "data_offsets": [0, 1]}}', ["UTF-8", "0xff"]),
    (b'{"t": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}', ["not valid JSON"]),
    (b'{"t": {"dtype": "U8", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', ["`dtype` twice"]),
    (b'{"t": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}', ["shape"]),
])
def test_shard_header_bad_json(tmp_path, text, words):
    p = raw_st(tmp_path / "x.safetensors", text, b"x")
    with pytest.raises(CheckpointError) as e:
        read_header(p)
    assert e.value.exit_code == EXIT_CHECKPOINT
    msg = str(e.value)
    assert str(p) in msg and "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_deeply_nested_shard_header_through_cli(capsys, model):
    shard = model / shard_names(model)[0]
    rewrite_header(shard, text=b"[" * 200_000 + b"]" * 200_000)
    run_refused(capsys, model, EXIT_CHECKPOINT, str(shard), "nested too deeply")


@pytest.mark.parametrize("value", [["model-00001-of-000010.safetensors"], 7, None, {"f": 1}, True, 1.5, ""])
def test_index_weight_map_value_of_wrong_type(capsys, model, value):
    idx = json.loads((model / INDEX).read_text())
    name = sorted(idx["weight_map"])[3]
    idx["weight_map"][name] = value
    write_json(model / INDEX, idx)
    run_refused(capsys, model, EXIT_CHECKPOINT, str(model / INDEX), name, "not a plain file name")


@pytest.mark.parametrize("wm,words", [
    ([["a", "b"]], ["'weight_map'", "list"]),
    ("model-00001-of-000010.safetensors", ["'weight_map'", "str"]),
    (None, ["'weight_map'", "missing"]),
    ({}, ["'weight_map'", "empty"]),
])
def test_index_weight_map_not_an_object(capsys, model, wm, words):
    idx = json.loads((model / INDEX).read_text())
    idx["weight_map"] = wm
    write_json(model / INDEX, idx)
    run_refused(capsys, model, EXIT_CHECKPOINT, str(model / INDEX), *words)


@pytest.mark.parametrize("text,words", [
    (b"[" * 100_000, ["nested too deeply"]),
    (b'{"weight_map": {"a": "x.safetensors"}, "weight_map": {}}', ["twice"]),
    (b'{"weight_map": {"a": "x\xff.safetensors"}}', ["UTF-8", "weight_map.a"]),
    (b"[1]", ["list", "weight_map"]),
])
def test_index_bad_json(capsys, model, text, words):
    (model / INDEX).write_bytes(text)
    run_refused(capsys, model, EXIT_CHECKPOINT, str(model / INDEX), *words)


def test_shard_that_is_a_directory(capsys, model):
    name = shard_names(model)[4]
    (model / name).unlink()
    (model / name).mkdir()
    err = run_refused(capsys, model, EXIT_CHECKPOINT, name, "is a directory")
    assert "missing" not in err


def test_shard_that_is_a_broken_symlink(capsys, model, tmp_path):
    name = shard_names(model)[4]
    (model / name).unlink()
    (model / name).symlink_to(tmp_path / "gone.safetensors")
    err = run_refused(capsys, model, EXIT_CHECKPOINT, name, "broken symbolic link", "gone.safetensors")
    assert "missing" not in err


def test_shard_that_is_a_symlink_loop(capsys, model):
    name = shard_names(model)[4]
    (model / name).unlink()
    (model / name).symlink_to(model / name)
    err = run_refused(capsys, model, EXIT_CHECKPOINT, name, "symbolic link loop")
    assert "missing" not in err


def test_missing_shard_is_still_missing(capsys, model):
    name = shard_names(model)[4]
    (model / name).unlink()
    run_refused(capsys, model, EXIT_CHECKPOINT, name, "incomplete", "missing")


def test_index_that_is_a_broken_symlink(model):
    (model / INDEX).unlink()
    (model / INDEX).symlink_to(model / "elsewhere.json")
    with pytest.raises(CheckpointError, match="broken symbolic link") as e:
        CheckpointIndex.open(model)
    assert INDEX in str(e.value)


def test_directory_named_like_a_shard_without_index(tmp_path):
    from k3.checkpoint.writer import write_checkpoint
    import torch

    write_checkpoint(tmp_path, [[("a", torch.ones(2))]], index=False, fsync=False)
    (tmp_path / "stray.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="stray.safetensors is a directory"):
        CheckpointIndex.open(tmp_path)
    (tmp_path / "stray.safetensors").rmdir()
    (tmp_path / "loop.safetensors").symlink_to(tmp_path / "loop.safetensors")
    with pytest.raises(CheckpointError, match="loop.safetensors is a symbolic link loop"):
        CheckpointIndex.open(tmp_path)


def test_read_header_of_a_directory_or_fifo(tmp_path):
    d = tmp_path / "d.safetensors"
    d.mkdir()
    with pytest.raises(CheckpointError, match="is a directory"):
        read_header(d)
    f = tmp_path / "f.safetensors"
    os.mkfifo(f)
    with pytest.raises(CheckpointError, match="FIFO"):  # and never blocks waiting for a writer
        read_header(f)


# ================================================================ 3. tokenizer files
@pytest.mark.parametrize("content,words", [
    (["a", "b"], ["tokenizer_config.json", "JSON object", "list"]),
    ("tokenizer", ["tokenizer_config.json", "JSON object", "string"]),
    ({"added_tokens_decoder": ["[BOS]"]}, ["`added_tokens_decoder`", "must be an object", "list"]),
    ({"added_tokens_decoder": "x"}, ["`added_tokens_decoder`", "must be an object"]),
    ({"added_tokens_decoder": {"1024": {"content": 5}}}, ["`added_tokens_decoder.1024`", "content"]),
    ({"added_tokens_decoder": {"1024": ["[BOS]"]}}, ["`added_tokens_decoder.1024`", "content"]),
    ({"added_tokens_decoder": {"1024": None}}, ["`added_tokens_decoder.1024`", "content"]),
    ({"added_tokens_decoder": {"bos": {"content": "[BOS]"}}}, ["`added_tokens_decoder`", "'bos'", "token id"]),
    ({"added_tokens_decoder": {"9" * 5000: {"content": "[BOS]"}}}, ["`added_tokens_decoder`", "token id"]),
])
def test_tokenizer_config_wrong_types_through_cli(capsys, model, content, words):
    write_json(model / "tokenizer_config.json", content)
    run_refused(capsys, model, EXIT_USAGE, str(model / "tokenizer_config.json"), *words,
                extra=("--prompt", "hello"))


def test_tokenizer_config_not_utf8_or_deep(model):
    p = model / "tokenizer_config.json"
    p.write_bytes(b'{"bos_token": "\xfe"}')
    with pytest.raises(UsageError, match="UTF-8.*bos_token") as e:
        Tokenizer(model)
    assert str(p) in str(e.value)
    p.write_bytes(b"[" * 100_000)
    with pytest.raises(UsageError, match="nested too deeply"):
        Tokenizer(model)


def _lines(model):
    return (model / "tiktoken.model").read_bytes().splitlines()


@pytest.mark.parametrize("damage,words", [
    (lambda ls: ls[:300] + [ls[300] + b" 7"] + ls[301:], ["line 301", "3 fields"]),
    (lambda ls: ls[:300] + [ls[300].split()[0]] + ls[301:], ["line 301", "1 fields"]),
    (lambda ls: ls[:300] + [b"@@@@ 300"] + ls[301:], ["line 301", "base64"]),
    (lambda ls: ls[:300] + [ls[300].split()[0] + b" -300"] + ls[301:], ["line 301", "rank"]),
    (lambda ls: ls[:300] + [ls[300].split()[0] + b" 3e2"] + ls[301:], ["line 301", "rank"]),
    (lambda ls: ls[:300] + [ls[300].split()[0] + b" " + b"9" * 5000] + ls[301:], ["line 301", "rank"]),
    (lambda ls: ls[:300] + [ls[300].split()[0] + b" 99999"] + ls[301:], ["line 301", "99999", "contiguous"]),
    (lambda ls: ls[:300] + [ls[300].split()[0] + b" 299"] + ls[301:], ["line 301", "rank 299", "line 300"]),
    (lambda ls: ls[:65] + [b"QUFB " + ls[65].split()[1]] + ls[66:], ["0x41", "single bytes"]),
    (lambda ls: ls[:300] + [b"= 300"] + ls[301:], ["line 301"]),
], ids=["3-fields", "1-field", "bad-base64", "neg-rank", "float-rank", "huge-rank", "gap", "dup-rank",
        "no-byte-A", "empty-token"])
def test_tiktoken_model_malformed_line(capsys, model, damage, words):
    p = model / "tiktoken.model"
    p.write_bytes(b"\n".join(damage(_lines(model))) + b"\n")
    run_refused(capsys, model, EXIT_USAGE, str(p), *words, extra=("--prompt", "hello"))


def test_tiktoken_model_is_a_directory(model):
    p = model / "tiktoken.model"
    p.unlink()
    p.mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        read_ranks(p)
    with pytest.raises(UsageError, match="is a directory"):
        Tokenizer(model)


def test_decoding_an_id_outside_the_tokenizer(model):
    tok = Tokenizer(model)
    for bad in (tok.vocab_size, -1, 2 ** 40):
        with pytest.raises(UsageError, match="outside the tokenizer's vocabulary"):
            tok.decode([1, bad])
        with pytest.raises(UsageError, match="outside the tokenizer's vocabulary"):
            tok.token_bytes(bad)


# ================================================================ 4. generation_config.json
@pytest.mark.parametrize("gen,words", [
    ({"do_sample": True, "temperature": -1.0}, ["`temperature`", ">= 0"]),
    ({"do_sample": True, "temperature": math.nan}, ["`temperature`", "NaN"]),
    ({"do_sample": True, "temperature": math.inf}, ["`temperature`", "Infinity"]),
    ({"do_sample": True, "temperature": "hot"}, ["`temperature`", "string"]),
    ({"do_sample": True, "temperature": [1.0]}, ["`temperature`", "list"]),
    ({"do_sample": True, "top_p": 1.5}, ["`top_p`", "(0, 1]"]),
    ({"do_sample": True, "top_p": "0.9"}, ["`top_p`", "string"]),
    ({"do_sample": True, "top_k": -1}, ["`top_k`", ">= 0"]),
    ({"do_sample": True, "top_k": 1.5}, ["`top_k`", "integer"]),
    ({"do_sample": True, "top_k": True}, ["`top_k`", "boolean"]),
    ({"do_sample": "yes"}, ["`do_sample`", "true or false"]),
    ([1, 2], ["JSON object", "list"]),
])
def test_generation_config_bad_value_names_file_and_field(capsys, model, gen, words):
    write_json(model / "generation_config.json", gen)
    err = run_refused(capsys, model, EXIT_USAGE, str(model / "generation_config.json"), *words)
    assert "--temperature" not in err and "--top-p" not in err and "--top-k" not in err
    # the flags still override a good file, and a bad file is still named when flags are given
    code, err = cli(capsys, "run", model, "--ids", IDS, "--gen", 1, "--temperature", "0.5", "--seed", "1")
    assert_refused(code, err, EXIT_USAGE, "generation_config.json")


def test_generation_config_non_json(model):
    p = model / "generation_config.json"
    p.write_bytes(b'{"temperature": \x80}')
    with pytest.raises(UsageError, match="UTF-8") as e:
        generation_defaults(model)
    assert str(p) in str(e.value)
    p.write_bytes(b"[" * 100_000)
    with pytest.raises(UsageError, match="nested too deeply"):
        generation_defaults(model)


def test_bad_flag_keeps_flag_wording(capsys, model):
    for flag, value in (("--temperature", "-1"), ("--temperature", "nan"), ("--top-p", "2"), ("--top-k", "-3")):
        code, err = cli(capsys, "run", model, "--ids", IDS, "--gen", 1, flag, value)
        assert_refused(code, err, EXIT_USAGE, flag)
        assert "generation_config.json" not in err


def test_ids_from_a_file(capsys, good, tmp_path):
    # --ids @FILE: the same run as the ids on the command line; a missing, empty or
    # non-id file is a usage error naming it
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    f = tmp_path / "p.ids"
    f.write_text(IDS.replace(",", "\n"))
    assert main(["run", str(good), "--ids", IDS, "--gen", "3", "--greedy", "--out", str(out_a)]) == 0
    assert main(["run", str(good), "--ids", f"@{f}", "--gen", "3", "--greedy", "--out", str(out_b)]) == 0
    a, b = json.loads(out_a.read_text()), json.loads(out_b.read_text())
    assert a["generated_ids"] == b["generated_ids"] and a["prompt_ids"] == b["prompt_ids"]
    (tmp_path / "empty.ids").write_text(" \n")
    (tmp_path / "words.ids").write_text("5, 17, seven")
    (tmp_path / "bin.ids").write_bytes(b"5,\xff")
    for name, word in (("missing.ids", "cannot read"), ("empty.ids", "empty"), ("words.ids", "integers"),
                       ("bin.ids", "other than ids")):
        run_refused(capsys, good, EXIT_USAGE, name, word, extra=("--ids", f"@{tmp_path / name}"))
    run_refused(capsys, good, EXIT_USAGE, "needs the file's name", extra=("--ids", "@"))


# ================================================================ 5. state files
def rewrite_state(src: Path, dst: Path, meta_edit=None, hdr_edit=None, text: bytes | None = None) -> Path:
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    data = raw[8 + n:]
    if text is None:
        hdr = json.loads(raw[8:8 + n])
        if meta_edit is not None:
            meta_edit(hdr["__metadata__"])
        if hdr_edit is not None:
            hdr_edit(hdr)
        text = json.dumps(hdr).encode()
    dst.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return dst


STATE_META = [
    ("n_layers", "eight", ["`n_layers`", "'eight'"]),
    ("n_layers", 8, ["`n_layers`", "number"]),
    ("n_layers", ["8"], ["`n_layers`", "list"]),
    ("n_layers", None, ["`n_layers`", "incomplete"]),
    ("positions", "1e3", ["`positions`", "'1e3'"]),
    ("positions", "-3", ["`positions`"]),
    ("tokens", "9" * 40, ["`tokens`", "15 digits"]),
    ("tokens", {"n": 5}, ["`tokens`", "object"]),
    ("version", ["1"], ["`version`", "list"]),
    ("version", math.inf, ["`version`"]),
    ("version", 1, ["`version`", "number"]),
    ("extra", "not json", ["`extra`", "not valid JSON"]),
    ("extra", "[1, 2]", ["`extra`", "list", "JSON object"]),
    ("extra", '"text"', ["`extra`", "string", "JSON object"]),
    ("extra", {"messages": []}, ["`extra`", "object", "written as a string"]),
    ("extra", "[" * 100_000, ["`extra`", "nested too deeply"]),
    ("sha256", ["x"], ["`sha256`", "list"]),
    ("sha256", "zz", ["`sha256`"]),
]


@pytest.mark.parametrize("key,value,words", STATE_META, ids=[f"{k}={v!r}"[:40] for k, v, _ in STATE_META])
def test_state_metadata_wrong_types_through_cli(capsys, good, saved_state, tmp_path, key, value, words):
    bad = rewrite_state(saved_state, tmp_path / "bad.k3state", meta_edit=lambda m: m.__setitem__(key, value))
    code, err = cli(capsys, "run", good, "--ids", IDS, "--gen", 1, "--load-state", bad)
    assert_refused(code, err, EXIT_USAGE, str(bad), *words)


@pytest.mark.parametrize("edit,words", [
    (lambda h: h["ids"].update(shape="5"), ["tensor ids", "expected I64"]),
    (lambda h: h["ids"].update(shape=None), ["tensor ids", "expected I64"]),
    (lambda h: h["ids"].update(shape=[True] * 5), ["tensor ids", "expected I64"]),
    (lambda h: h["ids"].update(data_offsets=[0]), ["tensor ids", "data_offsets"]),
    (lambda h: h["ids"].update(data_offsets=5), ["tensor ids", "data_offsets"]),
    (lambda h: h["ids"].update(data_offsets=[0, 1.5]), ["tensor ids", "data_offsets"]),
    (lambda h: h.update(ids=[1, 2]), ["tensor ids", "not an object"]),
    (lambda h: h["layers.0.S"].update(shape=[10 ** 30, 4, 32]), ["layers.0.S", "expected F32"]),
    (lambda h: h.update(__metadata__=["k3-state"]), ["not a k3 conversation state file"]),
])
def test_state_tensor_entries_wrong_types(good, saved_state, tmp_path, edit, words):
    cfg = load_config(good)
    bad = rewrite_state(saved_state, tmp_path / "bad.k3state", hdr_edit=edit)
    with pytest.raises(StateFileError) as e:
        load_state(bad, cfg)
    assert e.value.exit_code == EXIT_USAGE
    msg = str(e.value)
    assert str(bad) in msg and "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_state_header_not_json(good, saved_state, tmp_path):
    cfg = load_config(good)
    for text, word in ((b"[" * 100_000, "nested too deeply"), (b'{"a": "\xff"}', "UTF-8"),
                       (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON"),
                       (b'{"__metadata__": {"format": "k3-state"}, "__metadata__": {}}', "twice")):
        bad = rewrite_state(saved_state, tmp_path / "h.k3state", text=text)
        with pytest.raises(StateFileError, match=word) as e:
            read_state_header(bad)
        assert str(bad) in str(e.value)
        with pytest.raises(StateFileError, match=word):
            load_state(bad, cfg)


def test_state_file_that_is_a_directory_or_fifo(capsys, good, tmp_path):
    d = tmp_path / "dir.k3state"
    d.mkdir()
    code, err = cli(capsys, "run", good, "--ids", IDS, "--gen", 1, "--load-state", d)
    assert_refused(code, err, EXIT_USAGE, str(d), "is a directory")
    f = tmp_path / "fifo.k3state"
    os.mkfifo(f)
    with pytest.raises(StateFileError, match="FIFO"):  # never blocks waiting for a writer
        read_state_header(f)


def test_state_good_file_still_loads(good, saved_state):
    ld = load_state(saved_state, load_config(good))
    assert ld.tokens[:3] == [1, 2, 3] and len(ld.tokens) == 5 and isinstance(ld.extra, dict)


def test_every_refusal_is_a_k3_error_with_a_documented_code():
    """The classes used above are K3Errors with exit 2 or 3 (the CLI prints, never traces)."""
    for cls, code in ((ConfigError, 2), (UsageError, 2), (StateFileError, 2), (CheckpointError, 3)):
        assert issubclass(cls, K3Error) and cls("x").exit_code == code


# ---------------------------------------------------------------- readers outside the model's own files
def test_doctor_reports_a_damaged_index_and_odd_shard_paths(model, capsys):
    ix = json.loads((model / INDEX).read_text())
    shard = sorted(set(ix["weight_map"].values()))[1]
    (model / shard).unlink()
    (model / shard).mkdir()  # a folder where a shard should be
    assert main(["doctor", str(model), "--no-probe"]) == 1
    out = capsys.readouterr().out
    assert f"{shard}" in out and "is a directory" in out and "internal error" not in out
    name = next(iter(ix["weight_map"]))
    ix["weight_map"][name] = ["a", "list"]
    (model / INDEX).write_text(json.dumps(ix))
    assert main(["doctor", str(model), "--no-probe"]) == 1
    out = capsys.readouterr().out
    assert INDEX in out and "internal error" not in out


def test_a_damaged_history_line_names_the_line(tmp_path):
    from k3.chat import read_history

    p = tmp_path / "h.jsonl"
    p.write_bytes(b'{"role": "user", "content": "hi"}\n' + b"[" * 100000 + b"\n")
    with pytest.raises(UsageError, match="line 2"):
        read_history(p)


def test_chat_refuses_a_state_whose_messages_were_edited(good, saved_state, tmp_path):
    from k3.chat import ChatSession
    from k3.chat_format import K3Format
    from k3.state import LoadedState
    from k3.loader import load

    with load(good, max_context=64) as eng:
        loaded = load_state(saved_state, eng.cfg)
        for extra in ({"messages": "not a list"}, {"messages": [1, 2]}, {"messages": [], "turn": "three"}):
            bad = LoadedState(loaded.state, loaded.pending, extra, loaded.meta)
            s = ChatSession(eng, K3Format(eng.tokenizer))
            with pytest.raises(StateFileError):
                s.resume_state(bad)
