"""Reading a graph file: TOML, ``--set`` overrides, decoding into a :class:`GraphSpec`.

Every problem (missing file, bad TOML, a malformed or dangling override, a decode error) is one
:class:`csp.GraphError` naming the file and the msgspec path, and the ``--set`` that caused it.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any, Sequence

import msgspec

from csp.errors import GraphError
from csp.graph.plugins import import_plugins_near
from csp.graph.schema import GraphSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

S = typing.TypeVar("S", bound=GraphSpec)


def load_spec(
    path: str | Path, spec_type: type[S] = GraphSpec, overrides: Sequence[str] = ()  # type: ignore[assignment]
) -> S:
    """Read a graph TOML file, apply ``--set`` overrides, decode it into ``spec_type``.

    Overrides are ``dotted.key=value``; arrays of tables are addressed by their ``name``
    (``process.target.replicas=1``, ``channel.batches.capacity=2``); the value is parsed as a
    TOML value (``true``, ``3``, ``[1, 2]``, ``"x"``), else taken as a plain string.

    ``plugins`` not importable from ``sys.path`` but found in the file's directory or a parent
    are imported here (:func:`import_plugins_near`); the rest are imported by
    :meth:`Graph.from_spec`.

    Raises:
        GraphError: the file is missing or unreadable, is not valid TOML, an override is
            malformed or addresses nothing, or decoding fails (message: ``FILE: <msgspec error>
            - at `$.channel[0]```).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GraphError(f"{path}: graph file not found (cwd {Path.cwd()})") from None
    except OSError as exc:
        raise GraphError(f"{path}: cannot read graph file: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GraphError(f"{path}: invalid TOML: {exc}") from None
    overridden: dict[str, str] = {}
    for item in overrides:
        overridden[apply_override(data, item)] = item
    try:
        spec = msgspec.convert(data, spec_type)
    except msgspec.ValidationError as exc:
        raise GraphError(f"{path}: {exc}{_override_note(str(exc), overridden)}") from None
    import_plugins_near(spec.plugins, path)
    return spec


def _override_note(message: str, overridden: dict[str, str]) -> str:
    """`` (from --set KEY=VALUE)`` when the error's ``$.`` path is a key an override set."""
    at = message.rpartition(" - at `")[2].rstrip("`") if " - at `" in message else "$"
    field = message.partition("unknown field `")[2].partition("`")[0]
    where = f"{at}.{field}" if field else at
    for msgspec_path, item in overridden.items():
        inside = where.startswith((msgspec_path + ".", msgspec_path + "["))
        created = bool(field) and msgspec_path.startswith(where + ".")  # a table the --set made
        if where == msgspec_path or inside or created:
            return f" (from --set {item})"
    return ""


def apply_override(data: dict[str, Any], item: str) -> str:
    """Apply one ``dotted.key=value`` override to raw TOML ``data`` in place.

    Returns:
        The key's msgspec error path, e.g. ``$.process[2].options.generate``.

    Raises:
        GraphError: no ``=``, an empty key part, a name not found in an array of tables, or a
            path through a value that is not a table.
    """
    key, eq, raw = item.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    if not eq or not all(parts):
        raise GraphError(f"override {item!r}: expected dotted.key=value, e.g. channel.batches.capacity=2")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    node: Any = data
    walked: list[str] = []
    mpath = "$"
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            matches = [t for t in node if isinstance(t, dict) and t.get("name") == part]
            if not matches:
                names = [t.get("name") for t in node if isinstance(t, dict)]
                raise GraphError(
                    f"override {item!r}: no [[{'.'.join(walked)}]] named {part!r} (known: {names})"
                )
            if last:
                raise GraphError(f"override {item!r}: give a field of {'.'.join(walked)}.{part}")
            mpath += f"[{next(j for j, t in enumerate(node) if t is matches[0])}]"
            node = matches[0]
        elif isinstance(node, dict):
            mpath += f".{part}"
            if last:
                node[part] = value
                return mpath
            node = node.setdefault(part, {})
        else:
            raise GraphError(f"override {item!r}: {'.'.join(walked)} is a value, not a table")
        walked.append(part)


__all__ = ["apply_override", "load_spec"]
