#!/usr/bin/env python
"""Golden tokens and logits: recorded from one k3 tree, to hold another tree to.

A refactor of the kernels or of the decode loop must not change a bit. This module
builds small models deterministically (k3's own synthetic generator, fixed seeds; and
the tiny K3 of the kimi-k3-in-c fixtures), runs a fixed set of cases through the public
API (``k3.load``, ``Engine.decode`` / ``generate`` / ``batch``) and reduces each case to
its greedy tokens and, per logits vector, the sha256 of its fp32 bytes plus its first
four values (the hash decides; the floats make a diff readable). ``tests/test_golden.py``
imports it to compute the same cases with the tree under test and compares them with
``values.json``, which this script writes.

Re-record (from the tree the values must describe, e.g. a worktree of the last
commit before a refactor; ``--tree`` puts that tree first on sys.path)::

    python tests/golden/record.py --tree /path/to/k3-tree --out tests/golden/values.json

On a machine whose last bits differ from the reference machine's (another CPU vendor or
model, other library versions: :func:`machine_key`), ``--machine`` records that
machine's own values into ``tests/golden/machines/KEY.json`` from the same reference
tree; the test then holds the tree to those bit for bit, and elsewhere to the
reference's tokens and schedule, with the logits' first values within 1e-4.

What it does:
1. builds every model twice and checks that the two builds are byte-identical (the test
   rebuilds them, so they must be a function of the seed alone), keeping the file
   digests so a test failure can tell "the model changed" from "the numbers changed";
2. computes every case in this process at the CPU's own instruction set;
3. checks the contracts the values rely on: 1 and 2 threads give the same bits, and a
   bounded expert cache gives the resident cache's bits;
4. recomputes every case in one fresh process per instruction set the CPU can run
   (``K3_KERNEL_ISA`` = generic / avx2 / avx512, each with a kernel cache of its own) and
   stores a per-set copy only where it differs from step 2 (k3 promises it never does,
   so values.json normally holds one set of values, valid whichever set a machine picks).

Nothing here imports k3 at module level: ``--tree`` must act before the first import.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
VALUES = HERE / "values.json"
#: this machine's own values, where the reference machine's bits are not this one's
MACHINES = HERE / "machines"
FORMAT = 1

# ---------------------------------------------------------------------------- models
#: the synthetic models: k3.synth's "tiny" preset (K3: 8 layers, 16 MXFP4 experts per
#: MoE layer, top-4, latent MoE, Attention Residuals; Kimi-Linear: the same trunk, BF16
#: experts). The seed is the only source of their weights.
SYNTH = {
    "k3": {"preset": "tiny", "arch": "k3", "seed": 1729},
    "kimi_linear": {"preset": "tiny", "arch": "kimi_linear", "seed": 1729},
}
#: plus the 13-layer tiny K3 of tests/fixtures/k3-in-c-v1 (fp32 weights), written in the
#: release's file layout
MODELS = (*SYNTH, "fixture")


def _write_fixture(out: Path) -> Path:
    """The fixture model as a release-format checkpoint: the layout of
    tests/test_tiny_model.py's write_release_format (two layer shards, globals last,
    experts out of id order), re-done here so that recording needs no test module that
    imports k3 internals."""
    sys.path.insert(0, str(HERE.parent))  # k3fixtures: numpy/torch only, no k3 import
    try:
        from k3fixtures import tiny_model
    finally:
        sys.path.remove(str(HERE.parent))
    from k3.checkpoint.writer import write_checkpoint

    cfg, tensors = tiny_model()
    shard_a, shard_b, glob = [], [], []
    layers: dict[int, list] = {}
    experts: dict[int, dict[int, list]] = {}
    for rel, t in sorted(tensors.items()):
        parts = rel.split(".")
        if parts[0] != "layers":
            glob.append((rel, t))
        elif ".experts." in rel:
            experts.setdefault(int(parts[1]), {}).setdefault(int(parts[4]), []).append((rel, t))
        else:
            layers.setdefault(int(parts[1]), []).append((rel, t))
    for i in sorted(layers):
        target = shard_a if i < 7 else shard_b
        target.extend(layers[i])
        for e in sorted(experts.get(i, {}), key=lambda e: (e * 5) % 8):
            target.extend(sorted(experts[i][e], key=lambda nt: nt[0]))
    shard_b.extend(glob)

    def name(rel: str) -> str:
        return "language_model.lm_head.weight" if rel == "lm_head.weight" else "language_model.model." + rel

    out.mkdir(parents=True)
    write_checkpoint(out, [[(name(n), t) for n, t in s] for s in (shard_a, shard_b)],
                     name_fmt="model-{i:05d}-of-{n:06d}.safetensors", fsync=False)
    (out / "config.json").write_text(json.dumps(cfg, sort_keys=True))
    return out


def build_model(name: str, out: Path) -> Path:
    """Write model ``name`` into the new folder ``out``; returns it."""
    if name == "fixture":
        return _write_fixture(out)
    from k3.synth import synthesize
    return synthesize(out, workers=1, **SYNTH[name])


def model_files(d: Path) -> dict[str, str]:
    """{file name: sha256} of a model folder."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).iterdir()) if p.is_file()}


