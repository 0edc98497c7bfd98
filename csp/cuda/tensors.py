"""Walking the tensors of a nested item: :func:`map_tensors` and :func:`iter_tensors`.

An *item* is a tensor, or a container holding items: a ``msgspec.Struct`` (its fields), a dict (its
values), a list, or a tuple (named tuples included). Everything else is a leaf that holds no tensor
and is kept as it is (ints, strings, ``None``, arrays, other objects). This is the one walker csp
(channel byte counts, CUDA hand-off, device moves) and dflash (the non-finite sentinel, checkpoint
snapshots and files) use.

A *path* names where a tensor sits: a tuple of steps from the top, a Struct field name (str), a dict
key (as it is), or an :class:`Index` for a list/tuple position; ``()`` for a top-level tensor.

torch is not imported here: when no module has imported it yet, no object can be a tensor, so the
walk finds none.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator

import msgspec

__all__ = ["ATOMS", "Index", "iter_tensors", "map_tensors"]

# Leaf types that can hold no tensor: the walk stops at once on them.
ATOMS = frozenset({int, float, str, bytes, bool, type(None), complex, bytearray})
Path = tuple  # of str (Struct field), dict keys, Index (list/tuple position)


class Index(int):
    """A list or tuple position in a path (a dict key is never an Index, even an int one)."""

    __slots__ = ()


class _NoTensor:
    """Stands for the tensor type while torch is not loaded: nothing is an instance of it."""


def _tensor_type() -> type:
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else _NoTensor


def iter_tensors(obj: Any, *, paths: bool = False, max_depth: int | None = None,
                 opaque: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Every tensor in ``obj``, depth first in container order (Struct fields in declaration order).

    Args:
        obj: the item to walk (see the module doc for what is walked into).
        paths: yield ``(path, tensor)`` pairs instead of tensors.
        max_depth: walk at most this many container levels (None: no limit); deeper containers
            are skipped, as a guard against self-referencing containers.
        opaque: objects for which it returns True are yielded like tensors and not walked into
            (csp's byte count uses it for objects that define ``__csp_nbytes__``).
    """
    tensor_type = _tensor_type()
    out: list = []
    if tensor_type is not _NoTensor or opaque is not None:
        if paths:
            _collect_paths(obj, tensor_type, opaque, (), max_depth, out)
        else:
            _collect(obj, tensor_type, opaque, max_depth, out)
    return iter(out)


def _collect(obj: Any, tensor_type: type, opaque: Callable | None, depth: int | None, out: list) -> None:
    # the hot path (every channel send walks its item): plain recursion appending to one list
    t = type(obj)
    if t in ATOMS:
        return
    if isinstance(obj, tensor_type) or (opaque is not None and opaque(obj)):
        out.append(obj)
        return
    if depth is not None:
        if depth <= 0:
            return
        depth -= 1
    if isinstance(obj, msgspec.Struct):
        for f in t.__struct_fields__:
            _collect(getattr(obj, f), tensor_type, opaque, depth, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, tensor_type, opaque, depth, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, tensor_type, opaque, depth, out)


def _collect_paths(obj: Any, tensor_type: type, opaque: Callable | None, path: Path, depth: int | None,
                   out: list) -> None:
    # _collect's walk, also building each leaf's path (kept apart so the per-send walk builds none)
    t = type(obj)
    if t in ATOMS:
        return
    if isinstance(obj, tensor_type) or (opaque is not None and opaque(obj)):
        out.append((path, obj))
        return
    if depth is not None:
        if depth <= 0:
            return
        depth -= 1
    if isinstance(obj, msgspec.Struct):
        for f in t.__struct_fields__:
            _collect_paths(getattr(obj, f), tensor_type, opaque, path + (f,), depth, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect_paths(v, tensor_type, opaque, path + (k,), depth, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect_paths(v, tensor_type, opaque, path + (Index(i),), depth, out)


def map_tensors(fn: Callable[..., Any], obj: Any, *, paths: bool = False, max_depth: int | None = None,
                share_unchanged: bool = False) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)`` (``fn(path, t)`` with ``paths=True``).

    The structure is rebuilt with the same types: a Struct by ``msgspec.structs.replace`` (its
    class and other fields kept), a named tuple by its class, a tuple or list (or subclass) by its
    type from the new values; a dict (or subclass) becomes a plain ``dict`` with the same keys in
    the same order. Leaves that are not tensors are kept by reference.

    Args:
        fn: the function applied to each tensor; whatever it returns takes the tensor's place.
        obj: the item to map (see the module doc for what is walked into).
        paths: call ``fn(path, tensor)``.
        max_depth: as :func:`iter_tensors`; containers deeper than that are kept as they are.
        share_unchanged: return a container itself (not a copy) when nothing inside it changed
            (``fn`` returned the same object for every tensor), so an item with nothing to change
            comes back as the same object. False: every container is a new one, so the result
            never shares a dict or list with ``obj`` (a snapshot the caller may keep while ``obj``
            is mutated).
    """
    if share_unchanged and sys.modules.get("torch") is None:
        return obj  # no torch loaded: the item holds no tensor
    return _map(obj, fn, _tensor_type(), paths, () if paths else None, max_depth, share_unchanged)


def _map(obj: Any, fn: Callable, tensor_type: type, paths: bool, path: Path | None, depth: int | None,
         share: bool) -> Any:
    t = type(obj)
    if t in ATOMS:
        return obj
    if isinstance(obj, tensor_type):
        return fn(path, obj) if paths else fn(obj)
    if depth is not None:
        if depth <= 0:
            return obj
        depth -= 1

    def sub(v: Any, key: Any) -> Any:
        return _map(v, fn, tensor_type, paths, path + (key,) if paths else None, depth, share)

    if isinstance(obj, msgspec.Struct):
        changes = {}
        for f in t.__struct_fields__:
            v = getattr(obj, f)
            nv = sub(v, f)
            if nv is not v:
                changes[f] = nv
        return msgspec.structs.replace(obj, **changes) if changes or not share else obj
    if isinstance(obj, dict):
        new = {k: sub(v, k) for k, v in obj.items()}
        return obj if share and all(new[k] is v for k, v in obj.items()) else new
    if isinstance(obj, (list, tuple)):
        vals = [sub(v, Index(i)) for i, v in enumerate(obj)]
        if share and all(a is b for a, b in zip(vals, obj)):
            return obj
        if t is list:
            return vals
        return t(*vals) if isinstance(obj, tuple) and hasattr(obj, "_fields") else t(vals)
    return obj
