"""Structure the code must keep: imports go one way (no cycle among k3's modules, the
library never imports the command line), and `k3 --help` / `k3 presets` stay cheap
(no torch). Function-level imports count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "k3"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every k3 module `path` imports (at any depth), resolved to module names."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "k3"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "k3":
                continue
            out.add(mod)
            for a in node.names:  # `from . import env` imports a module
                out.add(f"{mod}.{a.name}")
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for m in _imports(path, name):
            while m and m not in files:  # `from .x import y` where y is a name, not a module
                m = m.rpartition(".")[0]
            if m and m != name and m != "k3":  # the package root only sets an env var
                deps.add(m)
        graph[name] = deps
    return graph


def _cycles(graph):
    seen, stack, on, found = set(), [], set(), []

    def visit(v):
        seen.add(v)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w in on:
                found.append(stack[stack.index(w):] + [w])
            elif w not in seen:
                visit(w)
        stack.pop()
        on.discard(v)

    for v in sorted(graph):
        if v not in seen:
            visit(v)
    return found


def test_no_import_cycle_among_k3_modules():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) and not _cycles({"a": {"b"}, "b": set()})


def test_only_the_command_line_imports_the_commands():
    graph = import_graph()
    bad = sorted(m for m, deps in graph.items() if not m.startswith(("k3.commands", "k3.cli", "k3.__main__"))
                 and any(d.startswith(("k3.commands", "k3.cli")) for d in deps))
    assert not bad, f"library modules importing the command line: {bad}"


def test_help_and_presets_do_not_import_torch():
    code = ("import sys, contextlib, io\n"
            "import k3.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    k3.cli.main(['presets'])\n"
            "    try:\n"
            "        k3.cli.main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in ('torch', 'numba', 'numpy') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_the_model_math_has_no_compiled_code():
    """k3/model states the forward as the spec does: no numba, no LLVM IR. Compiled code
    lives in k3/kernels, which the model calls and which never imports the model or the
    memory system."""
    bad = []
    for p in sorted((PKG / "model").rglob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{p.relative_to(ROOT)}: imports {n}" for n in names if n.split(".")[0] in ("numba", "llvmlite")]
    assert not bad, "\n".join(bad)
    graph = import_graph()
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("k3.kernels")
                for d in deps if d.startswith(("k3.model", "k3.memory", "k3.engine", "k3.server")))
    assert not up, f"kernels importing the layers above them: {up}"


def test_kernel_files_and_functions_stay_small():
    """No kernel file over ~600 lines, no function over 12 parameters: a region takes its
    arguments as named structures, not positional lists. An LLVM intrinsic's typer
    (first parameter ``typingctx``) is exempt: its parameters are the machine operands
    of one vector instruction sequence (registers and pointers), which numba hands
    to it one by one."""
    long_files, wide = [], []
    for p in sorted((PKG / "kernels").glob("*.py")):
        text = p.read_text()
        if text.count("\n") > 620:
            long_files.append(f"{p.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                if a.args and a.args[0].arg == "typingctx":
                    continue
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if n > 12:
                    wide.append(f"{p.name}:{node.lineno} {node.name} ({n} parameters)")
    assert not long_files, long_files
    assert not wide, "\n".join(wide)


def test_loading_and_the_decode_loop_stay_apart():
    """k3.loader opens a model and returns an Engine; the Engine drives the decode loop
    (k3.decode). Neither knows how a model is opened, and the loop takes its engine as
    an argument rather than importing it (the cycle test alone would let the two layers
    swap places)."""
    graph = import_graph()
    assert not graph["k3.decode"] & {"k3.engine", "k3.loader"}, sorted(graph["k3.decode"])
    assert "k3.loader" not in graph["k3.engine"], sorted(graph["k3.engine"])