def build_models(root: Path) -> dict[str, Path]:
    return {m: build_model(m, Path(root) / m) for m in MODELS}


# ---------------------------------------------------------------------------- cases
#: 34 tokens (every id < 256, the fixture's vocabulary): long enough that the prefill
#: takes KDA's chunked form, which decode and short prefills do not
PROMPT = [5, 17, 99, 200, 42, 7, 100, 12, 64, 3, 250, 77, 31, 8, 50, 2, 9, 60, 11, 13,
          14, 15, 16, 40, 41, 42, 33, 34, 35, 36, 37, 38, 39, 40]
#: the prefill-in-pieces case reads 102 tokens in passes of 32, 32 and 38 (a piece
#: must hold whole 16-token KDA chunks and at least 32 tokens: k3.decode.prefill_pieces)
LONG_PROMPT = PROMPT * 3
PREFILL_CHUNK = 32
#: the one-pass forward (teacher forcing, logits of every position) reads LONG_PROMPT
#: and these: 114 tokens, over the 64 up to which a pass runs torch on one thread
#: (k3.engine.SMALL_PASS), so torch's own ops run threaded there
CONTINUATION = [101, 102, 7, 250, 13, 99, 64, 64, 3, 18, 200, 1]
#: the speculative prompt repeats itself, so the sequence's own n-grams draft too
SPEC_PROMPT = PROMPT[:8] * 3
N_STEPS = 12
N_SPEC = 24
SPEC = 8
MAX_CONTEXT = 128
#: batch: (prompt, max_tokens, the pass before which it joins): three lengths, one
#: sequence joining while the others decode
BATCH = [(PROMPT, 6, 0), (PROMPT[:7], 9, 0), (PROMPT[20:21], 4, 2)]
#: the bounded expert cache: top-k + 2 slots (the smallest allowed is top-k + 1), far
#: below the 7 MoE layers x 16 experts of the synthetic models, so experts are evicted
#: and re-read all the time
BOUNDED_EXTRA_SLOTS = 2

KINDS = ("incremental", "chunked", "full", "forward", "batch", "spec")


@dataclass(frozen=True)
class Case:
    model: str
    kind: str
    threads: int
    cache: str = "resident"  # or "bounded"

    @property
    def name(self) -> str:
        return f"{self.model}/{self.kind}/threads{self.threads}/{self.cache}"


def _cases() -> list[Case]:
    out = []
    for m in MODELS:
        for kind in KINDS:
            for threads in (2, 1):
                out.append(Case(m, kind, threads))
        if m != "fixture":  # the fixture's experts are fp32 tensors, not a cache's slots
            for kind in ("incremental", "batch", "spec"):
                out.append(Case(m, kind, 2, "bounded"))
    return out


CASES = _cases()


def digest(t) -> dict:
    """A logits vector as {sha256 of its fp32 bytes, its first 4 values}."""
    import numpy as np
    import torch
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise TypeError(f"logits must be an fp32 tensor, got {type(t).__name__} {getattr(t, 'dtype', '')}")
    a = np.ascontiguousarray(t.detach().reshape(-1).numpy()).astype("<f4", copy=False)
    return {"sha256": hashlib.sha256(a.tobytes()).hexdigest(), "head": [float(x) for x in a[:4]]}


