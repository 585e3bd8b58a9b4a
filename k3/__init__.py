"""k3: exact Kimi K3 / Kimi-Linear inference on ordinary machines.

    import k3
    with k3.load("path/to/model") as eng:          # preset="auto": the plan that fits
        for step in eng.generate("Hello", max_tokens=16):
            print(step.text, end="")

`k3.load` (:func:`k3.loader.load`) returns a :class:`k3.engine.Engine`; see their docstrings and README.md.
Importing k3 itself imports no torch: that happens on the first `load`.
"""

import os as _os

# OpenMP workers (torch's libgomp, which numba's pool also uses) spin after each
# parallel call by default, which steals the core another worker needs on a small
# machine (docs/PERFORMANCE.md). libgomp reads this when torch is imported, so it is
# set here, before anything imports torch; an explicit setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .version import __version__

__all__ = ["__version__", "load", "Budgets", "LoadOptions"]


def load(model_dir, options=None, **kwargs):
    """Open a model within a memory plan: see :func:`k3.loader.load` (``options``: a
    :class:`k3.loader.LoadOptions`; its fields may be given as keywords)."""
    from .loader import load as _load
    return _load(model_dir, options, **kwargs)


def __getattr__(name):
    if name == "Budgets":
        from .memory.planner import Budgets
        return Budgets
    if name == "LoadOptions":
        from .loader import LoadOptions
        return LoadOptions
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
