"""Golden values: today's tokens and logits, bit for bit.

tests/golden/values.json holds, for a fixed set of cases (incremental decode, full
recompute, a one-pass forward over every position, a prefill read in pieces, a batch of
three sequences, speculative decoding; 1 and 2 threads; resident and bounded expert
caches) on three deterministic models (synthetic K3 with MXFP4 experts, synthetic
Kimi-Linear, the tiny K3 fixture), the greedy tokens and the sha256 of every fp32 logits
vector, recorded from a known tree by tests/golden/record.py (see its docstring for how
to re-record). A change that is meant to keep every bit - a kernel refactor, the decode
loop moved - must pass this unchanged; a change that is meant to change numbers must
re-record, and say why.

The models are rebuilt here from their seeds; test_models_rebuild_identically tells a
changed generator apart from changed arithmetic. k3's results do not depend on the
thread count, the expert cache's size or the instruction set its kernels compile for
(docs/ARCHITECTURE.md; the slow tests force each set, K3_KERNEL_ISA, in a fresh
process), but the math libraries under torch pick their code by CPU: another machine's
last bits can differ, with the same tokens. So a machine with its own recording
(tests/golden/machines/KEY.json, record.py --machine, recorded from the same reference
tree) is held to it bit for bit; any other to the reference's tokens and schedule with
close logits, and to the same bits at 1 and 2 threads and either cache (checked here).

The in-process cases take ~25 s with warm kernels. The slow ones (-m slow) take ~20 s
per instruction set once compiled, and compile each set once per version of the k3
sources (~3.5 minutes a set on 2 cores; record.isa_cache says where).
To hold another checkout to the values, run this file from that checkout's root with it
first on the path (copy tests/test_golden.py and tests/golden/ there if it lacks them):

    cd OTHER && PYTHONPATH=$PWD python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("k3_golden_record", _HERE / "golden" / "record.py")
golden = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = golden  # dataclasses look their module up while the class is made
_spec.loader.exec_module(golden)

VALUES = json.loads(golden.VALUES.read_text())
# this machine's own bits where they were recorded (record.py --machine); else the
# reference machine's values, held to its tokens and schedule and close logits
_LOCAL = golden.machine_values()
LOCAL = json.loads(_LOCAL.read_text()) if _LOCAL.is_file() else None
EXPECTED = LOCAL["cases"] if LOCAL is not None else VALUES["cases"]
_SEEN: dict[str, dict] = {}   # the cases computed here, for the thread / cache agreement test


def test_values_cover_every_case():
    """values.json and record.py's case list belong together (re-record after editing either)."""
    assert VALUES["format"] == golden.FORMAT
    assert sorted(VALUES["cases"]) == sorted(c.name for c in golden.CASES)
    assert sorted(VALUES["models"]) == sorted(golden.MODELS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return golden.build_models(tmp_path_factory.mktemp("golden"))


@pytest.fixture(scope="module")
def changed_models(models) -> dict[str, str]:
    """{model: which of its files differ from the recorded build} for the models that changed."""
    out = {}
    for m, d in models.items():
        want, got = VALUES["models"][m], golden.model_files(d)
        bad = sorted(f for f in set(want) | set(got) if want.get(f) != got.get(f))
        if bad:
            out[m] = ", ".join(bad)
    return out


def test_models_rebuild_identically(changed_models):
    """The generator gives the recorded files: otherwise every case of that model would
    fail for a reason that is not the arithmetic."""
    assert not changed_models, "model files differ from the recorded build: " + "; ".join(
        f"{m}: {files}" for m, files in changed_models.items())


def _close(name: str, want: dict, got: dict) -> str | None:
    """Against another machine's values: the same tokens and schedule, every logits
    vector's first values within 1e-4 (the hashes cannot agree across machines)."""
    msg = golden.diff(name, want, got)
    if msg is None:
        return None
    for w, g in zip(want["seqs"], got["seqs"]):
        if w["tokens"] != g["tokens"] or w.get("steps") != g.get("steps") or len(w["logits"]) != len(g["logits"]):
            return msg
        for a, b in zip(w["logits"], g["logits"]):
            if any(abs(x - y) > 1e-4 * max(1.0, abs(x)) for x, y in zip(a["head"], b["head"])):
                return msg + "\n  (beyond 1e-4 in the first values)"
    return None


def _check(results: dict, expected: dict, names, changed_models: dict, where: str = "") -> None:
    bad = []
    compare = golden.diff if LOCAL is not None else _close
    for n in names:
        if n not in results:
            bad.append(f"{n}: not computed")
            continue
        msg = compare(n, expected[n], results[n])
        if msg:
            model = n.split("/")[0]
            if model in changed_models:
                msg += f"\n  (model {model}'s files differ from the recorded build: {changed_models[model]})"
            bad.append(msg)
    if bad:
        src = _LOCAL.relative_to(_HERE.parent) if LOCAL is not None else "tests/golden/values.json"
        pytest.fail(f"{len(bad)} case(s) differ from {src}{where}:\n" + "\n".join(bad), pytrace=False)


@pytest.mark.parametrize("case", golden.CASES, ids=lambda c: c.name)
def test_case_matches_recorded(case, models, changed_models):
    results = golden.compute(models, [case])  # puts the thread counts back
    _SEEN.update(results)
    _check(results, EXPECTED, [case.name], changed_models)


def test_threads_and_caches_agree_bit_for_bit(models):
    """On this machine, whatever its values: 1 and 2 threads, and a bounded expert cache
    against the resident one, give the same bits (k3's contract on every machine)."""
    missing = [c for c in golden.CASES if c.name not in _SEEN]
    _SEEN.update(golden.compute(models, missing) if missing else {})
    bad = []
    for c in golden.CASES:
        if c.threads == 2:
            one = golden.Case(c.model, c.kind, 1, c.cache).name
            if one in _SEEN and _SEEN[one] != _SEEN[c.name]:
                bad.append(golden.diff(c.name, _SEEN[one], _SEEN[c.name]))
        if c.cache == "bounded":
            res = golden.Case(c.model, c.kind, c.threads).name
            if _SEEN[res]["seqs"] != _SEEN[c.name]["seqs"]:
                bad.append(golden.diff(c.name, _SEEN[res], _SEEN[c.name]))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_forced_instruction_set_matches_recorded(isa, models, changed_models):
    """Every case with the kernels compiled for one instruction set (K3_KERNEL_ISA), in a
    fresh process with a numba cache of its own (record.isa_cache: compiles once per
    version of the k3 sources, several minutes). The recorded values are the default
    set's unless record.py found this set to differ (values.json "isa")."""
    if isa not in golden.isa_paths():
        pytest.skip(f"this CPU cannot run the {isa} path")
    import k3
    tree = Path(k3.__file__).resolve().parent.parent
    results = golden.compute_in_child(tree, models, golden.forced_isa_env(tree, isa))
    want = EXPECTED if LOCAL is not None else VALUES["isa"].get(isa, VALUES["cases"])
    _check(results, want, [c.name for c in golden.CASES], changed_models, f" with K3_KERNEL_ISA={isa}")
