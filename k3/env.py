"""Every environment variable k3 reads, in one place.

Users set ``K3_CACHE`` (where `k3 demo` keeps its checkpoint and `k3 chat` its
histories), ``K3_PIN_PREFIX=1`` (pin trunk layers as a prefix, the C engine's v1.0.0
order, instead of largest first), ``K3_NOHUGE`` (no transparent huge pages for the
expert arena), ``K3_DEBUG=1`` (show tracebacks) and ``K3_SPEC_EVERY_DRAFT=1`` (speculative
decoding reads every draft it finds, as before the pass cost model weighed them; for
A/B runs) and ``K3_EXPERT_STREAM=0`` (a layer's experts are multiplied once all its
missing ones are read, instead of each as its read completes; for A/B runs) and ``K3_FUSED=0``
(every layer runs the plain forward instead of its compiled regions, k3.model.compiled;
the same bits, slower). ``K3_TEST_FAULT`` injects read
failures for the tests of the failure path.

Under ``torchrun`` (a pipeline over several processes, k3.pipeline) k3 reads the
launcher's ``RANK`` and ``WORLD_SIZE`` (torch.distributed reads the rest).

``OMP_WAIT_POLICY`` is set (to PASSIVE, unless the user set it) in ``k3/__init__.py``:
libgomp reads it when torch is imported, so it must happen before that.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("K3_CACHE") or Path.home() / ".cache" / "k3")


def pin_order() -> str:
    """'prefix' with K3_PIN_PREFIX=1, else 'largest'."""
    return "prefix" if os.environ.get("K3_PIN_PREFIX") == "1" else "largest"


def hugepages() -> bool:
    return os.environ.get("K3_NOHUGE") is None


def fused() -> bool:
    """False under K3_FUSED=0: the plain forward instead of the layers' compiled regions."""
    return os.environ.get("K3_FUSED", "1") != "0"


def expert_stream() -> bool:
    return os.environ.get("K3_EXPERT_STREAM", "1") != "0"


def spec_every_draft() -> bool:
    return os.environ.get("K3_SPEC_EVERY_DRAFT", "") not in ("", "0")


def debug() -> bool:
    return os.environ.get("K3_DEBUG", "") not in ("", "0")


def test_fault() -> str | None:
    return os.environ.get("K3_TEST_FAULT") or None


def launch() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun (or any launcher setting RANK and
    WORLD_SIZE) with more than one process; None otherwise."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 else None


def kernel_isa() -> str | None:
    """K3_KERNEL_ISA (generic | avx2 | avx512): the MXFP4 decode path to compile, for
    tests that compare the paths (each path compiles into its own cache folder,
    k3.kernels.kcache). Not for users: every path gives the same bits."""
    v = os.environ.get("K3_KERNEL_ISA") or None
    return v