def _seq(steps) -> dict:
    """One sequence's Steps: tokens, per-step logits digests, and (pass index, sequences
    in the pass, drafted, accepted) per step - the decode loop's schedule, deterministic
    when every draft is read (see run_case)."""
    return {"tokens": [s.token for s in steps], "logits": [digest(s.logits) for s in steps],
            "steps": [[s.pass_index, s.batch, s.drafted, s.accepted] for s in steps]}


_SLOT_BYTES: dict[str, tuple[int, int, int]] = {}


def _bounded_gb(model_dir: Path) -> tuple[float, int, int]:
    """(cache_gb for top-k + BOUNDED_EXTRA_SLOTS expert slots, those slots, every routed
    expert of the model), from a resident engine's slot size."""
    import k3
    key = str(model_dir)
    if key not in _SLOT_BYTES:
        with k3.load(model_dir, max_context=16) as eng:
            cfg = eng.cfg
            every = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)) * cfg.num_experts
            _SLOT_BYTES[key] = (eng.provider.cache.slot_bytes, cfg.num_experts_per_token + BOUNDED_EXTRA_SLOTS, every)
    slot, slots, every = _SLOT_BYTES[key]
    return (slots + 0.5) * slot / 1e9, slots, every


def run_case(case: Case, model_dir: Path) -> dict:
    """The case's result: {"seqs": [one _seq dict per sequence]}. Each case opens its own
    engine with its thread count (k3.load sets it for the process)."""
    import k3

    kw = {"max_context": MAX_CONTEXT, "threads": case.threads}
    if case.cache == "bounded":
        kw["cache_gb"], _, every = _bounded_gb(model_dir)
    if case.kind == "chunked":
        kw["prefill_chunk"] = PREFILL_CHUNK
    if case.kind == "batch":
        kw["max_batch"] = len(BATCH)
    if case.kind == "spec":
        kw["spec"] = SPEC
    with k3.load(model_dir, **kw) as eng:
        if case.cache == "bounded" and not eng.plan.cache_slots < every:
            raise AssertionError(f"{case.name}: the cache holds {eng.plan.cache_slots} of {every} experts: not bounded")
        if case.kind in ("incremental", "chunked", "full"):
            steps = list(eng.decode(LONG_PROMPT if case.kind == "chunked" else PROMPT, max_tokens=N_STEPS,
                                    keep_logits=True, incremental=case.kind != "full"))
            return {"seqs": [_seq(steps)]}
        if case.kind == "forward":
            logits = eng.model.forward(LONG_PROMPT + CONTINUATION, last_only=False)
            return {"seqs": [{"tokens": logits.argmax(-1).tolist(), "logits": [digest(r) for r in logits]}]}
        if case.kind == "batch":
            batch, reqs, got, passes = eng.batch(), [], {}, 0
            while batch.active or len(reqs) < len(BATCH):
                for prompt, n, at in BATCH[len(reqs):]:
                    if at > passes:
                        break
                    reqs.append(batch.add(prompt, max_tokens=n, keep_logits=True))
                for r, steps in batch.step():
                    got.setdefault(r.id, []).extend(steps)
                passes += 1
            return {"seqs": [_seq(got[r.id]) for r in reqs]}
        if case.kind == "spec":
            # Drafts come from the sequence's own n-grams and from a corpus holding the
            # model's own continuation with two tokens changed, so some drafts are kept
            # and some refused. Every draft found is read (K3_SPEC_EVERY_DRAFT): the
            # pass cost model would weigh them by measured seconds, which makes the
            # passes - and the logits of a verification pass - depend on timing.
            plain = [s.token for s in eng.decode(SPEC_PROMPT, max_tokens=N_SPEC)]
            corpus = SPEC_PROMPT + [(t + 1) % eng.cfg.vocab_size if i in (5, 14) else t for i, t in enumerate(plain)]
            prev = os.environ.get("K3_SPEC_EVERY_DRAFT")
            os.environ["K3_SPEC_EVERY_DRAFT"] = "1"
            try:
                steps = list(eng.generate(SPEC_PROMPT, max_tokens=N_SPEC, greedy=True, keep_logits=True, spec=SPEC,
                                          spec_corpus=corpus))
            finally:
                if prev is None:
                    del os.environ["K3_SPEC_EVERY_DRAFT"]
                else:
                    os.environ["K3_SPEC_EVERY_DRAFT"] = prev
            if [s.token for s in steps] != plain:
                raise AssertionError(f"{case.name}: speculative decoding gave other tokens than plain decoding")
            return {"seqs": [_seq(steps)]}
    raise ValueError(f"unknown case kind {case.kind!r}")


