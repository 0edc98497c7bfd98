"""What a recipe leaves and prints: JSON results files (indent 1, as every committed one), the
fields of an eval result it quotes, and the listing of its output directory at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


def write_json(path: Path, doc: Any) -> None:
    """``doc`` as indented JSON at ``path`` (the committed results' format)."""
    Path(path).write_text(json.dumps(doc, indent=1))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON results file; {} when it is missing or empty (a step that wrote nothing)."""
    p = Path(path)
    if not p.is_file() or not p.stat().st_size:
        return {}
    return json.loads(p.read_text())


def pick(doc: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """``{key: doc.get(key)}`` for each of ``keys`` (None where missing)."""
    return {k: doc.get(k) for k in keys}


def listing(directory: Path) -> str:
    """One line per file under ``directory``: its size in bytes and its name (``ls -la`` of the
    phase's output, which the recipes print last)."""
    rows = [f"{p.stat().st_size:>12}  {p.relative_to(directory)}" for p in sorted(Path(directory).rglob("*"))
            if p.is_file()]
    return "\n".join([str(directory), *rows])
