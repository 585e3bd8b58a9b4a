"""Access to the independent CPU references (spec section 7) without their GPU parts.

* fla-core: the package root imports lazily, but `fla.ops.kda` pulls in Triton kernels,
  so its torch-only reference functions are reached without importing `fla.ops`:
  `fla/ops/kda/naive.py` is loaded by file path (it needs only torch + einops), and the
  two torch gate functions of `fla/ops/kda/gate.py` (a module that imports triton at
  the top) are compiled on their own from that file's syntax tree.
* transformers' native Kimi-Linear port: its KDA / short-conv functions resolve to fla
  or causal_conv1d kernels when those import, and those kernels fail on CPU. They are
  hidden while the modeling module is imported, so the torch fallbacks are bound.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

FLA_DIST = "fla-core"
FLA_VERSION = "0.6.0"


def fla_file(rel: str) -> Path:
    """Path of a file inside the installed fla-core, found from the distribution's
    metadata (nothing of `fla` is imported). Skips the test when fla-core is absent."""
    try:
        dist = importlib.metadata.distribution(FLA_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{FLA_DIST} is not installed (pip install --no-deps {FLA_DIST}=={FLA_VERSION})")
    p = Path(dist.locate_file(rel))
    if not p.is_file():
        pytest.skip(f"{FLA_DIST} {dist.version} has no {rel}")
    return p


def load_fla_naive():
    """fla/ops/kda/naive.py as a stand-alone module (naive_recurrent_kda, naive_chunk_kda)."""
    path = fla_file("fla/ops/kda/naive.py")
    name = "_fla_kda_naive_ref"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


FLA_GATE_FUNCS = ("naive_kda_gate", "naive_kda_lowerbound_gate")


def load_fla_gate_functions() -> dict:
    """The torch reference gate functions of fla/ops/kda/gate.py, compiled from the
    installed file's own source, without executing its triton imports. They use only
    `torch` and `F` (torch.nn.functional); anything else would fail loudly here."""
    path = fla_file("fla/ops/kda/gate.py")
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FLA_GATE_FUNCS]
    found = {n.name for n in defs}
    missing = set(FLA_GATE_FUNCS) - found
    if missing:
        pytest.fail(f"{path} no longer defines {sorted(missing)}")
    for n in defs:
        n.decorator_list = []  # neither is decorated in 0.6.0; be safe anyway
    module = ast.Module(body=defs, type_ignores=[])
    ns = {"torch": torch, "F": F, "__name__": "_fla_kda_gate_ref"}
    exec(compile(module, str(path), "exec"), ns)
    return {name: ns[name] for name in FLA_GATE_FUNCS}


_HIDDEN = ("fla", "causal_conv1d")
KERNEL_FUNCS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                 "causal_conv1d_fn", "causal_conv1d_update")


def bound_implementation(fn):
    """What a transformers `use_kernel_func_from_hub_with_fallback` wrapper dispatches to
    (read from its closure), or None if the wrapper's shape is not recognised."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or "implementation" not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index("implementation")].cell_contents


def import_kimi_linear_modeling():
    """transformers.models.kimi_linear.modeling_kimi_linear with fla / causal_conv1d
    hidden during its import (so its kernel wrappers bind the torch fallbacks); the
    previous sys.modules entries are restored afterwards. If something imported the
    module earlier with fla's Triton kernels bound (they cannot run on CPU), the module's
    kernel functions are replaced by their torch fallbacks."""
    pytest.importorskip("transformers")
    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if name in sys.modules:
        mod = sys.modules[name]
        for fname in KERNEL_FUNCS:
            fn = getattr(mod, fname)
            impl = bound_implementation(fn)
            if impl is not None and impl is not torch_fallback(fn):
                setattr(mod, fname, torch_fallback(fn))
        return mod
    saved = {k: sys.modules[k] for k in _HIDDEN if k in sys.modules}
    # Also hide already-imported fla submodules, or `import fla.ops...` could still resolve.
    saved.update({k: v for k, v in sys.modules.items() if k.startswith(tuple(h + "." for h in _HIDDEN))})
    try:
        for k in list(saved):
            del sys.modules[k]
        for k in _HIDDEN:
            sys.modules[k] = None
        return importlib.import_module(name)
    finally:
        for k in _HIDDEN:
            sys.modules.pop(k, None)
        sys.modules.update(saved)


def torch_fallback(fn):
    """The reference torch function behind a transformers kernel wrapper."""
    import inspect
    return inspect.unwrap(fn)


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """The reference models here are tiny: intra-op threads only add contention (on a
    2-core machine running other tests a forward is ~5x slower with 2 threads than with
    one), so run them on `n` threads and restore the setting afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