def compute(model_dirs: dict[str, Path], cases=CASES) -> dict[str, dict]:
    """{case name: result} for the tree this process imports, threads put back after."""
    import numba
    import torch
    before = torch.get_num_threads(), numba.get_num_threads()
    try:
        return {c.name: run_case(c, model_dirs[c.model]) for c in cases}
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])


# ---------------------------------------------------------------------------- comparing
def diff(name: str, want: dict, got: dict) -> str | None:
    """None if the two results of case ``name`` are the same; else a readable account:
    the first differing token, the first differing logits step with the four floats on
    either side, how many steps differ."""
    if want == got:
        return None
    lines = [f"{name}:"]
    if len(want["seqs"]) != len(got["seqs"]):
        return f"{name}: {len(got['seqs'])} sequences, recorded {len(want['seqs'])}"
    for k, (w, g) in enumerate(zip(want["seqs"], got["seqs"])):
        where = f"  seq {k}" if len(want["seqs"]) > 1 else " "
        if w["tokens"] != g["tokens"]:
            i = next((i for i, (a, b) in enumerate(zip(w["tokens"], g["tokens"])) if a != b),
                     min(len(w["tokens"]), len(g["tokens"])))
            lines.append(f"{where} tokens differ first at step {i}: recorded {w['tokens'][i:i + 4]}..., "
                         f"got {g['tokens'][i:i + 4]}... ({len(w['tokens'])} vs {len(g['tokens'])} tokens)")
        bad = [i for i, (a, b) in enumerate(zip(w["logits"], g["logits"])) if a["sha256"] != b["sha256"]]
        if len(w["logits"]) != len(g["logits"]):
            lines.append(f"{where} {len(g['logits'])} logits vectors, recorded {len(w['logits'])}")
        if bad:
            i = bad[0]
            same_head = w["logits"][i]["head"] == g["logits"][i]["head"]
            lines.append(f"{where} logits differ at {len(bad)} of {len(w['logits'])} steps, first at step {i}: "
                         f"recorded head {w['logits'][i]['head']}, got {g['logits'][i]['head']}"
                         + (" (the first 4 agree: the difference lies further in)" if same_head else ""))
        if w.get("steps") != g.get("steps"):
            i = next((i for i, (a, b) in enumerate(zip(w["steps"], g["steps"])) if a != b), None)
            lines.append(f"{where} schedule [pass, batch, drafted, accepted] differs first at step {i}: "
                         f"recorded {w['steps'][i] if i is not None else w['steps']}, "
                         f"got {g['steps'][i] if i is not None else g['steps']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- instruction sets
def isa_paths() -> list[str]:
    """The kernel paths this CPU can run (as tests/test_mxfp4.py finds them)."""
    import llvmlite.binding as ll
    feats = ll.get_host_cpu_features()
    return ["generic"] + (["avx2"] if feats.get("avx2") else []) + \
        (["avx512"] if feats.get("avx2") and feats.get("avx512bw") else [])


def sources_hash(tree: Path) -> str:
    """A hash of every .py file of the k3 package in ``tree``."""
    h = hashlib.sha256()
    pkg = Path(tree) / "k3"
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(pkg)).encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


def isa_cache(tree: Path, isa: str) -> Path:
    """The numba cache of a forced-``isa`` child: its own per instruction set (numba
    caches per CPU, not per path) and per version of the k3 sources. numba checks only
    the file that defines a function, while k3's kernels compile in code of other files
    (the reason for k3.quant.kcache), so a folder keyed by every source never serves a
    stale kernel; it persists so that only the first run per version compiles
    (several minutes per set on 2 cores). Under K3_CACHE (default ~/.cache/k3)."""
    base = Path(os.environ.get("K3_CACHE") or Path.home() / ".cache" / "k3")
    return base / "golden-isa" / sources_hash(tree) / isa


