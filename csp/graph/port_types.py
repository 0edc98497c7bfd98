"""Port type compatibility: may items of a sender's type be received on a port of another type?"""

from __future__ import annotations

import types
import typing
from typing import Any


def compatible(out_t: Any, in_t: Any) -> bool:
    """True if items of type ``out_t`` may be received on a port typed ``in_t``.

    Rules: ``object``/``Any`` on either side matches; a union input accepts an output matching
    any member, a union output must match for every member; generics compare their origins
    (``list[int]`` -> ``list``); classes use ``issubclass``.
    """
    if out_t in (object, Any) or in_t in (object, Any):
        return True
    if _is_union(out_t):
        return all(compatible(a, in_t) for a in typing.get_args(out_t))
    if _is_union(in_t):
        return any(compatible(out_t, a) for a in typing.get_args(in_t))
    out_o, in_o = typing.get_origin(out_t) or out_t, typing.get_origin(in_t) or in_t
    if isinstance(out_o, type) and isinstance(in_o, type):
        return issubclass(out_o, in_o)
    return out_t == in_t


def _is_union(t: Any) -> bool:
    return typing.get_origin(t) is typing.Union or isinstance(t, types.UnionType)


def type_name(t: Any) -> str:
    """A type as error messages show it: a class's qualified name, else its repr."""
    return t.__qualname__ if isinstance(t, type) else repr(t)


__all__ = ["compatible", "type_name"]
