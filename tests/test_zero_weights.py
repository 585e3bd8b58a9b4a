"""Weights that read as zeros (k3.checkpoint.zeros): an unfinished or preallocated
download keeps its sizes and headers, so nothing else catches it. `k3 doctor` names
the shard and tensor, `k3 run` refuses (exit 3) unless --allow-zero-weights."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3.checkpoint import zeros
from k3.checkpoint.safetensors import CheckpointIndex, TensorInfo

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from k3.synth import synthesize
    return synthesize(tmp_path_factory.mktemp("zw") / "m", preset="tiny", arch="k3", seed=4)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _zero_range(path: str, start: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\0" * n)


def _k3(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "k3", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_sample_ranges_are_aligned_blocks_inside_the_tensor():
    t = TensorInfo("w", "/f", 1000, 100_000, "BF16", (50_000,))
    r = zeros.sample_ranges(t, 3)
    assert len(r) == 3 and all(o % 4096 == 0 and n == 4096 for o, n in r)
    assert r[0][0] == 4096 and r[-1][0] + 4096 <= t.end and r[-1][0] + 8192 > t.end
    small = TensorInfo("v", "/f", 1000, 5000, "BF16", (2500,))
    assert zeros.sample_ranges(small) == [(1000, 5000)]  # too small for two whole blocks: read whole


def test_a_clean_checkpoint_has_no_findings(tiny):
    ix = CheckpointIndex.open(tiny)
    assert zeros.scan(zeros.doctor_selection(ix)) == []
    fixtures = ROOT / "tests" / "fixtures" / "k3-in-c-v1"
    for d in ("st", "cache"):  # the C engine's fixtures: real-format weights, none zero
        assert zeros.scan(zeros.doctor_selection(CheckpointIndex.open(fixtures / d))) == []


def test_a_zeroed_lm_head_is_named_by_doctor_and_refused_by_run(tiny, tmp_path):
    m = _copy(tiny, tmp_path / "m")
    head = CheckpointIndex.open(m).get("language_model.lm_head.weight")
    _zero_range(head.file, head.offset, head.nbytes)
    r = _k3("doctor", m, "--no-probe", "--json")
    rep = json.loads(r.stdout)
    assert [z["tensor"] for z in rep["zero_weights"]] == ["language_model.lm_head.weight"]
    assert any("looks unfinished" in w and "language_model.lm_head.weight" in w
               and os.path.basename(head.file) in w for w in rep["warnings"])
    r = _k3("run", m, "--ids", "5,6", "--gen", "2", "--greedy")
    assert r.returncode == 3, r.stderr[-2000:]
    assert f"shard {os.path.basename(head.file)} looks unfinished" in r.stderr
    assert "language_model.lm_head.weight reads as zeros at offsets" in r.stderr
    assert "re-download" in r.stderr.lower() and "--allow-zero-weights" in r.stderr and "Traceback" not in r.stderr
    r = _k3("run", m, "--ids", "5,6", "--gen", "2", "--greedy", "--allow-zero-weights")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip("\n") == "\0\0"  # token 0 twice (the tokenizer decodes it as NUL): the reason to refuse it


def test_a_zero_filled_expert_shard_is_named_and_refused(tiny, tmp_path):
    m = _copy(tiny, tmp_path / "m")
    ix = CheckpointIndex.open(m)
    shard = next(s for s in ix.shards() if any(".experts." in t.name for t in ix.tensors_in(s)))
    data_start = ix.shard_header(shard).data_start
    _zero_range(shard, data_start, os.path.getsize(shard) - data_start)  # a preallocated, never written shard
    found = zeros.scan(zeros.doctor_selection(CheckpointIndex.open(m)))
    assert found and {f.shard for f in found} == {shard}
    r = _k3("run", m, "--ids", "5,6", "--gen", "2", "--greedy")
    assert r.returncode == 3, r.stderr[-2000:]
    assert f"shard {os.path.basename(shard)} looks unfinished" in r.stderr and "are routed experts' weights" in r.stderr


def test_a_megabyte_hole_in_a_large_weight_is_found(tmp_path):
    """A large weight whose middle was never written: one sample in the hole, the others
    fine. A single zero 4 KiB block inside real values is not a hole."""
    import torch
    from safetensors.torch import save_file
    w = torch.randn(1024, 2048).to(torch.bfloat16)  # 4 MiB
    save_file({"a.weight": w}, str(tmp_path / "x.safetensors"))
    ix = CheckpointIndex.open(tmp_path)
    t = ix.get("a.weight")
    assert zeros.scan([t], samples=3) == []
    mid = zeros.sample_ranges(t, 3)[1][0]
    _zero_range(t.file, mid, 4096)  # one zero block: not a hole
    assert zeros.scan([t], samples=3) == []
    _zero_range(t.file, mid - (1 << 20), 2 << 20)  # 2 MiB of zeros around it
    (f,) = zeros.scan([t], samples=3)
    assert not f.whole and f.offsets and f.tensor == "a.weight"
    assert "1 MiB of zero bytes at offset" in zeros.describe([f], tmp_path)