def compute_in_child(tree: Path, model_dirs: dict[str, Path], env_extra: dict[str, str],
                     timeout: float = 3600) -> dict[str, dict]:
    """compute() in a fresh process importing ``tree``, with ``env_extra`` set."""
    with tempfile.TemporaryDirectory(prefix="k3-golden-") as tmp:
        out = Path(tmp) / "values.json"
        models = json.dumps({m: str(p) for m, p in model_dirs.items()})
        env = dict(os.environ, **env_extra)
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--tree", str(tree), "--child", models,
                            "--out", str(out)], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
                           check=False)
        if r.returncode != 0:
            raise RuntimeError(f"child with {env_extra} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
        return json.loads(out.read_text())


def forced_isa_env(tree: Path, isa: str) -> dict[str, str]:
    cache = isa_cache(tree, isa)
    cache.mkdir(parents=True, exist_ok=True)
    return {"K3_KERNEL_ISA": isa, "NUMBA_CACHE_DIR": str(cache)}


# ---------------------------------------------------------------------------- recording
def _git(tree: Path, *args) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _kernel_isa() -> str:
    """The path this process's kernels compiled for (informational; the module moves
    in the kernels refactor)."""
    import importlib
    for mod in ("k3.quant.bf16", "k3.kernels.cpu"):
        try:
            return importlib.import_module(mod).kernel_isa()
        except (ImportError, AttributeError):
            continue
    return "unknown"


def record(tree: Path, isas: list[str], say=print) -> dict:
    import numba
    import torch

    import k3

    say(f"k3 from {Path(k3.__file__).parent}")
    with tempfile.TemporaryDirectory(prefix="k3-golden-") as tmp:
        t0 = time.perf_counter()
        dirs = build_models(Path(tmp) / "a")
        again = build_models(Path(tmp) / "b")
        files = {m: model_files(d) for m, d in dirs.items()}
        for m, d in again.items():
            if model_files(d) != files[m]:
                raise SystemExit(f"model {m}: two builds differ; the test could not rebuild it")
        say(f"models built twice, identical ({time.perf_counter() - t0:.1f} s)")

        t0 = time.perf_counter()
        cases = compute(dirs)
        say(f"{len(cases)} cases in-process ({time.perf_counter() - t0:.1f} s)")

        # the contracts the recorded values rest on (k3: docs/ARCHITECTURE.md)
        for c in CASES:
            if c.threads == 1:
                other = Case(c.model, c.kind, 2, c.cache).name
                if cases[c.name] != cases[other]:
                    raise SystemExit(f"1 and 2 threads differ:\n{diff(other, cases[other], cases[c.name])}")
            if c.cache == "bounded":
                res = Case(c.model, c.kind, c.threads).name
                if cases[c.name]["seqs"] != cases[res]["seqs"]:
                    raise SystemExit(f"bounded cache differs from resident:\n{diff(res, cases[res], cases[c.name])}")
            if c.kind == "spec":
                st = [s for q in cases[c.name]["seqs"] for s in q["steps"]]
                drafted, accepted = sum(s[2] for s in st), sum(s[3] for s in st)
                if not 0 < accepted < drafted:
                    raise SystemExit(f"{c.name}: {accepted} of {drafted} drafts accepted; the case needs some "
                                     "kept and some refused")
        say("1 == 2 threads, bounded == resident cache: bit for bit")

        per_isa, agree = {}, {}
        for isa in isas:
            t0 = time.perf_counter()
            got = compute_in_child(tree, dirs, forced_isa_env(tree, isa))
            bad = [diff(n, cases[n], got[n]) for n in cases if got.get(n) != cases[n]]
            agree[isa] = not bad
            if bad:
                per_isa[isa] = got
                say(f"K3_KERNEL_ISA={isa}: {len(bad)} cases DIFFER from the default set; recorded separately:\n"
                    + "\n".join(bad[:5]))
            else:
                say(f"K3_KERNEL_ISA={isa}: every case identical ({time.perf_counter() - t0:.0f} s)")

    return {
        "format": FORMAT,
        "meta": {
            "recorded_from": {"commit": _git(tree, "rev-parse", "HEAD"),
                              "k3_changes": _git(tree, "status", "--porcelain", "--", "k3") or "none"},
            "recorded_at": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "numba": numba.__version__,
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "kernel_isa": _kernel_isa()},
            "isa_checked": agree,
            "command": "python tests/golden/record.py --tree TREE --out tests/golden/values.json",
        },
        "models": files,
        "cases": cases,
        "isa": per_isa,  # only instruction sets whose values differ from "cases" (none, by k3's contract)
    }


