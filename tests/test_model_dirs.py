"""Shards spread over several folders (one per drive, `--model-dirs`): the index in the
model folder names them, each is found where it is, the tokens are those of the
checkpoint in one folder, the doctor probes every folder, and a shard found nowhere is
named with every place looked in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3.checkpoint.safetensors import CheckpointIndex
from k3.errors import CheckpointError
from k3.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
IDS = "5,17,99,300,42,7"


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    base = tmp_path_factory.mktemp("dirs")
    one = synthesize(base / "one", preset="pool", seed=4)
    split = base / "split"
    shutil.copytree(one, split)
    other = base / "drive2"
    other.mkdir()
    shards = sorted(split.glob("model-*.safetensors"))
    for p in shards[::2]:  # every other shard to the second "drive", the first among them
        os.rename(p, other / p.name)
    return one, split, other


def run(model, *extra):
    r = subprocess.run([sys.executable, "-m", "k3", "run", str(model), "--ids", IDS, "--gen", "6", "--greedy",
                        "--cache-gb", "0.001", *extra], cwd=ROOT, capture_output=True, text=True)
    return r


def test_shards_in_two_folders_give_the_same_tokens(spread, tmp_path):
    one, split, other = spread
    want = run(one)
    assert want.returncode == 0, want.stderr[-2000:]
    got = run(split, "--model-dirs", str(other), "--out", str(tmp_path / "r.json"))
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == want.stdout
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["expert_bytes_read"] > 0  # experts were read from both folders
    idx = CheckpointIndex.open(split, [other])
    dirs = {os.path.dirname(p) for p in idx.shards()}
    assert dirs == {str(split), str(other)}


def test_a_shard_found_nowhere_names_every_folder(spread):
    one, split, other = spread
    with pytest.raises(CheckpointError, match="missing") as e:
        CheckpointIndex.open(split)
    assert "looked for" not in str(e.value)
    r = run(split, "--model-dirs", str(split))  # the second drive not given
    assert r.returncode == 3 and "looked for in" in r.stderr and "Traceback" not in r.stderr
    for argv in (["run", str(split), "--ids", IDS, "--model-dirs", str(split / "nope")],
                 ["pack-trunk", str(split), str(split.parent / "t"), "--model-dirs", str(split / "nope")],
                 ["doctor", str(split), "--no-probe", "--model-dirs", str(split / "nope")]):
        r = subprocess.run([sys.executable, "-m", "k3", *argv], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2 and "--model-dirs" in r.stderr and "Traceback" not in r.stderr, argv


def test_the_doctor_probes_every_folder(spread, tmp_path):
    _, split, other = spread
    t = subprocess.run([sys.executable, "-m", "k3", "pack-trunk", str(split), str(tmp_path / "t"), "--model-dirs",
                        str(other)], cwd=ROOT, capture_output=True, text=True)
    assert t.returncode == 0, t.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "k3", "doctor", str(split), "--model-dirs", str(other), "--trunk",
                        str(tmp_path / "t"), "--probe-seconds", "0.3", "--json"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert "storage" in rep and str(other) in rep["storage_dirs"]
    assert f"storage probe ({other})" in rep["sections"]
    assert not rep["blocking"]
    assert any("(current)" in line for line in rep["sections"][f"model {split}"]), rep["sections"]
