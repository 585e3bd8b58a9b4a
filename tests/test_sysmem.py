"""The memory a plan may use under a memory cgroup: every limit up the tree counts, not
only the process's own group's.

Fake hierarchies in tmp_path cover both layouts (cgroup v2, alone or as the hybrid
`unified` mount; cgroup v1) and the odd cases: a limit only on the parent, a child
limit lower than the parent's, a parent whose usage leaves less than the child's own
limit, no limit at all, a cgroup namespace, v1's hierarchical_memory_limit, garbage
files. Where the machine allows (root, a writable memory controller), a real parent
cgroup with a 250 MiB limit and a child without one: the process in the child sees at
most 250 MiB, and `k3 run` is refused (exit 1, REFUSING TO START) instead of being
OOM-killed."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3.errors import UsageError
from k3.memory import sysmem

MiB = 1 << 20
UNLIMITED_V1 = "9223372036854771712\n"  # what v1 shows for "no limit"
MEMINFO = "MemTotal:       16000000 kB\nMemFree:        1000000 kB\nMemAvailable:   15000000 kB\n"
HOST_TOTAL, HOST_AVAIL = 16000000 * 1024, 15000000 * 1024


def fake(root: Path, files: dict[str, str | bytes | None]) -> str:
    """Write a fake cgroup tree under root: path -> content (None makes a folder)."""
    for rel, text in files.items():
        p = root / rel
        if text is None:
            p.mkdir(parents=True, exist_ok=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)
    return str(root)


def mem(root: str, proc_cgroup: str) -> dict:
    return sysmem.meminfo(cgroup_root=root, proc_cgroup=proc_cgroup, proc_meminfo=MEMINFO)


# ---------------------------------------------------------------- cgroup v2 (fake)

def test_v2_parent_limit_applies_to_an_unlimited_child(tmp_path):
    """The issue's case: 250 MiB on the parent, nothing on the child. The parent's usage
    (the child's plus its siblings') counts against the parent's limit."""
    root = fake(tmp_path, {
        "cgroup.controllers": "cpu io memory pids\n",
        "job/memory.max": f"{250 * MiB}\n", "job/memory.current": f"{40 * MiB}\n",
        "job/run/memory.max": "max\n", "job/run/memory.current": f"{30 * MiB}\n",
    })
    mi = mem(root, "0::/job/run\n")
    assert mi == {"MemTotal": 250 * MiB, "MemAvailable": 210 * MiB, "CgroupLimit": 250 * MiB}
    # inactive page cache is reclaimed before the OOM killer runs: not counted as used
    fake(tmp_path, {"job/memory.stat": f"anon {20 * MiB}\nfile {20 * MiB}\ninactive_file {15 * MiB}\n"})
    assert mem(root, "0::/job/run\n")["MemAvailable"] == 225 * MiB


def test_v2_lowest_limit_and_lowest_headroom_win(tmp_path):
    root = fake(tmp_path, {
        "cgroup.controllers": "memory\n",
        "job/memory.max": f"{250 * MiB}\n", "job/memory.current": f"{50 * MiB}\n",
        "job/run/memory.max": f"{100 * MiB}\n", "job/run/memory.current": f"{20 * MiB}\n",
    })
    assert mem(root, "0::/job/run\n") == {"MemTotal": 100 * MiB, "MemAvailable": 80 * MiB, "CgroupLimit": 100 * MiB}
    # siblings use 210 MiB of the parent's 250: the child's own 100 MiB limit is not reachable
    fake(tmp_path, {"job/memory.current": f"{230 * MiB}\n"})
    assert mem(root, "0::/job/run\n") == {"MemTotal": 100 * MiB, "MemAvailable": 20 * MiB, "CgroupLimit": 100 * MiB}
    # over the limit (usage can exceed it briefly): nothing available, not a negative number
    fake(tmp_path, {"job/memory.current": f"{300 * MiB}\n"})
    assert mem(root, "0::/job/run\n")["MemAvailable"] == 0
    # MemAvailable still wins when the machine has less than the cgroups allow
    fake(tmp_path, {"job/memory.current": f"{50 * MiB}\n"})
    mi = sysmem.meminfo(cgroup_root=root, proc_cgroup="0::/job/run\n",
                        proc_meminfo="MemTotal: 200000 kB\nMemAvailable: 10000 kB\n")
    assert mi == {"MemTotal": 100 * MiB, "MemAvailable": 10000 * 1024, "CgroupLimit": 100 * MiB}


