"""Bad input ends in one clear message and a documented exit code, never a traceback
or silent garbage. A few cases run the real `k3` console entry in a subprocess (what a
user sees); the rest run the same ``main`` in this process (``k3_here``), since each
fresh interpreter costs seconds of imports."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from k3.config import load_config, parse_config
from k3.errors import ConfigError

from k3fixtures import FIXTURES, tiny_model
from test_tiny_model import write_release_format

PROMPT = "203,34,2,239"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    cfg_dict, tensors = tiny_model()
    return write_release_format(tmp_path_factory.mktemp("good") / "tiny", tensors, cfg_dict)


def copy(good, tmp_path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(good, d)
    return d


def k3(*args, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "k3", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, **kw)


def k3_here(*args):
    """``k3`` in this process (the CLI's own main, its exit code and printed output):
    for refusals that need no fresh interpreter (each subprocess costs seconds of
    imports on a slow host)."""
    import contextlib
    import io
    from types import SimpleNamespace

    from k3.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])  # (main turns argparse's exits into codes too)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def assert_refused(r, code: int, *words):
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    msg = r.stderr.lower()
    for w in words:
        assert w.lower() in msg, f"{w!r} not in: {r.stderr[-1500:]}"


def shard(d: Path, n: int) -> Path:
    return sorted(d.glob("model-*.safetensors"))[n]


def test_good_checkpoint_runs(good):
    r = k3("run", good, "--ids", PROMPT, "--gen", 2)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 2


def test_truncated_shard(good, tmp_path):
    d = copy(good, tmp_path)
    s = shard(d, 1)
    os.truncate(s, s.stat().st_size - 100)
    assert_refused(k3_here("run", d, "--ids", PROMPT, "--gen", 1), 3, s.name)


def test_header_larger_than_file(good, tmp_path):
    d = copy(good, tmp_path)
    s = shard(d, 0)
    with open(s, "r+b") as f:
        f.write(struct.pack("<Q", s.stat().st_size * 2))
    assert_refused(k3_here("run", d, "--ids", PROMPT, "--gen", 1), 3, s.name, "header")


def test_tensor_out_of_bounds(good, tmp_path):
    d = copy(good, tmp_path)
    s = shard(d, 1)
    raw = s.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    name = next(k for k in hdr if k != "__metadata__")
    b, e = hdr[name]["data_offsets"]
    # same data, but this tensor's span now lies past the end of the file
    hdr[name]["data_offsets"] = [b + len(data), e + len(data)]
    new = json.dumps(hdr, separators=(",", ":")).encode()
    new = new.ljust((len(new) + 7) // 8 * 8)
    s.write_bytes(struct.pack("<Q", len(new)) + new + data)
    assert_refused(k3_here("run", d, "--ids", PROMPT, "--gen", 1), 3, name)


def test_missing_tensor(good, tmp_path):
    d = copy(good, tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    # rewrite shard 2 without one layer tensor, and drop it from the index
    from k3.checkpoint.safetensors import read_header
    from k3.checkpoint.io import load_tensor
    from k3.checkpoint.writer import write_checkpoint
    victim = "language_model.model.layers.9.self_attn.q_proj.weight"
    s = shard(d, 1)
    infos = sorted(read_header(s).values(), key=lambda t: t.offset)
    tensors = [(t.name, load_tensor(t)) for t in infos if t.name != victim]
    tmp = tmp_path / "rew"
    write_checkpoint(tmp, [tensors], index=False, name_fmt=s.name, fsync=False)
    shutil.move(tmp / s.name, s)
    del idx["weight_map"][victim]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert_refused(k3_here("run", d, "--ids", PROMPT, "--gen", 1), 3, victim, "1 of 13 layers")


def test_missing_shard(good, tmp_path):
    d = copy(good, tmp_path)
    s = shard(d, 0)
    s.unlink()
    assert_refused(k3_here("run", d, "--ids", PROMPT, "--gen", 1), 3, s.name)


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "full_attn_layers", "attn_res_block_size",
                                   "kda_num_heads", "rms_norm_eps"])
def test_missing_config_field(good, tmp_path, field):
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg[field]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_refused(k3_here("run", d, "--ids", PROMPT, "--gen", 1), 2, field, "config")


@pytest.mark.parametrize("field,value,word", [
    ("hidden_size", 64, "shape"),  # structurally valid but does not match the tensors
    ("num_experts_per_token", 9, "num_experts_per_token"),
    ("full_attn_layers", [0, 4], "one-based"),
    ("vocab_size", "256", "integer"),
])
def test_mutated_config_field(good, tmp_path, field, value, word):
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    r = k3_here("run", d, "--ids", PROMPT, "--gen", 1)
    assert r.returncode in (2, 3)
    assert_refused(r, r.returncode, word)


def test_config_not_json(good, tmp_path):
    d = copy(good, tmp_path)
    (d / "config.json").write_text("{not json")
    assert_refused(k3_here("run", d, "--ids", PROMPT, "--gen", 1), 2, "config.json", "json")


def test_token_id_outside_vocab(good):
    assert_refused(k3_here("run", good, "--ids", "1,2,256", "--gen", 1), 2, "256", "vocabulary")
    assert_refused(k3_here("run", good, "--ids", "1,-3", "--gen", 1), 2, "-3")


def test_usage_errors(good):
    assert_refused(k3("run", good, "--gen", 1), 2, "exactly one")  # the console entry itself, once
    assert_refused(k3_here("run", good, "--ids", "1", "--prompt", "x"), 2, "exactly one")
    assert_refused(k3_here("run", good, "--ids", "1,x"), 2, "integers")
    assert_refused(k3_here("run", good, "--ids", "1", "--gen", 5000), 2, "--gen")
    assert_refused(k3_here("run", good, "--ids", "1", "--layers", 99), 2, "--layers")
    assert_refused(k3_here("run", good, "--prompt", "hello"), 2, "tiktoken.model")
    assert_refused(k3_here("run", good / "nope", "--ids", "1"), 2, "not a folder")


def test_output_path_in_missing_folder_refused_before_running(good, tmp_path):
    missing = tmp_path / "no-such-folder"
    for flag in ("--out", "--dump-logits", "--save-state"):
        r = (k3 if flag == "--out" else k3_here)("run", good, "--ids", PROMPT, "--gen", 1, flag, missing / "x.bin")
        assert_refused(r, 2, flag, "does not exist")
        assert r.stdout == ""  # nothing was generated
    assert not missing.exists()


@pytest.mark.parametrize("name", ["no_layermap", "bad_layer_index", "bad_topk"])
def test_fixture_configs_refused(name):
    """kimi-k3-in-c's broken configs: each is a valid config with one field mutated."""
    with pytest.raises(ConfigError) as e:
        load_config(FIXTURES / "cfg" / f"{name}.json")
    assert e.value.exit_code == 2
    want = {"no_layermap": "full_attn_layers", "bad_layer_index": "full_attn_layers",
            "bad_topk": "num_experts_per_token"}[name]
    assert want in str(e.value)


def test_all_missing_fields_named_at_once():
    cfg, _ = tiny_model()
    for k in ("hidden_size", "vocab_size", "q_lora_rank" if False else "kv_lora_rank"):
        del cfg[k]
    with pytest.raises(ConfigError) as e:
        parse_config(cfg, "x")
    for k in ("hidden_size", "vocab_size", "kv_lora_rank"):
        assert k in str(e.value)
