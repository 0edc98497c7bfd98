"""Kind strings -> Process classes.

A graph file names each process's class by a ``kind`` string (``kind = "dflash.target"``). Kinds
come from three places, tried in this order:

1. explicit registration: ``@csp.register("examples.upper")`` on a :class:`csp.Process` subclass;
2. installed entry points of the group ``"csp.processes"`` (entry name = kind, value =
   ``"module:Class"``), loaded the first time a kind is not found;
3. only when the caller opts in (``allow_imports=True``, ``python -m csp.run --allow-imports``):
   an import string ``"package.module:Class"`` used directly as the kind.

Import strings are off by default so that a graph file cannot import arbitrary code by naming it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import threading
from typing import Callable, TypeVar

from csp.errors import GraphError, NotAProcess, RegistryError

ENTRY_POINT_GROUP = "csp.processes"

P = TypeVar("P", bound=type)


class Registry:
    """A mapping from kind strings to :class:`csp.Process` subclasses.

    Thread-safe. The module-level :data:`registry` is the default one used by
    :func:`register` and by :meth:`csp.Graph.from_spec` when no registry is given.
    """

    def __init__(self, entry_point_group: str | None = ENTRY_POINT_GROUP) -> None:
        self._kinds: dict[str, type] = {}
        self._lock = threading.Lock()
        self._entry_point_group = entry_point_group
        self._entry_points_loaded = entry_point_group is None

    def register(self, kind: str, cls: type | None = None) -> Callable[[P], P] | type:
        """Register ``cls`` under ``kind``; without ``cls``, return a class decorator.

        Re-registering the same class (or a re-import of it: same module and qualified name) is
        allowed and replaces the old entry.

        Raises:
            RegistryError (a ValueError): ``kind`` is empty, contains ``":"`` or whitespace, or is already taken by
                a different class.
            NotAProcess (a TypeError): ``cls`` is not a :class:`csp.Process` subclass.
        """
        if not kind or ":" in kind or any(ch.isspace() for ch in kind):
            raise RegistryError(
                f"invalid kind {kind!r}: use a dotted name without ':' or spaces, e.g. 'mylib.tokenize'"
            )

        def decorate(c: P) -> P:
            from csp.core.process import Process

            if not (isinstance(c, type) and issubclass(c, Process)):
                raise NotAProcess(f"csp.register({kind!r}): {c!r} is not a csp.Process subclass")
            with self._lock:
                old = self._kinds.get(kind)
                if old is not None and old is not c and _class_id(old) != _class_id(c):
                    raise RegistryError(
                        f"kind {kind!r} is already registered to {_class_id(old)}; "
                        f"cannot register {_class_id(c)} under the same kind"
                    )
                self._kinds[kind] = c
            return c

        return decorate if cls is None else decorate(cls)

    def kinds(self) -> list[str]:
        """Every known kind (registered and, once loaded, from entry points), sorted."""
        with self._lock:
            return sorted(self._kinds)

    def resolve(self, kind: str, *, allow_imports: bool = False) -> type:
        """Return the Process class registered as ``kind``.

        Raises:
            GraphError: the kind is unknown (the message lists the known kinds and close
                matches), is an import string while ``allow_imports`` is False, or its import
                fails or does not name a Process subclass.
        """
        with self._lock:
            cls = self._kinds.get(kind)
        if cls is not None:
            return cls
        if ":" in kind:
            if not allow_imports:
                raise GraphError(
                    f"kind {kind!r} is an import string; import strings are off by default. "
                    "Register the class with @csp.register(...) or an entry point in the group "
                    f"{ENTRY_POINT_GROUP!r}, or opt in with allow_imports=True "
                    "(python -m csp.run --allow-imports)"
                )
            return _import_class(kind)
        self._load_entry_points()
        with self._lock:
            cls = self._kinds.get(kind)
            known = sorted(self._kinds)
        if cls is not None:
            return cls
        close = difflib.get_close_matches(kind, known, n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(k) for k in close)}?" if close else ""
        listing = ", ".join(known) if known else "(none registered)"
        raise GraphError(
            f"unknown process kind {kind!r}.{hint} Known kinds: {listing}. A kind exists once the "
            "module defining it is imported (graph 'plugins' list) or installed as a "
            f"{ENTRY_POINT_GROUP!r} entry point"
        )

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in importlib.metadata.entry_points(group=self._entry_point_group):
            with self._lock:
                if ep.name in self._kinds:
                    continue
            try:
                cls = ep.load()
            except Exception as exc:  # a broken plugin must name itself
                raise GraphError(
                    f"entry point {ep.name!r} = {ep.value!r} (group {self._entry_point_group!r}) "
                    f"failed to load: {exc!r}"
                ) from exc
            self.register(ep.name, cls)


def _class_id(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_class(spec: str) -> type:
    from csp.core.process import Process

    module_name, _, attr = spec.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise GraphError(f"cannot import kind {spec!r}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, Process)):
        raise GraphError(f"kind {spec!r} names {obj!r}, which is not a csp.Process subclass")
    return obj


registry = Registry()
"""The default registry (used by :func:`register` and :meth:`csp.Graph.from_spec`)."""


def register(kind: str) -> Callable[[P], P]:
    """Class decorator: register a :class:`csp.Process` subclass in the default registry.

    Example: ``@csp.register("examples.upper") class Upper(csp.Process): ...``
    """
    return registry.register(kind)  # type: ignore[return-value]


__all__ = ["ENTRY_POINT_GROUP", "Registry", "register", "registry"]
