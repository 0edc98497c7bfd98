"""Validating a graph's wiring before anything runs: ports, channels, types, devices, topology.

Every check raises a :class:`csp.GraphError` naming the first bad process or channel and what to
change. :meth:`csp.Graph.validate` calls :func:`check_wiring`.
"""

from __future__ import annotations

from csp.core.process import is_async
from csp.errors import GraphError
from csp.graph.devices import check_device
from csp.graph.nodes import ChannelNode, ProcessNode
from csp.graph.port_types import compatible, type_name


def check_wiring(processes: dict[str, ProcessNode], channels: dict[str, ChannelNode]) -> None:
    """Check the wiring and devices of a graph's nodes. Raises GraphError naming the first bad node.

    Checked: every port connected to a declared channel (but those the class lists in
    ``optional``, which may be left out), every channel with a sender and a
    receiver, port types compatible (:func:`csp.graph.compatible`), devices exist, async
    processes not bound to CUDA, and the topology (:func:`check_topology`).
    """
    senders: dict[str, list[tuple[ProcessNode, str]]] = {c: [] for c in channels}
    receivers: dict[str, list[tuple[ProcessNode, str]]] = {c: [] for c in channels}
    for p in processes.values():
        where = f"process {p.name!r}"
        for declared, wired, direction, table in (
            (p.cls.inputs, p.inputs, "input", receivers),
            (p.cls.outputs, p.outputs, "output", senders),
        ):
            for port in declared:
                if port not in wired and port not in p.cls.optional:
                    raise GraphError(
                        f"{where}: {direction} port {port!r} is not connected; add it to "
                        f"{direction}s = {{ {port} = \"<channel>\" }}"
                    )
            for port, chan in wired.items():
                if port not in declared:
                    raise GraphError(
                        f"{where}: {p.cls.__name__} has no {direction} port {port!r} "
                        f"(its {direction}s: {sorted(declared)})"
                    )
                if chan not in channels:
                    raise GraphError(
                        f"{where}: {direction} port {port!r} is connected to unknown channel "
                        f"{chan!r} (channels: {sorted(channels)})"
                    )
                table[chan].append((p, port))
        for dev in p.devices:
            check_device(where, dev)
        if is_async(p.cls) and any(d and d.startswith("cuda") for d in p.devices):
            raise GraphError(
                f"{where}: an async process cannot be bound to a CUDA device (the current "
                "stream is per thread); make its run() blocking"
            )
    for name in channels:
        if not senders[name]:
            raise GraphError(f"channel {name!r} has no sender: connect a process output to it or remove it")
        if not receivers[name]:
            raise GraphError(f"channel {name!r} has no receiver: connect a process input to it or remove it")
        for sp, sport in senders[name]:
            out_t = sp.cls.outputs[sport]
            for rp, rport in receivers[name]:
                in_t = rp.cls.inputs[rport]
                if not compatible(out_t, in_t):
                    raise GraphError(
                        f"channel {name!r}: process {sp.name!r} sends {type_name(out_t)} "
                        f"(port {sport!r}) but process {rp.name!r} receives {type_name(in_t)} "
                        f"(port {rport!r})"
                    )
    check_topology(processes, channels, senders, receivers)


def check_topology(processes: dict[str, ProcessNode], channels: dict[str, ChannelNode],
                   senders: dict[str, list[tuple[ProcessNode, str]]],
                   receivers: dict[str, list[tuple[ProcessNode, str]]]) -> None:
    """Reject wiring that can only hang or fail once running.

    * A self-loop: a process receiving from a channel it sends to. That channel closes only when
      its senders do, so its receive loop never ends.
    * A cycle no source feeds: processes whose inputs all come, directly or not, from each other
      and not from a source (a process with no input ports, or one whose class declares
      ``sends_first = True``: it sends before it receives). Nothing ever sends the first item.
    * An ordered channel fed by more than one process or port. It restores one ``seq`` stream;
      two producers number their items independently and collide. Replicas of one process share
      one stream (they split the items of an upstream channel) and are fine.
    * An ordered channel whose ``seq`` numbers come from more than one origin upstream
      (:func:`check_seq_origins`).

    Raises:
        GraphError: naming the channels (and processes) involved.
    """
    for name in channels:
        for sp, sport in senders[name]:
            for rp, rport in receivers[name]:
                if sp is rp:
                    raise GraphError(
                        f"channel {name!r} is a self-loop: process {sp.name!r} sends to it (port "
                        f"{sport!r}) and receives from it (port {rport!r}); it would never close "
                        "and the run would hang. Keep that state inside the process instead")
    for name, c in channels.items():
        feeds = sorted({(p.name, port) for p, port in senders[name]})
        if c.ordered and len(feeds) > 1:
            listed = ", ".join(f"process {p!r} port {port!r}" for p, port in feeds)
            raise GraphError(
                f"channel {name!r} is ordered but has {len(feeds)} producers ({listed}); an ordered "
                "channel restores one seq stream, so feed it from one process (replicas of it may "
                "share it) or set ordered = false")
    check_seq_origins(processes, channels, senders)
    # processes reachable from a source, following channels downstream
    reached = {n for n, p in processes.items() if not p.inputs or getattr(p.cls, "sends_first", False)}
    frontier = list(reached)
    while frontier:
        p = processes[frontier.pop()]
        for chan in p.outputs.values():
            for rp, _ in receivers[chan]:
                if rp.name not in reached:
                    reached.add(rp.name)
                    frontier.append(rp.name)
    unfed = [n for n in processes if n not in reached]
    if not unfed:
        return
    # walk upstream from an unfed process: every sender of its input is unfed too, so the walk
    # must come back to a process it has seen; the loop closed there is the cycle to name
    path: list[tuple[str, str]] = []          # (process, channel it receives from)
    seen: dict[str, int] = {}
    node = unfed[0]
    while node not in seen:
        seen[node] = len(path)
        chan = sorted(processes[node].inputs.values())[0]
        path.append((node, chan))
        node = next(sp.name for sp, _ in senders[chan] if sp.name not in reached)
    cycle = path[seen[node]:][::-1]           # in the direction items flow
    chans = ", ".join(repr(c) for _, c in cycle)
    flow = repr(cycle[-1][0]) + "".join(f" --{c}--> {p!r}" for p, c in cycle)
    raise GraphError(
        f"channels {chans} form a cycle ({flow}) that no source feeds: no process without inputs "
        "reaches it, so nothing would ever send and the run would hang; feed the cycle from a "
        "source process, break it, or, if one of its processes sends before it receives, declare "
        "sends_first = True on that class")


