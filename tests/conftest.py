import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# test helpers (k3fixtures, refutil) live beside the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))

_ISA_TEST = "test_every_instruction_set_path_gives_the_same_bits"
_early = []   # (module, folder) of the instruction-set processes started below


def _worker(config) -> bool:
    """True in a pytest-xdist worker process (`make test` runs the suite in several)."""
    return hasattr(config, "workerinput")


def _parallel(config) -> bool:
    """True in the controller of a pytest-xdist run with workers."""
    return not _worker(config) and bool(getattr(config.option, "numprocesses", None))


# ---------------------------------------------------------------- parallel runs (pytest-xdist)
@pytest.hookimpl(tryfirst=True)    # before xdist starts its workers
def pytest_sessionstart(session):
    """Before xdist's workers start: compile k3's kernels once, here, into the shared
    cache folder (K3_CACHE, default ~/.cache/k3), in helpers on every core. Each worker
    would otherwise compile the same kernels at its first k3.load, at the same time."""
    if not _parallel(session.config) or os.environ.get("NUMBA_CACHE_DIR"):
        return
    from k3 import warmup
    from k3.kernels import kcache
    prev = kcache.enter()     # names this process's kernel folder (where the markers live)
    kcache.leave(prev)
    cold = kcache.missing(list(warmup.JOBS))
    if cold:
        r = warmup.compile_in_helpers(cold, warmup.usable_cores())
        for name in cold:
            if name not in r["failed"]:
                kcache.mark(name)


#: the modules that take longest, longest first: `--dist loadfile` hands a module's tests
#: to one worker (its module-scoped fixtures, often a synthesized model or a server, are
#: built once), the modules in the order of the tests, so these start first and the short
#: ones fill in at the end. (Not --dist loadgroup: with pytest 9, xdist 3.8's groups are
#: silently ignored.)
_LONG = ("test_pipeline.py", "test_server.py", "test_streaming.py", "test_signals.py", "test_reliability.py",
         "test_trunk.py", "test_api.py", "test_mxfp4.py", "test_answer_grammar.py", "test_model_dirs.py",
         "test_spec.py")


def _order(item) -> int:
    name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
    return _LONG.index(name) if name in _LONG else len(_LONG)


def pytest_collection_modifyitems(session, config, items):
    if _worker(config):
        items.sort(key=_order)     # stable: the same order in every worker, as xdist requires


# A test marked realtime measures time (signal moments, a policy's own clock, timeouts):
# another worker's test beside it would slow it by a factor and could fail it. The
# workers share a lock file: each test holds it shared, a realtime test (with the
# realtime tests right after it on its worker) exclusive. The turnstile (taken exclusive by the
# realtime worker while it waits) stops the other workers from starting new tests
# meanwhile, so the exclusive lock is reached once their current tests end.
_lock = {"fd": None, "turn": None, "mode": None}


def _lock_files(config):
    if _lock["fd"] is None:
        base = Path(config.workerinput["k3_lock_dir"])
        _lock["fd"] = os.open(base / "tests.lock", os.O_RDWR | os.O_CREAT, 0o600)
        _lock["turn"] = os.open(base / "turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)
    return _lock["fd"], _lock["turn"]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: one lock folder for this run's workers."""
    d = node.config.__dict__.setdefault("_k3_lock_dir", tempfile.mkdtemp(prefix="k3-tests-lock-"))
    node.workerinput["k3_lock_dir"] = d


def _acquire(item):
    fd, turn = _lock_files(item.config)
    if item.get_closest_marker("realtime"):
        if _lock["mode"] == "ex":
            return
        if _lock["mode"] == "sh":
            fcntl.flock(fd, fcntl.LOCK_UN)
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _lock["mode"] = "ex"
    elif _lock["mode"] is None:
        fcntl.flock(turn, fcntl.LOCK_EX)   # passes straight through unless a realtime test waits
        fcntl.flock(fd, fcntl.LOCK_SH)
        fcntl.flock(turn, fcntl.LOCK_UN)
        _lock["mode"] = "sh"


def _release(nextitem):
    if _lock["mode"] is None:
        return
    if _lock["mode"] == "ex" and nextitem is not None and nextitem.get_closest_marker("realtime"):
        return                             # the realtime tests after it keep the lock
    fd, turn = _lock["fd"], _lock["turn"]
    fcntl.flock(fd, fcntl.LOCK_UN)
    if _lock["mode"] == "ex":
        fcntl.flock(turn, fcntl.LOCK_UN)
    _lock["mode"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _worker(item.config):
        _acquire(item)
        try:
            yield
        finally:
            _release(nextitem)
    else:
        yield


# ---------------------------------------------------------------- the instruction-set test
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Once the tests are known: if the instruction-set test is among them, start its
    other-path compiles now (fresh processes, a minute or more each), so they run on the
    other core while the first tests run, instead of in series when that test comes.
    Not in an xdist worker: every worker collects every test, and the other cores are
    busy with tests there; the test starts its compiles itself when it runs."""
    if _worker(session.config):
        return
    for item in session.items:
        if item.name == _ISA_TEST:
            mod = item.module
            folder = Path(tempfile.mkdtemp(prefix="k3-isa-"))
            mod.EARLY_PATHS = (folder, mod.start_other_paths(folder))
            _early.append((mod, folder))
            break


def pytest_sessionfinish(session, exitstatus):
    for mod, folder in _early:      # nothing left running, nothing left behind
        for p in mod.EARLY_PATHS[1].values():
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(folder, ignore_errors=True)
    d = session.config.__dict__.get("_k3_lock_dir")
    if d:
        shutil.rmtree(d, ignore_errors=True)
