"""The kernels' numba cache folder (k3.kernels.kcache): named by every kernel source, so
that a change to one kernel file cannot leave another file's cached code stale."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from k3.kernels import kcache

ROOT = Path(__file__).resolve().parent.parent


def _sources():
    return {rel: (ROOT / "k3" / rel).read_bytes() for rel in kcache.KERNEL_SOURCES}


def test_the_folder_changes_with_any_kernel_source_and_the_path():
    base = kcache.folder(_sources(), isa="")
    assert base == kcache.folder(_sources(), isa="")
    seen = {base}
    for rel in kcache.KERNEL_SOURCES:
        changed = _sources()
        changed[rel] += b"\n# edited\n"
        seen.add(kcache.folder(changed, isa=""))
    seen.add(kcache.folder(_sources(), isa="avx2"))
    assert len(seen) == len(kcache.KERNEL_SOURCES) + 2


def test_every_kernel_file_is_listed():
    # a module with cached numba functions that is not hashed would bring the problem back
    decorated = re.compile(r"^@(numba\.)?njit\(.*cache=True", re.M)
    with_cache = {str(p.relative_to(ROOT / "k3")) for p in (ROOT / "k3").rglob("*.py")
                  if decorated.search(p.read_text(encoding="utf-8"))}
    assert with_cache and with_cache <= set(kcache.KERNEL_SOURCES)


_PROBE = """
import json, sys
import k3.kernels.bf16 as b, k3.kernels.mxfp4 as m, k3.kernels.norms as f, k3.kernels.vml as v
from numba.core import config
from k3.kernels import kcache
print(json.dumps({"paths": [b._bf16_t1._cache._cache_path, m._mxfp4_t1._cache._cache_path,
                            f._weighted_sum._cache._cache_path, v.vexp._cache._cache_path],
                  "folder": str(kcache.folder()), "after": config.CACHE_DIR,
                  "missing": kcache.missing(sys.argv[1:]), "where": kcache.where()}))
for job in sys.argv[1:]:
    kcache.mark(job)
"""


def _probe(tmp_path, *jobs, **env):
    e = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    e.update(K3_CACHE=str(tmp_path / "k3cache"), **env)
    out = subprocess.run([sys.executable, "-c", _PROBE, *jobs], env=e, capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_cache_in_the_folder_and_numba_setting_is_restored(tmp_path):
    r = _probe(tmp_path)
    assert r["folder"].startswith(str(tmp_path / "k3cache" / "numba"))
    assert all(p.startswith(r["folder"]) for p in r["paths"]), r
    assert r["after"] == ""                  # other code's numba functions: numba's own places


def test_an_explicit_numba_cache_dir_wins(tmp_path):
    mine = tmp_path / "mine"
    r = _probe(tmp_path, NUMBA_CACHE_DIR=str(mine))
    assert all(p.startswith(str(mine)) for p in r["paths"]), r


def test_a_first_run_knows_what_it_compiles_and_the_next_does_not(tmp_path):
    """A kernel folder without the markers of a group's finished warm-up is seen as such
    before anything compiles (k3.load then says that they compile, minutes of silence
    otherwise); once a process has marked a group, the next one finds it. Under the
    user's own NUMBA_CACHE_DIR k3 cannot tell, and claims nothing."""
    first = _probe(tmp_path, "matmul", "kda")
    assert first["missing"] == ["matmul", "kda"] and first["where"] == first["folder"]
    assert _probe(tmp_path, "matmul", "kda", "mla_region")["missing"] == ["mla_region"]
    assert _probe(tmp_path, "matmul", NUMBA_CACHE_DIR=str(tmp_path / "mine"))["missing"] == []