def seq_origins(processes: dict[str, ProcessNode], senders: dict[str, list[tuple[ProcessNode, str]]],
                channel: str) -> tuple[dict[str, int], list[str]]:
    """Where the ``seq`` numbers sent on ``channel`` come from: ``(origins, path)``.

    The rule the runtime needs: an ordered channel accepts each ``seq`` once, so every item
    reaching it must be numbered by one counter. A process that forwards seqs (its items keep the
    seq of what it received, as ``textpipe.tokenize`` and ``dflash.target`` do) takes them from
    its inputs, so the walk goes upstream through every input channel to the processes that
    number items themselves: a process without inputs (a source), or one whose class declares
    ``seq_origin = True`` (it numbers what it sends as one stream across all its replicas, e.g. it
    renumbers merged inputs). Each replica of a source without ``seq_origin`` numbers its own
    items from 0, so it counts once per replica. Returns ``{origin: counters}`` in graph order
    and the processes walked through on the way.
    """
    origins: dict[str, int] = {}
    via: list[str] = []
    seen: set[str] = set()
    frontier = [p for p, _ in senders[channel]]
    while frontier:
        p = frontier.pop()
        if p.name in seen:
            continue
        seen.add(p.name)
        if getattr(p.cls, "seq_origin", False):
            origins[p.name] = 1
        elif not p.inputs:
            origins[p.name] = p.replicas
        else:
            via.append(p.name)
            for chan in p.inputs.values():
                frontier += [sp for sp, _ in senders.get(chan, ())]
    order = list(processes)
    return ({n: origins[n] for n in sorted(origins, key=order.index)}, sorted(via, key=order.index))


def check_seq_origins(processes: dict[str, ProcessNode], channels: dict[str, ChannelNode],
                      senders: dict[str, list[tuple[ProcessNode, str]]]) -> None:
    """Reject an ordered channel whose ``seq`` numbers come from more than one origin
    (:func:`seq_origins`): two sources upstream (``read`` and ``read2`` both feeding ``lines``
    before the ordered ``tokens``), or one source with several replicas, each numbering its
    items 0, 1, 2, ...; at run time the second seq 0 is a SeqError. Replicas of a forwarding
    process (``tokenize``, ``target``) share the one stream and are fine.

    Raises:
        GraphError: naming the ordered channel, its origins and the processes in between.
    """
    for name, c in channels.items():
        if not c.ordered:
            continue
        origins, via = seq_origins(processes, senders, name)
        n = sum(origins.values())
        if n <= 1:
            continue
        path = f" through {', '.join(repr(v) for v in via)}" if via else ""
        listed = " and ".join(repr(o) + (f" ({k} replicas)" if k > 1 else "") for o, k in origins.items())
        raise GraphError(
            f"ordered channel {name!r} gets its seq numbers from {n} origins ({listed}, "
            f"reaching it{path}): each numbers its items 0, 1, 2, ..., so the seqs collide (a SeqError "
            "at run time). Feed it from one source with one replica, merge the sources into one "
            "process that numbers the items, declare seq_origin = True on a process that renumbers "
            "them as one stream, or set ordered = false")


__all__ = ["check_seq_origins", "check_topology", "check_wiring", "seq_origins"]
