"""Reading a graph file: TOML, ``--set`` overrides, decoding into a :class:`GraphSpec`.

Every problem (missing file, bad TOML, a malformed or dangling override, a decode error) is one
:class:`csp.GraphError` naming the file and the msgspec path, and the ``--set`` that caused it;
user text echoed in a message (a key, an override) is cut to its start and end past
:data:`ECHO_LIMIT` characters.

Relative paths: the application names which keys hold paths (``file_paths`` of
:func:`load_spec`); a relative path written in the graph file is taken relative to the file's own
directory (as plugins are found next to it), and one given by ``--set`` relative to the current
directory, like any command-line path.
"""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

import msgspec

from csp.errors import GraphError
from csp.graph.plugins import import_plugins_near
from csp.graph.schema import GraphSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

S = typing.TypeVar("S", bound=GraphSpec)

ECHO_LIMIT = 200
"""Longest piece of user text (a key, an override) a message repeats whole, in characters."""


def cut(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text``, or its start and end around ``...(N characters)...`` when longer than ``limit``."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}...({len(text)} characters)...{text[-half:]}"


def load_spec(
    path: str | Path, spec_type: type[S] = GraphSpec, overrides: Sequence[str] = (),  # type: ignore[assignment]
    file_paths: Callable[[str, str], bool] | None = None,
) -> S:
    """Read a graph TOML file, apply ``--set`` overrides, decode it into ``spec_type``.

    Overrides are ``dotted.key=value``; arrays of tables are addressed by their ``name``
    (``process.target.replicas=1``, ``channel.batches.capacity=2``); the value is parsed as a
    TOML value (``true``, ``3``, ``[1, 2]``, ``"x"``), else taken as a plain string.

    ``plugins`` not importable from ``sys.path`` but found in the file's directory or a parent
    are imported here (:func:`import_plugins_near`); the rest are imported by
    :meth:`Graph.from_spec`.

    ``file_paths(key, value)`` says whether the string ``value`` the file gives at the dotted
    ``key`` (the addressing of ``--set``: ``run.out_dir``, ``process.NAME.options.path``) is a
    path. Each relative one is re-spelled for the current directory before the overrides apply:
    joined to the file's directory (relative to the current directory when the file lies in or
    below it, else absolute) and normalised, so ``examples/../models/x`` reads ``models/x``.
    Absolute, ``~`` and empty values, and every value set by ``--set``, are left as given.

    The file is UTF-8 text; a leading byte-order mark is accepted.

    Raises:
        GraphError: the file is missing or unreadable, is not valid TOML, an override is
            malformed or addresses nothing, or decoding fails (message: ``FILE: <msgspec error>
            - at `$.channel[0]```).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (some Windows editors) is dropped
    except FileNotFoundError:
        raise GraphError(f"{path}: graph file not found (cwd {Path.cwd()})") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text: a binary or other-encoding file
        raise GraphError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason}); a graph file is "
                         "TOML, saved as UTF-8") from None
    except OSError as exc:
        raise GraphError(f"{path}: cannot read graph file: {exc}") from exc
    data = _parse_toml(text, path)
    if file_paths is not None:
        _rebase_paths(data, _spelled_base(path), file_paths)
    overridden: dict[str, str] = {}
    for item in overrides:
        overridden[apply_override(data, item)] = item
    try:
        spec = msgspec.convert(data, spec_type)
    except msgspec.ValidationError as exc:
        raise GraphError(f"{path}: {_cut_quoted(str(exc))}{_override_note(str(exc), overridden)}") from None
    import_plugins_near(spec.plugins, path)
    return spec


def _spelled_base(graph_file: Path) -> str:
    """The graph file's directory as a relative path joins onto it: relative to the current
    directory when the file lies in or below it, else absolute."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(graph_file)))
    rel = os.path.relpath(here)
    return here if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def _rebase_paths(node: Any, base: str, is_path: Callable[[str, str], bool], prefix: str = "") -> None:
    """Re-spell, in place, every relative path value of raw TOML ``node`` onto ``base``."""
    if isinstance(node, dict):
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, str):
                if value.strip() and not os.path.isabs(value) and not value.startswith("~") \
                        and is_path(dotted, value):
                    node[key] = os.path.normpath(os.path.join(base, value))
            else:
                _rebase_paths(value, base, is_path, dotted + ".")
    elif isinstance(node, list):  # arrays of tables, addressed by name as --set addresses them
        for item in node:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                _rebase_paths(item, base, is_path, f"{prefix}{item['name']}.")


