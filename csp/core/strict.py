"""The base of every table a graph file holds: unknown keys refused, fields keyword-only.

A graph file is read into msgspec Structs (``[[channel]]``, ``[[process]]``, ``[trace]``, a
process's ``[process.options]``, an application's own tables). Each should refuse a key it does
not know, so a typo is reported with its path (``Object contains unknown field `capacty` - at
`$.channel[0]```) instead of silently meaning the default, and take its fields by keyword only.
msgspec's ``forbid_unknown_fields`` is inherited by subclasses but ``kw_only`` covers only the
fields of the class that sets it, so :class:`Strict`'s metaclass sets it on every subclass.
"""

from __future__ import annotations

import msgspec

__all__ = ["Strict"]


class _StrictMeta(msgspec.StructMeta):
    def __new__(mcls, name, bases, namespace, **kwargs):
        kwargs.setdefault("kw_only", True)
        return super().__new__(mcls, name, bases, namespace, **kwargs)


class Strict(msgspec.Struct, metaclass=_StrictMeta, forbid_unknown_fields=True):
    """A graph-file table: an unknown key is an error naming its path, and every field (this class's
    subclasses' included) is keyword-only."""
