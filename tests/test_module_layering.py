"""Layering of the files split into single-purpose modules (issue 15, item 5): each module
imports alone in a fresh interpreter, csp never imports dflash, and module-level imports form no
cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the modules split out of one file: csp/graph/ (was csp/graph/__init__.py), dflash.target's and
# dflash.eval's parts, csp.backpressure's stats reader and csp.dist.bridge's crossing channel
SPLIT_FILES = (*sorted((ROOT / "csp" / "graph").glob("*.py")),
               *(ROOT / "dflash" / f"{m}.py" for m in ("target", "target_config", "layer_ids",
                                                       "document_mask", "shared_head", "eval", "decode",
                                                       "eval_measure", "eval_report", "eval_inputs")),
               ROOT / "dflash" / "data" / "prompts.py",
               *(ROOT / "csp" / f"{m}.py" for m in ("backpressure", "stats_reader", "dist/bridge",
                                                    "dist/crossing")))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _split_modules() -> list[str]:
    return sorted(_module_name(p) for p in SPLIT_FILES if p.name != "__main__.py")


def _import_time_imports(path: Path) -> set[str]:
    """Absolute module names imported when ``path`` is imported: module level and class bodies,
    not function bodies (those run later, so they cannot close an import cycle) nor
    ``if TYPE_CHECKING:`` blocks (they never run)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)  # a submodule, maybe
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                visit(node.orelse)  # the body runs only under a type checker
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.AST)])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


@pytest.mark.parametrize("module", _split_modules())
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    """Invariant: every module of a split package imports by itself (no hidden dependency on an
    import order), and importing a csp module loads no dflash module."""
    code = f"import sys, {module}\n"
    if module.startswith("csp"):
        code += ("bad = sorted(m for m in sys.modules if m.split('.')[0] == 'dflash')\n"
                 "assert not bad, f'csp loaded dflash modules: {bad}'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr


def test_csp_never_imports_dflash():
    """Invariant: csp is generic; no csp module imports dflash, at import time or in a function."""
    offenders = []
    for path in sorted((ROOT / "csp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "dflash"]
    assert offenders == []


def test_split_modules_import_each_other_without_a_cycle():
    """Invariant: the split modules' import-time imports form a DAG (a package ``__init__`` only
    re-exports), so no module ever sees another half-initialised."""
    modules = {m for m in _split_modules() if (ROOT / (m.replace(".", "/") + ".py")).is_file()}
    edges = {m: _import_time_imports(ROOT / (m.replace(".", "/") + ".py")) & modules for m in modules}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        for dep in sorted(edges[m]):
            visit(dep, stack + [m])
        done.add(m)

    assert len(modules) >= 2
    for m in sorted(modules):
        visit(m, [])