def test_v2_no_limits(tmp_path):
    root = fake(tmp_path, {
        "cgroup.controllers": "memory\n",
        "user.slice/memory.max": "max\n", "user.slice/memory.current": f"{900 * MiB}\n",
        "user.slice/s/memory.max": "max\n", "user.slice/s/memory.current": f"{9 * MiB}\n",
    })
    assert mem(root, "0::/user.slice/s\n") == {"MemTotal": HOST_TOTAL, "MemAvailable": HOST_AVAIL}
    assert sysmem.cgroup_limit(root, "0::/user.slice/s\n") is None
    assert sysmem.cgroup_limit(root, "0::/\n") is None  # the root cgroup has no memory.max
    # limits of 2^60 and above are "unlimited" written as a number
    fake(tmp_path, {"user.slice/memory.max": f"{1 << 62}\n"})
    assert sysmem.cgroup_limit(root, "0::/user.slice/s\n") is None


def test_v2_hybrid_unified_mount(tmp_path):
    """systemd's hybrid layout: v1 controllers under /sys/fs/cgroup/<name>, the v2 tree at
    /sys/fs/cgroup/unified. Memory may sit on either side."""
    root = fake(tmp_path, {
        "cpu/tasks": "",
        "memory/tasks": "", "memory/memory.limit_in_bytes": UNLIMITED_V1,
        "unified/cgroup.controllers": "memory\n",
        "unified/job/memory.max": f"{250 * MiB}\n", "unified/job/memory.current": f"{10 * MiB}\n",
        "unified/job/run/memory.max": "max\n", "unified/job/run/memory.current": f"{1 * MiB}\n",
    })
    mi = mem(root, "4:memory:/\n1:cpu:/\n0::/job/run\n")
    assert mi == {"MemTotal": 250 * MiB, "MemAvailable": 240 * MiB, "CgroupLimit": 250 * MiB}
    # this machine's layout: the unified mount without the memory controller, memory on v1
    root2 = fake(tmp_path / "h2", {
        "unified/cgroup.controllers": "hugetlb\n", "unified/cgroup.procs": "",
        "memory/memory.limit_in_bytes": UNLIMITED_V1,
        "memory/job/memory.limit_in_bytes": f"{250 * MiB}\n", "memory/job/memory.stat": f"total_rss {5 * MiB}\n",
        "memory/job/run/memory.limit_in_bytes": UNLIMITED_V1, "memory/job/run/memory.stat": f"total_rss {5 * MiB}\n",
    })
    assert mem(root2, "4:memory:/job/run\n0::/\n")["MemAvailable"] == 245 * MiB


def test_v2_cgroup_namespace(tmp_path):
    """Inside a cgroup namespace (or a container whose own cgroup is bind-mounted at
    /sys/fs/cgroup) the path in /proc/self/cgroup is "/" or names a folder the mount does
    not have: the mount's root is the process's own cgroup. Its limit counts; nothing
    above it is visible."""
    root = fake(tmp_path, {
        "cgroup.controllers": "memory\n",
        "memory.max": f"{250 * MiB}\n", "memory.current": f"{50 * MiB}\n",
    })
    for proc in ("0::/\n", "0::/../../system.slice/docker-1.scope\n", "0::/docker/abc\n"):
        assert mem(root, proc) == {"MemTotal": 250 * MiB, "MemAvailable": 200 * MiB, "CgroupLimit": 250 * MiB}, proc


