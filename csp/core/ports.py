"""Typed ports: a process's inputs and outputs declared once, as ``TypedDict``s of channel ends.

A process names its port types as the type parameters of :class:`csp.Process`::

    class UpperIn(TypedDict):
        text: csp.Receiver[str]

    class UpperOut(TypedDict):
        out: csp.Sender[str]
        log: NotRequired[csp.Sender[str]]      # optional: a graph may leave it unconnected

    @csp.register("examples.upper")
    class Upper(csp.Process[UpperIn, UpperOut]):
        def run(self, inputs: UpperIn, outputs: UpperOut) -> None:
            for text in inputs["text"]:
                outputs["out"].send(text.upper())

A type checker then knows that ``inputs["text"]`` is a ``Receiver[str]``, that ``send`` takes a
``str`` and that ``outputs.get("log")`` may be None. The graph reads the same declaration as the
port tables it checks a wiring against (:func:`port_table`): ``Upper.inputs == {"text": str}``,
``Upper.outputs == {"out": str, "log": str}``, ``Upper.optional == {"log"}``.
"""

from __future__ import annotations

from typing import Any, NotRequired, Required, TypedDict, get_args, get_origin, get_type_hints

from csp.core.channel import Receiver, Sender
from csp.errors import PortTypeError

__all__ = ["NoPorts", "port_table"]


class NoPorts(TypedDict):
    """The ports of a side that has none: a source's inputs, a sink's outputs."""


def port_table(ports: type, end: type[Receiver[Any]] | type[Sender[Any]], owner: str
               ) -> tuple[dict[str, Any], set[str]]:
    """``(port name -> item type, names of the optional ports)`` of the ``TypedDict`` ``ports``,
    whose fields are all ``end[item type]`` (``Receiver`` for inputs, ``Sender`` for outputs);
    ``NotRequired[...]`` marks an optional port, a bare ``end`` an item type of ``object``.

    Raises:
        PortTypeError (a TypeError): a field is not an ``end``, or names a type the module of
            ``ports`` does not have at run time (imported only under ``TYPE_CHECKING``). ``owner``
            (the process class) is named in the message.
    """
    try:
        hints = get_type_hints(ports, include_extras=True)
    except NameError as exc:
        raise PortTypeError(f"{owner}: the port types of {ports.__qualname__} must be importable at run "
                            f"time (not only under TYPE_CHECKING): {exc}") from None
    table: dict[str, Any] = {}
    optional = set(getattr(ports, "__optional_keys__", ()))
    for name, hint in hints.items():
        if get_origin(hint) in (NotRequired, Required):
            if get_origin(hint) is NotRequired:
                optional.add(name)
            (hint,) = get_args(hint)
        origin = get_origin(hint) or hint
        if not (isinstance(origin, type) and issubclass(origin, end)):
            raise PortTypeError(f"{owner}: port {name!r} of {ports.__qualname__} must be a "
                                f"{end.__name__}[item type], got {hint!r}")
        args = get_args(hint)
        table[name] = args[0] if args else object
    return table, optional