def _cut_quoted(message: str) -> str:
    """msgspec's message with each backquoted piece of user text (a field name) cut."""
    parts = message.split("`")
    return "`".join(cut(p) if i % 2 else p for i, p in enumerate(parts))


def _override_note(message: str, overridden: dict[str, str]) -> str:
    """`` (from --set KEY=VALUE)`` when the error's ``$.`` path is a key an override set."""
    at = message.rpartition(" - at `")[2].rstrip("`") if " - at `" in message else "$"
    field = message.partition("unknown field `")[2].partition("`")[0]
    where = f"{at}.{field}" if field else at
    for msgspec_path, item in overridden.items():
        inside = where.startswith((msgspec_path + ".", msgspec_path + "["))
        created = bool(field) and msgspec_path.startswith(where + ".")  # a table the --set made
        if where == msgspec_path or inside or created:
            return f" (from --set {cut(item)})"
    return ""


def _parse_toml(text: str, path: Path) -> dict[str, Any]:
    """``text``, the contents of the TOML file ``path``, as a dict; :class:`GraphError` naming the file if it is not TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GraphError(f"{path}: invalid TOML: {exc}") from None
    except ValueError:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        raise GraphError(f"{path}: invalid TOML: {_too_long_int()}; give a smaller number") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file ``path`` as a plain dict, no overrides or decoding (e.g. a run's recorded
    ``config.toml``, read by reports).

    Raises:
        GraphError: one line naming the file: missing or unreadable, not UTF-8 text, invalid TOML,
            or an integer of more digits than Python converts (4,300 by default).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise GraphError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason}); a TOML file "
                         "is saved as UTF-8") from None
    except OSError as exc:
        raise GraphError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    return _parse_toml(text, path)


_TOML_OPENERS = ('"', "'", "[", "{")


def _too_long_int() -> str:
    """Why TOML holding an integer of more digits than Python converts (4,300 by default) was
    refused: :func:`tomllib.loads` raises a bare ``ValueError`` for it, not a decode error."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
    return f"an integer has more than {limit:,} digits, the most Python reads"


def apply_override(data: dict[str, Any], item: str) -> str:
    """Apply one ``dotted.key=value`` override to raw TOML ``data`` in place.

    The value is TOML when it parses as TOML, else plain text; one that opens like TOML (a quote,
    ``[`` or ``{``) but does not parse (``run.name="abc``) is an error, never taken literally.

    Returns:
        The key's msgspec error path, e.g. ``$.process[2].options.generate``.

    Raises:
        GraphError: no ``=``, an empty key part, a value opening like TOML that is not TOML, an
            integer of more digits than Python converts (4,300 by default), a name not found in
            an array of tables, or a path through a value that is not a table.
    """
    key, eq, raw = item.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    shown = repr(cut(item))
    if not eq or not all(parts):
        raise GraphError(f"override {shown}: expected dotted.key=value, e.g. channel.batches.capacity=2")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError as exc:
        if raw.strip()[:1] in _TOML_OPENERS:  # meant as TOML (a quote, array, table), not plain text
            raise GraphError(f"override {shown}: the value is not valid TOML ({exc}); close the quote or "
                             "bracket, or leave the quotes out for a plain string") from None
        value = raw.strip()
    except ValueError:  # an integer longer than Python converts: meant as a number, never taken as text
        raise GraphError(f"override {shown}: {_too_long_int()}; give {cut('.'.join(parts))} "
                         "a smaller number") from None
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
                    f"override {shown}: no [[{'.'.join(walked)}]] named {cut(part)!r} (known: {names})"
                )
            if last:
                raise GraphError(f"override {shown}: give a field of {'.'.join(walked)}.{part}")
            mpath += f"[{next(j for j, t in enumerate(node) if t is matches[0])}]"
            node = matches[0]
        elif isinstance(node, dict):
            mpath += f".{part}"
            if last:
                node[part] = value
                return mpath
            node = node.setdefault(part, {})
        else:
            raise GraphError(f"override {shown}: {cut('.'.join(walked))} is a value, not a table")
        walked.append(part)


__all__ = ["ECHO_LIMIT", "apply_override", "cut", "load_spec", "read_toml"]