# ---------------------------------------------------------------- cgroup v1 (fake)

def test_v1_hierarchical_limit_below_own_limit(tmp_path):
    """v1: memory.limit_in_bytes is only the group's own; hierarchical_memory_limit is the
    lowest up the tree, including levels this mount does not show."""
    root = fake(tmp_path, {
        "memory/memory.limit_in_bytes": f"{2048 * MiB}\n",
        "memory/memory.stat": (f"cache {500 * MiB}\nrss {10 * MiB}\nhierarchical_memory_limit {250 * MiB}\n"
                               f"total_cache {500 * MiB}\ntotal_rss {30 * MiB}\n"),
    })
    # the container's own cgroup is the mount's root; the parent with 250 MiB is not visible
    mi = mem(root, "4:memory:/docker/abc\n0::/\n")
    assert mi == {"MemTotal": 250 * MiB, "MemAvailable": 220 * MiB, "CgroupLimit": 250 * MiB}


def test_v1_parent_visible_counts_its_whole_subtree(tmp_path):
    """With the parent visible, its usage (total_rss: itself and every child, siblings
    included) is what counts against its limit; page cache is not counted."""
    root = fake(tmp_path, {
        "memory/memory.limit_in_bytes": UNLIMITED_V1, "memory/memory.stat": f"total_rss {9000 * MiB}\n",
        "memory/job/memory.limit_in_bytes": f"{250 * MiB}\n",
        "memory/job/memory.stat": f"rss 0\ntotal_cache {900 * MiB}\ntotal_rss {100 * MiB}\n",
        "memory/job/run/memory.limit_in_bytes": UNLIMITED_V1,
        "memory/job/run/memory.stat": (f"rss {30 * MiB}\nhierarchical_memory_limit {250 * MiB}\n"
                                       f"total_rss {30 * MiB}\n"),
    })
    proc = "9:name=systemd:/\n4:memory:/job/run\n1:cpu,cpuacct:/\n0::/\n"
    assert mem(root, proc) == {"MemTotal": 250 * MiB, "MemAvailable": 150 * MiB, "CgroupLimit": 250 * MiB}
    # old kernels: a parent with use_hierarchy 0 does not charge its children (and then the
    # kernel's hierarchical_memory_limit does not include it either)
    fake(tmp_path, {"memory/job/memory.use_hierarchy": "0\n",
                    "memory/job/run/memory.stat": f"rss {30 * MiB}\nhierarchical_memory_limit {1 << 63}\n"})
    assert mem(root, proc) == {"MemTotal": HOST_TOTAL, "MemAvailable": HOST_AVAIL}


# ---------------------------------------------------------------- garbage

def test_garbage_means_no_limit_at_that_level(tmp_path):
    """Unparsable, empty, negative, non-UTF-8 or unreadable files (a folder where a file
    should be) are "no limit here", never an exception; a valid level still applies."""
    root = fake(tmp_path, {
        "cgroup.controllers": "memory\n",
        "a/memory.max": f"{250 * MiB}\n", "a/memory.current": "lots\n",
        "a/memory.stat": b"\xff\xfe\x00 inactive_file\nanon\n",
        "a/b/memory.max": "garbage\n", "a/b/memory.current": "",
        "a/b/c/memory.max": "-5\n", "a/b/c/memory.current": f"{1 * MiB}\n",
        "a/b/c/d/memory.max": b"\xff\xff\xff", "a/b/c/d/memory.current": None,
        "a/b/c/d/e/memory.max": "1e9\n", "a/b/c/d/e/memory.current": "12 34\n",
        "a/b/c/d/e/f/memory.max": None, "a/b/c/d/e/f/memory.current": "7" * 5000 + "\n",
        "memory/x/memory.limit_in_bytes": "99999999999999999999999\n",
        "memory/x/memory.stat": "hierarchical_memory_limit\nrss -3\ntotal_rss x y z\n\n",
    })
    proc = "garbage\n::\n4:memory\n7:memory:/x\n0::/a/b/c/d/e/f\n"
    # only a's 250 MiB is a limit; its usage is unreadable and counts as 0
    assert mem(root, proc) == {"MemTotal": 250 * MiB, "MemAvailable": 250 * MiB, "CgroupLimit": 250 * MiB}
    for proc in ("", "\x00\n", "0::\n", "0::relative/path\n", "4:memory:\n"):
        sysmem.cgroup_limit(root, proc)  # no exception
    assert sysmem.cgroup_limit(str(tmp_path / "nowhere"), "0::/a\n4:memory:/a\n") is None
    with pytest.raises(UsageError, match="meminfo"):
        sysmem.meminfo(cgroup_root=root, proc_cgroup=proc, proc_meminfo="MemTotal: lots\n")


