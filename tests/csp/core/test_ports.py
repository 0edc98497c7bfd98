"""Typed ports: ``Process[Inputs, Outputs]`` with ``TypedDict``s of channel ends declares a process's
port tables once; a graph checks and runs such a process as it does one with hand-written tables."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

import pytest

import csp

pytestmark = pytest.mark.timeout(20)


class Base:
    pass


class Derived(Base):
    pass


class RelayIn(TypedDict):
    inp: csp.Receiver[Base]


class RelayOut(TypedDict):
    out: csp.Sender[Base]
    side: NotRequired[csp.Sender[int | str]]


class Relay(csp.Process[RelayIn, RelayOut]):
    def run(self, inputs: RelayIn, outputs: RelayOut) -> None:
        side = outputs.get("side")
        for item in inputs["inp"]:
            outputs["out"].send(item)
            if side is not None:
                side.send(1)


class EmitOut(TypedDict):
    out: csp.Sender[Derived]


class Emit(csp.Process[csp.NoPorts, EmitOut]):
    def run(self, inputs: csp.NoPorts, outputs: EmitOut) -> None:
        for _ in range(3):
            outputs["out"].send(Derived())


class CollectIn(TypedDict):
    inp: csp.Receiver  # a bare end: any item


class Collect(csp.Process[CollectIn, csp.NoPorts]):
    got: list[Any] = []

    async def run(self, inputs: CollectIn, outputs: csp.NoPorts) -> None:
        async for item in inputs["inp"]:
            Collect.got.append(item)


def test_the_port_tables_are_read_from_the_typed_ports():
    """Invariant: the item types, the optional ports (``NotRequired``) and an untyped end read as
    the tables a hand-written process sets, so graph validation sees no difference."""
    assert Relay.inputs == {"inp": Base}
    assert Relay.outputs == {"out": Base, "side": int | str}
    assert Relay.optional == frozenset({"side"})
    assert (Emit.inputs, Emit.outputs, Emit.optional) == ({}, {"out": Derived}, frozenset())
    assert Collect.inputs == {"inp": object} and Collect.outputs == {}
    assert csp.Process.inputs == {} and csp.Process.outputs == {}  # the base keeps its own


def test_a_subclass_keeps_the_typed_tables_and_an_untyped_process_its_own():
    class Again(Relay):
        pass

    class Plain(csp.Process):
        inputs = {"a": int}

    assert Again.inputs is Relay.inputs and Again.optional == {"side"}
    assert Plain.inputs == {"a": int} and Plain.optional == frozenset()


def test_typed_ports_and_hand_written_tables_together_are_refused():
    """Invariant: the ports are declared once; a class with both is a PortTypeError (a TypeError)
    naming it."""
    with pytest.raises(csp.PortTypeError, match=r"Twice: .* typed by Process\[RelayIn, RelayOut\]; drop inputs"):
        class Twice(csp.Process[RelayIn, RelayOut]):
            inputs = {"inp": Base}


def test_a_port_that_is_not_the_right_end_is_refused():
    class Backwards(TypedDict):
        inp: csp.Sender[int]

    with pytest.raises(csp.PortTypeError, match=r"port 'inp' of .*Backwards must be a Receiver\[item type\]"):
        class Wrong(csp.Process[Backwards, csp.NoPorts]):
            pass


def test_a_port_type_missing_at_run_time_is_named():
    class Unresolved(TypedDict):
        inp: csp.Receiver[NotImportedHere]  # noqa: F821

    with pytest.raises(csp.PortTypeError, match="must be importable at run time"):
        class Late(csp.Process[Unresolved, csp.NoPorts]):
            pass


def test_a_graph_of_typed_processes_validates_and_runs():
    """Invariant: a typed process is wired, type-checked (Derived reaches a Base port) and run
    like any other; an optional typed port may stay unconnected; an async run is a task."""
    Collect.got = []
    g = csp.Graph().channel("a", capacity=2).channel("b", capacity=2)
    g.process("emit", Emit, outputs={"out": "a"})
    g.process("relay", Relay, inputs={"inp": "a"}, outputs={"out": "b"})
    g.process("collect", Collect, inputs={"inp": "b"})
    g.validate()
    assert csp.Runtime(g).run().status == "completed"
    assert len(Collect.got) == 3 and all(isinstance(x, Derived) for x in Collect.got)


def test_a_typed_port_type_mismatch_is_a_graph_error():
    class IntIn(TypedDict):
        inp: csp.Receiver[int]

    class TakeInt(csp.Process[IntIn, csp.NoPorts]):
        def run(self, inputs: IntIn, outputs: csp.NoPorts) -> None:  # pragma: no cover - never run
            pass

    g = csp.Graph().channel("a", capacity=1)
    g.process("emit", Emit, outputs={"out": "a"}).process("take", TakeInt, inputs={"inp": "a"})
    with pytest.raises(csp.GraphError, match="Derived"):
        g.validate()
