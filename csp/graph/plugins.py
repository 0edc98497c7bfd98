"""Importing a graph file's ``plugins``: the modules whose ``@csp.register`` defines its kinds."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Sequence

from csp.errors import GraphError


def import_plugins_near(plugins: Sequence[str], graph_file: str | Path) -> None:
    """Import plugins that are not importable from ``sys.path`` but live next to the graph file.

    For each plugin ``a.b`` not yet imported and not found on ``sys.path``, the nearest of the
    graph file's directory and its parents holding ``a/b/__init__.py`` or ``a/b.py`` is put on
    ``sys.path`` for the import only (so ``python -m csp.run /abs/path/examples/x.toml`` works
    from any directory). Plugins found nowhere are left for :meth:`Graph.from_spec` to report.

    Raises:
        GraphError: a plugin found this way fails to import.
    """
    import importlib.util

    start = Path(graph_file).resolve().parent
    for module in plugins:
        if module in sys.modules:
            continue
        try:
            if importlib.util.find_spec(module) is not None:
                continue
        except (ImportError, ValueError):
            pass
        rel = Path(*module.split("."))
        root = next((d for d in (start, *start.parents)
                     if (d / rel / "__init__.py").is_file() or (d / rel).with_suffix(".py").is_file()),
                    None)
        if root is None:
            continue
        sys.path.insert(0, str(root))
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise GraphError(f"plugins: cannot import {module!r} from {root}: {exc}") from exc
        finally:
            sys.path.remove(str(root))


def import_plugins(plugins: Sequence[str]) -> None:
    """Import each plugin module from ``sys.path`` (:meth:`csp.Graph.from_spec` calls it).

    Raises:
        GraphError: a plugin fails to import, with a hint to put its directory on PYTHONPATH.
    """
    for module in plugins:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise GraphError(
                f"plugins: cannot import {module!r}: {exc} (searched sys.path and, for a graph "
                "file, its directory and their parents; add the directory holding the "
                "package to PYTHONPATH)") from exc


__all__ = ["import_plugins", "import_plugins_near"]
