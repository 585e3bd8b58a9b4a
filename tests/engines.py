"""Opening test models through the one public entry point, k3.load, and the greedy
decode loop the tests compare against references."""

from __future__ import annotations

import k3


def open_engine(model_dir, **kw):
    """k3.load with the defaults a test wants (auto plan, trunk resident unless `trunk=`)."""
    return k3.load(model_dir, **kw)


def greedy_ids(eng, prompt_ids, n: int, incremental: bool = True, state=None) -> list[int]:
    """The n greedy tokens after prompt_ids (full recompute or incremental)."""
    return [s.token for s in eng.decode(list(prompt_ids), state=state, incremental=incremental, max_tokens=n)]


def own_cache(cache):
    """``cache`` (a Path) made to serve as a child process's K3_CACHE, with this process's
    compiled kernels linked in: every kernel compiled afresh in the child took about a
    minute, as long as the timeouts its test waits with."""
    from k3.kernels import kcache
    cache.mkdir(parents=True, exist_ok=True)
    kernels = kcache.folder().parent
    kernels.mkdir(parents=True, exist_ok=True)
    if not (cache / "numba").exists():
        (cache / "numba").symlink_to(kernels, target_is_directory=True)
    return cache
