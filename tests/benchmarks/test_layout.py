"""The benchmarks' house rules: every script lives in a room, and none reaches into the library's
private names (so a change inside csp or dflash can only break a benchmark through a public name,
which the library's own tests cover)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
ROOMS = {"h200", "micro", "decode", "quality", "plan", "peers", "real_target", "recipe", "results"}


def _private_uses(path: Path) -> list[str]:
    """``from csp|dflash|benchmarks... import _x``, a ``_private`` module in such a path, or an
    attribute ``_x`` read off a name bound to a csp/dflash module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: set[str] = set()  # local names of imported csp/dflash modules
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if top not in ("csp", "dflash", "benchmarks"):
                continue
            if any(part.startswith("_") and not part.startswith("__") for part in node.module.split(".")):
                found.append(f"from {node.module} import ...")
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("csp", "dflash"):
                    bound.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, (ast.Name, ast.Attribute))
                and ast.unparse(node.value).split(".")[0] in bound and ast.unparse(node.value).split(".")[0] != "self"):
            found.append(ast.unparse(node))
    return found


def test_no_benchmark_uses_a_private_name_of_the_library():
    """Invariant: benchmarks import only public names of csp, dflash and each other."""
    offenders = {str(p.relative_to(ROOT)): uses for p in sorted(BENCH.rglob("*.py")) if (uses := _private_uses(p))}
    assert offenders == {}


def test_the_private_name_check_sees_each_form(tmp_path):
    """The check above can fail: each way of reaching a private name is caught."""
    f = tmp_path / "b.py"
    f.write_text("from dflash.eval.cli import _prompts\nfrom csp.core import _state\n"
                 "from dflash.data import tokenize as tok\nx = tok._encode_all\nimport csp.cuda\ny = csp.cuda._x\n")
    assert _private_uses(f) == ["from dflash.eval.cli import _prompts", "from csp.core import _state",
                                "tok._encode_all", "csp.cuda._x"]


def test_every_benchmark_is_in_a_room():
    """Invariant: the benchmarks directory holds rooms and its index, no loose scripts."""
    loose = sorted(p.name for p in BENCH.iterdir() if p.is_file() and p.name not in ("__init__.py", "RESULTS.md"))
    rooms = sorted(p.name for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert loose == [] and set(rooms) <= ROOMS, (loose, rooms)
