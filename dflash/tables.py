"""What every table of the graph file shares: strict decoding, the bounded number types, and the
mark a key added after checkpoints existed carries on its own field.

:class:`Table` is the base of every ``[section]`` struct (``[target]``, ``[drafter]``, ``[loss]``,
``[train]``, ...): an unknown key is an error naming its path, and fields are keyword-only.

A key added to a table after runs had been trained without it is declared where it is defined::

    tv_weight: Annotated[NonNegFloat, added_later(0.0)] = 0.0

``before`` is the value that does what the code did before the key existed. Two readers use it:

* the config hash (:func:`dflash.run.config.config_hash`) leaves the key out while it holds
  ``before``, so a graph file that never sets it hashes as it did before the key existed and its
  checkpoints resume without a "config differs" warning (``hashed=False`` for a key the hash
  already leaves out for another reason, such as a variant's own fields);
* the change report of a resume (:mod:`dflash.checkpoint.config_changes`) reads a saved config
  that lacks the key as holding ``before``, so an unchanged setting is never reported.

:func:`keys_added_later` lists the marked keys of a table.
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

import msgspec
from msgspec import Meta

from csp.core.strict import Strict

__all__ = ["AddedLater", "NonNegFloat", "NonNegInt", "PositiveInt", "Table", "added_later", "keys_added_later"]

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]

_MARK = "added_later"


class Table(Strict):
    """A table of the graph file: unknown keys are refused (``Object contains unknown field `lr_peak`
    - at `$.train```) and every field is keyword-only (:class:`csp.Strict`)."""


class AddedLater(NamedTuple):
    """A key's mark (:func:`added_later`): the value meaning what the code did before the key
    existed, and whether the config hash leaves the key out while it holds that value."""

    before: Any
    hashed_when_set: bool


def added_later(before: Any, *, hashed: bool = True) -> Meta:
    """The mark of a key added after runs were trained without it, for ``Annotated[type, ...]``.

    Args:
        before: the value that reproduces the code before the key existed.
        hashed: True: the config hash leaves the key out while it equals ``before``; False: the
            hash treats it like any other key (it is left out, or kept, for another reason).
    """
    return Meta(extra={_MARK: AddedLater(before, hashed)})


def keys_added_later(table: type[Table]) -> dict[str, AddedLater]:
    """``{key: AddedLater}`` for the fields of ``table`` marked with :func:`added_later`."""
    out = {}
    for field in msgspec.inspect.type_info(table).fields:
        extra = getattr(field.type, "extra", None) or {}
        if _MARK in extra:
            out[field.encode_name] = extra[_MARK]
    return out