def test_defaults_read_this_machine():
    mi = sysmem.meminfo()
    assert mi["MemTotal"] > 0 and 0 <= mi["MemAvailable"] <= mi["MemTotal"]
    lim = sysmem.cgroup_limit()
    assert lim is None or (lim[0] == mi["CgroupLimit"] and mi["MemTotal"] <= lim[0])


# ---------------------------------------------------------------- a real cgroup

ROOT = "/sys/fs/cgroup"


def _hierarchy() -> tuple[str, str] | None:
    """('v1', memory mount) or ('v2', unified mount) where this process's memory
    controller is and can be written (root), else None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    if any("memory" in ln.split(":")[1].split(",") for ln in lines if ln.count(":") >= 2):
        mount = os.path.join(ROOT, "memory")
        return ("v1", mount) if os.access(os.path.join(mount, "cgroup.procs"), os.W_OK) else None
    for mount in (os.path.join(ROOT, "unified"), ROOT):
        try:
            ctrls = Path(mount, "cgroup.subtree_control").read_text().split()
        except OSError:
            continue
        if "memory" in ctrls and os.access(mount, os.W_OK):
            return "v2", mount
    return None


HIER = _hierarchy()
needs_cgroup = pytest.mark.skipif(HIER is None, reason="needs root and a writable memory cgroup (v1 or v2)")


@contextlib.contextmanager
def parent_with_limit(limit: int, own: bool = False):
    """A fresh cgroup with a memory limit and a child without one; yields the command
    prefix that runs a program in the child (``own``: in the limited group itself).
    Both are removed afterwards, whatever happened."""
    kind, mount = HIER
    parent = os.path.join(mount, f"k3sysmem{os.getpid()}")
    child = os.path.join(parent, "child")
    made = []
    try:
        os.mkdir(parent)
        made.append(parent)
        if kind == "v1":
            Path(parent, "memory.limit_in_bytes").write_text(str(limit))
        else:
            Path(parent, "memory.max").write_text(str(limit))
            Path(parent, "cgroup.subtree_control").write_text("+memory")  # the child gets memory.max ("max")
        os.mkdir(child)
        made.append(child)
        yield ["sh", "-c", f'echo $$ > {parent if own else child}/cgroup.procs && exec "$@"', "sh"]
    finally:
        for d in reversed(made):  # a killed process may take a moment to leave the group
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from k3.synth import synthesize
    d = tmp_path_factory.mktemp("tiny") / "m"
    synthesize(d, preset="tiny", arch="k3", seed=3)
    return d


PROBE = "import json; from k3.memory import sysmem; print(json.dumps(sysmem.meminfo()))"


@needs_cgroup
@pytest.mark.parametrize("own", [False, True], ids=["parent", "own"])
def test_real_limit_250mib_refuses_before_the_kill(tiny, tmp_path, own):
    """The issue: 250 MiB on the parent (the process in an unlimited child), or on the
    process's own group. meminfo() there sees at most 250 MiB, and `k3 run` is refused
    (exit 1, the plan with its shortfall) before it loads or compiles the kernels, which
    would take it past the limit, instead of being OOM-killed. The interpreter with
    torch alone needs more than 250 MiB (peak RSS ~430 MB plus the plan's 300 MB
    margin), so at 250 MiB every model, even tiny, is refused. Both with the kernels
    cached and with a cold kernel folder (a first run)."""
    with parent_with_limit(250 * MiB, own=own) as inside:
        r = subprocess.run([*inside, sys.executable, "-c", PROBE], check=False, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        mi = json.loads(r.stdout)
        print(f"\n{HIER[0]}: meminfo() in {'a 250 MiB group' if own else 'the child of a 250 MiB parent'}: {mi}")
        assert mi["CgroupLimit"] == 250 * MiB and mi["MemTotal"] == 250 * MiB
        assert 0 < mi["MemAvailable"] <= 250 * MiB

        for cache in (None, tmp_path / "cold"):
            env = dict(os.environ, **({"K3_CACHE": str(cache)} if cache else {}))
            r = subprocess.run([*inside, sys.executable, "-m", "k3", "run", str(tiny), "--ids", "5,6", "--gen", "2"],
                               check=False, capture_output=True, text=True, timeout=300, env=env)
            print(r.stderr[-1500:])
            assert r.returncode == 1, f"exit {r.returncode} (-9/137: OOM-killed)\n{r.stderr[-2000:]}"
            assert "REFUSING TO START" in r.stderr and "shortfall" in r.stderr
            assert "interpreter + libs" in r.stderr  # the usual plan message, with its rows
            assert "compiling" not in r.stderr
            assert "Traceback" not in r.stderr


@needs_cgroup
def test_real_parent_limit_that_fits_still_runs(tiny):
    """Under a parent limit large enough for the interpreter and the tiny model, the same
    run goes through, and its plan saw the parent's limit."""
    with parent_with_limit(1536 * MiB) as inside:
        out = Path(str(tiny) + ".run.json")
        r = subprocess.run([*inside, sys.executable, "-m", "k3", "run", str(tiny), "--ids", "5,6", "--gen", "2",
                            "--greedy", "--out", str(out)], check=False, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads(out.read_text())
        print(f"\nplan available {res['memory_plan']['available']}, total {res['memory_plan']['total']}, "
              f"peak RSS {res['peak_rss_bytes']}")
        assert 0 < res["memory_plan"]["available"] <= 1536 * MiB
        assert len(res["generated_ids"]) == 2


@needs_cgroup
def test_real_limit_ultra_runs_where_auto_runs(tiny, tmp_path):
    """`--preset ultra` and `--preset auto` under the same cap (a packed trunk, as in the
    issue): both run, ultra streaming the tables within its ceilings, and they give the
    same greedy tokens."""
    trunk = tmp_path / "trunk"
    r = subprocess.run([sys.executable, "-m", "k3", "pack-trunk", str(tiny), str(trunk)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ids = {}
    with parent_with_limit(1280 * MiB, own=True) as inside:
        for preset in ("auto", "ultra"):
            out = tmp_path / f"{preset}.json"
            r = subprocess.run([*inside, sys.executable, "-m", "k3", "run", str(tiny), "--ids", "5,6,7", "--gen", "4",
                                "--greedy", "--trunk", str(trunk), "--preset", preset, "--out", str(out)],
                               check=False, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"{preset}: exit {r.returncode}\n{r.stderr[-2000:]}"
            res = json.loads(out.read_text())
            assert res["memory_plan"]["available"] <= 1280 * MiB
            ids[preset] = res["generated_ids"]
            if preset == "ultra":
                assert res["memory_plan"]["stream_tables"] and "ultra: " in r.stderr
    assert ids["auto"] == ids["ultra"] and len(ids["auto"]) == 4
