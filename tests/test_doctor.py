"""k3 doctor on this machine: without a model, with a complete synthetic model, with a
folder missing a shard or holding a truncated one, a stale packed trunk, the estimate
for a model too large for memory; and the storage probe."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3.cli import build_parser
from k3.cli import main as k3_main
from k3.commands import doctor as doctor_cmd
from k3.doctor import ModelFacts, Report, estimate, next_steps, run_doctor
from k3.probe import ProbeResult, probe_storage
from k3.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(probe_seconds=0.4, read_size=1 << 20, scratch_bytes=16 << 20)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    synthesize(d, preset="tiny", arch="k3", seed=41)
    return d


def titles(rep: Report) -> list[str]:
    return [t.split(" ")[0] for t, _ in rep.sections]


def test_without_a_model(tmp_path):
    rep = run_doctor(None, probe_dir=tmp_path, **SMALL)
    assert titles(rep) == ["system", "cpu", "memory", "disk", "storage", "expected"]
    assert rep.blocking == []
    text = rep.render()
    assert "recommended preset for K3:" in text and "MemAvailable" in text
    assert "random 1.05 MB: QD1" in text and "QD16" in text and "sequential 8 MiB: QD1" in text
    assert "the released K3 at preset" in text and "s/token from storage alone" in text
    cmds = [c for c, _ in rep.next_steps]
    assert cmds[0].startswith("k3 synth") and any(c.startswith("hf download moonshotai/Kimi-K3") for c in cmds)
    assert not [p for p in tmp_path.iterdir()]  # the scratch file is gone
    assert rep.data["storage"]["scratch"] is True
    # the kernel path it reports is the one the kernels were compiled for
    from k3.kernels.cpu import kernel_isa
    kern = rep.data["cpu"]["kernels"]
    assert kern["isa"] == kernel_isa() and f"k3 kernels: {kern['isa']} path" in text
    assert rep.data["cpu"]["vendor"] in ("intel", "amd", "")
    assert rep.data["cpu"]["cold_reads"]["first_us"] > 0 and "cold reads after a weight stream" in text


def test_complete_model(model):
    rep = run_doctor(model, **SMALL)
    assert rep.blocking == [], rep.blocking
    text = rep.render()
    assert "shards: 10 of 10 present" in text
    assert "tokenizer: 1024 ranks + 256 specials; chat format: K3 XTML" in text
    assert "packed trunk: none" in text and "fits in memory" in text
    assert [c for c, _ in rep.next_steps][-1] == f"k3 chat {model}"
    assert doctor_cmd.run(_args(str(model), "--no-probe", "--probe-seconds", "1")) == 0


def _args(*argv) -> argparse.Namespace:
    """`k3 doctor`'s arguments as its own parser makes them."""
    p = argparse.ArgumentParser()
    doctor_cmd.add_arguments(p)
    return p.parse_args(list(argv))


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_missing_and_truncated_shards(model, tmp_path, capsys):
    d = _copy(model, tmp_path / "broken")
    (d / "model-00003-of-000010.safetensors").unlink()
    rep = run_doctor(d, probe=False)
    assert any("1 of 10 shards the index names are missing: model-00003-of-000010.safetensors" in b
               for b in rep.blocking)
    assert "no estimate" in rep.render()
    assert rep.next_steps[0][0].startswith("hf download REPO model-00003-of-000010.safetensors --local-dir")
    assert doctor_cmd.run(_args(str(d), "--no-probe", "--probe-seconds", "1", "--json")) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["blocking"] and out["next"][-1] == f"k3 doctor {d}"
    shard = d / "model-00005-of-000010.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    rep = run_doctor(d, probe=False)
    assert any(b.startswith("shard model-00005-of-000010.safetensors:") for b in rep.blocking)
    (d / "config.json").write_text("{not json")
    rep = run_doctor(d, probe=False)
    assert any(b.startswith("config:") for b in rep.blocking)


def test_stale_trunk_and_missing_tokenizer(model, tmp_path):
    d = _copy(model, tmp_path / "m2")
    (d / "trunk").mkdir()
    (d / "trunk" / "trunk.json").write_text(json.dumps({"config_fingerprint": "0000000000000000", "layers": []}))
    (d / "tiktoken.model").unlink()
    rep = run_doctor(d, probe=False)
    assert rep.blocking == []
    text = rep.render()
    assert "packed trunk:" in text and "(stale)" in text
    assert any("packed trunk" in w and ("stale" in w or "another model" in w) for w in rep.warnings)
    assert any(w.startswith("tokenizer:") for w in rep.warnings)


