"""A fresh clone must pass its tests with nothing beside it: no file of the package or of
its tests may reach outside the repository for data (the reference fixtures live in
tests/fixtures/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Built from parts so that this file does not match itself.
OUTSIDE = re.compile(re.escape(".." + "/" + "shared") + "|" + re.escape("parents" + "[2]"))


def _text_files():
    for top in ("k3", "tests"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in {".py", ".md", ".json", ".txt", ".toml", ".cfg", ".sh"}:
                yield p


def test_no_file_reaches_outside_the_repository():
    hits = []
    for p in _text_files():
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "files refer to data outside the repository:\n" + "\n".join(hits)


def test_the_scan_sees_what_it_must_catch():
    # The pattern itself must catch both spellings the old tests used.
    assert OUTSIDE.search('FIX = ROOT / "..' + '/' + 'shared/fixtures"')
    assert OUTSIDE.search('Path(__file__).resolve().' + 'parents' + '[2] / "x"')
    assert not OUTSIDE.search('Path(__file__).resolve().parent / "fixtures"')


def test_reference_fixtures_are_in_the_repository():
    fx = ROOT / "tests" / "fixtures" / "k3-in-c-v1"
    for rel in ("tiny_k3.json", "tiny_k3.bin", "ref_k3.json", "ops/MANIFEST.json", "mxfp4.json",
                "expert_trace.bin", "cfg/bad_topk.json", "st/model-00001-of-00002.safetensors",
                "cache/model-00001-of-00001.safetensors"):
        assert (fx / rel).is_file(), rel
    assert (ROOT / "tests" / "fixtures" / "README.md").is_file()
