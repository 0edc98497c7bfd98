"""Which rank runs which process instance, and which channels cross ranks.

Rule (docs/distributed.md):

* a process with ``ranks = [r0, r1, ...]`` (one per replica) puts replica ``i`` on rank ``ri``;
* otherwise replica ``i`` goes to rank ``i % world_size``: single-replica processes land on rank
  0, and a process with ``replicas == world_size`` gets one replica per rank.

A channel *crosses ranks* when its senders and receivers are not all on one rank (and it is not
``rank_local``); :mod:`csp.distributed.bridge` then carries it over *links*, one per (sending rank,
receiving rank) pair. A ``rank_local`` channel is an independent in-process channel on every rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from csp.errors import GraphError, UnknownProcess
from csp.graph import Graph

__all__ = ["ChannelPlan", "Link", "Placement", "place"]


@dataclass(frozen=True)
class Link:
    """One direction of a cross-rank channel: items from ``src`` to ``dst``.

    Attributes:
        id: index in :attr:`Placement.links` (the same on every rank).
        channel: the channel's name.
        src, dst: global ranks (``src == dst`` is the local link of a rank that both sends and
            receives on the channel).
        credits: items that may be in flight on this link at once (granted by ``dst``).
    """

    id: int
    channel: str
    src: int
    dst: int
    credits: int


@dataclass
class ChannelPlan:
    """Where a channel's ends live. ``senders``/``receivers``: sorted ranks with at least one
    sending/receiving process instance; ``links``: the channel's links when it crosses ranks."""

    name: str
    capacity: int
    ordered: bool
    rank_local: bool
    senders: list[int]
    receivers: list[int]
    links: list[Link] = field(default_factory=list)

    @property
    def crosses(self) -> bool:
        """True when the channel is carried between ranks by links."""
        return bool(self.links)


@dataclass
class Placement:
    """The whole graph's placement on ``world_size`` ranks (identical on every rank).

    Attributes:
        world_size: number of ranks.
        ranks: ``(process name, replica) -> rank``.
        channels: ``name -> ChannelPlan``.
        links: every link of every crossing channel, indexed by ``Link.id``.
    """

    world_size: int
    ranks: dict[tuple[str, int], int]
    channels: dict[str, ChannelPlan]
    links: list[Link]

    def instances(self, rank: int) -> set[tuple[str, int]]:
        """The ``(name, replica)`` instances that run on ``rank``."""
        return {inst for inst, r in self.ranks.items() if r == rank}

    def ranks_of(self, process: str) -> list[int]:
        """The rank of each replica of ``process``, in replica order.

        Raises:
            UnknownProcess (a KeyError): no process of that name.
        """
        out = [r for (name, _), r in sorted(self.ranks.items()) if name == process]
        if not out:
            raise UnknownProcess(f"no process {process!r} in the graph")
        return out

    def peers(self, rank: int) -> list[int]:
        """Ranks that ``rank`` exchanges link traffic with (either direction), sorted."""
        return sorted({lk.dst if lk.src == rank else lk.src for lk in self.links
                       if rank in (lk.src, lk.dst) and lk.src != lk.dst})

    def lanes(self) -> list[tuple[int, int]]:
        """Every directed rank pair ``(a, b)``, ``a != b``, that needs a lane (both directions of
        each pair joined by a link), sorted: the order in which every rank creates lane groups."""
        pairs = {(min(lk.src, lk.dst), max(lk.src, lk.dst)) for lk in self.links if lk.src != lk.dst}
        return sorted(itertools.chain.from_iterable(((a, b), (b, a)) for a, b in pairs))


def place(graph: Graph, world_size: int) -> Placement:
    """Place ``graph`` on ``world_size`` ranks and plan its cross-rank channels.

    Raises:
        GraphError: a ``ranks`` entry is outside ``0..world_size-1``; an ordered channel has
            receivers on more than one rank (each rank would restore its own order); a
            ``rank_local`` channel has, on some rank, senders but no receiver (or the reverse).
    """
    if world_size < 1:
        raise GraphError(f"world_size must be >= 1, got {world_size}")
    ranks: dict[tuple[str, int], int] = {}
    for node in graph.processes.values():
        for i in range(node.replicas):
            r = node.ranks[i] if node.ranks is not None else i % world_size
            if not 0 <= r < world_size:
                raise GraphError(
                    f"process {node.name!r}: replica {i} is placed on rank {r} but the run has "
                    f"{world_size} rank(s) (0..{world_size - 1}); fix ranks = {node.ranks} or launch "
                    "more processes (torchrun --nproc-per-node)"
                )
            ranks[(node.name, i)] = r
    plans: dict[str, ChannelPlan] = {}
    links: list[Link] = []
    for name, c in graph.channels.items():
        snd = sorted({ranks[(p.name, i)] for p in graph.processes.values() if name in p.outputs.values()
                      for i in range(p.replicas)})
        rcv = sorted({ranks[(p.name, i)] for p in graph.processes.values() if name in p.inputs.values()
                      for i in range(p.replicas)})
        plan = ChannelPlan(name, c.capacity, c.ordered, c.rank_local, snd, rcv)
        plans[name] = plan
        if c.rank_local:
            if snd != rcv:
                raise GraphError(
                    f"channel {name!r} is rank_local, but its senders are on ranks {snd} and its "
                    f"receivers on ranks {rcv}; every rank with one must have the other (or drop "
                    "rank_local so items may cross ranks)"
                )
            continue
        if len(set(snd) | set(rcv)) <= 1:
            continue  # every end on one rank: an ordinary in-process channel there
        if c.ordered and len(rcv) > 1:
            raise GraphError(
                f"channel {name!r} is ordered but its receivers are on ranks {rcv}; put every "
                "receiver of an ordered channel on one rank (process ranks = [...])"
            )
        for dst in rcv:
            n_in = len(snd)
            credits = max(1, -(-c.capacity // n_in))  # ceil(capacity / sending ranks), >= 1
            for src in snd:
                lk = Link(len(links), name, src, dst, credits)
                links.append(lk)
                plan.links.append(lk)
    return Placement(world_size, ranks, plans, links)