def test_current_and_stale_packed_trunk(model, tmp_path, monkeypatch):
    import k3.probe
    from k3.memory.trunk import pack_trunk

    # a quiet machine's cold reads: that warning depends on the other tenants of the moment
    monkeypatch.setattr(k3.probe, "cold_reads_after_stream", lambda: (30.0, 3.0))

    a = _copy(model, tmp_path / "a")
    pack_trunk(a, a / "trunk", progress=False)
    rep = run_doctor(a, probe=False)
    assert f"packed trunk: {a / 'trunk'} (current)" in rep.render() and rep.warnings == []
    b = tmp_path / "b"
    synthesize(b, preset="tiny", arch="k3", seed=42)  # same shapes, other weights
    rep = run_doctor(b, trunk=a / "trunk", probe=False)
    assert "(stale)" in rep.render() and any("k3 pack-trunk" in w for w in rep.warnings)


def test_estimate_for_a_model_larger_than_memory():
    rep = Report()
    from k3.memory import planner

    mem = {"total": 64 * 10**9, "avail": 60 * 10**9, "preset": "desktop", "planner": planner}

    # the released K3's config (its real shapes: 93 layers, 896 experts, vocabulary 163840);
    # the estimate sizes an auto plan with it
    from k3.config import parse_config
    from k3.synth import build_config
    raw = build_config("realdims", "k3", layers=93, experts=896)
    raw["text_config"]["vocab_size"] = 163840
    cfg = parse_config(raw, "k3.json")
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.hidden_size) == (93, 896, 7168)
    facts = ModelFacts(ok=True, cfg=cfg, total_bytes=1_560_000_000_000, trunk_bytes=108_810_000_000,
                       table_bytes=4_700_000_000, expert_bytes_per_token=25_830_000_000, largest_layer=2_340_000_000,
                       trunk_dir=Path("/m/trunk"), trunk_state="absent")
    probe = ProbeResult("/m", sequential={1: 3000.0}, random={1: 800.0, 4: 1200.0})
    preset, resident = estimate(rep, mem, facts, probe)
    assert (preset, resident) == ("desktop", False)
    text = rep.render()
    want = (108.81e9 - 16e9) / 3000e6 + 25.83e9 / 1200e6
    assert f"expect roughly {want:.1f} s/token" in text
    assert "92.81 GB trunk streamed + 25.83 GB experts" in text
    assert "with a packed trunk, memory plan:" in text, text  # the auto plan fits 60 GB by streaming the trunk
    next_steps(rep, Path("/m"), facts, preset, resident)
    cmds = [c for c, _ in rep.next_steps]
    assert cmds == ["k3 pack-trunk /m /m/trunk",
                    "k3 run /m --trunk /m/trunk --preset desktop --prompt 'The capital of France is' --gen 8 --incremental",
                    "k3 chat /m --trunk /m/trunk --preset desktop"]


def test_probe_reads_model_files_with_o_direct(tmp_path):
    f = tmp_path / "shard.safetensors"
    f.write_bytes(os.urandom(6 << 20))
    res = probe_storage(tmp_path, [f], seconds=0.5, read_size=1 << 20, seq_qds=(1,), random_qds=(1, 4))
    assert res.files == 1 and not res.scratch and set(res.random) == {1, 4} and set(res.sequential) == {1}
    assert all(v > 0 for v in [*res.random.values(), *res.sequential.values()])
    assert res.bytes_read >= 6 << 20  # at least one sequential pass
    assert f.stat().st_size == 6 << 20 and [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]


def test_command_and_cli_entry(model, tmp_path, capsys):
    args = build_parser().parse_args(["doctor", str(model), "--no-probe", "--json"])
    assert args.fn is doctor_cmd.run and args.model == str(model) and args.no_probe and args.json
    # the command's own checks are usage errors (exit 2), before any work
    assert k3_main(["doctor", "--probe-seconds", "0"]) == 2
    assert "--probe-seconds must be > 0" in capsys.readouterr().err
    assert k3_main(["doctor", "--probe-dir", str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "k3", "doctor", "--no-probe", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["blocking"] == [] and out["memory"]["preset"] and out["versions"]["torch"]
    r = subprocess.run([sys.executable, "-m", "k3", "doctor", str(tmp_path / "nope"), "--no-probe"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "is not a folder" in r.stdout


@pytest.mark.parametrize("first,hot,warned", [(230.0, 5.0, True), (40.0, 3.0, False)])
def test_cold_read_line_and_warning(monkeypatch, first, hot, warned):
    import k3.probe
    monkeypatch.setattr(k3.probe, "cold_reads_after_stream", lambda: (first, hot))
    rep = Report()
    from k3.doctor import check_cpu
    check_cpu(rep)
    text = rep.render()
    assert f"cold reads after a weight stream: 256 lines {first:.0f} us, again {hot:.0f} us" in text
    assert rep.data["cpu"]["cold_reads"] == {"lines": 256, "first_us": first, "hot_us": hot}
    assert any("memory reads that miss the caches are slow" in w for w in rep.warnings) == warned


def test_cold_read_probe_measures_both_reads():
    from k3.probe import cold_reads_after_stream
    first, hot = cold_reads_after_stream(stream_bytes=8 << 20, lines=16, reps=3)
    assert first > 0 and hot > 0