def machine_key() -> str:
    """What the last bits of the values depend on beyond k3's own sources: the CPU
    (vendor, family, model: the math libraries torch and numpy call pick their code by
    it) and the versions of the libraries and interpreter. k3 promises the same bits at
    every thread count, budget and kernel instruction set on one machine, not across
    machines (the reference values came from an AMD Zen 4; an Intel Xeon rounds a few
    logits' last bits otherwise, with the same tokens)."""
    import llvmlite
    import numba
    import numpy
    import torch

    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("vendor_id", "cpu family", "model") and k.strip() not in cpu:
                cpu[k.strip()] = v.strip()
    except OSError:
        pass
    parts = [cpu.get("vendor_id", platform.machine()), f"f{cpu.get('cpu family', '')}m{cpu.get('model', '')}",
             torch.backends.cpu.get_cpu_capability(), f"py{platform.python_version()}", f"torch{torch.__version__}",
             f"numba{numba.__version__}", f"llvmlite{llvmlite.__version__}", f"numpy{numpy.__version__}"]
    return "-".join(p.replace("+", "_").replace("/", "_") for p in parts)


def machine_values() -> Path:
    return MACHINES / f"{machine_key()}.json"


def dumps(obj, indent: str = "") -> str:
    """JSON with a line per logits digest and per token list, so that a re-recording's
    git diff shows which steps changed (sorted keys: the same values give the same file)."""
    flat = json.dumps(obj, sort_keys=True)
    if not isinstance(obj, (dict, list)) or len(flat) <= 200 or \
            (isinstance(obj, list) and not any(isinstance(x, (dict, list)) for x in obj)):
        return flat
    inner = indent + " "
    if isinstance(obj, list):
        return "[\n" + ",\n".join(inner + dumps(x, inner) for x in obj) + "\n" + indent + "]"
    return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {dumps(obj[k], inner)}" for k in sorted(obj)) + \
        "\n" + indent + "}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, help="the k3 checkout to record from (put first on sys.path)")
    ap.add_argument("--out", type=Path, default=VALUES, help=f"where to write the values (default {VALUES})")
    ap.add_argument("--isa", default="all",
                    help="comma-separated instruction sets to check in child processes, 'all' (every one this "
                         "CPU runs) or 'none'")
    ap.add_argument("--machine", action="store_true",
                    help="record this machine's own values (tests/golden/machines/KEY.json; no instruction-set "
                         "children), for a machine whose last bits are not the reference machine's")
    ap.add_argument("--child", metavar="MODELS_JSON", help=argparse.SUPPRESS)  # compute() for the parent
    a = ap.parse_args(argv)
    if a.tree is not None:
        sys.path.insert(0, str(a.tree.resolve()))
    import k3
    tree = Path(k3.__file__).resolve().parent.parent
    if a.tree is not None and tree != a.tree.resolve():
        raise SystemExit(f"--tree {a.tree}: k3 was imported from {tree}")
    if a.child is not None:
        dirs = {m: Path(p) for m, p in json.loads(a.child).items()}
        a.out.write_text(json.dumps(compute(dirs)))
        return 0
    isas = isa_paths() if a.isa == "all" and not a.machine else [] if a.isa == "none" or a.machine \
        else a.isa.split(",")
    values = record(tree, isas, say=lambda m: print(m, file=sys.stderr, flush=True))
    if a.machine:
        a.out = machine_values() if a.out == VALUES else a.out
        a.out.parent.mkdir(parents=True, exist_ok=True)
        values = {"format": values["format"], "meta": dict(values["meta"], key=machine_key()),
                  "cases": values["cases"]}
    a.out.write_text(dumps(values) + "\n")
    print(f"wrote {a.out}: {len(values['cases'])} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
