"""The package layout as a checked rule: rooms on floors, imports running one way, no circle.

``csp`` and ``dflash`` are each split into rooms (sub-packages, and a few leaf modules) on floors;
a module may import its own room and the rooms on lower floors, never a room on its own floor or
above (docs/architecture.md draws it). The rooms of ``csp``:

=====  ==========================================================================================
floor  rooms
=====  ==========================================================================================
0      the leaves: ``csp.errors``, ``csp._guard`` (another distribution named csp)
1      ``csp.cli`` (what every command line shares), ``csp.cuda`` (the tensor walker, the hand-off)
2      ``csp.core`` (channels, processes, statistics records, the registry)
3      ``csp.observe`` (stats log, trace, backpressure, what-if: reads no graph file)
4      ``csp.graph`` (graph files: schema, loading, validation, drawing; ``python -m csp.graph``)
5      ``csp.runtime``
6      ``csp.distributed``
7      the entry points: ``csp`` (the public surface), ``csp.run``, ``csp.inspect``
=====  ==========================================================================================

and of ``dflash``:

=====  ==========================================================================================
floor  rooms
=====  ==========================================================================================
0      the leaves: ``dflash`` (the package), ``dflash.errors``, ``dflash.messages``,
       ``dflash.records``, ``dflash.seeding``, ``dflash.import_noise``, ``dflash.tables``, and
       ``dflash.gguf_tokenizer`` (a tool's part that imports no dflash module), ``dflash.repetition``
       (the repetition-loop rule the data, the regeneration engines and the evaluation share)
1      ``dflash.data``, ``dflash.model``
2      ``dflash.checkpoint``, ``dflash.regenerate_files`` (regeneration's files; raises dflash.data's errors),
       ``dflash.regenerate_plan`` (regeneration's engine, rows and chunk sizes; reads dflash.model's engines)
3      ``dflash.train``, ``dflash.observe``
4      ``dflash.eval`` (decoding a drafter against its target, the evaluation sets)
5      ``dflash.run`` (the graph's stages, the in-training evaluator among them)
6      the tools and thin entry modules: ``dflash.export``, ``dflash.regenerate``,
       ``dflash.pretrain``, ``dflash.import_gguf``, ``dflash.logs``, ``dflash.plot``, ``dflash.plan``
=====  ==========================================================================================

Below all of dflash is ``csp``, which never imports ``dflash``; above them, ``benchmarks`` (nothing in
``csp`` or ``dflash`` imports ``benchmarks`` or ``tests``). Every import counts: at module level,
inside functions (a deferred import still makes the two modules depend on each other) and under
``if TYPE_CHECKING:`` (a type-level import is a dependency a reader and a type checker follow).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CSP_FLOORS = {
    "csp.errors": 0, "csp._guard": 0, "csp.cli": 1,
    "csp.cuda": 1, "csp.core": 2, "csp.observe": 3, "csp.graph": 4, "csp.runtime": 5, "csp.distributed": 6,
    "csp": 7, "csp.run": 7, "csp.inspect": 7,
}

FLOORS = {
    "dflash": 0, "dflash.errors": 0, "dflash.messages": 0, "dflash.records": 0, "dflash.seeding": 0,
    "dflash.import_noise": 0, "dflash.tables": 0, "dflash.gguf_tokenizer": 0, "dflash.repetition": 0,
    "dflash.data": 1, "dflash.model": 1,
    "dflash.checkpoint": 2, "dflash.regenerate_files": 2, "dflash.regenerate_plan": 2,
    "dflash.train": 3, "dflash.observe": 3,
    "dflash.eval": 4, "dflash.run": 5,
    "dflash.export": 6, "dflash.regenerate": 6, "dflash.pretrain": 6, "dflash.import_gguf": 6, "dflash.logs": 6, "dflash.plot": 6,
    "dflash.plan": 6,
}

# Modules imported alone in a fresh interpreter (no hidden dependency on import order): every
# package __init__, the leaves, and one module per room that pulls in most of its room.
FRESH = ("csp", "csp.core", "csp.cuda", "csp.observe", "csp.runtime", "csp.runtime.engine", "csp.graph",
         "csp.distributed", "csp.observe.backpressure", "csp.observe.stats_reader", "csp.distributed.bridge",
         "csp.distributed.crossing", "dflash", "dflash.errors", "dflash.messages", "dflash.records",
         "dflash.seeding", "dflash.data", "dflash.data.prompts", "dflash.model", "dflash.model.target",
         "dflash.model.drafter", "dflash.model.layer_ids", "dflash.checkpoint", "dflash.checkpoint.model_files",
         "dflash.train", "dflash.train.step", "dflash.observe", "dflash.observe.summary", "dflash.eval",
         "dflash.eval.cli", "dflash.eval.decode", "dflash.run", "dflash.run.cli", "dflash.run.stages",
         "dflash.run.validate", "dflash.export", "dflash.export.write", "dflash.train.config",
         "dflash.checkpoint.config", "dflash.observe.config")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for top in ("csp", "dflash") for p in (ROOT / top).rglob("*.py")}


def imports_of(module: str) -> set[str]:
    """The csp/dflash modules ``module`` imports anywhere in its file (module level, class and
    function bodies, ``if TYPE_CHECKING:`` blocks). ``from P import x`` counts ``P`` and,
    when ``P.x`` is a module, ``P.x``; relative imports are resolved."""
    path = MODULES[module]
    found: set[str] = set()

    def visit(nodes: list[ast.AST]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join(package + ([node.module] if node.module else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit([n for n in getattr(node, field, []) if isinstance(n, ast.AST)])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return {m for m in found if m in MODULES and m != module}


def room_of(module: str) -> str:
    if module in CSP_FLOORS:
        return module
    parts = module.split(".")
    return ".".join(parts[:2])


def floor_of(room: str) -> int:
    return CSP_FLOORS[room] if room.split(".")[0] == "csp" else FLOORS[room]


def test_every_module_is_in_a_room_on_a_floor():
    """Invariant: a new module lands in a room of the tables above (or the tables grow with it)."""
    homeless = sorted(m for m in MODULES if room_of(m) not in (CSP_FLOORS if m.startswith("csp") else FLOORS))
    assert homeless == []


def test_imports_run_down_the_floors():
    """Invariant: a module imports only its own room and lower floors; a dflash module may import
    any of csp, csp imports no dflash. So a channel is tested without a runtime, a model without a
    trainer, the reports read a run directory without a model, and nothing below the run knows
    the graph."""
    upward = []
    for module in sorted(MODULES):
        for dep in sorted(imports_of(module)):
            here, there = room_of(module), room_of(dep)
            if here == there or (here.startswith("dflash") and there.startswith("csp")):
                continue
            if here.startswith("csp") and there.startswith("dflash"):
                upward.append(f"{module} -> {dep}")
            elif floor_of(there) >= floor_of(here):
                upward.append(f"{module} -> {dep}")
    assert upward == []


def test_no_import_circle_in_csp_or_dflash():
    """Invariant: the modules' imports form a DAG, deferred imports inside functions and
    type-level ones included, so no module can ever see another half-initialised, no import only
    works by being late, and no type annotation needs a name from a module that needs this one."""
    edges = {m: imports_of(m) for m in MODULES}
    done: set[str] = set()
    circles: list[str] = []

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            circles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in done:
            return
        for dep in sorted(edges[m]):
            visit(dep, stack + [m])
        done.add(m)

    for m in sorted(MODULES):
        visit(m, [])
    assert circles == []
    assert sum(map(len, edges.values())) > 100  # the walk sees the imports at all


def test_benchmarks_and_tests_sit_above_the_packages():
    """Invariant: benchmarks -> dflash -> csp; no module of the packages imports benchmarks or tests."""
    offenders = [f"{m} -> {name}" for m, path in sorted(MODULES.items())
                 for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                              else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                              else [])
                 if name.split(".")[0] in ("benchmarks", "tests")]
    assert offenders == []


def test_every_package_says_what_it_owns():
    """Invariant: each room's ``__init__`` has a docstring of at least a paragraph (what it owns,
    what it may import), so the tree explains itself without the tracker."""
    thin = sorted(m for m, p in MODULES.items() if p.name == "__init__.py"
                  and len(ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "") < 200)
    assert thin == []


def test_the_package_docstring_numbers_the_floors_as_enforced():
    """Invariant: the floors ``dflash/__init__.py`` lists (``N. ...`` items naming rooms) are the
    floors this file enforces, every room named once, so a reader of the package learns the rule
    that is checked."""
    import re

    doc = ast.get_docstring(ast.parse((ROOT / "dflash" / "__init__.py").read_text(encoding="utf-8")))
    items = re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |^\S|\Z)", doc, flags=re.M | re.S)
    said = {name: int(floor) for floor, text in items for name in re.findall(r"`(dflash(?:\.\w+)?)`", text)}
    assert said == {room: floor for room, floor in FLOORS.items() if room != "dflash"}


PACKAGES = sorted(_module_name(p) for top in ("csp", "dflash") for p in (ROOT / top).rglob("__init__.py"))


def unnamed_modules(package: str) -> list[str]:
    """The modules of ``package`` (its ``.py`` files and sub-packages) that its ``__init__``
    docstring does not name, as a file (``chat.py``, ``stages/``), a dotted name
    (``dflash.data.chat``) or, for ``__main__.py``, its command (``python -m dflash.run``)."""
    import re

    folder = ROOT.joinpath(*package.split("."))
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    missing = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".py" and path.name != "__init__.py":
            name, forms = path.stem, [rf"(?<![\w.]){re.escape(path.name)}\b"]
        elif path.is_dir() and (path / "__init__.py").exists():
            name, forms = path.name, [rf"(?<![\w.]){re.escape(path.name)}/"]
        else:
            continue
        forms.append(rf"\b{re.escape(package)}\.{re.escape(name)}\b")
        if name == "__main__":
            forms.append(rf"python -m {re.escape(package)}\b")
        if not any(re.search(form, doc) for form in forms):
            missing.append(name)
    return missing


@pytest.mark.parametrize("package", PACKAGES)
def test_every_room_names_its_modules(package):
    """Invariant: a package's ``__init__`` docstring names every module in it (one line each: what
    it is for), so a reader finds a room's parts, private and entry modules included, from the
    room's own page; a new module is added to that list with its file."""
    assert unnamed_modules(package) == []


@pytest.mark.parametrize("module", FRESH)
def test_module_imports_alone_in_a_fresh_interpreter(module):
    """Invariant: the module imports by itself (no hidden dependency on an import order), and
    importing a csp module loads no dflash module."""
    code = f"import sys, {module}\n"
    if module.startswith("csp"):
        code += ("bad = sorted(m for m in sys.modules if m.split('.')[0] == 'dflash')\n"
                 "assert not bad, f'csp loaded dflash modules: {bad}'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
